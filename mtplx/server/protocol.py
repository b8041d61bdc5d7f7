"""OpenAI request bodies (pydantic) and the response / stream chunk objects we send.

Besides OpenAI's fields, requests accept the common extensions ``top_k`` and ``min_p``, and
mtplx's ``generation_mode`` ("mtp" | "ar"), ``depth``, ``draft_policy`` and
``return_token_ids`` (OpenAI clients pass them through ``extra_body``). Unknown fields are
ignored, as OpenAI clients send many optional ones.
"""

from __future__ import annotations

import codecs
import json
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mtplx.batching.job import JobResult
from mtplx.server.errors import APIError, bad_param, error_body
from mtplx.server.tools import (ROLES, ToolCall, ToolCallStream, ToolChoice, parse_tool_choice, parse_tools,
                                split_tool_calls)

DEFAULT_TEMPERATURE = 1.0  # OpenAI's documented default when a request gives none
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_N = 16  # completions per request
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's limit)
NO_LOGPROB = -9999.0  # what JSON carries for a token the distribution excludes (-inf), as OpenAI


def lone_surrogate_path(value, path: tuple = ()) -> tuple | None:
    """Where in a parsed JSON body a string holds a lone UTF-16 surrogate (JSON's "\\ud800"
    escape decodes to one; it is not Unicode text and no tokenizer takes it), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate_path(key, path) or lone_surrogate_path(item, (*path, str(key)))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate_path(item, (*path, str(i)))
            if found is not None:
                return found
    return None


class RequestBody(BaseModel):
    """A request body: every string in it must be valid Unicode (checked before the fields).
    A whole request (``null_is_unset``) reads a top-level field sent as JSON null as not sent,
    as OpenAI's and Anthropic's APIs do (clients such as LiteLLM send ``"n": null``)."""

    null_is_unset: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        path = lone_surrogate_path(data)
        if path is not None:
            param = ".".join(path) or None
            raise APIError(400, f"{param or 'body'}: contains a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                                "without its pair), which is not valid Unicode text", param=param,
                           code="invalid_value")
        if cls.null_is_unset and isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False


# Fields other servers accept that this one does not implement and that would change the
# output if ignored: a 400 naming the field unless the value is one of these neutral ones.
# Other unknown fields (user, metadata, store, ...) do not change the output and are ignored.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "logit_bias": (None, {}), "min_tokens": (None, 0), "repetition_penalty": (None, 1, 1.0),
    "response_format": (None, {"type": "text"}), "functions": (None, []),
    "function_call": (None, "none"), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "prompt_logprobs": (None, 0), "length_penalty": (None, 1, 1.0),
    "use_beam_search": (None, False), "min_new_tokens": (None, 0), "best_of": (None, 1),
}


def is_neutral(value, neutral: tuple) -> bool:
    """Whether ``value`` is one of the neutral values, of the same type (true is not 1)."""
    return any(value == n and type(value) is type(n) for n in neutral)


class GenerationFields(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions. Numbers are strict: ``true``
    is not 1 and ``2.5`` is not an integer."""

    model_config = ConfigDict(extra="allow", strict=True)  # unknown fields are checked in check_supported
    null_is_unset = True

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    generation_mode: Literal["mtp", "ar"] | None = None
    depth: int | Literal["auto"] | None = None
    draft_policy: Literal["auto", "greedy", "mirror"] = "auto"
    return_token_ids: bool = False
    ignore_eos: bool = False

    def check_supported(self) -> None:
        """400 for features this server does not offer, instead of silently ignoring them."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and not is_neutral(value, UNSUPPORTED_FIELDS[name]):
                raise APIError(400, f"{name}: not supported by this server (ignoring it would change the output)",
                               param=name, code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options",
                           code="invalid_value")

    def sampling_kwargs(self, default_temperature: float = DEFAULT_TEMPERATURE) -> dict:
        """Keyword arguments for ``Engine.make_request`` (besides prompt, max_tokens, mode, depth)."""
        temperature = default_temperature if self.temperature is None else self.temperature
        return dict(temperature=temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    seed=self.seed, stop=self.stop, draft_policy=self.draft_policy, ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal[ROLES]
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None


def text_of(content, param: str, refusals: bool = False) -> str:
    """A message's content as text: a string, or a list of text parts (and with ``refusals``,
    an assistant message's, refusal parts ``{"type": "refusal", "refusal": str}``: what the
    model said)."""
    if isinstance(content, str):
        return content
    kinds = {"text": "text", **({"refusal": "refusal"} if refusals else {})}  # part type -> its text's key
    if any(not isinstance(part, dict) or not isinstance(part.get("type"), str) or part["type"] not in kinds
           or not isinstance(part.get(kinds[part["type"]]), str) for part in content):
        raise APIError(400, f"{param}: only text parts ({{'type': 'text', 'text': str}}"
                            + (" and refusal parts" if refusals else "") + ") are supported",
                       param=param, code="unsupported_value")
    return join_text(part[kinds[part["type"]]] for part in content)


def join_text(parts) -> str:
    """A message's text parts (OpenAI's content parts, Anthropic's text blocks) as one text: a
    line break between parts, as the parts were written apart (joined bare, "You are a pirate."
    and "Answer briefly." ran into one sentence)."""
    return "\n".join(parts)


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    response_format: Any = None  # text, json_object, json_schema (structured.py)

    def check_supported(self) -> None:
        super().check_supported()
        self.offered_tools = parse_tools(self.tools)
        self.choice: ToolChoice = parse_tool_choice(self.tool_choice, self.offered_tools)
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs", code="invalid_value")
        if self.choice.forced and self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "response_format: cannot be combined with a forced tool_choice (the output is the "
                                "tool call)", param="response_format", code="invalid_value")

    @property
    def logprobs_wanted(self) -> int | None:
        """None (no logprobs) or how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict]:
        """Messages as {"role", "content": str} plus "tool_calls" (assistant) and "tool_call_id"
        (tool); "developer" is a system message. A 400 names the first message that is wrong."""
        messages = [chat_message(m.role, m.content, m.tool_calls, m.tool_call_id, f"messages.{i}")
                    for i, m in enumerate(self.messages)]
        check_tool_turns(messages)
        return messages


