"""The hyper admission gate ("h0"): singleton admission around the untouched serial closure.

Contract (REFERENCE.md section 3):
- ``HYPER_ADMISSION_CAP = 1``: one external request runs at a time. The model-owner thread
  runs bound closures one after another, so the cap holds without extra locks; the bound
  callable still refuses to start a second one (RuntimeError) as a guard.
- Width 1 calls the serial closure directly: no batch objects, no wait window, every fast
  path of the serial path kept, so trajectories are byte-identical to ``serial``.
- Width > 1 exists only through an installed ``HyperWidthExecutor`` (for the same request's
  self-generated speculative rows); a width > 1 without one is a RuntimeError.

``admit`` runs on request handlers and never blocks; ``bind``'s callable runs on the model
thread. The gate only counts and routes: it holds no model state.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from mtplx.batching.telemetry import Summary

HYPER_ADMISSION_CAP = 1
HYPER_STAGE = "h0"
PASSTHROUGH = "serial_b1"  # the lane of a width-1 request: the serial closure, batch size 1


@dataclass(frozen=True)
class HyperRequestMeta:
    """What a width executor may look at to plan a request's cohort."""

    request_id: str
    prompt_tokens: int
    generation_mode: str = "mtp"
    admitted_at: float = field(default_factory=time.perf_counter)  # seconds, perf_counter clock


@dataclass(frozen=True)
class HyperCohortPlan:
    """How wide one request runs: width 1 is the serial passthrough; more needs an executor."""

    width: int = 1
    reason: str = PASSTHROUGH


@runtime_checkable
class HyperWidthExecutor(Protocol):
    """Runs a request wider than 1 with its own speculative rows; must still call
    ``singleton()`` (the serial closure) for the request's own trajectory and return its result."""

    def plan(self, request: HyperRequestMeta) -> HyperCohortPlan: ...

    def run_cohort(self, plan: HyperCohortPlan, singleton: Callable[[], Any]) -> Any: ...


@dataclass
class HyperTicket:
    """One admitted request: state goes queued -> running -> completed | failed, or abandoned."""

    meta: HyperRequestMeta
    state: str = "queued"
    started_at: float | None = None


