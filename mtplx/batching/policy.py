"""The base every scheduler mode builds on: job bookkeeping around the engine step.

A policy decides which jobs run in which engine step; it never decodes by itself. Its
``run`` loop is the model-owner thread's whole life: take jobs from the queue, drive the
engine, report through the job's events, and return when the queue closes.
"""

from __future__ import annotations

import logging
from typing import Callable

from mtplx.batching.job import Job, JobResult
from mtplx.batching.queue import JobQueue
from mtplx.batching.state import SchedulerMode, SchedulerSettings
from mtplx.batching.telemetry import JobCounters
from mtplx.engine.llm_engine import Engine, Request
from mtplx.engine.sequence import Sequence

log = logging.getLogger("mtplx.scheduler")

Listener = Callable[[Job, JobResult | None], None]


class Policy:
    """One scheduler mode over ``engine``. Subclasses implement ``run`` and ``mode_telemetry``."""

    mode: SchedulerMode

    def __init__(self, engine: Engine, settings: SchedulerSettings):
        self.engine, self.settings = engine, settings
        self.jobs = JobCounters()
        self.listeners: list[Listener] = []
        self.running: list[Job] = []  # jobs that hold KV blocks now
        self.kv_stats: dict = kv_stats(engine)  # published for handlers after each cycle

    # -- handler thread -------------------------------------------------------------------
    def check_request(self, request: Request) -> None:
        """Raise InvalidParameter if this mode cannot run ``request`` (a 400 for the client)."""

    def on_accept(self, job: Job) -> None:
        """Called under the queue lock when ``job`` enters the queue; must not block."""

    # -- model-owner thread ---------------------------------------------------------------
    def run(self, queue: JobQueue) -> None:
        raise NotImplementedError

    def mode_telemetry(self) -> dict:
        """This mode's own block (``scheduler.<mode>``), beside the common job counters."""
        return {}

    def telemetry(self) -> dict:
        return {"policy": self.settings.policy_label, "active": len(self.running), **self.jobs.as_dict(),
                **self.mode_telemetry()}

    @property
    def active_lane(self) -> str:
        """The lane running now ("idle" when nothing is)."""
        running = self.running[:1]  # one atomic copy: the model thread may empty the list meanwhile
        return running[0].lane if running else "idle"

    def begin(self, job: Job, lane: str) -> bool:
        """Start ``job`` on ``lane``; False (and nothing to run) if it was cancelled while queued."""
        if job.cancelled:
            self.drop_unstarted(job)
            return False
        job.start(lane)
        self.jobs.count("started")
        self.jobs.queue_wait_s.add(job.t_started - job.t_enqueued)
        self.running.append(job)
        return True

    def drop_unstarted(self, job: Job) -> None:
        """End a job cancelled while it waited (its client left): it never holds blocks. Runs on
        the model thread, or under the queue lock when a full queue sheds its dead jobs."""
        self.jobs.count("abandoned_before_start")
        self.abandon(job)
        self._tell_listeners(job, job.finish_unstarted())

    def abandon(self, job: Job) -> None:
        """Hook for a job dropped before it started (hyper releases its ticket)."""

    def finish(self, job: Job, seq: Sequence) -> None:
        """Report a job that ended normally or by cancel; its blocks must already be released."""
        try:
            result = job.finish(seq)
        except Exception as exc:  # building the result failed: the client still gets an answer
            self.fail(job, exc)
            return
        self.jobs.count("cancelled" if result.finish_reason == "cancelled" else "completed")
        self._ended(job, result)

    def fail(self, job: Job, error: BaseException) -> None:
        """Report a job that failed (its blocks must already be released), with a log line
        that names it."""
        log.error("request %s failed: %s: %s", job.request_id, type(error).__name__, error, exc_info=error)
        job.fail(error)
        self.jobs.count("failed")
        self._ended(job, None)

    def abort(self, error: BaseException) -> None:
        """After ``run`` raised: give back every sequence the engine holds (blocks, state
        slots, the cycle in flight) and fail every running job with ``error``, counted as
        failed. The policy's own rows are forgotten; its counters stay."""
        self.engine.release_all()
        for job in list(self.running):
            self.fail(job, error)

    def publish_kv(self, *_: object) -> None:
        """Refresh the KV block counts handlers read (a few ints; called once per cycle)."""
        self.kv_stats = kv_stats(self.engine)

    def _ended(self, job: Job, result: JobResult | None) -> None:
        if job in self.running:
            self.running.remove(job)
        if job.t_started is not None:
            self.jobs.run_s.add(job.t_finished - job.t_started)
        if job.t_cancelled is not None and job.t_finished >= job.t_cancelled:
            self.jobs.cancel_latency_s.add(job.t_finished - job.t_cancelled)
        self.publish_kv()
        self._tell_listeners(job, result)

    def _tell_listeners(self, job: Job, result: JobResult | None) -> None:
        for listener in self.listeners:
            try:
                listener(job, result)
            except Exception:  # telemetry must never take the model thread down
                log.exception("scheduler listener failed")


def kv_stats(engine: Engine) -> dict:
    """The KV allocator's counts (``state_slots_used`` too on hybrid models)."""
    return engine.kv.stats()
