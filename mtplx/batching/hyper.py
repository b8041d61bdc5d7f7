"""``hyper``: singleton admission through the hyper gate (``mtplx.batching.hyper_gate``).

Each job is admitted to the gate when it enters the FIFO (never blocking) and, on the model
thread, runs as ``gate.bind(ticket, serial closure)()``: at width 1 that is exactly
``run_serial``, so outputs are byte-identical to ``serial`` for the same request and seed.
"""

from __future__ import annotations

from mtplx.batching.job import Job
from mtplx.batching.serial import SingleRequestPolicy, run_serial
from mtplx.batching.state import SchedulerMode
from mtplx.engine.sequence import Sequence


class HyperPolicy(SingleRequestPolicy):
    mode = SchedulerMode.HYPER

    def __init__(self, engine, settings, gate):
        """``gate``: a ``mtplx.batching.hyper_gate.HyperAdmissionGate``."""
        super().__init__(engine, settings)
        self.gate = gate

    def on_accept(self, job: Job) -> None:
        job.ticket = self.gate.admit(request_id=job.request_id, prompt_tokens=len(job.request.prompt_ids),
                                     generation_mode=job.request.mode)

    def abandon(self, job: Job) -> None:
        self.gate.release(job.ticket)

    def lane_for(self, job: Job) -> str:
        return "hyper_width_executor" if self.gate.width_executor_installed else "serial_b1"

    def execute(self, job: Job) -> Sequence:
        closure = lambda: run_serial(self.engine, job, self.publish_kv)  # noqa: E731
        return self.gate.bind(job.ticket, closure, generation_mode=job.request.mode)()

    def telemetry(self) -> dict:
        """The gate's ``scheduler.hyper`` block, plus how jobs ended (cancelled included)."""
        jobs = self.jobs.as_dict()
        return {"policy": self.settings.policy_label, **self.gate.snapshot(),
                "job_totals": jobs["totals"], "cancel_latency_s": jobs["cancel_latency_s"]}
