"""Read-only routes: /health, /metrics (Prometheus text) and /v1/mtplx/snapshot."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from mtplx.server.metrics import CONTENT_TYPE
from mtplx.batching.scheduler import scheduler_state

open_router = APIRouter()  # /health, /metrics: open without the API key (security.OPEN_PATHS decides)
router = APIRouter()  # /v1/...: behind the API key when one is set


@open_router.get("/health")
async def health(request: Request):
    server = request.app.state.mtplx
    state = scheduler_state(server)
    ok = server.scheduler.alive
    body = {"status": "ok" if ok else "scheduler_stopped", "model": server.model_id,
            "scheduler_mode": state["scheduler_mode"], "scheduler_policy": state["scheduler_policy"],
            "active_lane": state["active_lane"], "scheduler": state["scheduler"],
            "queue_depth": server.scheduler.queue_depth, "active_requests": server.scheduler.active_requests,
            "kv_cache": server.kv_cache()}
    return JSONResponse(body, 200 if ok else 503)


@open_router.get("/metrics")
async def metrics(request: Request):
    return Response(request.app.state.mtplx.metrics.exposition(), media_type=CONTENT_TYPE)


@router.get("/v1/mtplx/snapshot")
async def snapshot(request: Request):
    return snapshot_payload(request.app.state.mtplx)


def snapshot_payload(server) -> dict:
    """The snapshot of ``server`` (a ``ServerState``); the dashboard's samples build on it."""
    return {**scheduler_state(server), "model": server.model_card(), "kv_cache": server.kv_cache(),
            "queue_depth": server.scheduler.queue_depth, "active_requests": server.scheduler.active_requests,
            "latest_request": server.latest_request, "uptime_s": time.time() - server.started_at}
