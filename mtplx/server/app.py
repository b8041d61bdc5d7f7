"""The FastAPI app: one engine, one scheduler (started with the app), routes and middleware."""

from __future__ import annotations

import itertools
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI

from mtplx.batching.job import Job, JobResult
from mtplx.batching.scheduler import Scheduler
from mtplx.batching.state import SchedulerSettings
from mtplx.engine.llm_engine import Engine
from mtplx.server import anthropic, dashboard, openai, responses, telemetry, tools
from mtplx.server.errors import install_error_handlers
from mtplx.server.live import RECENT_REQUESTS, ended_entry
from mtplx.server.metrics import CountRequests, Metrics, RequestId
from mtplx.server.protocol import DEFAULT_TEMPERATURE
from mtplx.server.security import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, MAX_HEAD_BYTES, BodySizeLimit,
                                   CORS, HeadSizeLimit, RequireAPIKey)


@dataclass
class ServerState:
    """What request handlers may use. ``engine`` only to build requests (tokenizer and
    validation); all model work happens on the scheduler's thread."""

    engine: Engine
    scheduler: Scheduler
    metrics: Metrics
    model_id: str
    default_temperature: float = DEFAULT_TEMPERATURE  # for requests that give none; the dashboard may change it
    model_temperature: float = DEFAULT_TEMPERATURE  # the model's generation config's, else OpenAI's
    tool_parser: object = None  # the tool-call dialect of this model's output (tools.parser_for)
    started_at: float = field(default_factory=time.time)
    latest_request: dict | None = None
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))  # ended requests (live.py rows)
    ended_count: int = 0  # requests ended so far; numbers the rows of ``recent``
    _numbers: itertools.count = field(default_factory=lambda: itertools.count(1), repr=False)
    dashboard_streams: int = 0  # live streams open now (dashboard.MAX_STREAMS)

    def check_model(self, name: str) -> None:
        if name != self.model_id:
            raise openai.unknown_model(name, self.model_id)

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": int(self.started_at), "owned_by": "mtplx",
                "max_model_len": self.engine.max_context, "mtp_head": self.engine.has_mtp}

    def kv_cache(self) -> dict:
        """Block counts as of the last cycle, plus the block size in tokens."""
        return {**self.scheduler.kv_stats, "block_size": self.engine.runner.block_size}

    def live_defaults(self) -> dict:
        """The per-request defaults the dashboard may change while the server runs; None: auto."""
        settings = self.scheduler.settings
        return {"generation_mode": settings.generation_mode, "depth": settings.depth,
                "temperature": self.default_temperature, "engine_depth": self.engine.request_depth(self.default_temperature)}

    def remember(self, job: Job, result: JobResult | None) -> None:
        """A scheduler listener, once per ended job (on the model thread, or a handler's for a
        job cancelled while queued): the snapshot's latest request and the dashboard's rows."""
        number = next(self._numbers)  # atomic: two threads never share a number
        self.recent.append(ended_entry(number, job, result))
        self.ended_count = max(self.ended_count, number)
        if result is not None:
            self.latest_request = {"request_id": job.request_id, "finish_reason": result.finish_reason,
                                   "prompt_tokens": result.prompt_tokens,
                                   "completion_tokens": result.completion_tokens, "mtplx_stats": result.stats}


def create_app(engine: Engine, settings: SchedulerSettings | None = None, *, model_id: str = "mtplx",
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, gate=None,
               tool_call_parser: str | None = None, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               max_head_bytes: int = MAX_HEAD_BYTES, allowed_origins: list[str] | None = None) -> FastAPI:
    """An app serving ``engine`` under ``settings`` (default: serial). ``api_key``: required on
    every route but /health and /metrics (security.py). ``gate``: the hyper admission gate to
    use in hyper mode (default: a fresh ``HyperAdmissionGate``). ``tool_call_parser``: a
    ``tools.PARSERS`` name (default: chosen from the chat template). ``body_timeout_s``: the
    longest wait for the next piece of a request body before a 408. ``max_head_bytes``: the
    largest request head (request line and headers) served; larger ones get 431.
    ``allowed_origins``: web origins whose pages may call the API from a browser (CORS; "*" for
    any): their preflights are answered before the API key check (a browser sends no key there)."""
    scheduler = Scheduler(engine, settings or SchedulerSettings(), gate=gate)
    metrics = Metrics(scheduler)
    temperature = float(engine.loaded.generation_defaults.get("temperature", DEFAULT_TEMPERATURE))
    state = ServerState(engine, scheduler, metrics, model_id, temperature, temperature,
                        tool_parser=tools.parser_for(engine.tokenizer, tool_call_parser))
    scheduler.add_listener(state.remember)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="mtplx", lifespan=lifespan)
    app.state.mtplx = state
    install_error_handlers(app)

    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.include_router(responses.router)
    app.include_router(telemetry.router)
    app.include_router(telemetry.open_router)
    app.include_router(dashboard.page_router)
    app.include_router(dashboard.router)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    app.add_middleware(RequireAPIKey, api_key=api_key)  # before the body is read
    app.add_middleware(HeadSizeLimit, max_bytes=max_head_bytes)
    app.add_middleware(CountRequests, metrics=metrics)  # counts 401s and 413s too
    if allowed_origins:
        app.add_middleware(CORS, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["x-request-id"], max_age=600)
    app.add_middleware(RequestId)  # outermost: every response has an x-request-id
    return app
