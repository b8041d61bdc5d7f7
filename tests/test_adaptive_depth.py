"""depth="auto": each row picks its draft depth cycle by cycle from its own acceptance and the
measured cycle costs (engine/adaptive_depth.py). Decoding stays what fixed depths decode:
greedy equals AR, a seed gives the same tokens chained or not (test_mtp_chained.py), sampled
rows keep the AR distribution (test_mtp_sampling_exact.py)."""

import pytest

from mtplx.engine.adaptive_depth import HYSTERESIS, AutoDepth, DepthCosts, DepthPlan
from mtplx.errors import InvalidParameter
from tests.tiny_models import repeat_head, tiny_engine

GPU = DepthCosts.default("cuda")


def plan(prior=(0.5, 0.43, 0.5), costs=GPU, max_depth=3) -> DepthPlan:
    return DepthPlan(max_depth, costs, prior)


def test_a_row_whose_drafts_are_all_accepted_drafts_to_the_maximum():
    p = plan()
    assert p.next_depth == 1  # the prior: depth 1 pays best on the H200's costs
    for _ in range(20):
        p.observe(p.take(), p.current)
    assert p.next_depth == 3


def test_a_row_whose_drafts_are_rejected_falls_back_to_depth_one():
    p = plan(prior=(0.9, 0.9, 0.9))
    assert p.next_depth == 3
    for _ in range(20):
        p.observe(p.take(), 0)
    assert p.next_depth == 1


def test_a_cycles_depth_depends_only_on_outcomes_two_cycles_back():
    """So the chained path (which launches a cycle before reading the one in flight) and the
    unchained one choose the same depths."""
    p = plan()
    first, second = p.take(), p.next_depth
    p.observe(first, first)  # cycle 0 committed: decides cycle 2, not cycle 1
    assert p.take() == second
    assert len(p.upcoming) == 1


def test_unobserved_depths_follow_the_first_positions_rate():
    p = plan()
    for _ in range(30):
        p.observe(1, 1)  # depth-1 cycles, always accepted
    assert p.alpha[1] > 0.43 and p.alpha[2] > 0.5


def test_hysteresis_keeps_the_depth_on_a_small_gain():
    costs = DepthCosts((1.0, 1.0), 0.1)
    p = DepthPlan(2, costs, (0.5, 0.0))
    assert p.choose(incumbent=1) == 1  # depth 2 promises nothing more
    # depth 2 yields 1.5 + 0.5 * alpha[1] tokens against depth 1's 1.5, at the same cost
    p.alpha[1] = 3 * HYSTERESIS * 0.8  # a gain of 0.8 times the threshold
    assert p.choose(incumbent=1) == 1
    p.alpha[1] = 3 * HYSTERESIS * 1.2
    assert p.choose(incumbent=1) == 2
    assert p.choose(incumbent=None) == 2  # a row's first choice has no incumbent


def test_costs_from_a_side_by_side_measurement():
    """The REFERENCE.md section 10 figures: AR 1,369 tok/s, depth 1 1.27x at acceptance 0.53."""
    costs = DepthCosts.from_measurement(1369.0, {1: 1369 * 1.27, 2: 1369 * 1.17},
                                        {1: [0.53], 2: [0.53, 0.20]})
    assert costs.of(1) == pytest.approx(1.53 / 1.27)
    assert costs.of(2) == pytest.approx(1.73 / 1.17)
    assert costs.of(3) == pytest.approx(costs.of(2) + costs.per_draft)
    assert DepthCosts.from_measurement(1000.0, {2: 900.0}, {2: [0.5, 0.2]}) is None  # depth 1 missing


def switching_engine():
    """A tiny engine whose head is often right, with costs under which rows switch depths."""
    engine, _ = tiny_engine("qwen3")
    engine.runner.head.load_state_dict(repeat_head(engine.loaded.model).state_dict())
    engine.auto_depth = AutoDepth(3, DepthCosts((1.0, 1.1, 1.15), 0.05))
    return engine


@pytest.mark.parametrize("chain", [False, True])
def test_auto_depth_greedy_equals_ar_and_uses_several_depths(chain):
    engine = switching_engine()
    prompt = [5, 17, 33, 2, 8, 9, 10, 11, 40]
    ar = engine.generate(prompt, mode="ar", max_tokens=60)
    engine.generator.chain.enabled = chain
    auto = engine.generate(prompt, mode="mtp", depth="auto", max_tokens=60)
    assert auto.token_ids == ar.token_ids
    assert auto.stats["adaptive"] and auto.stats["depth"] == 3
    assert sum(n > 0 for n in auto.stats["cycles_by_depth"]) >= 2, auto.stats["cycles_by_depth"]
    assert engine.runner.blocks.num_used_blocks == 0


def test_depth_auto_is_validated_and_bounded_by_max_depth():
    engine, _ = tiny_engine("qwen3")
    req = engine.make_request([1, 2, 3], mode="mtp", depth="auto")
    assert req.adaptive and req.depth == engine.auto_depth.max_depth == 3
    assert not engine.make_request([1, 2, 3], mode="ar", depth="auto").adaptive
    with pytest.raises(InvalidParameter, match="or 'auto'"):
        engine.make_request([1, 2, 3], depth="deep")
    with pytest.raises(InvalidParameter, match="max_depth"):
        type(engine)(engine.loaded, max_depth=0)


def test_untuned_engines_price_sampled_cycles_apart_from_greedy_ones():
    """Without a tuned cost table, greedy rows plan with the device's greedy cycle costs and
    sampled rows with its sampled ones (on the CPU the measured greedy table made sampled rows
    draft deeper than paid); a tuned greedy table without a sampled one serves both, as before."""
    engine, _ = tiny_engine("llama")
    assert engine.auto_depth.costs == DepthCosts.default("cpu")
    assert engine.auto_depth.sampled_costs == DepthCosts.default_sampled("cpu")
    assert engine.auto_depth.plan(greedy=False).costs == DepthCosts.default_sampled("cpu")
    tuned = DepthCosts((1.1, 1.3, 1.5), 0.2)
    assert type(engine)(engine.loaded, depth_costs=tuned).auto_depth.plan(greedy=False).costs == tuned
    assert isinstance(engine.auto_depth, AutoDepth)
