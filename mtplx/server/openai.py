"""The OpenAI-compatible front door: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request

from mtplx.batching.state import MTP_ONLY_MODES, SchedulerSettings
from mtplx.server.errors import APIError
from mtplx.server.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields, ResponseShape
from mtplx.server.streaming import stream_response, whole_response

router = APIRouter()


# -- routes --------------------------------------------------------------------------------------
@router.get("/v1/models")
async def list_models(request: Request):
    server = request.app.state.mtplx
    return {"object": "list", "data": [server.model_card()]}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    body.check_supported()
    max_tokens = body.max_completion_tokens or body.max_tokens
    return await _generate(request, body, body.chat_messages(), max_tokens, chat=True)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    body.check_supported()
    return await _generate(request, body, body.single_prompt(), body.max_tokens, chat=False)


async def _generate(request: Request, body: GenerationFields, prompt, max_tokens: int | None, chat: bool):
    server = request.app.state.mtplx
    server.check_model(body.model)
    settings = server.scheduler.settings
    engine_request = server.engine.make_request(
        prompt, chat=chat, mode=body.generation_mode or settings.generation_mode or _mode_default(settings),
        depth=body.depth if body.depth is not None else settings.depth,
        max_tokens=max_tokens or server.engine.max_context, **body.sampling_kwargs(server.default_temperature))
    shape = ResponseShape(chat, body.model, body.return_token_ids)
    if body.stream:
        return stream_response(server.scheduler, engine_request, shape, body.include_usage)
    return await whole_response(request, server.scheduler, engine_request, shape)


def _mode_default(settings: SchedulerSettings) -> str | None:
    """mtp in the MTP-only modes (whatever the engine's default, e.g. AR after `mtplx tune`
    found MTP slower); else None: the engine's default."""
    return "mtp" if settings.mode in MTP_ONLY_MODES else None


def unknown_model(name: str, served: str) -> APIError:
    return APIError(404, f"model {name!r} is not served here; this server serves {served!r}",
                    param="model", code="model_not_found")
