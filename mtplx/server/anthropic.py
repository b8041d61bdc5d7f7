"""Anthropic Messages: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request becomes the same chat messages and tools as an OpenAI one (``tool_use`` blocks are
assistant tool calls, ``tool_result`` blocks are tool messages) and runs on the same engine
and scheduler; the reply is a ``message`` with ``text`` and ``tool_use`` blocks, or the event
stream ``message_start``, ``ping``, ``content_block_start`` / ``_delta`` / ``_stop`` per block,
``message_delta`` (stop reason, usage), ``message_stop``. Errors have Anthropic's shape
(errors.py chooses it by path). Keys: ``x-api-key`` (security.py); ``anthropic-version`` is
accepted whatever its value (there is one API version here).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field

from mtplx.batching.job import Delta, JobResult
from mtplx.errors import InvalidParameter
from mtplx.server.errors import APIError, anthropic_type, bad_param
from mtplx.server.openai import chat_prompt, engine_requests, respond_with
from mtplx.server.protocol import RequestBody, article, chat_message, join_text, sse
from mtplx.server.structured import tool_call_grammar
from mtplx.server.tools import (Tool, ToolCall, ToolCallStream, ToolChoice, check_unique_names, make_tool,
                                split_tool_calls)

router = APIRouter()


class AnthropicMessage(RequestBody):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["user", "assistant"]
    content: str | list[dict]


class PromptFields(RequestBody):
    """What ``count_tokens`` and ``messages`` share: the conversation and its tools."""

    model_config = ConfigDict(extra="allow", strict=True)
    null_is_unset = True

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None

    def offered_tools(self) -> list[Tool]:
        tools = []
        for i, t in enumerate(self.tools or ()):
            if "input_schema" not in t and t.get("type") in (None, "custom"):
                raise bad_param(f"tools.{i}.input_schema", "a custom tool needs an input_schema (a JSON Schema object)")
            if "input_schema" not in t:
                raise bad_param(f"tools.{i}", "only custom tools ({name, description, input_schema}) are supported; "
                                              f"server tool type {t.get('type')!r} is not")
            tools.append(make_tool(t.get("name"), t.get("description"), t["input_schema"], f"tools.{i}",
                                   "input_schema"))
        check_unique_names(tools, "tools")
        return tools

    def choice(self, tools: list[Tool]) -> ToolChoice:
        raw = self.tool_choice
        if raw is None:
            return ToolChoice("auto" if tools else "none")
        kind = raw.get("type")
        mode = {"auto": "auto", "none": "none", "any": "required", "tool": "function"}.get(kind)
        if mode is None:
            raise bad_param("tool_choice.type", f"must be one of auto, any, tool, none, got {kind!r}")
        if mode != "none" and not tools:
            raise bad_param("tool_choice", f"{kind!r} needs tools, and the request offers none")
        if mode == "function" and raw.get("name") not in {t.name for t in tools}:
            raise bad_param("tool_choice.name", f"{raw.get('name')!r} is not among the offered tools")
        return ToolChoice(mode, raw.get("name"))

    def chat_messages(self) -> list[dict]:
        out = []
        if self.system:
            if isinstance(self.system, list) and any(_blank_text(b) for b in self.system):
                raise bad_param("system", "a text block must contain non-whitespace text")
            out.append({"role": "system", "content": _text(self.system, "system")})
        for i, m in enumerate(self.messages):
            _check_turn(self.messages, i)
            out += _convert(m, f"messages.{i}")
        return out


def _check_turn(messages: list[AnthropicMessage], i: int) -> None:
    """What Anthropic's API refuses in a history, as it does: a turn with no content (but the
    last assistant turn, a prefill), a text block of whitespace alone, two tool_use blocks of
    one id, a tool_result whose tool_use_id no tool_use of the assistant turn before it has, a
    tool_result after other blocks, and a tool_use that the next turn leaves unanswered."""
    m, where = messages[i], f"messages.{i}"
    last = i == len(messages) - 1
    if not m.content and not (last and m.role == "assistant"):
        raise bad_param(f"{where}.content", "must not be empty (only the last assistant turn, a prefill, may be)")
    blocks = m.content if isinstance(m.content, list) else []
    if isinstance(m.content, str) and m.content and not m.content.strip() and not last:
        raise bad_param(f"{where}.content", "must contain non-whitespace text")
    for j, block in enumerate(blocks):
        if _blank_text(block):
            raise bad_param(f"{where}.content.{j}.text", "a text block must contain non-whitespace text")
    if m.role == "user":
        asked = _tool_use_ids(messages[i - 1]) if i else []
        kinds = [b.get("type") if isinstance(b, dict) else None for b in blocks]
        answered = []
        for j, (block, kind) in enumerate(zip(blocks, kinds)):
            if kind != "tool_result":
                continue
            if any(k != "tool_result" for k in kinds[:j]):
                raise bad_param(f"{where}.content.{j}", "tool_result blocks must come first in the turn, before any "
                                                        "other block")
            if block.get("tool_use_id") not in asked:
                raise bad_param(f"{where}.content.{j}.tool_use_id", f"{block.get('tool_use_id')!r} answers no tool_use "
                                                                    "block of the assistant turn before it")
            answered.append(block["tool_use_id"])
        if missing := [t for t in asked if t not in answered]:
            raise bad_param(f"{where}.content", f"tool_use ids without a tool_result block here: "
                                                f"{', '.join(map(str, missing))}")
    elif ids := _tool_use_ids(m):
        if len(set(ids)) < len(ids):
            raise bad_param(f"{where}.content", "tool_use ids must be unique within a turn")
        if not last and messages[i + 1].role != "user":
            raise bad_param(f"messages.{i + 1}", "tool_use blocks must be answered by tool_result blocks in the user "
                                                 "turn after them")


def _blank_text(block) -> bool:
    """Whether ``block`` is a text block of whitespace alone (Anthropic's API refuses one)."""
    return isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str) \
        and not block["text"].strip()


