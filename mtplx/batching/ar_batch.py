"""``ar_batch``: continuous batching of autoregressive decode.

Up to ``max_active_requests`` rows; new requests join at every step. Prompts are prefilled
in chunks of ``prefill_chunk`` tokens, one chunk per waiting row per step, interleaved with
the decode step of the rows already generating, so a long prompt does not stall them.

MTP is off while the batch is wider than 1. The choice is made once, at admission: a
request admitted as the only row keeps MTP for its whole run (it then steps in a forward
of its own if others join); one admitted beside others decodes AR, and its response says
why in ``mtp_disabled_reason``.
"""

from __future__ import annotations

from mtplx.batching.cohort import Row, RowPolicy, take_jobs
from mtplx.batching.job import Job
from mtplx.batching.queue import JobQueue
from mtplx.batching.state import SchedulerMode

PREFILL_CHUNK_TOKENS = 128


class ARBatchPolicy(RowPolicy):
    mode = SchedulerMode.AR_BATCH
    lane = "ar_batch"

    def __init__(self, engine, settings, prefill_chunk: int = PREFILL_CHUNK_TOKENS):
        super().__init__(engine, settings)
        self.prefill_chunk = prefill_chunk
        self.prefill_chunks = 0
        self.mtp_rows = self.mtp_disabled_rows = 0

    def run(self, queue: JobQueue) -> None:
        limit = self.settings.max_active_requests
        while True:
            if not self.rows and not queue.wait_for(1):
                return  # closed
            jobs = take_jobs(queue, limit - len(self.rows), self.engine, self.rows)
            width = len(self.rows) + sum(not j.cancelled for j in jobs)
            for job in jobs:
                self._choose_generation_mode(job, width)
                self.join(job)
            self.prefill_chunks += sum(not r.prefilled and r.seq.pending_prefill is None for r in self.rows)
            self.prefill_waiting(self.prefill_chunk)
            self.retire_done()
            for group in _by_mode([r for r in self.rows if r.prefilled]):
                self.step(group)
            self.retire_done()

    def _choose_generation_mode(self, job: Job, width: int) -> None:
        req = job.request
        if req.mode != "mtp":
            return
        if width == 1:
            self.mtp_rows += 1
            return
        req.mode, req.depth, req.adaptive = "ar", 0, False
        job.mtp_disabled_reason = (f"ar_batch admitted this request beside {width - 1} other(s); "
                                   "MTP is off while the batch is wider than 1")
        self.mtp_disabled_rows += 1

    def mode_telemetry(self) -> dict:
        return {**self.row_telemetry(), "max_active_requests": self.settings.max_active_requests,
                "prefill_chunk_tokens": self.prefill_chunk, "prefill_chunks": self.prefill_chunks,
                "mtp_rows": self.mtp_rows, "mtp_disabled_rows": self.mtp_disabled_rows}


def _by_mode(rows: list[Row]) -> list[list[Row]]:
    """Rows grouped by generation mode (one engine step per group), in order of appearance."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(row.seq.mode, []).append(row)
    return list(groups.values())
