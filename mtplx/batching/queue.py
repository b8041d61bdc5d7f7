"""The FIFO between request handlers and the model-owner thread."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from mtplx.batching.job import Job
from mtplx.errors import MtplxError


class QueueFull(MtplxError):
    """More requests are waiting than the server accepts (the server answers 503 + Retry-After)."""

    def __init__(self, capacity: int):
        super().__init__(f"the server's request queue is full ({capacity} waiting); retry shortly")
        self.capacity = capacity


class SchedulerStopped(MtplxError):
    """The server is shutting down (or its scheduler stopped): the request cannot run."""


class JobQueue:
    """A bounded, thread-safe FIFO of jobs. ``close()`` wakes every waiter with None."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, job: Job, on_accept: Callable[[Job], None] | None = None,
            on_drop: Callable[[Job], None] | None = None) -> None:
        """Append ``job``; raises QueueFull when ``capacity`` live jobs are already waiting.
        A full queue first sheds jobs cancelled while waiting (their clients left), handing
        each to ``on_drop``. Both callbacks run under the lock and must not block."""
        with self._cond:
            if self._closed:
                raise SchedulerStopped("the server is shutting down")
            if len(self._jobs) >= self.capacity and on_drop is not None:
                dead = [j for j in self._jobs if j.cancelled]
                if dead:
                    self._jobs = deque(j for j in self._jobs if not j.cancelled)
                    for j in dead:
                        on_drop(j)
            if len(self._jobs) >= self.capacity:
                raise QueueFull(self.capacity)
            if on_accept is not None:
                on_accept(job)
            self._jobs.append(job)
            self._cond.notify_all()

    def put_front(self, job: Job) -> None:
        """Return a job taken but not started (e.g. it did not fit in the KV cache yet)."""
        with self._cond:
            self._jobs.appendleft(job)

    def remove(self, job: Job, on_drop: Callable[[Job], None]) -> bool:
        """Take ``job`` out of the queue and hand it to ``on_drop`` (under the lock, as ``put``
        sheds dead jobs); False when it is not waiting here (started, or taken by a policy)."""
        with self._cond:
            kept = deque(j for j in self._jobs if j is not job)  # by identity: Jobs compare by fields
            if len(kept) == len(self._jobs):
                return False
            self._jobs = kept
            on_drop(job)
            return True

    def get(self, timeout: float | None = None) -> Job | None:
        """The oldest job, waiting up to ``timeout`` seconds (None: until one comes or close)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._jobs and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._jobs.popleft() if self._jobs else None

    def wait_for(self, count: int, timeout: float | None = None) -> bool:
        """Wait until ``count`` jobs are queued (True), ``timeout`` seconds pass or the queue
        closes (False unless enough jobs are there). Takes nothing."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._jobs) < count and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(remaining)
            return len(self._jobs) >= count

    def waiting(self) -> list[Job]:
        """The jobs waiting now, oldest first (a copy)."""
        with self._cond:
            return list(self._jobs)

    def get_nowait(self) -> Job | None:
        with self._cond:
            return self._jobs.popleft() if self._jobs else None

    def close(self) -> list[Job]:
        """Stop accepting jobs; return the ones still waiting (the caller fails them)."""
        with self._cond:
            self._closed = True
            left = list(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
            return left

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._jobs)
