"""A job: one admitted request as the scheduler sees it, and what it sends back.

The HTTP layer builds a Job around a validated engine ``Request`` and an ``emit`` callback;
the model-owner thread runs it and calls ``emit`` with events (``Delta``, ``Done``,
``Failed``). ``emit`` must be cheap and thread-safe (the server hands events to its event
loop). Cancellation is a flag the model thread reads at every cycle boundary.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mtplx.engine.llm_engine import Request
from mtplx.engine.sequence import Sequence
from mtplx.engine.stats import DecodeStats

_job_ids = itertools.count(1)


@dataclass
class Delta:
    """New output of one cycle: text (stop strings and partial UTF-8 held back) and token ids."""

    text: str
    token_ids: list[int]
    logprobs: list | None = None  # per token (logprob, [(id, logprob), ...]) when the request asked
    prompt_logprobs: list | None = None  # the prompt's (after its first token), on the first Delta only


@dataclass
class Done:
    """The job ended (finish_reason "stop", "length" or "cancelled")."""

    result: "JobResult"


@dataclass
class Failed:
    """The job could not run; ``error`` is the exception (user errors are ``MtplxError``)."""

    error: BaseException


@dataclass
class JobResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict  # the ``mtplx_stats`` object: decode statistics plus scheduler fields
    logprobs: list | None = None  # per token (logprob, [(id, logprob), ...]) when the request asked
    prompt_logprobs: list | None = None  # the prompt's tokens after the first (prompt scoring)


@dataclass
class Job:
    """One request in a scheduler. Times are ``time.perf_counter()`` seconds."""

    request: Request
    emit: Callable[[Any], None] = lambda event: None
    request_id: str = field(default_factory=lambda: f"job-{next(_job_ids)}")
    scheduler_mode: str = ""  # set by the scheduler on submit
    choice: int = 0  # which of its HTTP request's n choices (the request counts once: server/metrics.py)
    choices: int = 1  # n
    group: str = ""  # the request id its choices share
    lane: str = ""  # the scheduler lane that ran it (set by the policy)
    mtp_disabled_reason: str | None = None
    ticket: Any = None  # a mode's admission ticket (hyper)
    extra_stats: dict = field(default_factory=dict)  # a mode's per-request additions (solo_mtp trace)
    t_enqueued: float = field(default_factory=time.perf_counter)
    t_started: float | None = None
    t_first_token: float | None = None
    t_finished: float | None = None
    t_cancelled: float | None = None  # the first cancel() (the client left, or the server cut it off)
    live_stats: DecodeStats | None = None  # the running sequence's statistics, updated in place each cycle
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _sent_tokens: int = 0
    _text: list[str] = field(default_factory=list, repr=False)

    # -- called from any thread ---------------------------------------------------------
    def cancel(self) -> None:
        """Ask the scheduler to stop this job at the next cycle boundary (and free its KV)."""
        if self.t_cancelled is None:
            self.t_cancelled = time.perf_counter()
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def sent_tokens(self) -> int:
        """Tokens published so far (one int the model thread writes; read without a lock)."""
        return self._sent_tokens

    # -- called on the model-owner thread ----------------------------------------------
    def start(self, lane: str) -> None:
        self.lane, self.t_started = lane, time.perf_counter()

    def publish(self, seq: Sequence, text: str, shown: int | None = None) -> None:
        """Send the tokens committed since the last call whose text is sent (``shown``: the
        text tracker's count, None: all), with that text, so that a chunk's tokens and logprobs
        are its text's (a stop string holds both back alike)."""
        self.live_stats = seq.stats  # one reference: readers (the dashboard) see the cycles as they count
        new_ids = seq.generated[self._sent_tokens:shown]
        if not new_ids and not text:
            return
        logprobs = None if seq.logprobs is None else seq.logprobs[self._sent_tokens:self._sent_tokens + len(new_ids)]
        prompt_logprobs = seq.prompt_logprobs if not self._text else None  # with the first Delta
        self._sent_tokens += len(new_ids)
        if self.t_first_token is None and new_ids:
            self.t_first_token = time.perf_counter()
        self._text.append(text)
        self.emit(Delta(text, new_ids, logprobs, prompt_logprobs))

    def finish(self, seq: Sequence) -> JobResult:
        """Emit ``Done`` with the result; a cancelled job ends with finish_reason "cancelled"."""
        self.t_finished = time.perf_counter()
        reason = "cancelled" if self.cancelled and not seq.finished else (seq.finish_reason or "length")
        stats = seq.stats.as_dict()
        stats.update(self.scheduler_stats(), generation_mode=seq.mode, depth=seq.request_depth,
                     draft_policy=seq.draft_policy, **self.extra_stats)
        result = JobResult("".join(self._text), list(seq.generated), reason, len(seq.prompt_ids),
                           seq.num_generated, stats, None if seq.logprobs is None else list(seq.logprobs),
                           seq.prompt_logprobs)
        self.emit(Done(result))
        return result

    def finish_unstarted(self) -> JobResult:
        """Emit ``Done`` (finish_reason "cancelled") for a job cancelled before it started."""
        self.t_finished = time.perf_counter()
        result = JobResult("", [], "cancelled", len(self.request.prompt_ids), 0, self.scheduler_stats())
        self.emit(Done(result))
        return result

    def fail(self, error: BaseException) -> None:
        self.t_finished = time.perf_counter()
        self.emit(Failed(error))

    def scheduler_stats(self) -> dict:
        """Queue wait and run time (seconds), the lane, and why MTP was off, if it was."""
        started = self.t_started if self.t_started is not None else self.t_finished
        return {
            "scheduler_mode": self.scheduler_mode,
            "scheduler_lane": self.lane,
            "queue_wait_s": (started - self.t_enqueued) if started is not None else None,
            "run_s": (self.t_finished - started) if self.t_finished is not None and started is not None else None,
            "mtp_disabled_reason": self.mtp_disabled_reason or self.request.mtp_disabled_reason,
        }
