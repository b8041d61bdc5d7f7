"""``mtp_batch``: up to ``decode_batch_max`` MTP requests verified together.

Every cycle is ONE ``Engine.step`` over all live rows: one batched draft pass and one target
forward verifying every row's drafts. A cohort forms when a request arrives at an idle
scheduler and decodes from its first cycle; for ``batch_wait_ms`` (the gather window) the
requests that arrive join it as founding rows, at the next cycle boundary; later requests join
the same way while the width has room (counted as mid-cohort joins). A row that finishes or is
cancelled leaves at the boundary without stalling the others. No padding rows are needed: the
step takes exactly the live rows.

The gather window never holds the engine idle. A join at a cycle boundary takes the place of
a row that left, in the running chain of cycles (``engine/chain.py``), or else costs the
chain's restart; holding a lone request for the window cost the whole window (H200, session
10: one stream at 1,399 tok/s against serial's 1,643, 256 tokens, 20 ms windows), and so did
every cohort narrower than the width (four streams at T 0.7: 0.98x ar_batch; eight, which
fill the width at once: 1.16x).

Fork statistics count joins that forked their prompt's KV from the prefix cache (another
row's blocks, shared by refcount, not copied).
"""

from __future__ import annotations

import time

from mtplx.batching.cohort import RowPolicy, take_jobs
from mtplx.batching.queue import JobQueue
from mtplx.batching.state import SchedulerMode
from mtplx.engine.llm_engine import Request
from mtplx.errors import InvalidParameter


class MTPBatchPolicy(RowPolicy):
    mode = SchedulerMode.MTP_BATCH
    lane = "mtp_batch"

    def __init__(self, engine, settings):
        super().__init__(engine, settings)
        self.cohorts_sealed = 0
        self.joined_mid_cohort = 0
        self.prefix_forks = 0
        self.forked_prompt_tokens = 0

    def check_request(self, request: Request) -> None:
        if request.mode != "mtp":
            raise InvalidParameter("generation_mode", "mtp_batch batches MTP requests only; "
                                   "use --scheduler-mode ar_batch to batch AR requests")

    def run(self, queue: JobQueue) -> None:
        width = self.settings.decode_batch_max
        gathering_until = 0.0  # the open cohort's gather window ends then (perf_counter seconds)
        while True:
            if not self.rows:
                if not queue.wait_for(1):
                    return  # closed
                gathering_until = time.perf_counter() + self.settings.batch_wait_ms / 1000
                self.cohorts_sealed += 1
            mid_cohort = bool(self.rows) and time.perf_counter() >= gathering_until
            self.prefill_waiting()  # rows whose prompts ran beside the chain: in once their first token is drawn
            wait = self.prompts_wait()
            for job in take_jobs(queue, width - len(self.rows), self.engine, self.rows):
                if self._join_and_prefill(job, wait) and mid_cohort:
                    self.joined_mid_cohort += 1
            self.retire_done()
            stepping = [r for r in self.rows if r.prefilled]
            if stepping:
                self.step(stepping)
                self.retire_done()

    def _join_and_prefill(self, job, wait: bool) -> bool:
        """Admit ``job`` and feed its prompt, before the next job's admission (as always).
        wait=False: with a chain running, the prompt may run beside it, and the row steps from a
        later cycle (``prefill_waiting``)."""
        row = self.join(job)
        if row is None:
            return False
        if row.seq.cached_prompt_tokens:
            self.prefix_forks += 1
            self.forked_prompt_tokens += row.seq.cached_prompt_tokens
        self.prefill(row, wait=wait)
        return True

    def mode_telemetry(self) -> dict:
        return {
            **self.row_telemetry(),
            "fixed_width": self.settings.decode_batch_max,
            "batch_wait_ms": self.settings.batch_wait_ms,
            "cohorts_sealed": self.cohorts_sealed,
            "rows_joined_mid_cohort": self.joined_mid_cohort,
            "fork_stats": {"prefix_forks": self.prefix_forks, "forked_prompt_tokens": self.forked_prompt_tokens},
        }
