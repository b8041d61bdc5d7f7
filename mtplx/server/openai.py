"""The OpenAI-compatible front door: /v1/chat/completions, /v1/completions, /v1/models(/{id})."""

from __future__ import annotations

import contextlib
import dataclasses

import jinja2

from fastapi import APIRouter, Request

from mtplx.batching.state import MTP_ONLY_MODES, SchedulerSettings
from mtplx.errors import ContextLengthExceeded
from mtplx.server.errors import APIError
from mtplx.server.protocol import ChatCompletionRequest, CompletionRequest, ResponseShape
from mtplx.server.streaming import stream_response, whole_response
from mtplx.server.structured import response_format_grammar, tool_call_grammar
from mtplx.server.tools import render_prompt

router = APIRouter()

# legacy completions' max_tokens where a request gives none: OpenAI's and vLLM's default (chat's
# is the context's end)
COMPLETIONS_MAX_TOKENS = 16


# -- routes --------------------------------------------------------------------------------------
@router.get("/v1/models")
async def list_models(request: Request):
    server = request.app.state.mtplx
    return {"object": "list", "data": [server.model_card()]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request):
    """One model's card (the SDKs' ``models.retrieve``); 404 model_not_found for another name."""
    server = request.app.state.mtplx
    server.check_model(model)
    return server.model_card()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    body.check_supported()
    server = request.app.state.mtplx
    server.check_model(body.model)
    tools = body.offered_tools if body.choice.mode != "none" else []
    prompt, chat = chat_prompt(server.engine, body.chat_messages(), tools)
    limit = ("max_completion_tokens", body.max_completion_tokens) if body.max_completion_tokens else \
        ("max_tokens", body.max_tokens)
    grammar = (tool_call_grammar(server.engine, tools, body.choice, server.tool_parser)
               or response_format_grammar(server.engine, body.response_format))
    requests = engine_requests(server, body, prompt, limit, chat=chat, n=body.n, grammar=grammar,
                               logprobs=body.logprobs_wanted, prompt_field="messages")
    shape = ResponseShape(True, body.model, body.return_token_ids, body.n, body.include_usage, tools,
                          server.tool_parser if tools else None, server.engine.tokenizer, choice=body.choice)
    return await respond_with(request, body.stream, requests, shape.id, shape, shape.whole)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    body.check_supported()
    server = request.app.state.mtplx
    server.check_model(body.model)
    prompt = body.single_prompt()
    requests = engine_requests(server, body, prompt, ("max_tokens", body.max_tokens), chat=False, n=body.n,
                               default_max_tokens=COMPLETIONS_MAX_TOKENS,
                               logprobs=body.logprobs_wanted, prompt_logprobs=body.logprobs if body.echo else None)
    echo = None
    if body.echo:  # the prompt as sent (token ids: decoded, control tokens as their text), before the output
        ids, tokenizer = requests[0].prompt_ids, server.engine.tokenizer
        if isinstance(prompt, str):  # the tokens the tokenizer adds (a BOS) are not in the text
            echo = (prompt, ids, max(0, len(ids) - len(tokenizer.encode(prompt, add_special_tokens=False))))
        else:
            echo = (tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else "", ids, 0)
    shape = ResponseShape(False, body.model, body.return_token_ids, body.n, body.include_usage,
                          tokenizer=server.engine.tokenizer, echo=echo)
    return await respond_with(request, body.stream, requests, shape.id, shape, shape.whole)


async def respond_with(request: Request, stream: bool, requests: list, request_id: str, encoder, build):
    """The stream of ``encoder`` (a streaming.StreamEncoder), or the whole reply ``build(results)``."""
    server = request.app.state.mtplx
    if stream:
        return stream_response(server.scheduler, requests, request_id, encoder)
    return await whole_response(request, server.scheduler, requests, request_id, build)


