"""The five scheduler modes, below HTTP: each is a policy over the same engine step, so
concurrent requests produce exactly what each would produce alone (greedy)."""

from __future__ import annotations

import pytest

from mtplx.batching.job import Delta, Done, Failed, Job
from mtplx.batching.queue import QueueFull
from mtplx.batching.scheduler import Scheduler
from mtplx.batching.state import SchedulerMode, SchedulerSettings
from mtplx.errors import InvalidParameter
from tests.test_server_harness import Collector, tiny_text_engine

PROMPTS = [f"row {i}: {'abcdefgh'[i]} says" for i in range(8)]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def engine():
    return tiny_text_engine(head="repeat")


@pytest.fixture(scope="module")
def solo(engine):
    """Each prompt decoded alone, greedy: the reference every mode must reproduce."""
    return [engine.generate(p, max_tokens=MAX_TOKENS, temperature=0.0) for p in PROMPTS]


def run_concurrently(engine, scheduler: Scheduler, prompts, **kwargs) -> list[Done]:
    collectors = [Collector() for _ in prompts]
    for prompt, collector in zip(prompts, collectors):
        scheduler.submit(Job(engine.make_request(prompt, **kwargs), collector))
    ends = [c.wait() for c in collectors]
    for end, collector in zip(ends, collectors):
        assert isinstance(end, Done), end
        assert [t for d in collector.deltas for t in d.token_ids] == end.result.token_ids
        assert "".join(d.text for d in collector.deltas) == end.result.text
    return ends


def started(engine, mode, **knobs) -> Scheduler:
    scheduler = Scheduler(engine, SchedulerSettings.resolve(mode, **knobs))
    scheduler.start()
    return scheduler


@pytest.fixture(params=[False, True], ids=["unchained", "chained"])
def chained(engine, request):
    """Both ways of stepping greedy rows: each cycle from the host's state, or chained cycles
    (the host one cycle behind, as on a GPU; tests/test_mtp_chained.py), run eagerly here."""
    engine.generator.chain.enabled = request.param
    yield request.param
    engine.generator.chain.enabled = False


@pytest.mark.parametrize("mode", SchedulerMode.choices())
def test_every_mode_reproduces_solo_greedy_output_under_8_concurrent_requests(engine, solo, mode, chained):
    scheduler = started(engine, mode)
    try:
        ends = run_concurrently(engine, scheduler, PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0)
    finally:
        scheduler.stop()
    for end, ref in zip(ends, solo):
        assert end.result.token_ids == ref.token_ids
        assert end.result.text == ref.text
        assert end.result.finish_reason == ref.finish_reason
        assert end.result.stats["scheduler_mode"] == mode
    assert engine.runner.blocks.num_used_blocks == 0
    engine.runner.blocks.check_invariants()
    assert scheduler.policy.jobs.totals["completed"] == len(PROMPTS)


@pytest.mark.parametrize("mode", ["mtp_batch", "ar_batch"])
def test_rows_arriving_at_a_running_chain_prefill_beside_it_and_decode_as_alone(engine, solo, mode):
    """Eight requests through three rows: each that finds the chain running has its prompt
    fed beside it (``Generator.prefill(wait=False)``, inline on the CPU), the other rows step
    meanwhile, and it joins once its first token is drawn; every output is its solo one."""
    gen = engine.generator
    beside = []
    inner = gen.prefill

    def prefill(seq, chunk=None, wait=True):
        fresh = seq.pending_prefill is None
        done = inner(seq, chunk, wait)
        if fresh and seq.pending_prefill is not None:
            beside.append(seq.seq_id)
        return done
    gen.prefill, gen.chain.enabled, gen.beside = prefill, True, "inline"
    scheduler = started(engine, mode, **({"decode_batch_max": 3} if mode == "mtp_batch" else {"max_active_requests": 3}))
    lengths = [5 + 3 * i % 12 for i in range(len(PROMPTS))]  # rows end apart: the chain runs on as they leave
    collectors = [Collector() for _ in PROMPTS]
    try:
        for prompt, n, collector in zip(PROMPTS, lengths, collectors):
            scheduler.submit(Job(engine.make_request(prompt, max_tokens=n, temperature=0.0), collector))
        ends = [c.wait() for c in collectors]
    finally:
        scheduler.stop()
        del gen.prefill
        gen.chain.enabled, gen.beside = False, "off"
    assert [e.result.token_ids for e in ends] == [r.token_ids[:n] for r, n in zip(solo, lengths)]
    assert len(beside) >= 3, beside  # rows that arrived at a running chain
    assert engine.runner.blocks.num_used_blocks == 0
    engine.runner.blocks.check_invariants()