def check_tool_turns(messages: list[dict]) -> None:
    """As OpenAI's API: a tool message answers a tool call of the assistant message its run of
    tool messages follows, and an assistant message's tool calls (but the last message's) are
    each answered by the tool messages right after it."""
    asked: list[str] = []  # the open assistant message's call ids
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if m["tool_call_id"] not in asked:
                raise bad_param(f"messages.{i}.tool_call_id", f"{m['tool_call_id']!r} answers no tool call of the "
                                                              "assistant message before it")
            asked.remove(m["tool_call_id"])
            continue
        if asked:
            raise bad_param(f"messages.{i}", f"the assistant message's tool calls {', '.join(asked)} need tool "
                                             "messages answering them first")
        asked = [c.id for c in m.get("tool_calls", ())]


def article(word: str) -> str:
    """``word`` after its indefinite article: "an assistant", "a user" (a "u" read as "you")."""
    vowel = word[:1] in "aeio" or (word[:1] == "u" and not word.startswith(("use", "usa", "uni", "url")))
    return ("an " if vowel else "a ") + word


def chat_message(role: str, content, tool_calls: list | None, tool_call_id: str | None, where: str) -> dict:
    if content is None and not (role == "assistant" and tool_calls):
        raise bad_param(f"{where}.content", f"{article(role)} message needs content (a string or text parts), got null")
    message = {"role": "system" if role == "developer" else role,
               "content": "" if content is None else text_of(content, f"{where}.content", role == "assistant")}
    if tool_calls:
        if role != "assistant":
            raise bad_param(f"{where}.tool_calls", "only assistant messages carry tool calls")
        message["tool_calls"] = [_tool_call(c, f"{where}.tool_calls.{j}") for j, c in enumerate(tool_calls)]
    if role == "tool":
        if not tool_call_id:
            raise bad_param(f"{where}.tool_call_id", "a tool message needs the tool_call_id it answers")
        message["tool_call_id"] = tool_call_id
    return message


