"""What the dashboard's live stream sends: one sample of the server every ``INTERVAL_S``.

A sample only reads what is already counted: the snapshot payload (``telemetry.snapshot_payload``),
the Prometheus counters (``metrics.py``), each running job's published token count and its
sequence's ``DecodeStats`` (updated in place by the model thread, read without a lock), and the
ring of recently ended requests (``ServerState.recent``, appended once per request by a
scheduler listener). Nothing here runs on the model thread; a decode cycle's only addition is
one attribute write (``Job.publish`` keeps a reference to its sequence's statistics).

Rates: the stream's ``LiveSampler`` remembers each running job's token count from the previous
sample; tokens emitted since = the growth of the running jobs plus what jobs that ended in the
meantime produced after they were last seen. ``tok_s`` is that over the last ``RATE_WINDOW_S``.
"""

from __future__ import annotations

import time
from collections import deque

from mtplx.batching.job import Job, JobResult
from mtplx.server.metrics import PHASES
from mtplx.server.telemetry import snapshot_payload

INTERVAL_S = 0.4  # one sample every 400 ms
RATE_WINDOW_S = 2.0  # tok/s is averaged over this long
RECENT_REQUESTS = 50  # ended requests kept for the table and the speed-up
RECENT_SHOWN = 20  # of those, sent in each sample
PENDING_S = 10.0  # how long a job that left the running list waits for its ended row
MIN_TOKENS_FOR_RATE = 8  # a request's decode tok/s counts toward the speed-up from this many tokens


def ended_entry(number: int, job: Job, result: JobResult | None) -> dict:
    """The dashboard's row of an ended request (built once, on the model thread, when it ends)."""
    stats = result.stats if result is not None else {}
    request = job.request
    ttft = job.t_first_token - job.t_enqueued if job.t_first_token is not None else None
    return {
        "n": number, "id": job.request_id, "ended_at": time.time(),
        "finish_reason": result.finish_reason if result is not None else "error",
        "prompt_tokens": len(request.prompt_ids),
        "completion_tokens": result.completion_tokens if result is not None else job.sent_tokens,
        "ttft_s": ttft, "tok_s": stats.get("decode_tok_s"),
        "e2e_s": job.t_finished - job.t_enqueued if job.t_finished is not None else None,
        "generation_mode": stats.get("generation_mode", request.mode), "depth": stats.get("depth", request.depth),
        "temperature": request.params.temperature,
        "mean_acceptance_length": stats.get("mean_acceptance_length"),
        "acceptance_rate": stats.get("acceptance_rate"),
    }


def running_entry(job: Job, now: float) -> dict:
    """A running or queued request as it stands (times from ``time.perf_counter()``)."""
    request, sent = job.request, job.sent_tokens
    first = job.t_first_token
    row = {"id": job.request_id, "state": "running" if job.t_started is not None else "queued",
           "prompt_tokens": len(request.prompt_ids), "completion_tokens": sent,
           "ttft_s": first - job.t_enqueued if first is not None else None,
           # tokens after the first over the time since it, as DecodeStats' decode_tok_s
           "tok_s": (sent - 1) / (now - first) if first is not None and sent > 1 and now > first else None,
           "elapsed_s": now - job.t_enqueued, "generation_mode": request.mode, "depth": request.depth,
           "temperature": request.params.temperature, "cancelling": job.cancelled}
    stats = job.live_stats
    if stats is not None and stats.verify_calls:
        row["mean_acceptance_length"] = 1.0 + stats.accepted_tokens / stats.verify_calls
        row["acceptance_rate"] = stats.accepted_tokens / stats.drafted_tokens if stats.drafted_tokens else None
    return row


