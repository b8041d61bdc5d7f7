"""depth="auto": each row picks its draft depth cycle by cycle from its own acceptance and the
measured cycle costs (engine/adaptive_depth.py). Decoding stays what fixed depths decode:
greedy equals AR, a seed gives the same tokens chained or not (test_mtp_chained.py), sampled
rows keep the AR distribution (test_mtp_sampling_exact.py)."""

import pytest

from mtplx.engine.adaptive_depth import (
    GREEDY_PRIOR, HYSTERESIS, SAMPLED_PRIOR, AutoDepth, DepthCosts, DepthPlan, batch_depth, head_priors)
from mtplx.engine.llm_engine import MIN_EXPECTED_SPEEDUP, cost_machine
from mtplx.errors import InvalidParameter
from tests.tiny_models import repeat_head, tiny_engine

GPU = DepthCosts.default("cuda")


def plan(prior=(0.5, 0.43, 0.5), costs=GPU, max_depth=3) -> DepthPlan:
    return DepthPlan(max_depth, costs, prior)


def decode_alone(p: DepthPlan, accepted, cycles: int = 20) -> list[int]:
    """A lone row's depths over ``cycles`` cycles, as the generator picks them (each from the
    outcomes two cycles back and the last depth); ``accepted(depth)``: each cycle's accepted count."""
    depths, depth = [], p.first_depth
    for k in range(cycles):
        depth = batch_depth([p], [p.expected_at(in_flight=False)], incumbent=depth if k else None)
        p.observe(depth, accepted(depth))
        depths.append(depth)
    return depths


def test_a_row_whose_drafts_are_all_accepted_drafts_to_the_maximum():
    p = plan()
    assert p.first_depth == 1  # the prior: depth 1 pays best on the H200's costs
    assert decode_alone(p, lambda d: d)[-1] == 3


def test_a_row_whose_drafts_are_rejected_falls_back_to_depth_one():
    p = plan(prior=(0.9, 0.9, 0.9))
    assert p.first_depth == 3
    assert decode_alone(p, lambda d: 0)[-1] == 1


def test_a_cycles_depth_depends_only_on_outcomes_two_cycles_back():
    """So the chained path (which launches a cycle before reading the one in flight) and the
    unchained one choose the same depths."""
    p = plan(prior=(0.9, 0.9, 0.9))
    assert p.first_depth == 3
    p.observe(3, 0)  # cycle 0 rejected everything: cycle 1 does not know yet, chained or not
    assert p.expected_at(in_flight=False) == p.initial  # unchained: cycle 0 read, cycle 1 next
    p.observe(3, 0)
    assert p.expected_at(in_flight=True) == p.history[-1] != p.initial  # chained: cycle 1 in flight, 2 next
    assert p.expected_at(in_flight=False) == p.history[0]  # unchained: cycle 1 read, 2 next


def test_unobserved_depths_follow_the_first_positions_rate():
    p = plan()
    for _ in range(30):
        p.observe(1, 1)  # depth-1 cycles, always accepted
    assert p.alpha[1] > 0.43 and p.alpha[2] > 0.5


def test_a_batch_drafts_at_the_depth_that_pays_for_all_its_rows():
    """A batched cycle costs its deepest row's depth, so the batch's auto rows share one depth:
    the most expected tokens of them all per unit of cost. One row whose drafts all pass would
    alone draft at 3; beside seven that accept nothing the batch drafts at 1, and where a
    fixed-depth row makes every cycle a depth-3 one, the auto rows draft at 3 for free."""
    keen, *dull = [plan() for _ in range(8)]
    for _ in range(30):
        keen.observe(3, 3)
        for p in dull:
            p.observe(1, 0)

    def depth(plans, incumbent, floor=0):
        return batch_depth(plans, [p.expected_at(in_flight=False) for p in plans], incumbent, floor)

    assert depth([keen], incumbent=3) == 3
    assert depth(dull, incumbent=1) == 1
    assert depth([keen] + dull, incumbent=None) == 1
    assert depth([keen] + dull[:3], incumbent=None) == 3  # (4 + 3) / 1.56 > (2 + 3) / 1.21
    assert depth([keen] + dull, incumbent=1, floor=3) == 3


