"""The hyper admission gate: singleton admission, the serial passthrough at width 1, and
width > 1 only through an installed HyperWidthExecutor."""

from __future__ import annotations

import threading
import time

import pytest

from mtplx.batching.job import Job
from mtplx.batching.scheduler import Scheduler
from mtplx.batching.state import SchedulerSettings
from mtplx.batching.hyper_gate import (HYPER_ADMISSION_CAP, HyperAdmissionGate, HyperCohortPlan, HyperRequestMeta,
                                HyperWidthExecutor)
from tests.test_server_harness import Collector, tiny_text_engine

SNAPSHOT_FIELDS = {"stage", "admission_cap", "width", "passthrough", "width_executor_installed", "active",
                   "queue_depth", "totals", "queue_wait_s", "run_s", "width_stats", "self_spec_rows", "forks"}


class WideExecutor:
    """Plans width 3 and runs the singleton (the serial closure) for the request's own rows."""

    def __init__(self, width: int = 3):
        self.width, self.seen = width, []

    def plan(self, request: HyperRequestMeta) -> HyperCohortPlan:
        self.seen.append(request)
        return HyperCohortPlan(self.width, "test_self_spec")

    def run_cohort(self, plan: HyperCohortPlan, singleton):
        return singleton()


def test_width_one_calls_the_serial_closure_directly():
    gate = HyperAdmissionGate()
    ticket = gate.admit(request_id="req-1", prompt_tokens=12)
    calls = []
    bound = gate.bind(ticket, lambda: calls.append("ran") or {"output": "hello"}, generation_mode="mtp")
    assert gate.snapshot()["queue_depth"] == 1
    assert bound() == {"output": "hello"} and calls == ["ran"]
    snap = gate.snapshot()
    assert SNAPSHOT_FIELDS <= set(snap)
    assert snap["stage"] == "h0" and snap["admission_cap"] == HYPER_ADMISSION_CAP == 1
    assert snap["passthrough"] == "serial_b1" and snap["width"] == 1 and not snap["width_executor_installed"]
    assert snap["width_stats"]["requests_by_width"] == {"1": 1}
    assert snap["totals"] == {"admitted": 1, "completed": 1, "failed": 0, "abandoned_before_start": 0}
    assert snap["active"] == 0 and snap["queue_depth"] == 0
    assert snap["queue_wait_s"]["count"] == snap["run_s"]["count"] == 1


def test_admit_never_blocks_while_a_request_runs_and_a_second_run_is_refused():
    gate = HyperAdmissionGate()
    running, release = threading.Event(), threading.Event()
    first = gate.bind(gate.admit(request_id="a", prompt_tokens=1), lambda: running.set() or release.wait(10))
    worker = threading.Thread(target=first)
    worker.start()
    assert running.wait(10)
    t0 = time.perf_counter()
    second_ticket = gate.admit(request_id="b", prompt_tokens=1)
    assert time.perf_counter() - t0 < 0.05
    with pytest.raises(RuntimeError, match="one is already running"):
        gate.bind(second_ticket, lambda: None)()
    release.set()
    worker.join()
    assert gate.snapshot()["active"] == 0


def test_install_width_executor_checks_the_protocol():
    gate = HyperAdmissionGate()

    class OnlyPlan:
        def plan(self, request):
            return HyperCohortPlan()

    with pytest.raises(TypeError, match="run_cohort"):
        gate.install_width_executor(OnlyPlan())
    with pytest.raises(TypeError, match="plan and run_cohort"):
        gate.install_width_executor(object())
    assert isinstance(WideExecutor(), HyperWidthExecutor)
    gate.install_width_executor(WideExecutor())
    assert gate.snapshot()["width_executor_installed"]
    gate.clear_width_executor()
    assert not gate.snapshot()["width_executor_installed"]


def test_width_above_one_needs_an_executor():
    gate = HyperAdmissionGate()
    with pytest.raises(RuntimeError, match="needs an installed HyperWidthExecutor"):
        gate.record_cohort_width(2)
    meta = HyperRequestMeta("r", 3)
    assert gate.plan_cohort(meta) == HyperCohortPlan(1, "serial_b1")
    executor = WideExecutor()
    gate.install_width_executor(executor)
    assert gate.plan_cohort(meta).width == 3
    assert gate.bind(gate.admit(request_id="r2", prompt_tokens=3), lambda: "serial result")() == "serial result"
    assert [m.request_id for m in executor.seen] == ["r", "r2"]
    assert gate.snapshot()["width_stats"]["requests_by_width"] == {"3": 1}


def test_release_counts_requests_abandoned_before_start_and_failures_are_counted():
    gate = HyperAdmissionGate()
    gate.release(gate.admit(request_id="gone", prompt_tokens=1))
    with pytest.raises(ValueError):
        gate.bind(gate.admit(request_id="bad", prompt_tokens=1), lambda: int("x"))()
    totals = gate.snapshot()["totals"]
    assert totals == {"admitted": 2, "completed": 0, "failed": 1, "abandoned_before_start": 1}
    assert gate.snapshot()["queue_depth"] == 0 and gate.snapshot()["active"] == 0


def test_an_installed_executor_keeps_the_serial_trajectory():
    engine = tiny_text_engine(head="repeat")
    reference = engine.generate("width seam", max_tokens=12, temperature=0.0)
    gate = HyperAdmissionGate()
    gate.install_width_executor(WideExecutor(width=2))
    scheduler = Scheduler(engine, SchedulerSettings.resolve("hyper"), gate=gate)
    scheduler.start()
    try:
        collector = Collector()
        scheduler.submit(Job(engine.make_request("width seam", max_tokens=12, temperature=0.0), collector))
        end = collector.wait()
    finally:
        scheduler.stop()
    assert end.result.token_ids == reference.token_ids
    assert end.result.stats["scheduler_lane"] == "hyper_width_executor"
    assert gate.snapshot()["width_stats"]["requests_by_width"] == {"2": 1}
