"""Scheduler modes and the settings a mode runs with.

A mode is a policy over the one engine step (see ``batching/<mode>.py``); this file only
names the modes and resolves each mode's defaults. The per-mode validation with its
user-facing messages lives in ``settings.py`` (``validate_scheduler_settings``).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass

from mtplx.errors import MtplxError


class SchedulerConfigError(MtplxError):
    """A scheduler setting is invalid or contradicts the chosen mode (``mtplx serve`` exits 2)."""


class SchedulerMode(enum.StrEnum):
    """How concurrent requests share the model (REFERENCE.md section 3)."""

    SERIAL = "serial"
    MTP_BATCH = "mtp_batch"
    HYPER = "hyper"
    AR_BATCH = "ar_batch"
    SOLO_MTP = "solo_mtp"

    @classmethod
    def parse(cls, value: object, source: str = "scheduler_mode") -> SchedulerMode:
        """``value`` as a mode, or a SchedulerConfigError that lists the allowed choices.
        ``source`` says where the value came from (a flag, a variable, a file)."""
        try:
            return cls(value)
        except ValueError:
            raise SchedulerConfigError(
                f"{source}: {value!r} is not a scheduler mode; choose one of {', '.join(cls.choices())}"
            ) from None

    @classmethod
    def choices(cls) -> list[str]:
        return [m.value for m in cls]


# Modes that decode MTP only (no AR fallback) need a model with an MTP head.
MTP_ONLY_MODES = (SchedulerMode.MTP_BATCH, SchedulerMode.SOLO_MTP)

DEFAULT_DECODE_BATCH_MAX = 8  # mtp_batch width
DEFAULT_BATCH_WAIT_MS = 20.0  # mtp_batch gather window
DEFAULT_AR_BATCH_ACTIVE = 8  # ar_batch max_active_requests
DEFAULT_MAX_QUEUED = 64  # requests waiting beyond the active ones before 503


@dataclass(frozen=True)
class SchedulerSettings:
    """The resolved knobs of one scheduler (every field set; mode defaults filled in).

    max_active_requests: requests holding KV blocks at once; decode_batch_max: rows verified
    in one target forward (mtp_batch); batch_wait_ms: a new cohort's gather window, milliseconds
    (arrivals within it join as founding rows; decoding never waits for it);
    max_queued_requests: waiting requests beyond which new ones get 503.
    generation_mode / depth: per-request defaults (None: the engine's own defaults).
    """

    mode: SchedulerMode = SchedulerMode.SERIAL
    generation_mode: str | None = None
    depth: int | None = None
    max_active_requests: int = 1
    decode_batch_max: int = 1
    batch_wait_ms: float = 0.0
    max_queued_requests: int = DEFAULT_MAX_QUEUED

    @classmethod
    def resolve(cls, mode: SchedulerMode | str, *, generation_mode: str | None = None, depth: int | None = None,
                max_active_requests: int | None = None, decode_batch_max: int | None = None,
                batch_wait_ms: float | None = None, max_queued_requests: int | None = None) -> SchedulerSettings:
        """Fill each unset (None) knob with the mode's default. Validate first (server.openai)."""
        mode = SchedulerMode.parse(mode)
        width, active, wait = 1, 1, 0.0
        if mode == SchedulerMode.MTP_BATCH:
            width = decode_batch_max or DEFAULT_DECODE_BATCH_MAX
            active = width
            wait = DEFAULT_BATCH_WAIT_MS if batch_wait_ms is None else float(batch_wait_ms)
        elif mode == SchedulerMode.AR_BATCH:
            active = max_active_requests or DEFAULT_AR_BATCH_ACTIVE
        queued = DEFAULT_MAX_QUEUED if max_queued_requests is None else max_queued_requests
        return cls(mode, generation_mode, depth, active, width, wait, queued)

    @property
    def policy_label(self) -> str:
        """The ``scheduler_policy`` name reported in the scheduler state payload."""
        return {
            SchedulerMode.SERIAL: "serial_fifo",
            SchedulerMode.MTP_BATCH: f"fixed_mtp_batch_width_{self.decode_batch_max}",
            SchedulerMode.HYPER: "hyper_singleton_admission_1",
            SchedulerMode.AR_BATCH: f"continuous_ar_batch_max_{self.max_active_requests}",
            SchedulerMode.SOLO_MTP: "solo_mtp_traced",
        }[self.mode]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["mode"] = self.mode.value
        return out
