"""Tool calling: the tools a request offers, how the prompt shows them, and how the model's
output becomes tool calls.

- ``parse_tools`` / ``parse_tool_choice`` validate the request (a tool's ``parameters`` must be
  a valid JSON Schema; a named ``tool_choice`` must name an offered tool).
- ``render_prompt`` turns chat messages (with assistant ``tool_calls`` and ``role: tool``
  results) and the tools into prompt token ids: through the model's own chat template when it
  has a tools section, else through ``HERMES_FALLBACK`` (the Hermes / Qwen2.5 wording, which
  the ``hermes`` parser reads back).
- ``ToolCallStream`` splits the output, as it streams, into content and tool calls with one
  parser per dialect (``PARSERS``: hermes, qwen3_coder, llama3_json). Markup that does not parse
  stays content, so malformed output degrades to text, never to an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

import jsonschema

from mtplx.server.errors import bad_param

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
ROLES = ("system", "developer", "user", "assistant", "tool")


# -- the request's tools ---------------------------------------------------------------------
@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai_dict(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def check_schema(schema, param: str) -> dict:
    """``schema`` if it is a valid JSON Schema object (draft 2020-12), else a 400 naming ``param``."""
    if not isinstance(schema, dict):
        raise bad_param(param, f"must be a JSON Schema object, got {type(schema).__name__}")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise bad_param(param, f"not a valid JSON Schema: {exc.message}"
                        + (f" (at {where})" if where else "")) from None
    return schema


def make_tool(name, description, parameters, param: str, schema_field: str = "parameters") -> Tool:
    """A tool from a request's entry ``param`` (``tools.0``); ``schema_field``: what the protocol
    calls its schema (Anthropic's ``input_schema``), for the errors."""
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise bad_param(f"{param}.name", f"must be 1-64 characters of a-z, A-Z, 0-9, '_', '.', '-', got {name!r}")
    if description is not None and not isinstance(description, str):
        raise bad_param(f"{param}.description", "must be a string")
    parameters = {"type": "object", "properties": {}} if parameters is None else parameters
    return Tool(name, description or "", check_schema(parameters, f"{param}.{schema_field}"))


def parse_tools(raw, param: str = "tools") -> list[Tool]:
    """OpenAI chat tools: ``[{"type": "function", "function": {name, description, parameters}}]``."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_param(param, "must be a list of tools")
    tools = []
    for i, item in enumerate(raw):
        where = f"{param}.{i}"
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
            raise bad_param(where, 'each tool must be {"type": "function", "function": {"name", "parameters", ...}}')
        fn = item["function"]
        tools.append(make_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{where}.function"))
    check_unique_names(tools, param)
    return tools


def check_unique_names(tools: list[Tool], param: str) -> None:
    names = [t.name for t in tools]
    for name in names:
        if names.count(name) > 1:
            raise bad_param(param, f"two tools are named {name!r}")


@dataclass(frozen=True)
class ToolChoice:
    """"auto" (the model decides), "none" (no tools shown, no parsing), "required" (at least one
    call) or "function" (a call to ``name``)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


def parse_tool_choice(raw, tools: list[Tool], param: str = "tool_choice") -> ToolChoice:
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if raw in ("auto", "none", "required"):
        choice = ToolChoice(raw)
    elif isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        choice = ToolChoice("function", raw["function"].get("name"))
    else:
        raise bad_param(param, 'must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}')
    if choice.mode != "none" and not tools:
        raise bad_param(param, f"{choice.mode!r} needs tools, and the request offers none")
    if choice.mode == "function" and choice.name not in {t.name for t in tools}:
        raise bad_param(param, f"names {choice.name!r}, which is not among the offered tools")
    return choice


# -- tool calls ------------------------------------------------------------------------------
@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    complete: bool = True  # False: a call whose output ended (max_tokens, a stop, a cancel) inside its markup

    def openai_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _json_object(text) -> dict | None:
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


# -- rendering -------------------------------------------------------------------------------
HERMES_FALLBACK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def template_has_tools(tokenizer) -> bool:
    template = getattr(tokenizer.hf, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


def render_prompt(tokenizer, messages: list[dict], tools: list[Tool], continue_final: bool = False) -> list[int]:
    """Prompt token ids for ``messages`` ({"role", "content", and "tool_calls" / "tool_call_id"
    where they apply}) offering ``tools``: the model's template when it renders tools, else the
    Hermes fallback (tools in the system message, calls and results as tagged text).
    ``continue_final``: the last (assistant) message's turn is left open for the reply to continue."""
    turn = dict(add_generation_prompt=False, continue_final_message=True) if continue_final else {}
    if template_has_tools(tokenizer):
        native = [_native_message(m) for m in messages]
        return tokenizer.apply_chat_template(native, tools=[t.openai_dict() for t in tools] or None, **turn)
    return tokenizer.apply_chat_template(hermes_messages(messages, tools), **turn)


def _native_message(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = [{"type": "function", "id": c.id, "function": {"name": c.name,
              "arguments": _json_object(c.arguments) or {}}} for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def hermes_messages(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """Plain {"role", "content"} messages in the Hermes convention, for templates without tools."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results share one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        content = m["content"]
        for call in m.get("tool_calls") or ():
            body = json.dumps({"name": call.name, "arguments": _json_object(call.arguments) or {}})
            content += ("\n" if content else "") + f"<tool_call>\n{body}\n</tool_call>"
        out.append({"role": m["role"], "content": content})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        block = HERMES_FALLBACK.format(tools="\n".join(json.dumps(t.openai_dict()) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# -- parsers ---------------------------------------------------------------------------------
class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, Qwen3)."""

    start, end = "<tool_call>", "</tool_call>"
    HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*(?=\{)')

    def header(self, block: str) -> tuple[str, int] | None:
        """(name, where the arguments object starts) once an open block shows them, so the
        arguments can stream; None until then (or in a dialect that cannot stream them)."""
        m = self.HEADER.match(block, len(self.start))
        return (m.group(1), m.end()) if m else None

    def find_start(self, text: str, pos: int, at_beginning: bool) -> int:
        return text.find(self.start, pos)

    def held(self, text: str, at_beginning: bool) -> int:
        """How many trailing characters might begin markup (kept back from content)."""
        return _partial_suffix(text, self.start)

    def find_end(self, text: str, start: int, forced: bool = False) -> int | None:
        """Past the block's end tag; None until it shows. ``forced``: the grammar makes the block
        valid JSON, whose string arguments may hold the tag's text (``{"note": "</tool_call>"}``),
        so the end is the first tag outside a JSON string. Unforced output may be malformed (an
        unclosed quote would hide every later tag), so there the first tag ends the block."""
        body = start + len(self.start)
        if forced:
            return next((i + len(self.end) for i, ch, _ in _structure(text, body)
                         if ch == "<" and text.startswith(self.end, i)), None)
        i = text.find(self.end, body)
        return None if i < 0 else i + len(self.end)

    def parse_block(self, block: str, tools: dict[str, Tool], final: bool) -> list[ToolCall] | None:
        body = block[len(self.start):]
        body = body[:-len(self.end)] if body.endswith(self.end) else body
        obj = _json_object(body.strip())
        if obj is None or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        args = _json_object(args) if isinstance(args, str) else args
        if not isinstance(args, dict):
            return None
        head = self.header(block)  # the arguments as the model wrote them, which is what streamed
        end = json_value_end(block, head[1]) if head else None
        raw = block[head[1]:end] if end else None
        arguments = raw if raw and _json_object(raw) == args else json.dumps(args, ensure_ascii=False)
        return [ToolCall(obj["name"], arguments)]


class Qwen3CoderParser(HermesParser):
    """``<tool_call><function=NAME><parameter=ARG>value</parameter></function></tool_call>``
    (Qwen3-Coder). Values are converted by the tool's schema type (strings stay strings)."""

    FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
    PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)

    def header(self, block: str) -> None:
        return None  # arguments are converted by schema at the end, so a call is sent whole

    def find_end(self, text: str, start: int, forced: bool = False) -> int | None:
        i = text.find(self.end, start)  # parameter values are plain text, not JSON strings
        return None if i < 0 else i + len(self.end)

    def parse_block(self, block: str, tools: dict[str, Tool], final: bool) -> list[ToolCall] | None:
        calls = []
        for name, body in self.FUNCTION.findall(block):
            props = tools[name].parameters.get("properties", {}) if name in tools else {}
            args = {}
            for arg, raw in self.PARAMETER.findall(body):
                value = raw.strip("\n")
                kind = props.get(arg, {}).get("type") if isinstance(props.get(arg), dict) else None
                if kind != "string":
                    try:
                        value = json.loads(value)
                    except ValueError:
                        pass
                args[arg] = value
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls or None


class Llama3JsonParser:
    """Llama 3.x: the whole reply is ``{"name": ..., "parameters": {...}}`` (several joined by
    ";"), optionally after ``<|python_tag|>``. Markup only at the start of the reply."""

    TAG = "<|python_tag|>"

    def header(self, block: str) -> None:
        return None

    def find_start(self, text: str, pos: int, at_beginning: bool) -> int:
        stripped = text[pos:].lstrip()
        if at_beginning and (stripped.startswith("{") or stripped.startswith(self.TAG)):
            return pos
        return -1

    def held(self, text: str, at_beginning: bool) -> int:
        stripped = text.lstrip()
        return len(text) if at_beginning and (not stripped or self.TAG.startswith(stripped)) else 0

    def find_end(self, text: str, start: int, forced: bool = False) -> int | None:
        return None  # the reply's end

    def parse_block(self, block: str, tools: dict[str, Tool], final: bool) -> list[ToolCall] | None:
        body = block.strip()
        body = body[len(self.TAG):] if body.startswith(self.TAG) else body
        calls = []
        for part in _split_top_level(body, ";"):
            obj = _json_object(part.strip())
            if obj is None or not isinstance(obj.get("name"), str):
                return None
            args = obj.get("parameters", obj.get("arguments", {}))
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)))
        return calls or None


PARSERS = {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser, "llama3_json": Llama3JsonParser}


def parser_for(tokenizer, override: str | None = None):
    """The parser named by ``--tool-call-parser``, else the one the chat template speaks
    (Qwen3-Coder XML, Llama 3 JSON), else hermes (which the fallback template teaches)."""
    if override:
        return PARSERS[override]()
    template = (getattr(tokenizer.hf, "chat_template", None) or "") if tokenizer is not None else ""
    template = template if isinstance(template, str) else ""
    if "<function=" in template:
        return Qwen3CoderParser()
    if "<|python_tag|>" in template or ("tools" in template and '"parameters"' in template
                                         and "<tool_call>" not in template):
        return Llama3JsonParser()
    return HermesParser()


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _structure(text: str, start: int = 0):
    """(index, character, bracket depth after it) for each character of ``text`` from ``start``
    that lies outside JSON strings (the quotes themselves included)."""
    depth, in_string, escape = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        yield i, ch, depth


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array starting at ``text[start]``, or None if it
    has not ended yet."""
    for i, ch, depth in _structure(text, start):
        if ch in "}]" and depth == 0:
            return i + 1
    return None


def _split_top_level(text: str, sep: str) -> list[str]:
    """``text`` split on ``sep`` outside JSON strings and brackets."""
    parts, start = [], 0
    for i, ch, depth in _structure(text):
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


class ToolCallStream:
    """Splits streamed output into content and tool calls. ``feed(text)`` and ``finish()``
    return events: ("content", str); ("call", ToolCall) for a call sent whole; or, where the
    dialect lets arguments stream (hermes), ("call_start", call) once its name is out, then
    ("arguments", (call, fragment)) as they arrive and ("call_end", call). Content that might
    begin markup is held back until decided; a block that does not parse is released as
    content (a streamed call whose arguments turn out malformed ends with what was sent). Under a
    forced ``choice`` (the grammar makes the output a call) a block the output's end cut short
    (max_tokens, a stop string, a cancel) is the call so far, marked incomplete: its name (the
    choice's where the end came before it) and its arguments as far as they came, as OpenAI
    reports a cut call, never the dialect's raw markup as content."""

    def __init__(self, parser, tools: list[Tool], choice: ToolChoice | None = None):
        self.parser, self.tools = parser, {t.name: t for t in tools}
        self.forced = choice is not None and choice.forced
        self.forced_name = (choice.name if choice is not None and choice.mode == "function"
                            else tools[0].name if len(tools) == 1 else "")
        self.text = ""
        self.pos = 0          # text[:pos] is decided (sent as content or parsed as calls)
        self.block: int | None = None  # where the open markup block starts
        self.calls: list[ToolCall] = []
        self.open: ToolCall | None = None  # the call whose arguments are streaming
        self.args_at = 0  # where its arguments start in text

    def feed(self, piece: str) -> list[tuple[str, object]]:
        self.text += piece
        return self._advance(final=False)

    def finish(self) -> list[tuple[str, object]]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[tuple[str, object]]:
        events: list[tuple[str, object]] = []
        while True:
            if self.block is None:
                start = self.parser.find_start(self.text, self.pos, not self.calls and not self.text[:self.pos].strip())
                if start < 0 and final and self.forced and not self.calls and self.text[self.pos:].strip():
                    start = self.pos  # cut inside the markup's opening: the call had begun
                if start < 0:
                    keep = 0 if final else self.parser.held(self.text[self.pos:], not self.text[:self.pos].strip()
                                                            and not self.calls)
                    self._content(events, len(self.text) - keep)
                    return events
                self._content(events, start)
                self.block = start
            end = self.parser.find_end(self.text, self.block, self.forced)
            if end is None and not final:
                self._stream_arguments(events)
                return events
            cut = end is None
            end = len(self.text) if end is None else end
            calls = self.parser.parse_block(self.text[self.block:end], self.tools, final)
            if self.open is not None:
                self._end_call(events, calls, cut)
                self.pos = end
            elif calls and all(c.name in self.tools for c in calls):  # a call to no offered tool is text
                self.calls += calls
                events += [("call", c) for c in calls]
                self.pos = end
            elif cut and self.forced:
                self._cut_call(events)
                self.pos = end
            else:
                self._content(events, end)
            self.block = None
            if end >= len(self.text) and (final or self.pos == len(self.text)):
                return events

    def _stream_arguments(self, events: list) -> None:
        """In an open block: start the call once its name shows, then send its new arguments."""
        if self.open is None:
            head = self.parser.header(self.text[self.block:])
            if head is None or head[0] not in self.tools:
                return
            self.open, self.args_at = ToolCall(head[0], ""), self.block + head[1]
            self.calls.append(self.open)
            events.append(("call_start", self.open))
        end = json_value_end(self.text, self.args_at) or len(self.text)
        self._send_arguments(events, self.text[self.args_at:end])

    def _send_arguments(self, events: list, arguments: str) -> None:
        call = self.open
        if arguments.startswith(call.arguments) and len(arguments) > len(call.arguments):
            events.append(("arguments", (call, arguments[len(call.arguments):])))
            call.arguments = arguments

    def _cut_call(self, events: list) -> None:
        """A forced call whose output ended before its block closed (max_tokens, a stop string,
        a cancel): its name and its arguments so far, marked incomplete."""
        found = _CUT_HEAD.search(self.text, self.block)
        if found is None or found.group("name") not in self.tools:
            call = ToolCall(self.forced_name, "", complete=False)
        elif found.group("arguments") is None:  # the end came before the arguments began
            call = ToolCall(found.group("name"), "", complete=False)
        else:
            at = found.end()
            call = ToolCall(found.group("name"), self.text[at:json_value_end(self.text, at) or len(self.text)],
                            complete=False)
        self.calls.append(call)
        events.append(("call", call))

    def _end_call(self, events: list, calls: list[ToolCall] | None, cut: bool) -> None:
        """Close the call whose arguments streamed: with its last arguments where the block
        parses; else it ends with what was sent, and is incomplete where the output ended inside
        its block (a block that closed malformed still ends the model's call)."""
        if calls and len(calls) == 1 and calls[0].name == self.open.name:
            self._send_arguments(events, calls[0].arguments)
        elif cut:
            self.open.complete = False
        events.append(("call_end", self.open))
        self.open = None

    def _content(self, events: list, upto: int) -> None:
        if upto > self.pos:
            events.append(("content", self.text[self.pos:upto]))
            self.pos = upto


# a call written as a JSON object (hermes' inside its tags, llama3_json's bare), as far as it came:
# its name, then where its arguments begin (a cut call's)
_CUT_HEAD = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"'
                       r'(?P<arguments>\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{))?')


def split_tool_calls(parser, tools: list[Tool], text: str,
                     choice: ToolChoice | None = None) -> tuple[str, list[ToolCall]]:
    """Whole-output parsing: (content, calls). A stream of ``text`` gives the same calls and
    content, except that a call whose name streamed and whose arguments then turned out
    malformed stays a call there (it was already sent) and is content here."""
    stream = ToolCallStream(parser, tools, choice)
    stream.text = text
    events = stream.finish()
    content = "".join(e for kind, e in events if kind == "content")
    return (content.strip() if stream.calls else content), stream.calls