def chat_prompt(engine, messages: list[dict], tools: list,
                continue_final: bool = False) -> tuple[list | list[int], bool]:
    """(prompt, chat): plain messages go to the engine's chat template as they are; with tools,
    tool calls or tool results the server renders them (tools.render_prompt) into token ids.
    ``continue_final`` (Anthropic's prefill): a last assistant message with text and no tool
    calls is the start of the reply, which continues it (its turn left open), not a new turn."""
    last = messages[-1] if messages else {}
    prefill = (continue_final and last.get("role") == "assistant" and not last.get("tool_calls")
               and isinstance(last.get("content"), str) and last["content"] != "")
    plain = not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    bare = [{"role": m["role"], "content": m["content"]} for m in messages] if plain else None
    if plain and not prefill:
        return bare, True
    if engine.tokenizer is None:
        raise APIError(400, "messages: this model has no tokenizer, so chat messages cannot be formatted",
                       param="messages", code="invalid_value")
    if prefill and last["content"] != last["content"].rstrip():
        raise APIError(400, f"messages.{len(messages) - 1}.content: a final assistant message (a prefill) cannot "
                            "end with whitespace, as Anthropic's API says", param=f"messages.{len(messages) - 1}.content",
                       code="invalid_value")
    with template_errors():
        try:
            if plain:
                return engine.tokenizer.apply_chat_template(bare, add_generation_prompt=False,
                                                            continue_final_message=True), False
            return render_prompt(engine.tokenizer, messages, tools, continue_final=prefill), False
        except ValueError as exc:  # transformers: the template does not end with the prefill's text
            if not prefill:
                raise
            raise APIError(400, f"messages: this model's chat template cannot continue a final assistant message "
                                f"(a prefill): {exc}", param="messages", code="invalid_value") from None


@contextlib.contextmanager
def template_errors():
    """A chat template that refuses the messages (raise_exception in Jinja) is the client's 400."""
    try:
        yield
    except jinja2.TemplateError as exc:
        raise APIError(400, f"messages: the model's chat template refused them: {exc}", param="messages",
                       code="invalid_value") from None


def engine_requests(server, body, prompt, limit: tuple[str, int | None], *, chat: bool, n: int = 1,
                    sampling: dict | None = None, grammar=None, logprobs: int | None = None,
                    prompt_logprobs: int | None = None, prompt_field: str | None = None,
                    default_max_tokens: int | None = None) -> list:
    """The validated engine requests of ``n`` completions of ``prompt`` (seeds seed, seed+1, ...;
    the prompt's KV is shared through the prefix cache). ``limit``: (field name, max tokens or
    None = ``default_max_tokens``, else up to the context); a limit the context cannot hold is a
    400 naming the field (a default stops at the context's end).
    ``grammar``: the output's grammar (structured.py), None for free text. ``logprobs``: report
    each token's logprob and this many alternatives (None: off); ``prompt_logprobs`` the same
    for the prompt's tokens (completions' echo). A prompt or limit the context cannot hold is
    OpenAI's ``context_length_exceeded``, naming the field (``prompt_field``: what the protocol
    calls the prompt; default messages for chat, else prompt)."""
    settings = server.scheduler.settings
    engine = server.engine
    name, max_tokens = limit
    field = prompt_field or ("messages" if chat else "prompt")
    with template_errors(), _context_errors(field):
        base = engine.make_request(
            prompt, chat=chat, mode=body.generation_mode or settings.generation_mode or _mode_default(settings),
            depth=body.depth if body.depth is not None else settings.depth,
            max_tokens=max_tokens or default_max_tokens or engine.max_context,
            **(sampling or body.sampling_kwargs(server.default_temperature)))
    room = engine.max_context - len(base.prompt_ids)
    if max_tokens is not None and max_tokens > room:  # (no shorter prompt helps a limit past the whole context)
        code = "context_length_exceeded" if max_tokens < engine.max_context else "invalid_value"
        raise APIError(400, f"{name}: {max_tokens} is more than the context leaves for output: the context is "
                            f"{engine.max_context} tokens and the prompt takes {len(base.prompt_ids)}, so at most "
                            f"{room}", param=name, code=code)
    base.grammar, base.logprobs, base.prompt_logprobs = grammar, logprobs, prompt_logprobs
    seed = base.params.seed
    return [base] + [dataclasses.replace(base, params=dataclasses.replace(
        base.params, seed=None if seed is None else (seed + i) % 2 ** 64)) for i in range(1, n)]


@contextlib.contextmanager
def _context_errors(field: str):
    try:
        yield
    except ContextLengthExceeded as exc:
        message = str(exc).split(": ", 1)[1]
        raise APIError(400, f"{field}: {message}", param=field, code="context_length_exceeded") from None


def _mode_default(settings: SchedulerSettings) -> str | None:
    """mtp in the MTP-only modes (whatever the engine's default, e.g. AR after `mtplx tune`
    found MTP slower); else None: the engine's default."""
    return "mtp" if settings.mode in MTP_ONLY_MODES else None


def unknown_model(name: str, served: str) -> APIError:
    return APIError(404, f"model {name!r} is not served here; this server serves {served!r}",
                    param="model", code="model_not_found")
