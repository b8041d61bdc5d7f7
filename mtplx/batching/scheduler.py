"""The model-owner thread: jobs come in through ``submit``, the mode's policy runs them.

All model work happens on this one thread (``Engine`` is single-threaded); request handlers
only submit jobs, read telemetry and receive events.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Any

import torch

from mtplx.batching.ar_batch import ARBatchPolicy
from mtplx.batching.hyper import HyperPolicy
from mtplx.batching.hyper_gate import HyperAdmissionGate
from mtplx.batching.job import Job
from mtplx.batching.mtp_batch import MTPBatchPolicy
from mtplx.batching.policy import Listener, Policy
from mtplx.batching.queue import JobQueue, SchedulerStopped
from mtplx.batching.serial import SerialPolicy
from mtplx.batching.solo_mtp import SoloMTPPolicy
from mtplx.batching.state import SchedulerMode, SchedulerSettings
from mtplx.engine.llm_engine import Engine
from mtplx.runtime import release_idle_openmp_threads

log = logging.getLogger("mtplx.scheduler")


class PolicyCrash(RuntimeError):
    """The scheduler's policy raised while this request ran (a bug, not the client's doing)."""


def make_policy(engine: Engine, settings: SchedulerSettings, gate=None) -> Policy:
    """The policy object of ``settings.mode``. ``gate``: the hyper admission gate to use."""
    mode = settings.mode
    if mode == SchedulerMode.HYPER:
        return HyperPolicy(engine, settings, gate if gate is not None else HyperAdmissionGate())
    policies = {SchedulerMode.SERIAL: SerialPolicy, SchedulerMode.MTP_BATCH: MTPBatchPolicy,
                SchedulerMode.AR_BATCH: ARBatchPolicy, SchedulerMode.SOLO_MTP: SoloMTPPolicy}
    return policies[mode](engine, settings)


class Scheduler:
    def __init__(self, engine: Engine, settings: SchedulerSettings, gate=None):
        self.engine, self.settings = engine, settings
        self.policy = make_policy(engine, settings, gate)
        self.queue = JobQueue(settings.max_queued_requests)
        self._thread: threading.Thread | None = None
        self._admitting = True
        self.policies_crashed = 0  # times the policy raised and was restarted
        # every submitted job until it is dropped (a job between the queue and the running list
        # is in neither): what ``cut_off`` fails at shutdown
        self._submitted: weakref.WeakValueDictionary[str, Job] = weakref.WeakValueDictionary()

    @property
    def mode(self) -> SchedulerMode:
        return self.settings.mode

    def add_listener(self, listener: Listener) -> None:
        """``listener(job, result or None)`` runs once when a job ends: on the model thread, or
        on the thread that dropped it while queued (``cancel``, a full queue shedding it).
        It must be quick and thread-safe."""
        self.policy.listeners.append(listener)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the model thread. On the CPU the calling thread (which built the engine) first
        lets its idle OpenMP workers go (``runtime.release_idle_openmp_threads``): with them
        alive the model thread's CPU kernels ran about half as fast."""
        if self.engine.device.type == "cpu":
            release_idle_openmp_threads()
        self._thread = threading.Thread(target=self._run, name="mtplx-model-owner", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, fail the queued ones, cancel the running ones and join the thread."""
        for job in self.queue.close():
            job.fail(SchedulerStopped("the server shut down before this request started"))
        for job in list(self.policy.running):
            job.cancel()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- draining (graceful shutdown) --------------------------------------------------------
    def stop_admitting(self) -> None:
        """Refuse new jobs from now on (``submit`` raises SchedulerStopped, a 503); queued
        and running jobs go on. One attribute write, so a signal handler may call it."""
        self._admitting = False

    def cut_off(self, error: Exception) -> int:
        """End every job that has not ended yet with ``error`` (its client gets an error
        event or a 503): queued jobs leave the queue, running ones stop at the next cycle
        boundary and free their KV blocks. Returns how many were cut off."""
        self.stop_admitting()
        self.queue.close()
        unfinished = [job for job in list(self._submitted.values()) if job.t_finished is None]
        for job in unfinished:
            job.fail(error)  # the Done the policy emits when the job stops comes after it, unread
            job.cancel()
        return len(unfinished)

    def _run(self) -> None:
        """The model thread: the policy's loop until the queue closes. A policy that raises
        (a bug) fails its running jobs (a 500 for their clients), gives back everything they
        held (KV blocks, recurrent-state slots, the cycle in flight) and runs again over the
        same queue: queued requests and later ones are still served."""
        while True:
            try:
                with torch.inference_mode():
                    self.policy.run(self.queue)
                return
            except Exception as exc:
                log.exception("the %s scheduler's policy raised; failing its %d running request(s) and going on",
                              self.mode, len(self.policy.running))
                self.policy.abort(PolicyCrash(f"the {self.mode} scheduler failed this request: "
                                              f"{type(exc).__name__}: {exc}"))
                self.policies_crashed += 1

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- request handlers -------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue ``job``. Raises InvalidParameter (this mode cannot run it), QueueFull, or
        SchedulerStopped (shutting down)."""
        if not self._admitting:
            raise SchedulerStopped("the server is shutting down and accepts no new requests")
        self.policy.check_request(job.request)
        job.scheduler_mode = self.mode.value
        self.queue.put(job, self.policy.on_accept, self.policy.drop_unstarted)
        self._submitted[job.request_id] = job
        self.policy.jobs.count("admitted")

    def cancel(self, request_id: str) -> str | None:
        """Cancel the unfinished job ``request_id``: a queued one leaves the queue and ends now
        (finish_reason "cancelled"), a running one stops at its next cycle boundary. Returns
        "queued" or "running" (what it was), or None when no such job is unfinished."""
        job = self._submitted.get(request_id)
        if job is None or job.t_finished is not None:
            return None
        was = "running" if job.t_started is not None else "queued"
        job.cancel()
        self.queue.remove(job, self.policy.drop_unstarted)
        return was

    def update_defaults(self, **changes) -> SchedulerSettings:
        """Replace the per-request defaults (``generation_mode``, ``depth``) for requests
        submitted from now on; validate first (server.openai). One attribute write each."""
        unknown = set(changes) - {"generation_mode", "depth"}
        if unknown:
            raise ValueError(f"not a live setting: {', '.join(sorted(unknown))}")
        self.settings = dataclasses.replace(self.settings, **changes)
        self.policy.settings = self.settings
        return self.settings

    @property
    def admitting(self) -> bool:
        """False once shutdown began (or ``stop_admitting`` was called)."""
        return self._admitting

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    @property
    def active_requests(self) -> int:
        return len(self.policy.running)

    @property
    def kv_stats(self) -> dict:
        """KV block counts as of the last cycle (published by the model thread)."""
        return self.policy.kv_stats

    def telemetry(self) -> dict:
        """This mode's ``scheduler.<mode>`` block."""
        return {"queue_depth": self.queue_depth, **self.policy.telemetry()}


def scheduler_state(state: Any) -> dict:
    """``scheduler_mode``, ``scheduler_policy``, ``active_lane``, ``config`` and the telemetry:
    ``telemetry`` is the running mode's block and ``scheduler.<mode>`` holds it too (the other
    modes' blocks are empty). ``state``: the server state (with ``.scheduler``) or a Scheduler."""
    scheduler = getattr(state, "scheduler", state)
    mode = scheduler.mode.value
    block = scheduler.telemetry()
    return {
        "scheduler_mode": mode,
        "scheduler_policy": scheduler.settings.policy_label,
        "active_lane": scheduler.policy.active_lane,
        "config": scheduler.settings.as_dict(),
        "telemetry": block,
        "scheduler": {m: (block if m == mode else {}) for m in SchedulerMode.choices()},
    }