def test_mtp_batch_verifies_several_rows_per_cycle(engine):
    scheduler = started(engine, "mtp_batch", batch_wait_ms=200)
    try:
        run_concurrently(engine, scheduler, PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0)
        block = scheduler.telemetry()
    finally:
        scheduler.stop()
    widths = {int(w) for w in block["batch_histogram"]}
    assert max(widths) > 1 and max(widths) <= 8
    assert block["fixed_width"] == 8 and scheduler.settings.policy_label == "fixed_mtp_batch_width_8"
    assert block["rows_joined"] == block["rows_retired"] == len(PROMPTS)


def test_mtp_batch_rows_join_a_running_cohort_at_cycle_boundaries(engine):
    scheduler = started(engine, "mtp_batch", decode_batch_max=4, batch_wait_ms=0)
    try:
        first = Collector()
        scheduler.submit(Job(engine.make_request(PROMPTS[0], max_tokens=200, temperature=0.0), first))
        first.events.get(timeout=30)  # the first row is decoding
        run_concurrently(engine, scheduler, PROMPTS[1:4], max_tokens=8, temperature=0.0)
        assert isinstance(first.wait(), Done)
        block = scheduler.telemetry()
    finally:
        scheduler.stop()
    assert block["rows_joined_mid_cohort"] >= 1
    assert max(int(w) for w in block["batch_histogram"]) > 1


SAMPLED = dict(temperature=0.8, top_p=0.95, max_tokens=24)


def one_client(engine, mode: str, prompts, **knobs) -> tuple[list[Done], list[tuple[str, int]]]:
    """Each prompt submitted when the last one finished (one client), seeded; returns the ends
    and the generator's events (chain starts and commits, by row) in order."""
    events: list[tuple[str, int]] = []
    observe = lambda event, seq: events.append((event, seq.num_generated))  # noqa: E731
    engine.generator.observers.append(observe)
    scheduler = started(engine, mode, **knobs)
    try:
        ends = [run_concurrently(engine, scheduler, [p], seed=i, **SAMPLED)[0] for i, p in enumerate(prompts)]
    finally:
        scheduler.stop()
        engine.generator.observers.remove(observe)
    return ends, events


def test_mtp_batch_one_stream_is_serial_step_for_step(engine, chained):
    """A lone client's seeded sampled requests through mtp_batch take serial's engine path (the
    same chain starts and commits, in order) and decode byte-identical output."""
    one_client(engine, "serial", PROMPTS[:3])  # both runs below then hit the prefix cache alike
    serial, serial_path = one_client(engine, "serial", PROMPTS[:3])
    batch, batch_path = one_client(engine, "mtp_batch", PROMPTS[:3])
    assert [e.result.token_ids for e in batch] == [e.result.token_ids for e in serial]
    assert batch_path == serial_path
    assert any(event == "chain_start" for event, _ in batch_path) == chained
    assert engine.runner.blocks.num_used_blocks == 0


def test_mtp_batch_decodes_while_its_gather_window_is_open(engine):
    """The gather window never holds the engine idle: a lone request under a 60 s window ends
    at once, and a request arriving while the first decodes joins the cohort as a founder."""
    scheduler = started(engine, "mtp_batch", batch_wait_ms=60_000)
    try:
        first = Collector()
        scheduler.submit(Job(engine.make_request(PROMPTS[0], max_tokens=4, temperature=0.0), first))
        assert isinstance(first.wait(timeout=20), Done)
        long = Collector()
        scheduler.submit(Job(engine.make_request(PROMPTS[1], max_tokens=200, temperature=0.0), long))
        long.events.get(timeout=20)  # decoding
        run_concurrently(engine, scheduler, PROMPTS[2:4], max_tokens=8, temperature=0.0)
        assert isinstance(long.wait(timeout=20), Done)
        block = scheduler.telemetry()
    finally:
        scheduler.stop()
    assert block["cohorts_sealed"] == 2 and block["rows_joined_mid_cohort"] == 0
    assert max(int(w) for w in block["batch_histogram"]) > 1