def _tool_use_ids(m: AnthropicMessage) -> list:
    return [b.get("id") for b in m.content if isinstance(b, dict) and b.get("type") == "tool_use"] \
        if m.role == "assistant" and isinstance(m.content, list) else []


def _text(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if not all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content):
        raise bad_param(param, "only text blocks ({\"type\": \"text\", \"text\": str}) are supported here")
    return join_text(b["text"] for b in content)


def _convert(m: AnthropicMessage, where: str) -> list[dict]:
    """One Anthropic message as chat messages: text and tool_use blocks of an assistant turn
    are one assistant message; a user turn's tool_result blocks are tool messages, its text a
    user message (in block order)."""
    if isinstance(m.content, str):
        return [chat_message(m.role, m.content, None, None, where)]
    out: list[dict] = []
    text, calls = [], []
    for j, block in enumerate(m.content):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and m.role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict):
                raise bad_param(at, "a tool_use block needs a name and an input object")
            calls.append(ToolCall(block["name"], json.dumps(block["input"]), id=str(block.get("id") or "")))
        elif kind == "tool_result" and m.role == "user":
            if text:
                out.append(chat_message("user", join_text(text), None, None, where))
                text = []
            content = block.get("content", "")
            result = _text(content, f"{at}.content") if content is not None else ""
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append(chat_message("tool", result, None, str(block.get("tool_use_id") or ""), at))
        else:
            raise bad_param(at, f"block type {kind!r} is not supported in {article(m.role)} message (text, tool_use in "
                                "assistant messages, tool_result in user messages)")
    if m.role == "assistant":
        out.append({"role": "assistant", "content": join_text(text), **({"tool_calls": calls} if calls else {})})
    elif text:
        out.append(chat_message("user", join_text(text), None, None, where))
    return out