class LiveSampler:
    """One stream's samples of ``server`` (a ``ServerState``); keeps what its rates need."""

    def __init__(self, server):
        self.server = server
        self._seen: dict[str, tuple[Job, int]] = {}  # running jobs: token count at the last sample
        self._baseline = server.ended_count  # ended rows numbered up to this predate the sampler
        self._handled: set[int] = set()  # ended rows (by number) already counted
        self.emitted = 0  # tokens this sampler has seen emitted since it was made
        self._history: deque[tuple[float, int]] = deque()  # (time, emitted), the last RATE_WINDOW_S

    def sample(self) -> dict:
        server = self.server
        now = time.perf_counter()
        # the counters before the jobs: a job ending in between is missed once, never counted twice
        counters = server.metrics.values()
        running = list(server.scheduler.policy.running)
        queued = server.scheduler.queue.waiting()
        recent = list(server.recent)
        snapshot = snapshot_payload(server)
        snapshot.pop("latest_request", None)  # the recent rows hold it
        snapshot.pop("scheduler", None)  # the same block as "telemetry" under the mode's name
        self._count_tokens(running, recent, now)
        rows = [running_entry(job, now) for job in running + queued]
        return {
            **snapshot,
            "t": time.time(),
            "defaults": server.live_defaults(),
            "tok_s": self._rate(),
            "running": rows,
            "recent": recent[-RECENT_SHOWN:][::-1],
            "spec": spec_totals(counters, running),
            "prefix_cache_hit_rate": _ratio(snapshot["kv_cache"].get("prefix_hit_tokens"),
                                            snapshot["kv_cache"].get("prefix_lookup_tokens")),
            "speedup_vs_ar": speedup_vs_ar(recent),
        }

    def _count_tokens(self, running: list[Job], recent: list[dict], now: float) -> None:
        """Add the tokens sent since the last sample to ``emitted``: each running job's growth;
        for a job that ended, its ended row's count less what was already counted."""
        sent = {job.request_id: (job, job.sent_tokens) for job in running}  # each read once
        emitted = sum(max(0, n - self._seen.get(rid, (job, 0))[1]) for rid, (job, n) in sent.items())
        gone = {rid: seen for rid, seen in self._seen.items() if rid not in sent}
        for entry in recent:
            if entry["n"] <= self._baseline or entry["n"] in self._handled or entry["id"] in sent:
                continue  # counted before this sampler began, already, or still counted as running
            self._handled.add(entry["n"])
            _, before = gone.pop(entry["id"], (None, 0))  # 0: it started and ended between samples
            emitted += max(0, entry["completion_tokens"] - before)
        # left the running list, ended row not written yet: count what it sent, settle the rest later
        for rid, (job, before) in list(gone.items()):
            emitted += max(0, job.sent_tokens - before)
            gone[rid] = (job, max(before, job.sent_tokens))
        self._handled &= {entry["n"] for entry in recent}
        self._seen = {**{rid: seen for rid, seen in gone.items() if job_recent(seen[0], now)}, **sent}
        self.emitted += emitted
        self._history.append((now, self.emitted))
        while len(self._history) > 2 and now - self._history[1][0] >= RATE_WINDOW_S:
            self._history.popleft()

    def _rate(self) -> float | None:
        if len(self._history) < 2:
            return None
        (t0, n0), (t1, n1) = self._history[0], self._history[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None


def job_recent(job: Job, now: float) -> bool:
    """Whether a job that left the running list may still get its ended row (it has not ended,
    or ended under ``PENDING_S`` seconds ago)."""
    return job.t_finished is None or now - job.t_finished < PENDING_S


def spec_totals(counters: dict, running: list[Job]) -> dict:
    """Speculative-decoding totals since the server started: the Prometheus counters (ended
    requests) plus the running requests' live statistics. Per position (0-based): drafted,
    accepted and their ratio; mean acceptance length = 1 + accepted / verify cycles; and the
    seconds per verify cycle of each phase."""
    def value(name: str, **labels) -> float:
        return counters.get((name, tuple(sorted(labels.items()))), 0.0)

    drafted, accepted = [], []
    pos = 0
    while ("mtplx_spec_decode_num_draft_tokens_per_pos_total", (("position", str(pos)),)) in counters:
        drafted.append(value("mtplx_spec_decode_num_draft_tokens_per_pos_total", position=str(pos)))
        accepted.append(value("mtplx_spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)))
        pos += 1
    cycles = value("mtplx_spec_decode_num_drafts_total")
    phases = {p: value("mtplx_decode_phase_seconds_total", phase=p) for p in PHASES}
    for job in running:
        stats = job.live_stats
        if stats is None or not stats.verify_calls:
            continue
        cycles += stats.verify_calls
        for i, (d, a) in enumerate(zip(list(stats.drafted_by_depth), list(stats.accepted_by_depth))):
            if i == len(drafted):
                drafted.append(0.0)
                accepted.append(0.0)
            drafted[i] += d
            accepted[i] += a
        for p in PHASES:
            phases[p] += getattr(stats, f"{p}_s")
    total_drafted, total_accepted = sum(drafted), sum(accepted)
    return {
        "cycles": int(cycles), "draft_tokens": int(total_drafted), "accepted_tokens": int(total_accepted),
        "drafted_by_position": [int(d) for d in drafted], "accepted_by_position": [int(a) for a in accepted],
        "acceptance_by_position": [a / d if d else None for a, d in zip(accepted, drafted)],
        "acceptance_rate": _ratio(total_accepted, total_drafted),
        "mean_acceptance_length": 1.0 + total_accepted / cycles if cycles else None,
        "cycle_ms": {p: 1000.0 * s / cycles if cycles else None for p, s in phases.items()},
    }


def speedup_vs_ar(recent: list[dict]) -> dict:
    """Measured on this server: mean decode tok/s of the recent MTP requests over that of the
    recent AR requests, separately for greedy (temperature 0) and sampled requests; None for a
    regime without both. Only requests that ran to their end ("stop", "length") with at least
    ``MIN_TOKENS_FOR_RATE`` tokens count. ``mtp_tok_s`` / ``ar_tok_s`` are the two means."""
    out = {}
    for regime, greedy in (("greedy", True), ("sampled", False)):
        means = {}
        for mode in ("mtp", "ar"):
            rates = [e["tok_s"] for e in recent if e["generation_mode"] == mode and e["tok_s"]
                     and (e["temperature"] == 0) == greedy and e["finish_reason"] in ("stop", "length")
                     and e["completion_tokens"] >= MIN_TOKENS_FOR_RATE]
            means[mode] = sum(rates) / len(rates) if rates else None
        ratio = means["mtp"] / means["ar"] if means["mtp"] and means["ar"] else None
        out[regime] = {"speedup": ratio, "mtp_tok_s": means["mtp"], "ar_tok_s": means["ar"]}
    return out


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None
