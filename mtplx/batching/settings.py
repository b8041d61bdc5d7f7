"""Per-mode validation of the scheduler settings, with one-line messages that name the rule,
the knob, its value and where the value came from. ``mtplx serve`` runs it before the model
loads (``validate_scheduler_settings``) and after (``validate_model_for_mode``)."""

from __future__ import annotations

from mtplx.batching.state import (DEFAULT_DECODE_BATCH_MAX, SchedulerConfigError, SchedulerMode,
                                  SchedulerSettings)


def _where(sources: dict[str, str] | None, name: str) -> str:
    source = (sources or {}).get(name)
    return f" (from {source})" if source and source != "default" else ""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise SchedulerConfigError(message)


# What each knob must be in a mode that does not use it: unset, or this neutral value.
_NEUTRAL = {"max_active_requests": 1, "decode_batch_max": 1, "batch_wait_ms": 0}

_HYPER_RULES = {
    "max_active_requests": "hyper admits one request at a time (HYPER_ADMISSION_CAP = 1, no external admission)",
    "decode_batch_max": "hyper never batches separate requests (width > 1 only for a request's own "
                        "speculative rows, through a HyperWidthExecutor)",
    "batch_wait_ms": "hyper never holds a gather window",
}


def _single_request_rules(mode: str) -> dict[str, str]:
    return {"max_active_requests": f"{mode} runs one request at a time (for concurrency use ar_batch or mtp_batch)",
            "decode_batch_max": f"{mode} does not batch (decode_batch_max sets mtp_batch's width)",
            "batch_wait_ms": f"{mode} never holds a gather window"}


_AR_BATCH_RULES = {
    "decode_batch_max": "ar_batch's width is max_active_requests (decode_batch_max sets mtp_batch's width)",
    "batch_wait_ms": "ar_batch admits at every decode step and never holds a gather window",
}


def _check_neutral(rules: dict[str, str], values: dict[str, float | None], sources: dict[str, str] | None) -> None:
    """For each knob in ``rules``: unset or neutral, else the rule (why), the knob, its value and source."""
    for name, why in rules.items():
        value = values[name]
        _require(not value or value == _NEUTRAL[name],
                 f"{why}: {name} must be {_NEUTRAL[name]}, got {value}{_where(sources, name)}")


def validate_hyper_settings(max_active_requests: int | None = None, decode_batch_max: int | None = None,
                             batch_wait_ms: float | None = None, *, sources: dict[str, str] | None = None) -> None:
    """Hyper admits one external request at a time and never gathers: reject anything else."""
    _check_neutral(_HYPER_RULES, {"max_active_requests": max_active_requests, "decode_batch_max": decode_batch_max,
                                  "batch_wait_ms": batch_wait_ms}, sources)


def validate_scheduler_settings(mode: SchedulerMode | str, *, generation_mode: str | None = None,
                                 depth: int | None = None, max_active_requests: int | None = None,
                                 decode_batch_max: int | None = None, batch_wait_ms: float | None = None,
                                 max_queued_requests: int | None = None,
                                 sources: dict[str, str] | None = None) -> SchedulerSettings:
    """Check the knobs against ``mode``'s rules (None = not set) and return the resolved
    settings. Raises SchedulerConfigError with a one-line message naming the rule."""
    mode = SchedulerMode.parse(mode, "scheduler_mode" + _where(sources, "scheduler_mode"))
    knobs = {"max_active_requests": max_active_requests, "decode_batch_max": decode_batch_max,
             "batch_wait_ms": batch_wait_ms}
    if mode == SchedulerMode.HYPER:
        validate_hyper_settings(**knobs, sources=sources)
    elif mode in (SchedulerMode.SERIAL, SchedulerMode.SOLO_MTP):
        _check_neutral(_single_request_rules(mode.value), knobs, sources)
    elif mode == SchedulerMode.AR_BATCH:
        _check_neutral(_AR_BATCH_RULES, knobs, sources)
    elif mode == SchedulerMode.MTP_BATCH:
        _require(max_active_requests in (None, decode_batch_max or DEFAULT_DECODE_BATCH_MAX),
                 f"mtp_batch admits up to decode_batch_max requests (its width): leave max_active_requests unset "
                 f"or equal to decode_batch_max, got {max_active_requests}{_where(sources, 'max_active_requests')}")
    if mode in (SchedulerMode.MTP_BATCH, SchedulerMode.SOLO_MTP):
        _require(generation_mode in (None, "mtp"),
                 f"{mode.value} decodes MTP only (no AR fallback): generation_mode must be mtp, got "
                 f"{generation_mode!r}{_where(sources, 'generation_mode')}; use serial or ar_batch for AR")
    return SchedulerSettings.resolve(mode, generation_mode=generation_mode, depth=depth,
                                     max_active_requests=max_active_requests, decode_batch_max=decode_batch_max,
                                     batch_wait_ms=batch_wait_ms, max_queued_requests=max_queued_requests)


def validate_model_for_mode(settings: SchedulerSettings, has_mtp: bool) -> None:
    """After loading: MTP-only modes and an explicit generation_mode=mtp need an MTP head."""
    needs_head = settings.mode in (SchedulerMode.MTP_BATCH, SchedulerMode.SOLO_MTP) or settings.generation_mode == "mtp"
    _require(has_mtp or not needs_head,
             f"{settings.mode.value} with generation_mode {settings.generation_mode or 'mtp'} needs a model with an "
             "MTP head, and this one has none (forge one with `mtplx forge build`, pass --head, "
             "or use --scheduler-mode serial/ar_batch for AR)")