class MessagesRequest(PromptFields):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, le=1.0, allow_inf_nan=False)  # Anthropic's range is [0, 1]
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # mtplx's, as on the OpenAI routes (Anthropic's API has none)
    stream: bool = False
    # mtplx extensions, as on the OpenAI routes
    generation_mode: Literal["mtp", "ar"] | None = None
    depth: int | Literal["auto"] | None = None
    draft_policy: Literal["auto", "greedy", "mirror"] = "auto"

    def check_supported(self) -> None:
        extra = self.model_extra or {}
        if extra.get("thinking") not in (None, {"type": "disabled"}):
            raise bad_param("thinking", "extended thinking is not supported")
        if isinstance(extra.get("output_config"), dict) and extra["output_config"].get("format") is not None:
            raise bad_param("output_config.format", "structured output is not supported yet")

    def sampling(self, default_temperature: float) -> dict:
        return dict(temperature=default_temperature if self.temperature is None else self.temperature,
                    top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
                    stop=self.stop_sequences, draft_policy=self.draft_policy)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: PromptFields, request: Request):
    server = request.app.state.mtplx
    server.check_model(body.model)
    tools = body.offered_tools()
    choice = body.choice(tools)
    prompt, chat = chat_prompt(server.engine, body.chat_messages(), tools if choice.mode != "none" else [],
                               continue_final=True)
    return {"input_tokens": len(server.engine.encode_prompt(prompt, chat=chat))}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    body.check_supported()
    server = request.app.state.mtplx
    server.check_model(body.model)
    tools = body.offered_tools()
    choice = body.choice(tools)
    tools = tools if choice.mode != "none" else []
    prompt, chat = chat_prompt(server.engine, body.chat_messages(), tools, continue_final=True)
    grammar = tool_call_grammar(server.engine, tools, choice, server.tool_parser, schema_field="input_schema")
    try:
        [engine_request] = engine_requests(server, body, prompt, ("max_tokens", body.max_tokens), chat=chat,
                                           sampling=body.sampling(server.default_temperature), grammar=grammar,
                                           prompt_field="messages")
    except InvalidParameter as exc:  # the engine's names for what this protocol calls otherwise
        name = {"stop": "stop_sequences"}.get(exc.param)
        if name is None:
            raise
        raise InvalidParameter(name, str(exc).removeprefix(f"{exc.param}: ")) from None
    reply = MessageShape(body.model, tools, server.tool_parser if tools else None, body.stop_sequences or [],
                         server.engine, len(engine_request.prompt_ids), choice)
    return await respond_with(request, body.stream, [engine_request], reply.id, reply, reply.whole)


