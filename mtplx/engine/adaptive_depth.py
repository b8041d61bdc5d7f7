"""Adaptive draft depth (``depth="auto"``): the depth of each cycle, chosen cycle by cycle.

A row keeps a running estimate of its conditional acceptance by position, alpha_j = P(draft j
accepted | drafts 1..j-1 accepted), updated from every cycle it commits. The expected tokens of
a cycle of depth d are E(d) = 1 + sum_{i<=d} prod_{j<=i} alpha_j, and a cycle takes the depth in
1..max_depth with the most tokens per unit of cycle cost, E(d) / cost(d), where cost(d) is the
measured time of a depth-d cycle in AR steps (``DepthCosts``: ``mtplx tune`` measures it per
machine and regime; the defaults are this project's measurements). So a row deepens where its
drafts keep being accepted (code, lists, repeated text) and stays shallow where they do not.

A batch's auto rows draft at one depth (``batch_depth``): the one with the most expected tokens
of all of them per unit of cost. A batched cycle costs what its deepest row costs (the verify
is padded to it, the head steps run for every row), so a row drafting shallower than the batch
only gives up tokens; and one depth for the batch changes less often than one of its rows',
where each change ends a chain of cycles on the device (session 18: per-row depths under
mtp_batch decoded 0.83-1.02x AR at 4 and 8 streams against the best fixed depth's 1.10-1.32x).

Where a batch's cycles grow dearer with its width, faster than its AR steps do (the CPU, whose
verify rows are bound by arithmetic: ``DepthCosts.width_growth``), drafting stops paying as the
batch widens, and the auto rows take AR steps (depth 0) until it pays again: as the batch
narrows, or under their own record (``batch_depth``, ``DepthPlan.steady_tokens``). The head
skips those steps and catches up on their pairs when the rows draft again (generator.py).

Positions deeper than the row drafts are not observed; their estimate follows the row's
observed first-position rate in proportion to the prior (content that accepts more at depth 1
accepts more deeper too), so a shallow row can still find that deeper drafts would pay.

Exactness and seeds: a cycle's depth is fixed before its drafts are drawn, from committed
outcomes alone, so every emitted token keeps the target's distribution (speculative sampling is
exact for any depth chosen in advance). A row's estimate enters its cycle n's depth as of its
cycle n - 2 (``DepthPlan.expected_at``): a chained cycle launches before the host has read the
one in flight, and the unchained path uses the same lag. The rows weighed are the cycle's own
and those of each row's last cycle that are gone since (ended or released: a chained cycle
launched before the host saw them go still carries them, so the unchained path counts them
once too), so a seed gives the same tokens chained or not, and a row decoded alone decodes as
it did before batches shared a depth. Which rows share a batch changes the depth, so a seeded
row's tokens (not their distribution) depend on the rows decoded beside it. A switch needs a
clear gain (``HYSTERESIS``): every depth change ends a chain.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

# A depth must promise 10% more tokens per unit of cost than the current one. H200, 12 held-out
# chat prompts x 256 tokens, one run (benchmarks/results/gpu_h200_s13_auto_hysteresis.json), auto
# at 0.03 / 0.10 / 0.25 against the best fixed depth: greedy 1.358x / 1.367x / 1.328x AR (depth
# 3: 1.353x), T 0.7 mirror 1.229x / 1.259x / 1.274x (depth 1: 1.263x), T 1.0 mirror 1.192x at
# each (depth 1: 1.191x). At 0.03 rows switched depth often, and each switch ends a chain.
HYSTERESIS = 0.10
# Where a machine's cycles grow dearer with the batch's width (the CPU: ``DepthCosts.width_growth``),
# a batch of auto rows takes AR steps (depth 0) once drafting promises fewer tokens per unit of
# cost than one a row per AR step, by AR_MARGIN, and drafts again once it promises AR_MARGIN more.
# That question is judged on each row's steady estimate (``DepthPlan.steady_tokens``): every
# cycle it committed, with EVIDENCE_PRIOR cycles' worth of the head's recorded acceptance, so a
# short run of rejections does not leave a row on AR steps, where it observes nothing more.
AR_MARGIN = 0.05
EVIDENCE_PRIOR = 8.0
RATE = 0.15  # weight of the newest cycle in the running acceptance (about the last 6-7 cycles)
DEFAULT_MAX_DEPTH = 3

# Conditional acceptance by position before a row has committed anything. Greedy: the session-15
# SmolLM2 head's on forge's 24 held-out prompts at depth 3 (docs/forge.md), 0.575 / 0.332 / 0.193
# by position, i.e. 0.58 / 0.58 / 0.58 conditional; kept for the session-16 head (0.585 / 0.334 /
# 0.206, i.e. 0.59 / 0.57 / 0.62), with which auto decoded greedy 1.63x AR on the H200 against depth
# 3's 1.62x (benchmarks/results/gpu_h200_s16_sampled_newhead.json), and for the session-17 head
# (0.605 / 0.350 / 0.220: 0.61 / 0.58 / 0.63), 1.64x against 1.61x (gpu_h200_s17_sampled_newhead.json). Sampled: the session-10 head's
# (about 0.44 at depth 1, temperature 0.7), kept: with it and the sampled cycle costs below, auto
# on the H200 with the session-15 head decoded T 0.7 mirror 1.338x AR against the best fixed
# depth's 1.343x and T 1.0 1.195x against 1.203x; with this head's own rates (0.52 / 0.52 / 0.51)
# and the measured sampled costs (1.22 / 1.50 / 1.63) 1.27x and 1.17x
# (benchmarks/results/gpu_h200_s15_sampled_{newhead,newcosts}.json). Session 18, four seeds, the
# session-17 head: with the measured prior (0.535 / 0.633 / 0.601) and measured costs auto decoded
# T 0.7 mirror 1.307x and T 1.0 1.202x against this prior's 1.314x and 1.238x
# (benchmarks/results/gpu_h200_s18_auto_depth_seeds.json): kept.
GREEDY_PRIOR = (0.58, 0.58, 0.58)
SAMPLED_PRIOR = (0.42, 0.40, 0.45)

# How much dearer a cycle of depth 1 / 2 / 3 is, in AR steps of as many rows, at 2, 4 and 8 rows
# than at one, through mtp_batch against ar_batch on an AVX2 CPU (Zen 3, two threads, the default
# model and head, the tune prompts, 96 tokens past EOS, the configurations side by side batch by
# batch, two rounds; `benchmarks/width_costs.py`, results/cpu_s42_width_costs_2threads.json).
# Measured at one row there: greedy 1.50 / 1.89 / 2.39 AR steps, T 0.7 1.49 / 1.98 / 2.49, T 1.0
# 1.52 / 1.93 / 2.45; at eight rows greedy 1.92 / 2.91 / 3.66. A verify row is bound by arithmetic
# there, where an AR row gains from its batch. Sampled: the mean of T 0.7 (top-p 0.95) and T 1.0.
# The AVX-512 CPU's were not measured (no such machine since session 31): its tables do not grow.
AVX2_GREEDY_GROWTH = ((2, (1.11, 1.17, 1.15)), (4, (1.28, 1.55, 1.67)), (8, (1.28, 1.54, 1.53)))
AVX2_SAMPLED_GROWTH = ((2, (1.10, 1.19, 1.17)), (4, (1.23, 1.23, 1.31)), (8, (1.27, 1.52, 1.52)))


@dataclass(frozen=True)
class DepthCosts:
    """The time of a cycle of depth d = 1, 2, ... in AR steps (``cycles[d - 1]``); depths past
    the table cost ``per_draft`` more each. Defaults (``default``: greedy cycles,
    ``default_sampled``: sampled ones). An AVX2 CPU's ("cpu-avx2": Zen 3, two threads, `mtplx
    tune`, the mean of two runs each): since session 35, when its products took one activation
    scale per row, greedy 1.49 / 1.82 / 2.29 AR steps (1.50 / 1.79 / 2.15 and 1.49 / 1.84 /
    2.43), sampled (T 0.7, top-p 0.95) 1.45 / 1.72 / 2.33 (1.45 / 1.75 / 2.34 and 1.45 / 1.68 /
    2.31; depth 2's unrounded mean, 1.715, would take T 0.7 requests to depth 2, which both runs
    measured slower than depth 1 there); before, sessions 32 and 33: greedy 1.51 / 2.09 / 2.58,
    sampled (one run) 1.55 / 2.15 / 2.70. The AVX-512 CPU's, since session 18, as `mtplx tune` measures
    them (`benchmarks/auto_depth.py`: the tune prompts, AR and depths 1-3 side by side, two
    threads, the shipped head; `cpu_s18_auto_depth_measured.json`): greedy 1.30 / 1.84 / 2.17
    AR steps, sampled (T 0.7 argmax and T 1.0 mirror drafts, averaged) 1.34 / 1.82 / 2.05. The
    table before them (session 11, one thread: 1.41 / 1.69 / 2.13) priced depth 2 so low that
    greedy auto drafted depth 2 in 970 of 1,004 cycles at 1.17x AR against depth 1's 1.22x;
    with the measured one, 1.22x (depth 1 in 1,180 of 1,204). The H200's sampled cycles keep
    session 10's table (1.20, 1.48, 1.75, from greedy AR 1,369 tok/s, depth 1 1.27x, 2 1.17x at
    acceptance 0.53 / 0.20): over four seeds auto with it decodes within 0.3% of the best fixed
    depth, and the costs measured in session 18 (1.21 / 1.48 / 1.59) do no better
    (`gpu_h200_s18_auto_depth_seeds.json`). Since session 22 the H200's sampled table is that
    session's measurement of mirror cycles (T 0.7 1.20 / 1.49 / 1.60, T 1.0 1.21 / 1.49 / 1.62 AR
    steps, `gpu_h200_s22_sampled_final.json`, after the cycle's bookkeeping went into single
    kernels and made deeper cycles cheaper): side by side with session 10's table, two passes
    over the 12 held-out prompts, mirror auto decoded 1.38x AR against 1.36x at T 0.7 and 1.24x
    against 1.25x at T 1.0 (mirror depth 3: 1.36x, 1.23x; `gpu_h200_s22_auto_sampled_costs_*.json`):
    within the runs' noise either way, the measured table kept as the true one. The H200's greedy
    table is the measured one since session 15 (1.21, 1.45, 1.56: sessions 13 and 15, either
    head, 12 held-out chat prompts): with the session-15 head, whose deeper drafts accept more,
    auto decoded greedy 1.62x AR against depth 3's 1.57x, where session 10's table held it at
    1.50x (benchmarks/results/gpu_h200_s15_sampled_{newcosts,newhead}.json)."""

    cycles: tuple[float, ...]
    per_draft: float
    # ((width, (growth at depth 1, 2, ...)), ...), widths ascending from 2: a cycle of w rows costs
    # ``of(d) * growth`` AR steps of w rows, linear in width between the listed ones (width 1:
    # 1.0) and the last one's beyond them; () where it does not grow
    width_growth: tuple[tuple[int, tuple[float, ...]], ...] = ()

    def of(self, depth: int, width: int = 1) -> float:
        if depth <= len(self.cycles):
            cost = self.cycles[depth - 1]
        else:
            cost = self.cycles[-1] + self.per_draft * (depth - len(self.cycles))
        return cost * self.growth(depth, width)

    def growth(self, depth: int, width: int) -> float:
        """How much dearer a depth-``depth`` cycle is, in AR steps of the same width, at
        ``width`` rows than at one."""
        if not self.width_growth or width <= 1:
            return 1.0

        def at(growth: tuple[float, ...] | None) -> float:
            return 1.0 if growth is None else growth[min(depth, len(growth)) - 1]

        points = ((1, None),) + self.width_growth
        for (w0, g0), (w1, g1) in zip(points, points[1:]):
            if width <= w1:
                return at(g0) + (width - w0) / (w1 - w0) * (at(g1) - at(g0))
        return at(points[-1][1])

    def grown_as(self, other: DepthCosts) -> DepthCosts:
        """This table with ``other``'s growth by width where it has none of its own."""
        return self if self.width_growth else replace(self, width_growth=other.width_growth)

    @classmethod
    def default(cls, machine: str) -> DepthCosts:
        """``machine`` (``cost_machine``): "cuda", "cpu" (AVX-512), or "cpu-avx2" (a CPU whose
        kernels run 256 bits wide, where a verify of 2 tokens costs more against a step)."""
        if machine == "cuda":
            return cls((1.21, 1.45, 1.56), 0.11)
        if machine == "cpu-avx2":
            return cls((1.49, 1.82, 2.29), 0.47, width_growth=AVX2_GREEDY_GROWTH)
        return cls((1.30, 1.84, 2.17), 0.33)

    @classmethod
    def default_sampled(cls, machine: str) -> DepthCosts:
        if machine == "cuda":
            return cls((1.21, 1.49, 1.61), 0.12)
        if machine == "cpu-avx2":
            return cls((1.45, 1.72, 2.33), 0.61, width_growth=AVX2_SAMPLED_GROWTH)
        return cls((1.34, 1.82, 2.05), 0.24)

    @classmethod
    def from_measurement(cls, ar_tok_s: float, tok_s: dict[int, float],
                         acceptance: dict[int, list[float]]) -> DepthCosts | None:
        """From side-by-side tok/s of AR and fixed depths and each depth's acceptance by
        position (``mtplx tune``): a depth-d cycle yields 1 + sum(acceptance) tokens in
        (those tokens / its tok/s) seconds, an AR step 1 / ar_tok_s. None if a depth is missing."""
        depths = sorted(tok_s)
        if not depths or depths != list(range(1, len(depths) + 1)) or ar_tok_s <= 0:
            return None
        return cls.of_cycles(tuple((1 + sum(acceptance[d][:d])) * ar_tok_s / tok_s[d] for d in depths))

    @classmethod
    def of_cycles(cls, cycles: tuple[float, ...]) -> DepthCosts:
        """A table of these measured cycles (depths 1..n), deeper ones costing the last step's
        increase more each (at least 0.05 AR steps)."""
        per_draft = cycles[-1] - cycles[-2] if len(cycles) > 1 else cycles[0] - 1
        return cls(cycles, max(per_draft, 0.05))


def head_priors(provenance: dict | None) -> tuple[tuple[float, tuple[float, ...]], ...]:
    """A forged head's own held-out acceptance (``mtplx_forge.json``'s ``measured``: greedy as
    temperature 0, sampled by temperature) as conditional acceptance by position, sorted by
    temperature: ((0.0, (a1, a2, a3)), (0.7, ...), (1.0, ...)); () where it records none."""
    measured = (provenance or {}).get("measured") or {}
    runs = [(0.0, measured.get("held_out"))]
    runs += [(t, run) for t, run in (measured.get("held_out_sampled") or {}).items()]
    out = {}
    for t, run in runs:
        try:
            t, rates = float(t), [float(a) for a in run["acceptance_by_depth"]]
        except (TypeError, KeyError, ValueError):
            continue
        if not rates or not 0.0 < rates[0] <= 1.0 or not 0.0 <= t:
            continue
        cond, reach = [], 1.0
        for a in rates:  # P(j accepted) / P(j - 1 accepted)
            cond.append(min(0.98, max(0.02, a / reach if reach > 0 else 0.0)))
            reach = a
        out[t] = tuple(cond)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class AutoDepth:
    """What ``depth="auto"`` rows of one engine share: the deepest depth, the cycle costs (of
    greedy cycles, and of sampled ones where measured apart), the prior acceptance rows start
    from (constants for greedy and for sampled rows) and the head's own measured acceptance by
    temperature where it records one (``measured``, ``head_priors``), from which an untuned
    engine judges whether MTP pays at all (``expected_speedup``)."""

    max_depth: int
    costs: DepthCosts
    sampled_costs: DepthCosts | None = None
    greedy_prior: tuple[float, ...] = GREEDY_PRIOR
    sampled_prior: tuple[float, ...] = SAMPLED_PRIOR
    rate: float = RATE
    measured: tuple[tuple[float, tuple[float, ...]], ...] = ()
    ar_steps: bool = False  # whether a batch of auto rows may take AR steps (``batch_depth``)

    def prior(self, temperature: float) -> tuple[float, ...]:
        """Conditional acceptance by position (max_depth of them) expected of a row sampled at
        ``temperature`` (0: greedy). From the head's measurement where it has one for the regime
        (greedy: its greedy run; sampled: at least one sampled run), linear in temperature
        between the measured ones and along the nearest two outside them, within [0.02, 0.98];
        else the constants. A forged head's sampled runs drafted from its own distribution
        (mirror); requests below ``llm_engine.mirror_from`` draft by argmax, which accepts less
        at the same temperature (session 33, H100, T 0.7: 0.55 against 0.61 at depth 1)."""
        points = self._points(temperature)
        if not points:
            return self._constant_prior(temperature <= 0)
        prior = _interpolate(points, max(temperature, 0.0))
        return tuple(prior[min(j, len(prior) - 1)] for j in range(self.max_depth))

    def _constant_prior(self, greedy: bool) -> tuple[float, ...]:
        prior = self.greedy_prior if greedy else self.sampled_prior
        return tuple(prior[min(j, len(prior) - 1)] for j in range(self.max_depth))

    def _points(self, temperature: float) -> list:
        """The measured runs a row at ``temperature`` reads: greedy rows the greedy run, sampled
        ones all runs where at least one is sampled; [] where the head measured neither."""
        if temperature <= 0:
            return [(t, a) for t, a in self.measured if t == 0]
        return list(self.measured) if any(t > 0 for t, _ in self.measured) else []

    def measured_for(self, temperature: float) -> bool:
        """Whether the prior at ``temperature`` is the head's own measurement."""
        return bool(self._points(temperature))

    def costs_of(self, greedy: bool) -> DepthCosts:
        return self.costs if greedy else self.sampled_costs or self.costs

    def plan(self, temperature: float) -> DepthPlan:
        """A row's plan. Its running estimate starts from the constants, not from the head's
        measurement (``prior``): on an H100 through mtp_batch (session 34, two A/B runs of
        each tree, `gpu_h100_s34_sched_ab_*.json`) rows started from the head's record decoded
        T 1.0 at one stream 1.217x / 1.220x AR against 1.258x / 1.250x from the constants, and
        within 2% of them elsewhere."""
        greedy = temperature <= 0
        return DepthPlan(self.max_depth, self.costs_of(greedy), self._constant_prior(greedy), self.rate,
                         steady_prior=self.prior(temperature), ar_steps=self.ar_steps)

    def expected_speedup(self, temperature: float, depth: int | None = None) -> tuple[int, float]:
        """(depth, its expected tokens per unit of cycle cost under ``prior``, i.e. the expected
        speed-up over AR) for a row at ``temperature``: at ``depth``, or (None) the best depth
        up to max_depth."""
        prior = self.prior(temperature)
        costs = self.costs_of(temperature <= 0)
        tokens = DepthPlan(self.max_depth, costs, prior).initial  # E(1..max_depth) under the prior
        depths = range(1, self.max_depth + 1) if depth is None else [depth]
        speed = {d: _tokens_at(tokens, prior, d) / costs.of(d) for d in depths}
        best = max(speed, key=speed.get)
        return best, speed[best]


def _interpolate(points, t: float):
    if len(points) == 1:
        return tuple(min(0.98, max(0.02, a)) for a in points[0][1])
    width = min(len(a) for _, a in points)
    i = next((k for k in range(1, len(points)) if t <= points[k][0]), len(points) - 1)
    (t0, a0), (t1, a1) = points[i - 1], points[i]
    f = (t - t0) / (t1 - t0)
    return tuple(min(0.98, max(0.02, a0[j] + f * (a1[j] - a0[j]))) for j in range(width))


def _tokens_at(tokens: tuple[float, ...], prior: tuple[float, ...], depth: int) -> float:
    """E(depth): ``tokens`` holds E(1..max_depth); deeper ones extend with the last rate."""
    if depth <= len(tokens):
        return tokens[depth - 1]
    out, reach = tokens[-1], 1.0
    for a in prior:
        reach *= a
    for _ in range(depth - len(tokens)):
        reach *= prior[-1]
        out += reach
    return out


class DepthPlan:
    """One auto row's running acceptance and, after each cycle it commits, the expected tokens
    of a cycle of each depth (``expected_at`` reads them two of the row's cycles late)."""

    def __init__(self, max_depth: int, costs: DepthCosts, prior: tuple[float, ...], rate: float = RATE,
                 steady_prior: tuple[float, ...] | None = None, ar_steps: bool = False):
        self.max_depth, self.costs, self.prior, self.rate = max_depth, costs, prior, rate
        self.alpha = list(prior)
        self.initial = self.expected_tokens()
        self.history: deque[tuple[float, ...]] = deque(maxlen=2)  # E(1..max_depth) after its last two commits
        self.ar_steps = ar_steps
        self.steady_prior = tuple(steady_prior or prior)
        self.tested = [0] * max_depth  # every committed cycle's outcome by position (steady_tokens)
        self.passed = [0] * max_depth
        self._steady: tuple[float, ...] | None = None  # steady_tokens as of the last commit

    @property
    def first_depth(self) -> int:
        """The depth this row alone would take before its first commit."""
        return batch_depth([self], [self.initial], incumbent=None)

    def observe(self, drafted: int, accepted: int) -> None:
        """A committed cycle: ``drafted`` drafts, the first ``accepted`` of them accepted."""
        for j in range(min(drafted, accepted + 1)):  # positions that were tested
            self.alpha[j] += self.rate * (float(j < accepted) - self.alpha[j])
            self.tested[j] += 1
            self.passed[j] += j < accepted
        self._steady = None
        scale = self.alpha[0] / max(self.prior[0], 1e-3)
        for j in range(drafted, self.max_depth):  # untested: follow the first position's rate
            target = min(0.98, self.prior[j] * scale)
            self.alpha[j] += self.rate * (target - self.alpha[j])
        self.history.append(self.expected_tokens())

    def expected_at(self, in_flight: bool) -> tuple[float, ...]:
        """E(1..max_depth) for the row's next cycle, two of its cycles late: as of its latest
        commit where a cycle over it is in flight (chained: the host has not read that one),
        else as of the commit before its latest (the prior's before there is one)."""
        h = self.history
        if in_flight:
            return h[-1] if h else self.initial
        return h[-2] if len(h) == 2 else self.initial

    def expected_tokens(self) -> tuple[float, ...]:
        return _tokens_by_depth(self.alpha)

    def steady_tokens(self) -> tuple[float, ...]:
        """E(1..max_depth) under every cycle the row committed, each position's count starting
        from ``EVIDENCE_PRIOR`` cycles at ``steady_prior`` (the head's recorded acceptance at the
        row's temperature): whether drafting pays at all, where the running estimate (``alpha``,
        about its last 6-7 cycles) says which depth."""
        if self._steady is None:
            prior = self.steady_prior
            self._steady = _tokens_by_depth([(self.passed[j] + EVIDENCE_PRIOR * prior[min(j, len(prior) - 1)])
                                             / (self.tested[j] + EVIDENCE_PRIOR) for j in range(self.max_depth)])
        return self._steady


def _tokens_by_depth(alpha) -> tuple[float, ...]:
    """E(1..len(alpha)) from conditional acceptance by position."""
    tokens, reach, out = 1.0, 1.0, []
    for a in alpha:
        reach *= a
        tokens += reach
        out.append(tokens)
    return tuple(out)


def batch_depth(plans: list[DepthPlan], expected: list[tuple[float, ...]], incumbent: int | None,
                floor: int = 0, width: int = 1) -> int:
    """The depth of a cycle's auto rows, with these plans and expected tokens by depth (each
    row's ``expected_at``): the most expected tokens of all of them per unit of the cycle's
    cost, a cycle of ``width`` rows costing its deepest row's (``floor``: the batch's deepest
    fixed-depth row); the incumbent (the auto rows' current depth) stays unless another
    promises ``HYSTERESIS`` more. Where every plan may take AR steps and no fixed-depth row
    drafts, 0 (an AR step) where that depth promises fewer tokens than one a row under the
    rows' steady estimates, by ``AR_MARGIN`` (and the incumbent 0 stays unless it promises
    ``AR_MARGIN`` more)."""
    # rows of one cost table and deepest depth (as a rule, all of them) are summed before pricing:
    # the host prices a batch's depths once a cycle, between the chain's launches
    groups: dict[tuple[int, int], list[tuple[float, ...]]] = {}
    for p, e in zip(plans, expected):
        groups.setdefault((id(p.costs), p.max_depth), [p.costs]).append(e)
    priced = [(g[0], [sum(col) for col in zip(*g[1:])]) for g in groups.values()]
    deepest = max(len(sums) for _, sums in priced)
    score = {d: sum(sums[min(d, len(sums)) - 1] / costs.of(max(d, floor), width) for costs, sums in priced)
             for d in range(1, deepest + 1)}
    best = max(score, key=score.get)
    if incumbent in score and score[best] <= score[incumbent] * (1 + HYSTERESIS):
        best = incumbent
    if floor or not all(p.ar_steps for p in plans):
        return best
    steady = sum(p.steady_tokens()[min(best, p.max_depth) - 1] / p.costs.of(best, width) for p in plans)
    if incumbent == 0:  # on AR steps: one token a row per AR step
        return best if steady > len(plans) * (1 + AR_MARGIN) else 0
    return 0 if len(plans) > steady * (1 + AR_MARGIN) else best