def test_ar_batch_turns_mtp_off_when_wider_than_one_and_says_why(engine, chained):
    """Chained: the lone MTP row and the AR rows step as two groups, so each group's step
    commits the other's cycle in flight; every committed token still reaches the stream."""
    scheduler = started(engine, "ar_batch")
    try:
        ends = run_concurrently(engine, scheduler, PROMPTS, max_tokens=8, temperature=0.0, mode="mtp")
        block = scheduler.telemetry()
        alone = run_concurrently(engine, scheduler, PROMPTS[:1], max_tokens=8, temperature=0.0, mode="mtp")[0]
    finally:
        scheduler.stop()
    disabled = [e.result.stats for e in ends if e.result.stats["mtp_disabled_reason"]]
    assert disabled and all(s["generation_mode"] == "ar" and "wider than 1" in s["mtp_disabled_reason"]
                            for s in disabled)
    assert block["mtp_disabled_rows"] == len(disabled)
    assert max(int(w) for w in block["batch_histogram"]) > 1
    assert alone.result.stats["generation_mode"] == "mtp" and alone.result.stats["mtp_disabled_reason"] is None


def test_ar_batch_prefills_long_prompts_in_chunks(engine):
    scheduler = Scheduler(engine, SchedulerSettings.resolve("ar_batch"))
    scheduler.policy.prefill_chunk = 8
    scheduler.start()
    try:
        long_prompt = "a long prompt that takes several chunks " * 3
        [end] = run_concurrently(engine, scheduler, [long_prompt], max_tokens=4, temperature=0.0)
        chunks = scheduler.telemetry()["prefill_chunks"]
    finally:
        scheduler.stop()
    prompt_tokens = end.result.prompt_tokens - end.result.stats["cached_prompt_tokens"]
    assert chunks == -(-prompt_tokens // 8)
    assert end.result.token_ids == engine.generate(long_prompt, max_tokens=4, temperature=0.0).token_ids


def test_solo_mtp_traces_every_cycle_and_refuses_ar(engine):
    scheduler = started(engine, "solo_mtp")
    try:
        [end] = run_concurrently(engine, scheduler, PROMPTS[:1], max_tokens=MAX_TOKENS, temperature=0.0)
        with pytest.raises(InvalidParameter, match="no AR fallback"):
            scheduler.submit(Job(engine.make_request(PROMPTS[0], mode="ar")))
        block = scheduler.telemetry()
    finally:
        scheduler.stop()
    trace, stats = end.result.stats["cycle_trace"], end.result.stats
    assert len(trace) == stats["verify_calls"] == block["cycles"]
    assert sum(c["drafted"] for c in trace) == stats["drafted_tokens"]
    assert sum(c["accepted"] for c in trace) == stats["accepted_tokens"]
    assert 1 + sum(c["committed"] for c in trace) == stats["generated_tokens"]  # +1: the prefill token
    assert sum(c["verify_s"] for c in trace) == pytest.approx(stats["verify_s"])
    assert set(block["phase_s"]) == {"draft_s", "verify_s", "accept_s", "commit_s"}


@pytest.mark.parametrize("mode", SchedulerMode.choices())
def test_cancel_stops_within_one_cycle_and_frees_blocks(engine, mode):
    """The client cancels while the third delta is delivered; the job ends at that cycle's
    boundary: no further output, finish_reason "cancelled", every KV block back."""
    scheduler = started(engine, mode)

    class CancelOnThird(Collector):
        seen = 0

        def __call__(self, event):
            super().__call__(event)
            if isinstance(event, Delta):
                self.seen += 1
                if self.seen == 3:
                    job.cancel()

    collector = CancelOnThird()
    job = Job(engine.make_request(PROMPTS[1], max_tokens=500, temperature=0.0), collector)
    try:
        scheduler.submit(job)
        end = collector.wait()
    finally:
        scheduler.stop()
    assert isinstance(end, Done) and end.result.finish_reason == "cancelled"
    assert len(collector.deltas) == 3
    assert engine.runner.blocks.num_used_blocks == 0
    assert scheduler.policy.jobs.totals["cancelled"] == 1


def test_a_job_cancelled_while_queued_never_starts(engine):
    scheduler = Scheduler(engine, SchedulerSettings.resolve("hyper"))  # not started: jobs wait
    job = Job(engine.make_request(PROMPTS[0], max_tokens=4))
    collector = Collector()
    job.emit = collector
    scheduler.submit(job)
    job.cancel()
    scheduler.start()
    try:
        follow_up = run_concurrently(engine, scheduler, PROMPTS[:1], max_tokens=4, temperature=0.0)
        gate = scheduler.telemetry()
    finally:
        scheduler.stop()
    unstarted = collector.wait()
    assert isinstance(unstarted, Done) and unstarted.result.finish_reason == "cancelled"
    assert not collector.deltas and follow_up[0].result.finish_reason in ("stop", "length")
    assert gate["totals"]["abandoned_before_start"] == 1 and gate["totals"]["completed"] == 1


@pytest.mark.parametrize("mode", ["serial", "hyper"])
def test_a_full_queue_sheds_jobs_whose_clients_left(engine, mode):
    """Jobs cancelled while queued do not hold queue slots: a new request is admitted (and the
    dead ones end as cancelled) instead of a 503."""
    scheduler = Scheduler(engine, SchedulerSettings.resolve(mode, max_queued_requests=2))  # not started
    dead = [Job(engine.make_request(p, max_tokens=4), Collector()) for p in PROMPTS[:2]]
    for job in dead:
        scheduler.submit(job)
    with pytest.raises(QueueFull):
        scheduler.submit(Job(engine.make_request(PROMPTS[2], max_tokens=4)))
    for job in dead:
        job.cancel()
    fresh = Job(engine.make_request(PROMPTS[2], max_tokens=4, temperature=0.0), Collector())
    scheduler.submit(fresh)  # the scheduler has not started: only shedding makes room
    for job in dead:  # ended at once, by the submit that shed them
        end = job.emit.events.get_nowait()
        assert isinstance(end, Done) and end.result.finish_reason == "cancelled"
    scheduler.start()
    try:
        end = fresh.emit.wait()
        totals = scheduler.telemetry()["totals"]
    finally:
        scheduler.stop()
    assert isinstance(end, Done) and end.result.finish_reason in ("stop", "length")
    assert totals["abandoned_before_start"] == 2 and totals["completed"] == 1


def test_batch_admission_waits_for_kv_room_instead_of_failing():
    """A KV cache that holds about two requests at once: eight still all complete."""
    engine = tiny_text_engine(head="repeat", kv_cache_tokens=96)
    refs = [engine.generate(p, max_tokens=12, temperature=0.0) for p in PROMPTS]
    for mode in ("mtp_batch", "ar_batch"):
        scheduler = started(engine, mode)
        try:
            ends = run_concurrently(engine, scheduler, PROMPTS, max_tokens=12, temperature=0.0)
            widest = max(int(w) for w in scheduler.telemetry()["batch_histogram"])
        finally:
            scheduler.stop()
        assert [e.result.token_ids for e in ends] == [r.token_ids for r in refs]
        assert 1 < widest < len(PROMPTS)  # batched, but never more rows than the KV cache holds
        assert engine.runner.blocks.num_used_blocks == 0


def test_an_engine_error_fails_only_its_job(engine):
    scheduler = started(engine, "serial")
    try:
        bad = Collector()
        request = engine.make_request(PROMPTS[0], max_tokens=4)
        request.prompt_ids = [10_000]  # out of vocabulary: the model step raises
        scheduler.submit(Job(request, bad))
        assert isinstance(bad.wait(), Failed)
        [ok] = run_concurrently(engine, scheduler, PROMPTS[:1], max_tokens=4, temperature=0.0)
    finally:
        scheduler.stop()
    assert ok.result.finish_reason in ("stop", "length")
    assert engine.runner.blocks.num_used_blocks == 0


def test_an_untuned_request_decoded_ar_by_the_estimate_says_why(engine, monkeypatch):
    """A sampled request naming no mode, where the head's recorded acceptance and the cycle
    costs expect MTP to lose (Engine.mtp_estimate), decodes AR and its stats say why; one
    asking for mtp gets MTP."""
    from dataclasses import replace

    from mtplx.engine.adaptive_depth import DepthCosts

    monkeypatch.setattr(engine, "estimated", frozenset({"sampled"}))
    monkeypatch.setattr(engine, "auto_depth", replace(
        engine.auto_depth, sampled_costs=DepthCosts((1.5, 2.2, 2.8), 0.6), measured=((1.0, (0.3, 0.3, 0.3)),)))
    scheduler = started(engine, "serial")
    try:
        plain, asked = (run_concurrently(engine, scheduler, PROMPTS[:1], max_tokens=8, temperature=1.0, seed=4, **kw)[0]
                        for kw in ({}, {"mode": "mtp"}))
    finally:
        scheduler.stop()
    assert plain.result.stats["generation_mode"] == "ar" and "0.87x AR" in plain.result.stats["mtp_disabled_reason"]
    assert asked.result.stats["generation_mode"] == "mtp" and asked.result.stats["mtp_disabled_reason"] is None
