"""Prometheus metrics of one server (its own CollectorRegistry, so apps never clash).

Speculative-decoding counters mirror vLLM's names under the ``mtplx_`` prefix:
``spec_decode_num_drafts`` (verify cycles), ``spec_decode_num_draft_tokens``,
``spec_decode_num_accepted_tokens`` and ``spec_decode_num_accepted_tokens_per_pos{position}``
(0-based). Acceptance rate = accepted / draft tokens; mean acceptance length = 1 +
accepted / drafts. mtplx adds ``spec_decode_num_draft_tokens_per_pos{position}`` (requests may
draft to different depths, so a position's rate is its accepted over its drafted tokens) and
``decode_phase_seconds{phase}`` (draft, verify, accept, commit seconds of MTP requests). Request counters are updated
when a request ends.
"""

from __future__ import annotations

import time
import uuid

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mtplx.batching.job import Job, JobResult
from mtplx.batching.scheduler import Scheduler

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)

CONTENT_TYPE = CONTENT_TYPE_LATEST
PHASES = ("draft", "verify", "accept", "commit")  # of a decode cycle (DecodeStats' *_s fields)


class Metrics:
    def __init__(self, scheduler: Scheduler):
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter("mtplx_http_requests", "HTTP requests by route and status code",
                                     ["route", "status"], registry=r)
        self.request_success = Counter("mtplx_request_success",
                                       "Requests that ended, by finish reason (of n choices: the last to end)",
                                       ["finish_reason"], registry=r)
        self.request_failure = Counter("mtplx_request_failure", "Generations that failed (each choice of a request)",
                                       registry=r)
        self.prompt_tokens = Counter("mtplx_prompt_tokens",
                                     "Prompt tokens of ended requests (once for n choices, as usage)", registry=r)
        self.generation_tokens = Counter("mtplx_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("mtplx_time_to_first_token_seconds", "Arrival to first token (queue wait included)",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("mtplx_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.queue_time = Histogram("mtplx_request_queue_time_seconds", "Arrival to start",
                                    buckets=LATENCY_BUCKETS_S, registry=r)
        Gauge("mtplx_num_requests_waiting", "Requests in the queue", registry=r) \
            .set_function(lambda: scheduler.queue_depth)
        Gauge("mtplx_num_requests_running", "Requests holding KV blocks", registry=r) \
            .set_function(lambda: scheduler.active_requests)
        Gauge("mtplx_kv_cache_blocks_used", "KV cache blocks held by running requests", registry=r) \
            .set_function(lambda: scheduler.kv_stats["used_blocks"])
        Gauge("mtplx_kv_cache_blocks_total", "KV cache blocks", registry=r) \
            .set_function(lambda: scheduler.kv_stats["total_blocks"])
        self.num_drafts = Counter("mtplx_spec_decode_num_drafts", "MTP verify cycles", registry=r)
        self.num_draft_tokens = Counter("mtplx_spec_decode_num_draft_tokens", "Drafted tokens", registry=r)
        self.num_accepted_tokens = Counter("mtplx_spec_decode_num_accepted_tokens", "Accepted draft tokens",
                                           registry=r)
        self.accepted_per_pos = Counter("mtplx_spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by draft position (0-based)", ["position"],
                                        registry=r)
        self.draft_tokens_per_pos = Counter("mtplx_spec_decode_num_draft_tokens_per_pos",
                                            "Drafted tokens by draft position (0-based)", ["position"], registry=r)
        self.phase_seconds = Counter("mtplx_decode_phase_seconds", "Decode time by cycle phase", ["phase"],
                                     registry=r)
        self._open: dict[str, tuple[int, float]] = {}  # n-choice requests with choices still running
        scheduler.add_listener(self.on_job_end)

    def on_job_end(self, job: Job, result: JobResult | None) -> None:
        """Count one ended job (a scheduler listener; prometheus-client is thread-safe)."""
        if result is None:
            self.request_failure.inc()
            self._choices_ended(job)  # (its request's other choices still count it as ended)
            return
        self.generation_tokens.inc(result.completion_tokens)
        if job.choice == 0:  # a request's first token and start: its first choice's
            if job.t_first_token is not None:
                self.ttft.observe(job.t_first_token - job.t_enqueued)
            if job.t_started is not None:
                self.queue_time.observe(job.t_started - job.t_enqueued)
        ended = self._choices_ended(job)
        if ended is not None:  # the request's last choice: once for its n, as its usage counts them
            self.request_success.labels(result.finish_reason).inc()
            self.prompt_tokens.inc(result.prompt_tokens)
            self.e2e.observe(ended - job.t_enqueued)
        stats = result.stats
        if stats.get("verify_calls"):
            self.num_drafts.inc(stats["verify_calls"])
            self.num_draft_tokens.inc(stats["drafted_tokens"])
            self.num_accepted_tokens.inc(stats["accepted_tokens"])
            for pos, accepted in enumerate(stats["accepted_by_depth"]):
                self.accepted_per_pos.labels(str(pos)).inc(accepted)
            for pos, drafted in enumerate(stats["drafted_by_depth"]):
                self.draft_tokens_per_pos.labels(str(pos)).inc(drafted)
            for phase in PHASES:  # MTP requests only: time per verify cycle = phase seconds / drafts
                self.phase_seconds.labels(phase).inc(stats.get(f"{phase}_s") or 0.0)

    def _choices_ended(self, job: Job) -> float | None:
        """The last finish time of a request's choices once all have ended (one choice: its
        own), else None (the scheduler thread is the only caller)."""
        finished = job.t_finished if job.t_finished is not None else time.perf_counter()
        if job.choices <= 1:
            return finished
        count, last = self._open.get(job.group, (0, 0.0))
        count, last = count + 1, max(last, finished)
        if count < job.choices:
            self._open[job.group] = count, last
            return None
        self._open.pop(job.group, None)
        return last

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def values(self) -> dict[tuple[str, tuple], float]:
        """Every sample now, keyed by (name, sorted label pairs): one pass over the registry."""
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for metric in self.registry.collect() for s in metric.samples}


class CountRequests:
    """ASGI middleware counting responses by route template and status code."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.http_requests.labels(route, str(status)).inc()


class RequestId:
    """ASGI middleware: every response carries a request id, as OpenAI's API sends it
    (``x-request-id``) and as Anthropic's does (``request-id``, which the anthropic SDK reads):
    the client's own ``x-request-id`` (up to 128 printable ASCII characters; a proxy's trace id
    follows the request through), else a new ``req_`` id."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        rid = given if 0 < len(given) <= 128 and all(32 <= c < 127 for c in given) else \
            f"req_{uuid.uuid4().hex}".encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid),
                                                  (b"request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