def test_a_batch_of_mixed_rows_scores_each_depth_as_the_sum_over_its_rows():
    """``batch_depth`` sums the rows of one cost table and deepest depth before pricing them:
    it picks what the score of its definition picks, each row's expected tokens at the depth
    over that row's own cost at it, across rows of different tables, deepest depths, widths,
    floors and incumbents."""
    import random

    def by_definition(plans, expected, incumbent, floor, width):
        score = {d: sum(e[min(d, p.max_depth) - 1] / p.costs.of(max(d, floor), width) for p, e in zip(plans, expected))
                 for d in range(1, max(p.max_depth for p in plans) + 1)}
        best = max(score, key=score.get)
        return incumbent if incumbent in score and score[best] <= score[incumbent] * (1 + HYSTERESIS) else best

    rng = random.Random(7)
    tables = [DepthCosts.default(m) for m in ("cuda", "cpu", "cpu-avx2")] + [DepthCosts.default_sampled("cuda")]
    for _ in range(3000):
        plans = []
        for _ in range(rng.randint(1, 8)):
            top = rng.choice((1, 2, 3, 3, 4))
            p = DepthPlan(top, rng.choice(tables), tuple(rng.uniform(0.1, 0.9) for _ in range(top)))
            for _ in range(rng.randint(0, 6)):
                p.observe(rng.randint(1, top), rng.randint(0, top))
            plans.append(p)
        expected = [p.expected_at(in_flight=rng.random() < 0.5) for p in plans]
        incumbent, floor, width = rng.choice((None, 1, 2, 3)), rng.choice((0, 0, 2)), rng.randint(1, 9)
        assert batch_depth(plans, expected, incumbent, floor, width) == by_definition(plans, expected, incumbent,
                                                                                      floor, width)


def test_hysteresis_keeps_the_depth_on_a_small_gain():
    costs = DepthCosts((1.0, 1.0), 0.1)

    def depth(alpha2: float, incumbent: int | None) -> int:
        # depth 2 yields 1.5 + 0.5 * alpha2 tokens against depth 1's 1.5, at the same cost
        p = DepthPlan(2, costs, (0.5, alpha2))
        return batch_depth([p], [p.initial], incumbent)

    assert depth(0.0, incumbent=1) == 1  # depth 2 promises nothing more
    assert depth(3 * HYSTERESIS * 0.8, incumbent=1) == 1  # a gain of 0.8 times the threshold
    assert depth(3 * HYSTERESIS * 1.2, incumbent=1) == 2
    assert depth(3 * HYSTERESIS * 0.8, incumbent=None) == 2  # a row's first choice has no incumbent


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
    machine = cost_machine(engine.device)
    assert machine in ("cpu", "cpu-avx2")
    assert engine.auto_depth.costs == DepthCosts.default(machine)
    assert engine.auto_depth.sampled_costs == DepthCosts.default_sampled(machine)
    assert engine.auto_depth.plan(0.7).costs == DepthCosts.default_sampled(machine)
    assert engine.auto_depth.plan(0.0).costs == DepthCosts.default(machine)
    tuned = DepthCosts((1.1, 1.3, 1.5), 0.2)
    assert type(engine)(engine.loaded, depth_costs=tuned).auto_depth.plan(0.7).costs.cycles == tuned.cycles
    assert isinstance(engine.auto_depth, AutoDepth)


def _record(greedy=(0.6, 0.36, 0.216), sampled=None) -> dict:
    """An ``mtplx_forge.json`` ``measured`` section: acceptance by position, greedy and by temperature."""
    measured = {"held_out": {"depth": 3, "acceptance_by_depth": list(greedy)}} if greedy else {}
    if sampled:
        measured["held_out_sampled"] = {str(t): {"temperature": t, "acceptance_by_depth": list(a)} for t, a in sampled.items()}
    return {"measured": measured}


