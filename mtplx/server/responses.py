"""OpenAI Responses: ``POST /v1/responses``, stateless.

``input`` (a string, or message / ``function_call`` / ``function_call_output`` items) and
``instructions`` become chat messages; ``tools`` (flat ``{"type": "function", "name",
"parameters"}``) and ``tool_choice`` are the chat route's. The reply's ``output`` holds a
``message`` item (``output_text``) and ``function_call`` items; streamed, the events run
``response.created``, ``response.in_progress``, per item ``response.output_item.added`` ...
``response.output_item.done`` (with ``response.output_text.delta`` or
``response.function_call_arguments.delta`` between), then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it). Nothing is stored, so
``previous_response_id`` is a 400 (send the whole conversation as ``input``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field

from mtplx.batching.job import Delta, JobResult
from mtplx.server.errors import APIError, bad_param
from mtplx.server.openai import chat_prompt, engine_requests, respond_with
from mtplx.server.protocol import (MAX_TEMPERATURE, MAX_TOP_LOGPROBS, RequestBody, chat_message, is_neutral,
                                   join_text, sse)
from mtplx.server.structured import response_format_grammar, tool_call_grammar
from mtplx.server.tools import (Tool, ToolCall, ToolCallStream, ToolChoice, check_unique_names, make_tool,
                                parse_tool_choice, split_tool_calls)

router = APIRouter()


# OpenAI's fields this server does not implement, each a 400 unless one of its neutral values
# (None: not sent); other unknown fields (user, metadata, ...) change nothing and are ignored
UNSUPPORTED = {"reasoning": (None, {}), "include": (None, []), "background": (None, False),
               "conversation": (None,), "prompt": (None,), "top_logprobs": (None, 0), "max_tool_calls": (None,),
               "truncation": (None, "disabled")}

# why a reply is "incomplete" (incomplete_details.reason), by the job's finish reason
INCOMPLETE = {"length": "max_output_tokens", "cancelled": "cancelled"}


class ResponsesRequest(RequestBody):
    model_config = ConfigDict(extra="allow", strict=True)
    null_is_unset = True

    model: str
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = 1.0
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    text: dict | None = None
    # mtplx extensions, as on the chat route
    seed: int | None = None
    top_k: int = 0
    generation_mode: Literal["mtp", "ar"] | None = None
    depth: int | Literal["auto"] | None = None
    draft_policy: Literal["auto", "greedy", "mirror"] = "auto"

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            raise bad_param("previous_response_id", "this server stores no responses (it is stateless); send the whole "
                                                    "conversation in input", "unsupported_value")
        extra = self.model_extra or {}
        top = extra.get("top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise bad_param("top_logprobs", f"must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}")
        if extra.get("truncation") not in (None, "auto", "disabled"):
            raise bad_param("truncation", f"must be 'auto' or 'disabled', got {extra['truncation']!r}")
        for name, neutral in UNSUPPORTED.items():
            if not is_neutral(extra.get(name), neutral):
                raise bad_param(name, "not supported by this server" + (
                    " (a conversation past the context is a 400, not cut)" if name == "truncation" else ""),
                                "unsupported_value")

    def offered_tools(self) -> list[Tool]:
        tools = []
        for i, t in enumerate(self.tools or ()):
            if t.get("type") != "function":
                raise bad_param(f"tools.{i}.type", f"only function tools are supported, got {t.get('type')!r}")
            tools.append(make_tool(t.get("name"), t.get("description"), t.get("parameters"), f"tools.{i}"))
        check_unique_names(tools, "tools")
        return tools

    def tool_choice_of(self, tools: list[Tool]):
        raw = self.tool_choice
        if isinstance(raw, dict) and raw.get("type") == "function" and "name" in raw:
            raw = {"type": "function", "function": {"name": raw["name"]}}
        return parse_tool_choice(raw, tools)

    def response_format(self) -> dict | None:
        """``text.format`` in the chat route's ``response_format`` shape ({"type": "json_schema",
        "name", "schema", "strict"} here becomes {"type": "json_schema", "json_schema": {...}})."""
        fmt = (self.text or {}).get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        return fmt

    def chat_messages(self) -> list[dict]:
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            _add_item(out, item, f"input.{i}")
        if not out:  # (a chat template refuses an empty conversation)
            raise bad_param("input", "holds no item and there are no instructions: give at least one message")
        return out

    def sampling(self, default_temperature: float) -> dict:
        return dict(temperature=default_temperature if self.temperature is None else self.temperature,
                    top_p=self.top_p, top_k=self.top_k, seed=self.seed, draft_policy=self.draft_policy)


def _add_item(out: list[dict], item: dict, where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_param(f"{where}.role", f"must be one of user, system, developer, assistant, got {role!r}")
        content = item.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                       and isinstance(p.get("text"), str) for p in content):
                raise bad_param(f"{where}.content", "only text parts (input_text, output_text) are supported")
            content = join_text(p["text"] for p in content)
        out.append(chat_message(role, content, None, None, where))
    elif kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise bad_param(where, "a function_call item needs call_id, name and arguments (strings)")
        call = ToolCall(item["name"], item["arguments"], id=item["call_id"])
        if out and out[-1]["role"] == "assistant":
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
            raise bad_param(where, "a function_call_output item needs call_id and output (strings)")
        calls = {c.id for m in out for c in m.get("tool_calls", ())}
        if item["call_id"] not in calls:  # (as OpenAI: an output answers a call the input holds)
            raise bad_param(f"{where}.call_id", f"no function_call item before it has call_id {item['call_id']!r}")
        out.append(chat_message("tool", output, None, item["call_id"], where))
    else:
        raise bad_param(f"{where}.type", f"item type {kind!r} is not supported (message, function_call, "
                                         "function_call_output)")


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    body.check_supported()
    server = request.app.state.mtplx
    server.check_model(body.model)
    tools = body.offered_tools()
    choice = body.tool_choice_of(tools)
    tools = tools if choice.mode != "none" else []
    prompt, chat = chat_prompt(server.engine, body.chat_messages(), tools)
    grammar = (tool_call_grammar(server.engine, tools, choice, server.tool_parser)
               or response_format_grammar(server.engine, body.response_format(), "text.format", spec_at="text.format"))
    [engine_request] = engine_requests(server, body, prompt, ("max_output_tokens", body.max_output_tokens),
                                       chat=chat, sampling=body.sampling(server.default_temperature),
                                       grammar=grammar, prompt_field="input")
    reply = ResponseObject(body, tools, server.tool_parser if tools else None, choice,
                           temperature=engine_request.params.temperature)
    return await respond_with(request, body.stream, [engine_request], reply.id, reply, reply.whole)


class ResponseObject:
    """Builds one Responses reply, whole (``whole``) or streamed (``start`` ... ``end``)."""

    def __init__(self, body: ResponsesRequest, tools: list[Tool], parser, choice: ToolChoice | None = None,
                 temperature: float | None = None):
        self.body, self.tools, self.parser, self.choice = body, tools, parser, choice
        self.temperature = body.temperature if temperature is None else temperature  # the one sampled at
        self.id = f"resp_{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.stream = ToolCallStream(parser, tools, choice) if tools and parser else None
        self.seq = 0
        self.items: list[dict] = []  # output items so far
        self.text_item: dict | None = None  # the open message item
        self.call_item: dict | None = None  # the last function_call item

    def envelope(self, status: str, output: list[dict], result: JobResult | None = None) -> dict:
        b = self.body
        usage = None
        if result is not None:
            usage = {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens,
                     "total_tokens": result.prompt_tokens + result.completion_tokens,
                     "input_tokens_details": {"cached_tokens": result.stats.get("cached_prompt_tokens", 0)},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        obj = {"id": self.id, "object": "response", "created_at": self.created,
               "completed_at": int(time.time()) if status == "completed" else None, "status": status,
               "model": b.model, "output": output, "error": None,
               "incomplete_details": ({"reason": INCOMPLETE[result.finish_reason if result else "length"]}
                                      if status == "incomplete" else None),
               "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
               "temperature": self.temperature, "top_p": b.top_p, "parallel_tool_calls": b.parallel_tool_calls,
               "tool_choice": b.tool_choice or "auto",
               "tools": [{"type": "function", "name": t.name, "description": t.description,
                          "parameters": t.parameters, "strict": False} for t in self.tools],
               "previous_response_id": None, "store": False, "text": b.text or {"format": {"type": "text"}},
               "truncation": "disabled", "metadata": (b.model_extra or {}).get("metadata") or {},
               "usage": usage}
        if result is not None:
            obj["mtplx_stats"] = result.stats
        return obj

    @staticmethod
    def status(result: JobResult) -> str:
        """"incomplete" where max_output_tokens or a cancel (by the request's id) cut it."""
        return "incomplete" if result.finish_reason in INCOMPLETE else "completed"

    def whole(self, results: list[JobResult]) -> dict:
        [result] = results
        text, calls = result.text, []
        if self.tools and self.parser:
            text, calls = split_tool_calls(self.parser, self.tools, result.text, self.choice)
        output = [_message_item(text, "completed")] if text or not calls else []
        output += [_call_item(c, _item_status(c)) for c in calls]
        status = self.status(result)
        if status == "incomplete" and output[-1]["type"] == "message":  # its text is what the end cut
            output[-1]["status"] = "incomplete"
        return self.envelope(status, output, result)

    # -- streamed --------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields}, event=kind)

    def start(self) -> list[str]:
        return [self._event("response.created", response=self.envelope("in_progress", [])),
                self._event("response.in_progress", response=self.envelope("in_progress", []))]

    def delta(self, index: int, event: Delta) -> list[str]:
        return self._items(self.stream.feed(event.text) if self.stream else [("content", event.text)])

    def _items(self, events: list) -> list[str]:
        out = []
        for kind, value in events:
            if kind == "content":
                if not value or (self.text_item is None and self.stream is not None and not value.strip()):
                    continue
                out += self._open_text()
                self.text_item["content"][0]["text"] += value
                out.append(self._event("response.output_text.delta", item_id=self.text_item["id"],
                                       output_index=len(self.items) - 1, content_index=0, delta=value))
                continue
            call, fragment = value if kind == "arguments" else (value, None)
            if kind in ("call", "call_start"):
                out += self._close_text()
                self.call_item = _call_item(call, "in_progress")
                self.items.append(self.call_item)
                out.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                       item={**self.call_item, "arguments": ""}))
            item, at = self.call_item, self.items.index(self.call_item)
            if kind == "call":
                fragment = call.arguments
            if fragment:
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=at, delta=fragment))
            if kind in ("call", "call_end"):
                item.update(arguments=call.arguments, status=_item_status(call))
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=at, arguments=call.arguments))
                out.append(self._event("response.output_item.done", output_index=at, item=item))
        return out

    def _open_text(self) -> list[str]:
        if self.text_item is not None:
            return []
        self.text_item = _message_item("", "in_progress")
        self.items.append(self.text_item)
        at = len(self.items) - 1
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self._event("response.output_item.added", output_index=at,
                            item={**self.text_item, "content": []}),
                self._event("response.content_part.added", item_id=self.text_item["id"], output_index=at,
                            content_index=0, part=part)]

    def _close_text(self, status: str = "completed") -> list[str]:
        """Close the open message item: "incomplete" where the reply's end cut its text."""
        item, self.text_item = self.text_item, None
        if item is None:
            return []
        at = self.items.index(item)
        item["status"] = status
        part = item["content"][0]
        return [self._event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                            text=part["text"]),
                self._event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=at, item=item)]

    def done(self, index: int, result: JobResult) -> list[str]:
        out = self._items(self.stream.finish()) if self.stream else []
        if not self.items:  # an empty reply is an empty message
            out += self._open_text()
        status = self.status(result)
        out += self._close_text(status)  # the last item, if it is text
        out.append(self._event(f"response.{status}", response=self.envelope(status, self.items, result)))
        return out

    def end(self) -> list[str]:
        return []

    def error(self, error: APIError) -> list[str]:
        return [self._event("error", code=error.code, message=error.message, param=error.param)]


def _item_status(call: ToolCall) -> str:
    return "completed" if call.complete else "incomplete"


def _message_item(text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: ToolCall, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}
