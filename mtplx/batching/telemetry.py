"""Counters, summaries and histograms the scheduler modes report.

Written on the model-owner thread, read by request handlers (snapshot, /health): each
object guards itself with a lock so a reader never sees a dict change size under it.
"""

from __future__ import annotations

import statistics
import threading
from collections import Counter, deque


class Summary:
    """count / total / mean / min / max of a quantity, and p50 / p90 over the latest ``window``."""

    def __init__(self, window: int = 1024):
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=window)
        self.count, self.total = 0, 0.0
        self.min: float | None = None
        self.max: float | None = None

    def add(self, value: float) -> None:
        with self._lock:
            self.count += 1
            self.total += value
            self.min = value if self.min is None else min(self.min, value)
            self.max = value if self.max is None else max(self.max, value)
            self._recent.append(value)

    def as_dict(self) -> dict:
        with self._lock:
            recent = sorted(self._recent)
            count, total, lo, hi = self.count, self.total, self.min, self.max
        return {
            "count": count, "total": total, "mean": total / count if count else None, "min": lo, "max": hi,
            "p50": statistics.median(recent) if recent else None,
            "p90": recent[min(len(recent) - 1, int(0.9 * len(recent)))] if recent else None,
        }


class Histogram:
    """Counts per integer key (e.g. rows per cycle); reported with string keys, ascending."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Counter[int] = Counter()

    def add(self, key: int, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {str(k): v for k, v in sorted(self._counts.items())}

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


class JobCounters:
    """What every mode reports about its jobs: totals, queue wait, run time and cancel latency
    (seconds from a running job's cancel to its end, its KV blocks freed)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.totals = Counter(admitted=0, started=0, completed=0, cancelled=0, failed=0, abandoned_before_start=0)
        self.queue_wait_s = Summary()
        self.run_s = Summary()
        self.cancel_latency_s = Summary()

    def count(self, name: str) -> None:
        with self._lock:
            self.totals[name] += 1

    def as_dict(self) -> dict:
        with self._lock:
            totals = dict(self.totals)
        return {"totals": totals, "queue_wait_s": self.queue_wait_s.as_dict(), "run_s": self.run_s.as_dict(),
                "cancel_latency_s": self.cancel_latency_s.as_dict()}