def test_a_heads_recorded_acceptance_becomes_conditional_rates_by_temperature():
    priors = head_priors(_record(sampled={1.0: (0.5, 0.2, 0.05), 0.7: (0.55, 0.33, 0.198)}))
    assert [t for t, _ in priors] == [0.0, 0.7, 1.0]
    assert priors[0][1] == pytest.approx((0.6, 0.6, 0.6))
    assert priors[1][1] == pytest.approx((0.55, 0.6, 0.6))
    assert priors[2][1] == pytest.approx((0.5, 0.4, 0.25))
    assert head_priors(None) == head_priors({}) == head_priors({"measured": {"held_out": {"x": 1}}}) == ()
    assert head_priors(_record(greedy=(0.0, 0.0, 0.0))) == ()  # a collapsed run says nothing of the rates


def test_the_prior_follows_the_heads_measurement_along_temperature():
    auto = AutoDepth(3, DepthCosts.default("cuda"), measured=head_priors(
        _record(sampled={0.7: (0.56, 0.3136, 0.175616), 1.0: (0.5, 0.25, 0.125)})))
    assert auto.prior(0.0) == pytest.approx((0.6, 0.6, 0.6))
    assert auto.prior(0.7) == pytest.approx((0.56, 0.56, 0.56))
    assert auto.prior(0.85) == pytest.approx((0.53, 0.53, 0.53))  # halfway between 0.7 and 1.0
    assert auto.prior(0.35) == pytest.approx((0.58, 0.58, 0.58))  # halfway between greedy and 0.7
    assert auto.prior(1.3) == pytest.approx((0.44, 0.44, 0.44))  # along the last two runs' slope
    assert auto.prior(9.0) == pytest.approx((0.02, 0.02, 0.02))  # never below 0.02
    assert auto.plan(0.0).costs == auto.plan(0.85).costs == auto.costs  # no sampled table: the greedy one
    assert auto.plan(0.0).prior == GREEDY_PRIOR and auto.plan(0.85).prior == SAMPLED_PRIOR  # rows start from the constants
    assert auto.measured_for(0.0) and auto.measured_for(1.5)
    greedy_only = AutoDepth(3, DepthCosts.default("cuda"), measured=head_priors(_record()))
    assert greedy_only.prior(0.0) == pytest.approx((0.6, 0.6, 0.6))
    assert greedy_only.prior(0.7) == SAMPLED_PRIOR and not greedy_only.measured_for(0.7)  # no sampled run
    bare = AutoDepth(3, DepthCosts.default("cuda"))
    assert bare.prior(0.0) == GREEDY_PRIOR and bare.prior(1.0) == SAMPLED_PRIOR and not bare.measured_for(0.0)


def test_the_expected_speedup_is_tokens_over_cycle_cost_under_the_prior():
    costs = DepthCosts((1.5, 2.0, 2.4), 0.4)
    auto = AutoDepth(3, costs, measured=((0.0, (0.8, 0.8, 0.8)),))
    tokens = (1.8, 1.8 + 0.64, 1.8 + 0.64 + 0.512)
    assert auto.expected_speedup(0.0, 1) == (1, pytest.approx(tokens[0] / 1.5))
    assert auto.expected_speedup(0.0) == (3, pytest.approx(tokens[2] / 2.4))  # the best of depths 1-3
    assert auto.expected_speedup(0.0, 4)[1] == pytest.approx((tokens[2] + 0.8 ** 4) / 2.8)  # past the table