class HyperAdmissionGate:
    def __init__(self):
        self._lock = threading.Lock()
        self._executor: HyperWidthExecutor | None = None
        self._totals = Counter(admitted=0, completed=0, failed=0, abandoned_before_start=0)
        self._queued = 0
        self._active = 0
        self._width = 1
        self._by_width: Counter[str] = Counter()
        self._by_generation_mode: Counter[str] = Counter()
        self._self_spec = Counter(launched=0, committed=0)
        self._forks = Counter(attempts=0, wins=0)
        self.queue_wait_s = Summary()
        self.run_s = Summary()

    # -- admission (request handlers) -----------------------------------------------------
    def admit(self, *, request_id: str, prompt_tokens: int, generation_mode: str = "mtp") -> HyperTicket:
        """Record a request entering the FIFO and return its ticket. Never blocks."""
        with self._lock:
            self._totals["admitted"] += 1
            self._queued += 1
        return HyperTicket(HyperRequestMeta(request_id, int(prompt_tokens), generation_mode))

    def release(self, ticket: HyperTicket) -> None:
        """Drop a ticket that never started (its client left while it was queued)."""
        with self._lock:
            if ticket.state == "queued":
                ticket.state = "abandoned"
                self._queued -= 1
                self._totals["abandoned_before_start"] += 1

    # -- execution (model-owner thread) --------------------------------------------------
    def bind(self, ticket: HyperTicket, closure: Callable[[], Any], generation_mode: str = "mtp") -> Callable[[], Any]:
        """A callable that runs ``closure`` (the serial closure) for ``ticket``: directly at
        width 1, through the installed width executor when its plan is wider."""

        def run() -> Any:
            plan = self._start(ticket, generation_mode)
            try:
                if plan.width == 1:
                    result = closure()
                else:
                    result = self._executor.run_cohort(plan, closure)
            except BaseException:
                self._end(ticket, "failed")
                raise
            self._end(ticket, "completed")
            return result

        return run

    def plan_cohort(self, request: HyperRequestMeta) -> HyperCohortPlan:
        """Width 1 (the serial passthrough) unless an installed executor plans wider."""
        executor = self._executor
        if executor is None:
            return HyperCohortPlan(1, PASSTHROUGH)
        plan = executor.plan(request)
        if not isinstance(plan, HyperCohortPlan) or isinstance(plan.width, bool) or not isinstance(plan.width, int) \
                or plan.width < 1:
            raise RuntimeError(f"HyperWidthExecutor.plan must return a HyperCohortPlan with width >= 1, got {plan!r}")
        return plan

    def record_cohort_width(self, width: int) -> None:
        """Count one request run at ``width``; width > 1 needs an installed executor."""
        if width > 1 and self._executor is None:
            raise RuntimeError(f"hyper width {width} > 1 needs an installed HyperWidthExecutor; "
                               "without one every request runs the serial closure at width 1")
        with self._lock:
            self._width = width
            self._by_width[str(width)] += 1

    def record_self_spec_rows(self, launched: int, committed: int) -> None:
        """For executors: speculative rows launched and how many of them were committed."""
        with self._lock:
            self._self_spec["launched"] += launched
            self._self_spec["committed"] += committed

    def record_fork(self, won: bool) -> None:
        """For executors: one fork attempt, and whether its row won."""
        with self._lock:
            self._forks["attempts"] += 1
            self._forks["wins"] += int(won)

    # -- the width seam -----------------------------------------------------------------
    def install_width_executor(self, executor: object) -> None:
        """Install ``executor``: it needs ``plan(request)`` and ``run_cohort(plan, singleton)``."""
        missing = [m for m in ("plan", "run_cohort") if not callable(getattr(executor, m, None))]
        if missing:
            raise TypeError(f"a HyperWidthExecutor needs callable {' and '.join(missing)}; "
                            f"{type(executor).__name__} lacks it")
        self._executor = executor

    def clear_width_executor(self) -> None:
        self._executor = None

    @property
    def width_executor_installed(self) -> bool:
        return self._executor is not None

    # -- telemetry ------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The ``scheduler.hyper`` block (REFERENCE.md section 3 lists every field)."""
        with self._lock:
            out = {
                "stage": HYPER_STAGE, "admission_cap": HYPER_ADMISSION_CAP, "width": self._width,
                "passthrough": PASSTHROUGH, "width_executor_installed": self._executor is not None,
                "active": self._active, "queue_depth": self._queued, "totals": dict(self._totals),
                "width_stats": {"requests_by_width": dict(sorted(self._by_width.items(), key=lambda kv: int(kv[0])))},
                "requests_by_generation_mode": dict(self._by_generation_mode),
                "self_spec_rows": dict(self._self_spec), "forks": dict(self._forks),
            }
        out["queue_wait_s"] = self.queue_wait_s.as_dict()
        out["run_s"] = self.run_s.as_dict()
        return out

    def _start(self, ticket: HyperTicket, generation_mode: str) -> HyperCohortPlan:
        with self._lock:
            if ticket.state != "queued":
                raise RuntimeError(f"hyper ticket {ticket.meta.request_id} is {ticket.state}, not queued")
            if self._active >= HYPER_ADMISSION_CAP:
                raise RuntimeError(f"hyper admits {HYPER_ADMISSION_CAP} request at a time; one is already running")
            self._queued -= 1
            self._active += 1
            ticket.state, ticket.started_at = "running", time.perf_counter()
            self._by_generation_mode[generation_mode] += 1
        self.queue_wait_s.add(ticket.started_at - ticket.meta.admitted_at)
        try:
            plan = self.plan_cohort(ticket.meta)
            self.record_cohort_width(plan.width)
        except BaseException:
            self._end(ticket, "failed")
            raise
        return plan

    def _end(self, ticket: HyperTicket, state: str) -> None:
        with self._lock:
            self._active -= 1
            self._totals[state] += 1
            ticket.state = state
            self._width = 1
        self.run_s.add(time.perf_counter() - ticket.started_at)