class MessageShape:
    """Builds one Anthropic reply, whole (``whole``) or as a stream (``start`` ... ``end``)."""

    def __init__(self, model: str, tools: list[Tool], parser, stops: list[str], engine, prompt_tokens: int,
                 choice: ToolChoice | None = None):
        self.model, self.tools, self.parser, self.stops = model, tools, parser, stops
        self.engine, self.prompt_tokens, self.choice = engine, prompt_tokens, choice
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.stream = ToolCallStream(parser, tools, choice) if tools and parser else None
        self.block: int | None = None  # index of the open text block
        self.tool_block = 0  # index of the last tool_use block
        self.blocks = 0
        self.result: JobResult | None = None

    def _split(self, text: str) -> tuple[str, list[ToolCall]]:
        if not (self.tools and self.parser):
            return text, []
        return split_tool_calls(self.parser, self.tools, text, self.choice)

    def _stop(self, result: JobResult, calls: list[ToolCall]) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) from the job's finish; "cancelled" (mtplx's, as on the
        OpenAI routes) for a request cancelled by its id, which did not end its turn."""
        if result.finish_reason == "length":
            return "max_tokens", None
        if result.finish_reason == "cancelled":
            return "cancelled", None
        if calls and all(c.complete for c in calls):
            return "tool_use", None
        eos = self.engine.generator.eos_token_ids
        if self.stops and not (result.token_ids and result.token_ids[-1] in eos):
            rest = self.engine.tokenizer.decode(result.token_ids)[len(result.text):]
            hit = min(self.stops, key=lambda s: (rest.find(s) if s in rest else len(rest) + 1))
            return "stop_sequence", hit
        return "end_turn", None

    def usage(self, result: JobResult | None) -> dict:
        return {"input_tokens": self.prompt_tokens, "output_tokens": result.completion_tokens if result else 0}

    def whole(self, results: list[JobResult]) -> dict:
        [result] = results
        text, calls = self._split(result.text)
        content: list[dict] = [{"type": "text", "text": text}] if text or not calls else []
        content += [_tool_use(c) for c in calls]
        reason, sequence = self._stop(result, calls)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": self.usage(result),
                "mtplx_stats": result.stats}

    # -- streamed --------------------------------------------------------------------------
    def start(self) -> list[str]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": self.usage(None)}
        return [_event("message_start", message=message), _event("ping")]

    def delta(self, index: int, event: Delta) -> list[str]:
        events = self.stream.feed(event.text) if self.stream else [("content", event.text)]
        return self._blocks(events)

    def _blocks(self, events: list) -> list[str]:
        out = []
        for kind, value in events:
            if kind == "content":
                if not value or (self.block is None and not value.strip() and self.stream is not None):
                    continue  # whitespace around tool calls opens no block
                if self.block is None:
                    self.block = self.blocks
                    self.blocks += 1
                    out.append(_event("content_block_start", index=self.block,
                                      content_block={"type": "text", "text": ""}))
                out.append(_event("content_block_delta", index=self.block,
                                  delta={"type": "text_delta", "text": value}))
                continue
            call, fragment = value if kind == "arguments" else (value, None)
            if kind in ("call", "call_start"):
                out += self._close_text()
                self.tool_block = self.blocks
                self.blocks += 1
                out.append(_event("content_block_start", index=self.tool_block,
                                  content_block={**_tool_use(call, {}), "input": {}}))
            if kind == "call":
                fragment = call.arguments
            if fragment:
                out.append(_event("content_block_delta", index=self.tool_block,
                                  delta={"type": "input_json_delta", "partial_json": fragment}))
            if kind in ("call", "call_end"):
                out.append(_event("content_block_stop", index=self.tool_block))
        return out

    def _close_text(self) -> list[str]:
        if self.block is None:
            return []
        index, self.block = self.block, None
        return [_event("content_block_stop", index=index)]

    def done(self, index: int, result: JobResult) -> list[str]:
        self.result = result
        out = self._blocks(self.stream.finish()) if self.stream else []
        if self.blocks == 0:  # an empty reply still has its (empty) text block
            self.block, self.blocks = 0, 1
            out.append(_event("content_block_start", index=0, content_block={"type": "text", "text": ""}))
        out += self._close_text()
        reason, sequence = self._stop(result, self.stream.calls if self.stream else [])
        out.append(_event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                          usage={"output_tokens": result.completion_tokens}, mtplx_stats=result.stats))
        return out

    def end(self) -> list[str]:
        return [_event("message_stop")]

    def error(self, error: APIError) -> list[str]:
        return [sse({"type": "error", "error": {"type": anthropic_type(error.status), "message": error.message}},
                    event="error")]


def _tool_use(call: ToolCall, input: dict | None = None) -> dict:
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1), "name": call.name,
            "input": _input(call.arguments) if input is None else input}


def _input(arguments: str) -> dict:
    """A call's arguments as a tool_use input object; {} for a forced call whose output ended
    before its arguments closed (stop_reason says why; a stream sent them as far as they came,
    as partial_json)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _event(kind: str, **fields: Any) -> str:
    return sse({"type": kind, **fields}, event=kind)
