"""OpenAI request bodies (pydantic) and the response / stream chunk objects we send.

Besides OpenAI's fields, requests accept the common extensions ``top_k`` and ``min_p``, and
mtplx's ``generation_mode`` ("mtp" | "ar"), ``depth``, ``draft_policy`` and
``return_token_ids`` (OpenAI clients pass them through ``extra_body``). Unknown fields are
ignored, as OpenAI clients send many optional ones.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mtplx.batching.job import JobResult
from mtplx.server.errors import APIError

DEFAULT_TEMPERATURE = 1.0  # OpenAI's documented default when a request gives none


class StreamOptions(BaseModel):
    include_usage: bool = False


# Fields other servers accept that this one does not implement and that would change the
# output if ignored: a 400 naming the field unless the value is one of these neutral ones.
# Other unknown fields (user, metadata, store, ...) do not change the output and are ignored.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "logit_bias": (None, {}), "min_tokens": (None, 0), "repetition_penalty": (None, 1, 1.0),
    "top_logprobs": (None, 0), "response_format": (None, {"type": "text"}), "functions": (None, []),
    "function_call": (None, "none"), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "prompt_logprobs": (None, 0), "length_penalty": (None, 1, 1.0),
    "use_beam_search": (None, False), "min_new_tokens": (None, 0),
}


class GenerationFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")  # unknown fields are checked in check_supported

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    generation_mode: Literal["mtp", "ar"] | None = None
    depth: int | None = None
    draft_policy: Literal["greedy", "mirror"] = "greedy"
    return_token_ids: bool = False
    ignore_eos: bool = False

    def check_supported(self) -> None:
        """400 for features this server does not offer, instead of silently ignoring them."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and value not in UNSUPPORTED_FIELDS[name]:
                raise APIError(400, f"{name}: not supported by this server (ignoring it would change the output)",
                               param=name, code="unsupported_value")
        if self.n != 1:
            raise APIError(400, f"n: only n=1 is supported (got {self.n}); send one request per completion",
                           param="n", code="unsupported_value")
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs: log probabilities are not supported", param="logprobs",
                           code="unsupported_value")

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
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools: tool calling is not supported", param="tools", code="unsupported_value")

    def chat_messages(self) -> list[dict]:
        """Messages as {"role", "content": str}; content parts must be text."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                if any(part.get("type") != "text" for part in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages.{i}.content", code="unsupported_value")
                content = "".join(str(part.get("text", "")) for part in content)
            out.append({"role": m.role, "content": content or ""})
        return out


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name, off in (("echo", False), ("suffix", None)):
            if getattr(self, name) != off:
                raise APIError(400, f"{name}: not supported", param=name, code="unsupported_value")
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


def usage(result: JobResult) -> dict:
    cached = result.stats.get("cached_prompt_tokens", 0)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


class ResponseShape:
    """Builds the objects of one response, chat or text completion, whole or streamed."""

    def __init__(self, chat: bool, model: str, return_token_ids: bool):
        self.chat, self.model, self.return_token_ids = chat, model, return_token_ids
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def whole(self, result: JobResult) -> dict:
        choice = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        if self.return_token_ids:
            choice["token_ids"] = result.token_ids
        return self._envelope("chat.completion" if self.chat else "text_completion", [choice],
                              usage=usage(result), mtplx_stats=result.stats)

    def chunk(self, text: str | None, token_ids: list[int] | None = None, finish_reason: str | None = None,
              role: bool = False, **extra) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def usage_chunk(self, result: JobResult) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [],
                              usage=usage(result), mtplx_stats=result.stats)
