"""depth="auto" on AR steps: where a batch's cycles grow dearer with its width (the CPU), a batch
of auto rows takes AR steps once drafting promises fewer tokens than one a row per step, and
drafts again once it pays (engine/adaptive_depth.py: ``DepthCosts.width_growth``,
``batch_depth``). An MTP row's AR step keeps its hidden state for the head, which catches up
on every pair it missed when the row drafts again: decoding stays AR's, and the head drafts
what it would have drafted without the AR steps."""

import pytest
import torch

from mtplx.engine.adaptive_depth import AR_MARGIN, HYSTERESIS, AutoDepth, DepthCosts, DepthPlan, batch_depth
from tests.test_mtp_chained import PROMPTS, start
from tests.tiny_models import repeat_head, tiny_engine

GROWING = DepthCosts((1.4, 1.7, 2.2), 0.5, width_growth=((4, (1.2, 1.4, 1.5)), (8, (1.3, 1.6, 1.8))))


def test_a_cycles_cost_grows_with_width_between_the_measured_widths():
    assert GROWING.of(1) == 1.4 and GROWING.of(1, width=1) == 1.4
    assert GROWING.of(1, width=2) == pytest.approx(1.4 * (1 + 0.2 / 3))  # a third of the way from 1 to 4
    assert GROWING.of(2, width=4) == pytest.approx(1.7 * 1.4)
    assert GROWING.of(3, width=6) == pytest.approx(2.2 * 1.65)  # halfway from 4 to 8
    assert GROWING.of(2, width=32) == pytest.approx(1.7 * 1.6)  # past the last width: the last growth
    assert GROWING.of(5, width=8) == pytest.approx((2.2 + 2 * 0.5) * 1.8)  # past the table: the deepest growth
    flat = DepthCosts((1.4, 1.7, 2.2), 0.5)
    assert flat.of(2, width=8) == 1.7
    assert flat.grown_as(GROWING).of(2, width=8) == pytest.approx(1.7 * 1.6)  # a tuned table, grown as the defaults
    assert GROWING.grown_as(flat) is GROWING


def rows(n: int, accepted: float, cycles: int = 40, prior=(0.6, 0.6, 0.6)) -> list[DepthPlan]:
    """n plans that may take AR steps, each having committed ``cycles`` depth-1 cycles whose
    draft was accepted at rate ``accepted``, the passes spread evenly."""
    plans = [DepthPlan(3, GROWING, prior, steady_prior=prior, ar_steps=True) for _ in range(n)]
    for p in plans:
        for k in range(cycles):
            p.observe(1, int((k + 1) * accepted) - int(k * accepted))
    return plans


def depth(plans, incumbent, width=None, floor=0):
    return batch_depth(plans, [p.expected_at(in_flight=False) for p in plans], incumbent, floor,
                       width=len(plans) if width is None else width)


def test_a_wide_batch_takes_ar_steps_where_its_cycles_cost_more_than_their_tokens():
    """Depth 1 at acceptance 0.6 yields 1.6 tokens: at one row a cycle costs 1.4 AR steps (1.14
    tokens per step), at eight rows 1.4 x 1.3 = 1.82 (0.88 per step: AR steps pay)."""
    assert depth(rows(1, 0.6), incumbent=1) == 1
    assert depth(rows(8, 0.6), incumbent=1) == 0
    assert depth(rows(8, 0.6), incumbent=0) == 0
    assert depth(rows(8, 0.6)[:2], incumbent=0) == 1  # the batch narrowed: drafting pays again
    assert depth(rows(8, 0.6), incumbent=1, floor=2) == 2  # a fixed-depth row drafts: the cycle is paid for
    no_ar = [DepthPlan(3, GROWING, (0.6,) * 3) for _ in range(8)]  # a machine without AR steps (CUDA)
    assert depth(no_ar, incumbent=1) == 1


def test_the_switch_to_and_from_ar_steps_needs_a_margin():
    """One row at width 1: depth 1 yields 1 + a tokens for 1.4 AR steps, so AR steps pay below
    a = 0.4; they are taken only where they promise AR_MARGIN more, and left only where
    drafting promises AR_MARGIN more."""
    to_ar = 1.4 / (1 + AR_MARGIN) - 1  # the acceptance below which a drafting row switches
    from_ar = 1.4 * (1 + AR_MARGIN) - 1  # the acceptance above which a row on AR steps drafts again
    for rate, drafting, on_ar in [(to_ar - 0.03, 0, 0), (0.4, 1, 0), (from_ar + 0.03, 1, 1)]:
        plans = rows(1, rate, cycles=400, prior=(rate,) * 3)
        assert depth(plans, incumbent=1) == drafting, rate
        assert depth(plans, incumbent=0) == on_ar, rate
    assert HYSTERESIS > AR_MARGIN  # switching between drafting depths ends a chain; AR steps never chain


def test_ar_steps_follow_a_rows_whole_record_not_a_short_run_of_rejections():
    """The running estimate weighs about the last 6-7 cycles; AR steps observe nothing, so a row that
    left drafting on a short run of rejections would never come back. The steady estimate
    (every committed cycle) keeps it drafting."""
    p = rows(1, 0.7, cycles=60)[0]
    for _ in range(8):
        p.observe(1, 0)
    e = p.expected_at(in_flight=False)
    assert e[0] / GROWING.of(1) < 1 / (1 + AR_MARGIN)  # the running estimate alone would step AR
    assert p.steady_tokens()[0] == pytest.approx(1 + (42 + 8 * 0.6) / (68 + 8))
    assert depth([p], incumbent=1) == 1