@pytest.mark.parametrize("estimated", [True, False])
def test_an_untuned_request_naming_no_mode_decodes_ar_where_mtp_is_expected_to_lose(estimated):
    """With the head's record saying drafts accept 0.6 greedy and 0.3 at temperature 1, and
    cycles costing 1.5 AR steps at depth 1, a greedy request that names no mode decodes MTP
    (1.6 / 1.5 tokens a step) and one at temperature 1 AR (1.3 / 1.5), also at depth="auto";
    one that names mtp decodes MTP, and a tuned engine (``estimated`` empty) keeps its default."""
    engine, _ = tiny_engine("qwen3")
    engine.loaded.head_info = {**engine.loaded.head_info, "provenance": _record(
        greedy=(0.6, 0.36, 0.216), sampled={1.0: (0.3, 0.09, 0.027)})}
    costs = DepthCosts((1.5, 2.2, 2.8), 0.6)
    engine = type(engine)(engine.loaded, depth_costs=costs, sampled_depth_costs=costs,
                          estimated=("greedy", "sampled") if estimated else ())
    assert engine.make_request([3, 4, 5]).mode == "mtp"
    hot = engine.make_request([3, 4, 5], temperature=1.0)
    assert hot.mode == ("ar" if estimated else "mtp") and hot.depth == (0 if estimated else 1)
    assert engine.make_request([3, 4, 5], temperature=1.0, depth="auto").mode == ("ar" if estimated else "mtp")
    assert engine.make_request([3, 4, 5], temperature=1.0, mode="mtp").mode == "mtp"
    result = engine.generate([3, 4, 5], temperature=1.0, seed=3, max_tokens=6)
    assert result.stats["mode"] == hot.mode and len(result.token_ids) == 6
    if estimated:  # the reason names the estimate and how to get MTP anyway
        assert "0.87x AR" in hot.mtp_disabled_reason and "generation_mode mtp" in hot.mtp_disabled_reason
        assert result.stats["mtp_disabled_reason"] == hot.mtp_disabled_reason
    else:
        assert hot.mtp_disabled_reason is None and result.stats["mtp_disabled_reason"] is None
    assert engine.make_request([3, 4, 5]).mtp_disabled_reason is None


def test_an_untuned_request_naming_no_depth_takes_the_estimates_best_depth():
    """Where cycles are cheap (1.1 / 1.2 / 1.3 AR steps) and the head's record says 0.6 at every
    position greedy, depth 3 promises the most tokens a step (2.18 / 1.3): a greedy request that
    names no depth decodes at 3; one naming a depth, or an engine given a depth, keeps it."""
    engine, _ = tiny_engine("qwen3")
    engine.loaded.head_info = {**engine.loaded.head_info, "provenance": _record(greedy=(0.6, 0.36, 0.216))}
    cheap = DepthCosts((1.1, 1.2, 1.3), 0.1)
    estimated = type(engine)(engine.loaded, depth_costs=cheap, estimated=("greedy", "sampled"))
    assert estimated.auto_depth.expected_speedup(0.0)[0] == 3
    assert estimated.make_request([3, 4, 5]).depth == 3
    assert estimated.make_request([3, 4, 5], depth=2).depth == 2
    assert estimated.make_request([3, 4, 5], temperature=0.7).depth == 1  # no sampled record: the default
    assert type(engine)(engine.loaded, depth=1, depth_costs=cheap, estimated=("greedy",)).make_request([3, 4, 5]).depth == 1
    assert type(engine)(engine.loaded, depth_costs=cheap).make_request([3, 4, 5]).depth == 1  # not estimated
    result = estimated.generate([3, 4, 5], max_tokens=12)
    assert result.token_ids == estimated.generate([3, 4, 5], mode="ar", max_tokens=12).token_ids
    assert result.stats["mode"] == "mtp" and result.stats["depth"] == 3


