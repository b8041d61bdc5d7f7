"""The dashboard: its page (``GET /dashboard``; ``/`` redirects there), the live stream it reads
(``GET /v1/mtplx/metrics/stream``), cancel (``POST /v1/mtplx/cancel/{id}``) and the settings
that may change while the server runs (``GET``/``POST /v1/mtplx/settings``).

The page is three static files in ``mtplx/assets/dashboard`` holding no data, open without the
API key (``security.PAGE_PATHS``); everything it shows comes from the routes below, which need
the key like every other route. The page sends it in the Authorization header (it reads the
stream with ``fetch``, not ``EventSource``, which cannot send headers), never in a URL.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse

from mtplx.batching import settings as scheduler_settings
from mtplx.batching.state import SchedulerConfigError
from mtplx.config import ConfigError, convert
from mtplx.engine.sampling import SamplingParams
from mtplx.errors import InvalidParameter
from mtplx.server.errors import APIError
from mtplx.server.live import INTERVAL_S, LiveSampler
from mtplx.server.protocol import MAX_TEMPERATURE

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "dashboard"
MAX_STREAMS = 16  # live streams open at once (the page opens one per tab)
# The page's security headers: its script and style come from this server only, nothing frames it.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"}

LIVE_SETTINGS = ("generation_mode", "depth", "temperature")
# Config keys the server reads once, at start: changing one means restarting it.
RESTART_SETTINGS = {"scheduler_mode": "--scheduler-mode", "max_active_requests": "--max-active-requests",
                    "decode_batch_max": "--decode-batch-max", "batch_wait_ms": "--batch-wait-ms",
                    "max_queued_requests": "--max-queue"}
SOURCE = "dashboard settings"  # where a rejected value came from, in config.convert's messages

page_router = APIRouter()  # the static page: open (security.PAGE_PATHS), GET and HEAD (link checkers, monitors)
router = APIRouter()  # its data: behind the API key


# -- the page ---------------------------------------------------------------------------------
@page_router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def root():
    return RedirectResponse("/dashboard", status_code=307)


@page_router.api_route("/dashboard", methods=["GET", "HEAD"], include_in_schema=False)
async def page():
    return FileResponse(ASSETS / "index.html", media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


@page_router.api_route("/dashboard/app.js", methods=["GET", "HEAD"], include_in_schema=False)
async def script():
    return FileResponse(ASSETS / "app.js", media_type="text/javascript; charset=utf-8", headers=PAGE_HEADERS)


@page_router.api_route("/dashboard/style.css", methods=["GET", "HEAD"], include_in_schema=False)
async def style():
    return FileResponse(ASSETS / "style.css", media_type="text/css; charset=utf-8", headers=PAGE_HEADERS)


# -- the live stream ------------------------------------------------------------------------
@router.get("/v1/mtplx/metrics/stream")
async def metrics_stream(request: Request):
    """SSE: ``data: {sample}`` every ``INTERVAL_S`` (live.py says what a sample holds), until the
    client leaves or the server starts shutting down."""
    server = request.app.state.mtplx
    if server.dashboard_streams >= MAX_STREAMS:
        raise APIError(503, f"{MAX_STREAMS} live streams are open already; close a dashboard tab and retry",
                       code="too_many_streams")
    return StreamingResponse(_samples(server), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _samples(server):
    server.dashboard_streams += 1  # the event loop's thread only: no lock
    try:
        sampler = LiveSampler(server)
        while server.scheduler.admitting:  # shutdown ends the stream, so draining need not wait for it
            yield f"data: {json.dumps(sampler.sample(), separators=(',', ':'))}\n\n"
            await asyncio.sleep(INTERVAL_S)
    finally:
        server.dashboard_streams -= 1


# -- cancel ------------------------------------------------------------------------------------
@router.post("/v1/mtplx/cancel/{request_id}")
async def cancel(request_id: str, request: Request):
    """Cancel a queued or running request by its response ``id``: its client gets the
    ``finish_reason`` "cancelled"; a running one stops at its next cycle boundary."""
    was = request.app.state.mtplx.scheduler.cancel(request_id)
    if was is None:
        raise APIError(404, f"no unfinished request with id {request_id!r} (it has ended, or never existed)",
                       param="request_id", code="not_found")
    return {"id": request_id, "cancelled": True, "was": was}


# -- settings ----------------------------------------------------------------------------------
@router.get("/v1/mtplx/settings")
async def get_settings(request: Request):
    return settings_payload(request.app.state.mtplx)


@router.post("/v1/mtplx/settings")
async def post_settings(request: Request):
    """Change the per-request defaults for requests that arrive from now on (this process
    only; the config file is not written). All fields are checked before any applies: 400
    naming the field on a bad value, 409 ``restart_required`` for a setting read at start."""
    server = request.app.state.mtplx
    try:
        body = json.loads(await request.body() or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body must be a JSON object: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object of settings", code="invalid_value")
    changes = validate_settings(server, body)
    if "generation_mode" in changes or "depth" in changes:
        current = server.scheduler.settings
        server.scheduler.update_defaults(generation_mode=changes.get("generation_mode", current.generation_mode),
                                         depth=changes.get("depth", current.depth))
    if "temperature" in changes:
        server.default_temperature = changes["temperature"]
    return settings_payload(server)


def settings_payload(server) -> dict:
    settings = server.scheduler.settings
    return {"live": server.live_defaults(),
            "restart_required": {name: settings.as_dict()[_field(name)] for name in RESTART_SETTINGS},
            "model_temperature": server.model_temperature}


def validate_settings(server, body: dict) -> dict:
    """The live changes in ``body`` (None = auto), checked as ``mtplx serve`` checks its config."""
    for name in body:
        if name not in LIVE_SETTINGS and name not in RESTART_SETTINGS:
            raise APIError(400, f"{name}: not a setting; live: {', '.join(LIVE_SETTINGS)}; at start only: "
                           f"{', '.join(RESTART_SETTINGS)}", param=name, code="invalid_value")
    for name, flag in RESTART_SETTINGS.items():
        if name in body:
            value = _convert(name, body[name])
            current = server.scheduler.settings.as_dict()[_field(name)]
            if value is not None and value != current:
                raise APIError(409, f"{name} cannot change while the server runs (it is {current}): restart "
                               f"with {flag} {value}, or `mtplx config set {name} {value}` and restart",
                               param=name, code="restart_required")
    changes = {name: _convert(name, body[name]) for name in ("generation_mode", "depth") if name in body}
    if "generation_mode" in changes:
        settings = server.scheduler.settings
        try:
            resolved = scheduler_settings.validate_scheduler_settings(
                settings.mode, generation_mode=changes["generation_mode"],
                max_active_requests=settings.max_active_requests, decode_batch_max=settings.decode_batch_max,
                batch_wait_ms=settings.batch_wait_ms)
            scheduler_settings.validate_model_for_mode(resolved, server.engine.has_mtp)
        except SchedulerConfigError as exc:
            raise APIError(400, str(exc), param="generation_mode", code="invalid_value") from None
    if "temperature" in body:
        value = body["temperature"]
        if value in (None, "auto"):
            changes["temperature"] = server.model_temperature
        else:
            try:
                changes["temperature"] = float(SamplingParams(temperature=value).validate().temperature)
            except InvalidParameter as exc:
                raise APIError(400, str(exc), param="temperature", code="invalid_value") from None
            if changes["temperature"] > MAX_TEMPERATURE:  # a default no request could ask for itself
                raise APIError(400, f"temperature: must be at most {MAX_TEMPERATURE:g} (OpenAI's range), got {value}",
                               param="temperature", code="invalid_value")
    return changes


def _convert(name: str, value):
    try:
        return convert(name, value, SOURCE)
    except ConfigError as exc:
        raise APIError(400, str(exc), param=name, code="invalid_value") from None


def _field(name: str) -> str:
    return "mode" if name == "scheduler_mode" else name

