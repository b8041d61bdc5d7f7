"""Rows: jobs decoding side by side in the batching modes (mtp_batch, ar_batch).

Each row owns its Sequence (KV length, sampler, RNG, stop and cancel state), so rows join and
leave between engine steps. Admission reserves KV room for a row's whole run (prompt +
max_tokens, capped by the context), so a running batch never runs out of blocks mid-step.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtplx.batching.job import Job
from mtplx.batching.policy import Policy
from mtplx.batching.queue import JobQueue
from mtplx.batching.telemetry import Histogram
from mtplx.engine.llm_engine import Engine, Request, TextTracker
from mtplx.engine.sequence import Sequence


@dataclass(eq=False)  # rows compare by identity: field-wise equality walked prompts on every step
class Row:
    job: Job
    seq: Sequence
    text: TextTracker
    prefilled: bool = False

    @classmethod
    def open(cls, engine: Engine, job: Job) -> Row:
        """Make the job's sequence and take its KV blocks (prefix-cache hits included).
        Raises (OutOfBlocks, or a fault) with nothing taken."""
        seq = engine.new_sequence(job.request)
        engine.generator.admit(seq)
        return cls(job, seq, engine.text_tracker(job.request))

    def prefill(self, engine: Engine, chunk: int | None = None, wait: bool = True) -> bool:
        """Feed the prompt (``chunk`` tokens at most); True once the first token is sampled.
        wait=False: where the prompt's forwards run beside the chain, this call may return before
        they are done, and a later one draws the first token (``Generator.prefill``)."""
        self.prefilled = engine.generator.prefill(self.seq, chunk, wait)
        if self.prefilled:
            self.publish()
        return self.prefilled

    def publish(self) -> None:
        self.job.publish(self.seq, self.text.update(self.seq), self.text.shown)

    @property
    def done(self) -> bool:
        return self.seq.finished or self.job.cancelled


def blocks_needed(engine: Engine, request: Request) -> int:
    """KV blocks one request can occupy over its whole run (the engine's allocator says)."""
    return engine.kv.blocks_needed(len(request.prompt_ids), request.max_tokens, request.depth)


def kv_headroom(engine: Engine, rows: list[Row]) -> int:
    """Free blocks (evictable cached ones included) not promised to the running rows."""
    return engine.kv.headroom((r.seq, blocks_needed(engine, r.job.request)) for r in rows)


def take_jobs(queue: JobQueue, limit: int, engine: Engine, rows: list[Row]) -> list[Job]:
    """Up to ``limit`` queued jobs, in FIFO order, whose whole runs fit in the KV cache beside
    ``rows``; the first that does not fit goes back to the front of the queue. Never waits.
    An empty queue costs one length check (no lock): a job that lands meanwhile is taken at the
    next cycle boundary."""
    taken: list[Job] = []
    if limit <= 0 or not len(queue):
        return taken
    headroom = kv_headroom(engine, rows)
    while len(taken) < limit and (job := queue.get_nowait()) is not None:
        need = 0 if job.cancelled else blocks_needed(engine, job.request)
        if need > headroom and (rows or taken):
            queue.put_front(job)
            break
        headroom -= need
        taken.append(job)
    return taken


class RowPolicy(Policy):
    """What the batching modes share: rows join, step together and retire one by one."""

    lane = "batch"

    def __init__(self, engine: Engine, settings):
        super().__init__(engine, settings)
        self.rows: list[Row] = []
        self.batch_histogram = Histogram()  # rows per engine step -> steps
        self.rows_joined = self.rows_retired = 0

    def join(self, job: Job) -> Row | None:
        """Start ``job`` as a row (None if it was cancelled while queued or cannot start)."""
        if not self.begin(job, self.lane):
            return None
        try:
            row = Row.open(self.engine, job)
        except Exception as exc:
            self.fail(job, exc)
            return None
        self.rows.append(row)
        self.rows_joined += 1
        return row

    def prefill(self, row: Row, chunk: int | None = None, wait: bool = True) -> None:
        try:
            row.prefill(self.engine, chunk, wait)
        except Exception as exc:
            self.drop(row, exc)

    def prompts_wait(self) -> bool:
        """Whether a prompt fed now is waited for: where no row is prefilled, nothing else would
        step; where some are, their step need not wait (``Generator.prefill``, wait=False)."""
        return not any(r.prefilled for r in self.rows)

    def prefill_waiting(self, chunk: int | None = None) -> None:
        """Feed each row not yet prefilled (``chunk`` tokens at most). Where other rows are
        prefilled, their step need not wait: a prompt then runs beside the chain's cycles and
        its row joins a later step, once its first token is drawn."""
        wait = self.prompts_wait()
        for row in [r for r in self.rows if not r.prefilled]:
            self.prefill(row, chunk, wait)

    def step(self, rows: list[Row]) -> None:
        """One engine step for ``rows`` (all of one generation mode), then publish each row it
        advanced: its own rows, and rows of another group whose chained cycle it committed first.

        A row whose own work failed fails alone; the others stepped and go on. Any other
        exception came from a batched forward: every row of the step fails (their state is no
        longer trustworthy), and the rows of other steps go on."""
        rows = [r for r in rows if r in self.rows]  # a row dropped since the caller grouped them
        if not rows:
            return
        try:
            result = self.engine.step([r.seq for r in rows])
        except Exception as exc:
            for row in rows:
                self.drop(row, exc)
            return
        self.batch_histogram.add(len(rows))
        by_id = {r.seq.seq_id: r for r in self.rows}
        for seq_id, error in result.failed.items():
            if seq_id in by_id:
                self.drop(by_id.pop(seq_id), error)
        stepped = {r.seq.seq_id for r in rows}
        for row in rows + [by_id[s.seq_id] for s in result.advanced if s.seq_id not in stepped and s.seq_id in by_id]:
            if row.seq.seq_id in by_id:
                self.publish(row)
        self.publish_kv()  # once per cycle, as serial does

    def publish(self, row: Row) -> None:
        """Send a row's new output; detokenising is the row's own work, so a failure there
        fails that row alone."""
        try:
            row.publish()
        except Exception as exc:
            self.drop(row, exc)

    def retire_done(self) -> None:
        """Release and report every row that finished or whose client cancelled (``finish``
        publishes the KV counts)."""
        for row in [r for r in self.rows if r.done]:
            self.engine.generator.release(row.seq)
            self.rows.remove(row)
            self.rows_retired += 1
            self.finish(row.job, row.seq)

    def abort(self, error: BaseException) -> None:
        self.rows.clear()
        super().abort(error)

    def drop(self, row: Row, error: BaseException) -> None:
        self.engine.generator.release(row.seq)
        self.rows.remove(row)
        self.fail(row.job, error)

    def row_telemetry(self) -> dict:
        return {"batch_histogram": self.batch_histogram.as_dict(), "rows_active": len(self.rows),
                "rows_joined": self.rows_joined, "rows_retired": self.rows_retired}