def _tool_call(call: dict, where: str) -> ToolCall:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise APIError(400, f"{where}: expected {{'id', 'type': 'function', 'function': {{'name': str, "
                            "'arguments': str}}}}", param=where, code="invalid_value")
    return ToolCall(fn["name"], fn["arguments"], id=str(call.get("id") or ToolCall("", "").id))


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix is not None:
            raise APIError(400, "suffix: not supported", param="suffix", code="unsupported_value")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of: only 1 is supported", param="best_of", code="unsupported_value")

    def single_prompt(self) -> str | list[int]:
        """The prompt as a string or a list of token ids; a batch of prompts is a 400."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"prompt: one prompt per request is supported (got {len(p)})",
                               param="prompt", code="unsupported_value")
            p = p[0]
        return p


# -- responses ------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(results: JobResult | list[JobResult]) -> dict:
    """OpenAI usage of one or n completions of the same prompt (prompt tokens counted once)."""
    results = results if isinstance(results, list) else [results]
    prompt = results[0].prompt_tokens
    completion = sum(r.completion_tokens for r in results)
    cached = results[0].stats.get("cached_prompt_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def stats_fields(results: list[JobResult]) -> dict:
    """``mtplx_stats`` (the first completion's), plus ``mtplx_choice_stats`` for n > 1."""
    extra = {"mtplx_stats": results[0].stats}
    if len(results) > 1:
        extra["mtplx_choice_stats"] = [r.stats for r in results]
    return extra


class ResponseShape:
    """Builds the objects of one OpenAI response, chat or text completion, whole or streamed,
    with ``n`` choices; with ``tools`` (and a parser) chat output is split into content and
    ``tool_calls``. Streaming: ``start``, ``delta``, ``done``, ``end`` return SSE lines."""

    def __init__(self, chat: bool, model: str, return_token_ids: bool, n: int = 1, include_usage: bool = False,
                 tools: list | None = None, parser=None, tokenizer=None, echo: tuple[str, list[int], int] | None = None,
                 choice: ToolChoice | None = None):
        self.chat, self.model, self.return_token_ids = chat, model, return_token_ids
        self.choice = choice  # a forced one makes output that ended inside its markup the call so far
        # completions' echo, sent before the output: (prompt text, prompt token ids, how many of the
        # ids lead the prompt without being in its text: a BOS the tokenizer added)
        self.echo = echo
        self.echoed = [False] * n
        self.tokenizer = tokenizer  # for logprobs' token strings
        self.offsets = [0] * n  # text offset of the next token per choice (completions' logprobs)
        self.characters = [_utf8() for _ in range(n)]  # the bytes of each choice's tokens so far -> characters
        self.n, self.include_usage = n, include_usage
        self.tools, self.parser = tools or [], parser
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.streams = [self._tool_stream() for _ in range(n)]
        self.results: dict[int, JobResult] = {}

    def _tool_stream(self) -> ToolCallStream | None:
        if not (self.chat and self.tools and self.parser):
            return None
        return ToolCallStream(self.parser, self.tools, self.choice)

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    # -- whole -----------------------------------------------------------------------------
    def whole(self, results: list[JobResult]) -> dict:
        return self._envelope(self.object, [self._choice(i, r) for i, r in enumerate(results)],
                              usage=usage(results), **stats_fields(results))

    def _choice(self, index: int, result: JobResult) -> dict:
        choice = {"index": index, "finish_reason": result.finish_reason,
                  "logprobs": self.logprobs(index, result.token_ids, result.logprobs)}
        if self.chat:
            message = {"role": "assistant", "content": result.text}
            if self._tool_stream() is not None:
                content, calls = split_tool_calls(self.parser, self.tools, result.text, self.choice)
                if calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [c.openai_dict() for c in calls]}
                    choice["finish_reason"] = _tool_finish(result.finish_reason, calls)
            choice["message"] = message
        else:
            choice["text"] = result.text
            if self.echo:
                choice["text"] = self.echo[0] + result.text
                self.offsets[index], self.characters[index] = 0, _utf8()
                choice["logprobs"] = _join(self._echo_logprobs(index, result.prompt_logprobs),
                                           self.logprobs(index, result.token_ids, result.logprobs))
        if self.return_token_ids:
            choice["token_ids"] = result.token_ids
        return choice

    def _echo_logprobs(self, index: int, values: list | None) -> dict | None:
        """Completions' logprobs of the echoed prompt: its first token has none (null)."""
        if values is None:
            return None
        return self.logprobs(index, self.echo[1], [(None, None)] + values, echoed=True)

    def logprobs(self, index: int, token_ids: list[int], values: list | None, echoed: bool = False) -> dict | None:
        """The choice's ``logprobs`` for these tokens: chat's {"content": [...]} or completions'
        {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; None when not asked.
        ``echoed``: the tokens of the echoed prompt, whose text holds its control tokens' literal
        text, but for those the tokenizer added (generated text leaves control tokens out)."""
        if values is None:
            return None
        if self.chat:
            return {"content": [{**self._entry(token, value), "top_logprobs": [self._entry(i, v) for i, v in top]}
                                for token, (value, top) in zip(token_ids, values)], "refusal": None}
        offsets = []
        added = self.echo[2] if echoed else 0
        for i, token in enumerate(token_ids):  # where each token's text starts: characters completed before it
            offsets.append(self.offsets[index])
            if not self._special(token):
                self.offsets[index] += len(self.characters[index].decode(self._bytes(token)))
            elif echoed and i >= added:
                self.offsets[index] += len(self._token(token))  # a prompt's control token, there in its text
        return {"tokens": [self._token(t) for t in token_ids],
                "token_logprobs": [None if v is None else _finite(v) for v, _ in values],
                "top_logprobs": [None if top is None else self._top(token, value, top)
                                 for token, (value, top) in zip(token_ids, values)],
                "text_offset": offsets}

    def _top(self, token_id: int, value: float, top: list) -> dict:
        """Completions' top logprobs at a position, the chosen token's among them: up to
        ``logprobs`` + 1 entries, as OpenAI's reference says."""
        return {**{self._token(i): _finite(v) for i, v in top}, self._token(token_id): _finite(value)}

    def _special(self, token_id: int) -> bool:
        return self.tokenizer is not None and self.tokenizer.is_special(token_id)

    def _bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else str(token_id).encode()

    def _token(self, token_id: int) -> str:
        """A token as text; the bytes of a part of a UTF-8 character as \\xNN escapes (as OpenAI
        writes them), so that such tokens stay apart and their bytes stay readable."""
        return self._bytes(token_id).decode("utf-8", errors="backslashreplace")

    def _entry(self, token_id: int, value: float) -> dict:
        return {"token": self._token(token_id), "logprob": _finite(value), "bytes": list(self._bytes(token_id))}

    # -- streamed --------------------------------------------------------------------------
    def chunk(self, index: int, text: str | None, token_ids: list[int] | None = None,
              finish_reason: str | None = None, role: bool = False, tool_calls: list | None = None,
              logprobs: dict | None = None, **extra) -> dict:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def start(self) -> list[str]:
        return [sse(self.chunk(i, "", role=True)) for i in range(self.n)] if self.chat else []

    def delta(self, index: int, event) -> list[str]:
        text, token_ids = event.text, event.token_ids
        head = self._echo_chunk(index, event.prompt_logprobs)
        lp = self.logprobs(index, token_ids, event.logprobs)
        if head:
            return head + ([sse(self.chunk(index, text, token_ids, logprobs=lp))] if token_ids or text else [])
        stream = self.streams[index]
        if stream is None:
            wanted = text or self.return_token_ids or lp is not None
            return [sse(self.chunk(index, text, token_ids, logprobs=lp))] if wanted else []
        out = self._tool_events(index, stream.feed(text))
        if self.return_token_ids or lp is not None:  # the tokens' own chunk (the text is in the others)
            out.append(sse(self.chunk(index, None, token_ids, logprobs=lp)))
        return out

    def _tool_events(self, index: int, events: list) -> list[str]:
        out = []
        for kind, value in events:
            if kind == "content":
                out.append(sse(self.chunk(index, value)))
                continue
            call, fragment = value if kind == "arguments" else (value, None)
            k = self.streams[index].calls.index(call)
            if kind in ("call", "call_start"):  # its id and name first
                head = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name,
                                                                                    "arguments": ""}}
                out.append(sse(self.chunk(index, None, tool_calls=[head])))
            if kind == "call":
                fragment = call.arguments
            if fragment:
                out.append(sse(self.chunk(index, None, tool_calls=[{"index": k, "function": {
                    "arguments": fragment}}])))
        return out

    def _echo_chunk(self, index: int, prompt_logprobs: list | None) -> list[str]:
        """The echoed prompt, once per choice, before its first output."""
        if not self.echo or self.echoed[index]:
            return []
        self.echoed[index] = True
        logprobs = self._echo_logprobs(index, prompt_logprobs)
        return [sse(self.chunk(index, self.echo[0], self.echo[1], logprobs=logprobs))]

    def done(self, index: int, result: JobResult) -> list[str]:
        self.results[index] = result
        stream, reason = self.streams[index], result.finish_reason
        out = self._echo_chunk(index, result.prompt_logprobs)
        if stream is not None:
            out += self._tool_events(index, stream.finish())
            reason = _tool_finish(reason, stream.calls)
        last = len(self.results) == self.n
        extra = {}
        if last and not self.include_usage:  # the last chunk before [DONE] carries usage and stats
            extra = dict(usage=usage(self._ordered()), **stats_fields(self._ordered()))
        out.append(sse(self.chunk(index, None if self.chat else "", [], reason, **extra)))
        return out

    def _ordered(self) -> list[JobResult]:
        return [self.results[i] for i in sorted(self.results)]

    def end(self) -> list[str]:
        out = []
        if self.include_usage:
            results = self._ordered()
            out.append(sse(self._envelope("chat.completion.chunk" if self.chat else "text_completion", [],
                                          usage=usage(results), **stats_fields(results))))
        return out + ["data: [DONE]\n\n"]

    def error(self, error: APIError) -> list[str]:
        return [sse(error_body(error.message, error.type, error.param, error.code)), "data: [DONE]\n\n"]


def _join(a: dict | None, b: dict | None) -> dict | None:
    """Two completions logprobs objects as one (the echoed prompt's, then the output's)."""
    if a is None or b is None:
        return a or b
    return {key: a[key] + b[key] for key in a}


def _utf8():
    """An incremental UTF-8 decoder: a character counts once its last byte is in."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def _finite(value: float) -> float:
    return value if value > NO_LOGPROB else NO_LOGPROB


def _tool_finish(reason: str, calls: list[ToolCall]) -> str:
    """A reply that ended on its calls finishes "tool_calls"; one whose (forced) call was cut
    short keeps why it ended (length, stop, cancelled)."""
    return "tool_calls" if reason == "stop" and calls and all(c.complete for c in calls) else reason


def sse(obj: dict, event: str | None = None) -> str:
    """One SSE event: ``data: {json}``, after ``event: NAME`` when given."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, separators=(',', ':'))}\n\n"
