"""``serial``: FIFO, one request at a time, MTP or AR per request.

``run_serial`` is the serial closure: one request alone through ``Engine.run``. Hyper mode
and solo_mtp hand requests to this same function, so their trajectories are serial's.
"""

from __future__ import annotations

from typing import Callable

from mtplx.batching.job import Job
from mtplx.batching.policy import Policy
from mtplx.batching.queue import JobQueue
from mtplx.batching.state import SchedulerMode
from mtplx.engine.llm_engine import Engine
from mtplx.engine.sequence import Sequence


def run_serial(engine: Engine, job: Job, on_cycle: Callable[[Sequence], None] | None = None) -> Sequence:
    """Decode ``job`` alone, publishing each cycle's output; stop at the first cycle boundary
    after a cancel. The KV blocks are released when this returns or raises."""
    text = engine.text_tracker(job.request)
    stream = engine.run(job.request, text)
    seq = None
    try:
        for seq, piece in stream:
            job.publish(seq, piece, text.shown)
            if on_cycle is not None:
                on_cycle(seq)
            if job.cancelled and not seq.finished:
                seq.cancelled = True
                break
    finally:
        stream.close()  # Engine.run releases the sequence's blocks when closed
    return seq


class SingleRequestPolicy(Policy):
    """Runs the queue's jobs one by one; subclasses choose how one job is executed."""

    lane = "serial"

    def run(self, queue: JobQueue) -> None:
        while (job := queue.get()) is not None:
            if not self.begin(job, self.lane_for(job)):
                continue
            try:
                seq = self.execute(job)
            except Exception as exc:
                self.fail(job, exc)
            else:
                self.finish(job, seq)

    def lane_for(self, job: Job) -> str:
        return self.lane

    def execute(self, job: Job) -> Sequence:
        return run_serial(self.engine, job, self.publish_kv)


class SerialPolicy(SingleRequestPolicy):
    mode = SchedulerMode.SERIAL