def test_the_cost_table_follows_the_cpu_kernels_width(monkeypatch):
    """cost_machine: CUDA; the CPU kernels' width (512: "cpu", 256: "cpu-avx2"); none built:
    "cpu-torch", where no table was measured, so an untuned engine does not follow the estimate."""
    import torch

    from mtplx.kernels import cpu as cpu_kernels

    assert cost_machine(torch.device("cuda", 0)) == "cuda"
    monkeypatch.setattr(cpu_kernels, "available", lambda: True)
    for width, machine in ((512, "cpu"), (256, "cpu-avx2")):
        monkeypatch.setattr(cpu_kernels, "vector_width", lambda force=0, w=width: w)
        assert cost_machine(torch.device("cpu")) == machine
    assert DepthCosts.default("cpu-avx2").of(1) > DepthCosts.default("cpu").of(1)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert cost_machine(torch.device("cpu")) == "cpu-torch"
    assert DepthCosts.default("cpu-torch") == DepthCosts.default("cpu")
    engine, _ = tiny_engine("qwen3")
    assert type(engine)(engine.loaded, estimated=("greedy", "sampled")).estimated == frozenset()


def test_the_shipped_heads_record_decides_as_documented():
    """docs/performance.md, sessions 34 and 35: with the default head's own record, an AVX2 CPU
    (its session-35 cycle costs) drafts greedy at depth 1 and still expects MTP to pay at T 1.0,
    by 4%; CUDA drafts greedy at depth 3 and samples at depth 1, MTP at every temperature up to
    1.0."""
    import json

    from mtplx.loading.default_model import default_head_dir

    record = json.loads((default_head_dir() / "mtplx_forge.json").read_text())
    measured = head_priors(record)
    assert [t for t, _ in measured] == [0.0, 0.7, 1.0]
    avx2 = AutoDepth(3, DepthCosts.default("cpu-avx2"), DepthCosts.default_sampled("cpu-avx2"), measured=measured)
    assert avx2.expected_speedup(0.0) == (1, pytest.approx(1.086, abs=0.001))
    assert avx2.expected_speedup(1.0) == (1, pytest.approx(1.041, abs=0.001))
    # T 0.7: depth 2 leads depth 1 by less than MIN_EXPECTED_SPEEDUP's 2% (tune measured it slower)
    assert avx2.expected_speedup(0.7)[1] < avx2.expected_speedup(0.7, 1)[1] * MIN_EXPECTED_SPEEDUP
    cuda = AutoDepth(3, DepthCosts.default("cuda"), DepthCosts.default_sampled("cuda"), measured=measured)
    assert cuda.expected_speedup(0.0) == (3, pytest.approx(1.409, abs=0.001))
    assert cuda.expected_speedup(0.0, 1)[1] == pytest.approx(1.337, abs=0.001)
    assert [cuda.expected_speedup(t)[0] for t in (0.7, 1.0)] == [1, 1]
    assert min(cuda.expected_speedup(t)[1] for t in (0.1, 0.4, 0.7, 1.0)) > 1.2


def test_the_estimates_summary_says_what_plain_requests_decode():
    """``Engine.estimate_summary`` (printed by `mtplx serve` before tuning): per regime the mode
    and depth a request naming neither gets, with the expected speed-up; None where the engine
    does not follow the estimate."""
    engine, _ = tiny_engine("qwen3")
    engine.loaded.head_info = {**engine.loaded.head_info, "provenance": _record(
        greedy=(0.6, 0.36, 0.216), sampled={1.0: (0.3, 0.09, 0.027)})}
    costs = DepthCosts((1.5, 2.2, 2.8), 0.6)
    estimated = type(engine)(engine.loaded, depth_costs=costs, sampled_depth_costs=costs, estimated=("greedy", "sampled"))
    summary = estimated.estimate_summary()
    assert summary.startswith("greedy: MTP depth 1 (1.07x AR expected); T 0.7: AR (")
    assert summary.endswith("T 1.0: AR (0.87x AR expected)")
    assert estimated.costs_source == "tuned"  # costs given: not the machine's defaults
    assert type(engine)(engine.loaded, depth_costs=costs).estimate_summary() is None
