"""``solo_mtp``: exactly one MTP request at a time, no batching, no AR fallback, traced.

It runs the serial closure and records every cycle (drafted, accepted, committed tokens and
the draft / verify / accept / commit seconds), so the MTP pipeline can be profiled alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mtplx.batching.job import Job
from mtplx.batching.serial import SingleRequestPolicy, run_serial
from mtplx.batching.state import SchedulerMode
from mtplx.batching.telemetry import Histogram, Summary
from mtplx.engine.llm_engine import Request
from mtplx.engine.sequence import Sequence
from mtplx.errors import InvalidParameter

PHASES = ("draft_s", "verify_s", "accept_s", "commit_s")
RECENT_CYCLES = 64  # cycles of the latest request shown in the snapshot


@dataclass
class Cycle:
    """One draft + verify cycle; times in seconds."""

    drafted: int
    accepted: int
    committed: int
    draft_s: float
    verify_s: float
    accept_s: float
    commit_s: float


class CycleTrace:
    """Turns a sequence's cumulative DecodeStats into per-cycle records; call ``observe``
    after prefill and after every engine step."""

    _FIELDS = ("verify_calls", "drafted_tokens", "accepted_tokens", *PHASES)

    def __init__(self):
        self.cycles: list[Cycle] = []
        self._last: dict | None = None

    def observe(self, seq: Sequence) -> None:
        now = {f: getattr(seq.stats, f) for f in self._FIELDS} | {"generated": seq.num_generated}
        last, self._last = self._last, now
        if last is None or now["verify_calls"] == last["verify_calls"]:
            return
        d = {k: now[k] - last[k] for k in now}
        self.cycles.append(Cycle(d["drafted_tokens"], d["accepted_tokens"], d["generated"],
                                 *(d[p] for p in PHASES)))


class SoloMTPPolicy(SingleRequestPolicy):
    mode = SchedulerMode.SOLO_MTP
    lane = "solo_mtp"

    def __init__(self, engine, settings):
        super().__init__(engine, settings)
        self.accepted_per_cycle = Histogram()
        self.phase_s = {p: Summary() for p in PHASES}
        self.tokens_per_cycle = Summary()
        self.drafted = self.accepted = 0
        self.latest: list[dict] = []

    def check_request(self, request: Request) -> None:
        if request.mode != "mtp":
            raise InvalidParameter("generation_mode", "solo_mtp runs MTP requests only (no AR fallback); "
                                   "use --scheduler-mode serial or ar_batch for AR")

    def execute(self, job: Job) -> Sequence:
        trace = CycleTrace()

        def on_cycle(seq: Sequence) -> None:
            trace.observe(seq)
            self.publish_kv()

        try:
            return run_serial(self.engine, job, on_cycle)
        finally:
            self._record(job, trace.cycles)

    def _record(self, job: Job, cycles: list[Cycle]) -> None:
        for c in cycles:
            self.accepted_per_cycle.add(c.accepted)
            self.tokens_per_cycle.add(c.committed)
            self.drafted += c.drafted
            self.accepted += c.accepted
            for p in PHASES:
                self.phase_s[p].add(getattr(c, p))
        job.extra_stats["cycle_trace"] = [asdict(c) for c in cycles]
        self.latest = job.extra_stats["cycle_trace"][-RECENT_CYCLES:]

    def mode_telemetry(self) -> dict:
        return {
            "cycles": self.tokens_per_cycle.count,
            "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "accepted_per_cycle": self.accepted_per_cycle.as_dict(),
            "tokens_per_cycle": self.tokens_per_cycle.as_dict(),
            "phase_s": {p: s.as_dict() for p, s in self.phase_s.items()},
            "latest_request_cycles": self.latest,
        }