def test_a_new_row_starts_from_the_heads_record():
    """A row with no cycles of its own judges AR steps on the head's recorded acceptance at its
    temperature (``AutoDepth.prior``), with the width-1 cycle cost."""
    measured = ((0.0, (0.6, 0.6, 0.6)), (1.0, (0.3, 0.3, 0.3)))
    auto = AutoDepth(3, GROWING, measured=measured, ar_steps=True)
    assert auto.plan(0.0).first_depth == 1  # 1.6 tokens for 1.4 steps
    assert auto.plan(1.0).first_depth == 0  # 1.3 tokens for 1.4 steps
    assert AutoDepth(3, GROWING, measured=measured).plan(1.0).first_depth == 1  # no AR steps (CUDA)


def test_a_cpu_engine_lets_auto_rows_take_ar_steps_and_grows_tuned_tables_as_its_defaults():
    engine, _ = tiny_engine("llama")
    assert engine.auto_depth.ar_steps
    machine = engine.cost_machine
    tuned = DepthCosts((1.1, 1.3, 1.5), 0.2)
    auto = type(engine)(engine.loaded, depth_costs=tuned, sampled_depth_costs=tuned).auto_depth
    assert auto.costs.cycles == tuned.cycles
    assert auto.costs.width_growth == DepthCosts.default(machine).width_growth
    assert auto.sampled_costs.width_growth == DepthCosts.default_sampled(machine).width_growth


def _forced(engine, ar_between: tuple[int, int]):
    """The generator's depths forced: AR steps while a row's generated count is in the range,
    depth 1 otherwise; each drafting cycle's ((prompt, position), drafts) recorded."""
    gen = engine.generator
    cycles = []
    commit = gen._commit

    def next_depths(seqs):
        return [0 if ar_between[0] <= len(s.tokens) - len(s.prompt_ids) < ar_between[1] else 1 for s in seqs]

    def record(seqs, outcome, hidden, continued, result, drafted=True):
        if drafted:
            cycles.extend(((tuple(s.prompt_ids), len(s.tokens)), tuple(outcome.row(r)[0])) for r, s in enumerate(seqs))
        return commit(seqs, outcome, hidden, continued, result, drafted)

    gen.next_depths, gen._commit = next_depths, record
    return cycles


@pytest.mark.parametrize("rows_", [1, 3])
def test_ar_steps_of_mtp_rows_decode_as_ar_and_the_head_catches_up(rows_):
    """Greedy: the tokens equal AR's; each draft after the AR steps is the draft a row that
    drafted at every position gets (the head's entries for the missed pairs written by its
    catch-up); the blocks all return."""
    engine, _ = tiny_engine("qwen3", kv_dtype=torch.float32)
    prompts = PROMPTS[:rows_]
    ar = [engine.generate(p, mode="ar", max_tokens=40).token_ids for p in prompts]
    reference = _forced(engine, (0, 0))  # depth 1 throughout
    with torch.inference_mode():
        seqs = [start(engine, p, mode="mtp", depth=1, max_tokens=40) for p in prompts]
        while not all(s.finished for s in seqs):
            engine.step([s for s in seqs if not s.finished])
    drafts_at = dict(reference)
    for s in seqs:
        engine.generator.release(s)
    engine, _ = tiny_engine("qwen3", kv_dtype=torch.float32)
    forced = _forced(engine, (5, 20))
    with torch.inference_mode():
        seqs = [start(engine, p, mode="mtp", depth=1, max_tokens=40) for p in prompts]
        while not all(s.finished for s in seqs):
            engine.step([s for s in seqs if not s.finished])
    assert [s.generated for s in seqs] == ar
    assert all(s.stats.ar_steps >= 10 for s in seqs)
    after = [(at, d) for at, d in forced if at[1] - len(at[0]) >= 20 and at in drafts_at]
    assert len(after) >= 5
    assert all(drafts_at[at] == d for at, d in after)
    for s in seqs:
        engine.generator.release(s)
    assert engine.runner.blocks.num_used_blocks == 0
    engine.runner.blocks.check_invariants()


def test_a_wide_auto_batch_on_ar_steps_drafts_again_as_it_narrows():
    """Four auto rows whose head is often right, on a machine whose cycles cost 1.5x more per
    token at four rows: AR steps while they are four, drafts once one row is left."""
    engine, _ = tiny_engine("qwen3")
    engine.runner.head.load_state_dict(repeat_head(engine.loaded.model).state_dict())
    wide = DepthCosts((1.2, 1.4, 1.6), 0.2, width_growth=((2, (3.0, 3.0, 3.0)),))
    engine.auto_depth = AutoDepth(3, wide, ar_steps=True)
    ar = [engine.generate(p, mode="ar", max_tokens=12 + 15 * i).token_ids for i, p in enumerate(PROMPTS + [[7, 8]])]
    with torch.inference_mode():
        seqs = [start(engine, p, mode="mtp", depth="auto", max_tokens=12 + 15 * i)
                for i, p in enumerate(PROMPTS + [[7, 8]])]
        while not all(s.finished for s in seqs):
            engine.step([s for s in seqs if not s.finished])
    assert [s.generated for s in seqs] == ar
    assert seqs[0].stats.ar_steps > 0 and not seqs[0].stats.verify_calls  # ended while the batch was wide
    assert seqs[-1].stats.ar_steps > 0 and seqs[-1].stats.verify_calls > 0  # drafted once alone
    for s in seqs:
        engine.generator.release(s)
    assert engine.runner.blocks.num_used_blocks == 0
