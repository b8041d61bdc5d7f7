"""Specification of mtplx.engine.speculative: greedy and exact sampled verification.

The exactness promise: one verify step followed by ordinary autoregressive sampling produces
token sequences with exactly the target's autoregressive distribution. The target p and the
draft q here are "chains": each prefix has its own distribution (a seeded random table), so a
sampler that read the wrong row, or the wrong residual, would be caught beyond the first token.
"""

import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from mtplx.engine.sampling import NoiseStream, SamplingParams, logits_to_probs
from mtplx.engine.speculative import (
    VerifyOutcome,
    acceptance_probs,
    next_token_distribution,
    verify_greedy,
    verify_sampled,
)

Prefix = tuple[int, ...]


# --- chains of distributions ----------------------------------------------------------------

@dataclass
class Chain:
    """A next-token distribution [V] float64 for every prefix, drawn once per prefix from a seed."""

    vocab: int
    seed: int
    make_row: Callable[[np.random.Generator, int], np.ndarray]
    rows: dict = field(default_factory=dict)

    def __call__(self, prefix: Prefix) -> np.ndarray:
        if prefix not in self.rows:
            rng = np.random.default_rng([self.seed, len(prefix), *prefix])
            row = np.asarray(self.make_row(rng, self.vocab), dtype=np.float64)
            self.rows[prefix] = row / row.sum()
        return self.rows[prefix]


def dense(rng, vocab):
    return rng.dirichlet(np.ones(vocab))


def sparse(rng, vocab):
    """Random zeros, at least one token kept."""
    row = rng.dirichlet(np.ones(vocab))
    row[rng.permutation(vocab)[: vocab // 2]] = 0.0
    return row


def even_support(rng, vocab):
    row = rng.dirichlet(np.ones(vocab))
    row[1::2] = 0.0
    return row


def odd_support(rng, vocab):
    row = rng.dirichlet(np.ones(vocab))
    row[0::2] = 0.0
    return row


def one_hot(rng, vocab):
    return np.eye(vocab)[rng.integers(vocab)]


def truncated(rng, vocab):
    """A distribution that went through top-k / top-p filtering, as a real sampler's would."""
    logits = torch.tensor(rng.normal(size=(1, vocab)) * 2.0)
    params = SamplingParams(temperature=0.8, top_k=vocab - 1, top_p=0.85)
    return logits_to_probs(logits, params)[0].double().numpy()


@dataclass
class OneHotDrafts:
    """Deterministic drafts as a one-hot q: the token ``pick`` chooses from another chain's row."""

    chain: Chain
    pick: Callable[[np.ndarray], int] = np.argmax

    def __call__(self, prefix: Prefix) -> np.ndarray:
        row = self.chain(prefix)
        return np.eye(len(row))[self.pick(row)]


@dataclass
class Case:
    """Target chain p, draft chain q; ``one_hot_drafts`` passes draft_probs=None (q is one-hot)."""

    p: Chain
    q: Chain | OneHotDrafts
    one_hot_drafts: bool = False
    tensors_cache: dict = field(default_factory=dict)

    def tensors(self, drafts: Prefix):
        """(target_probs [k+1, V], draft_probs [k, V] or None, draft_tokens [k]) for these drafts."""
        if drafts not in self.tensors_cache:
            k = len(drafts)
            target = torch.tensor(np.stack([self.p(drafts[:i]) for i in range(k + 1)]))
            draft = None
            if not self.one_hot_drafts:
                draft = torch.tensor(np.stack([self.q(drafts[:i]) for i in range(k)])).reshape(k, -1)
            self.tensors_cache[drafts] = (target, draft, torch.tensor(drafts, dtype=torch.long))
        return self.tensors_cache[drafts]


def make_case(name: str, vocab: int) -> Case:
    p_dense, q_dense = Chain(vocab, 11, dense), Chain(vocab, 22, dense)
    cases = {
        "random": lambda: Case(p_dense, q_dense),
        "p_equals_q": lambda: Case(p_dense, p_dense),
        "disjoint_supports": lambda: Case(Chain(vocab, 11, even_support), Chain(vocab, 22, odd_support)),
        "q_zero_where_p_positive": lambda: Case(p_dense, Chain(vocab, 22, sparse)),
        "p_zero_where_q_positive": lambda: Case(Chain(vocab, 11, sparse), q_dense),
        "top_k_top_p_truncated": lambda: Case(Chain(vocab, 11, truncated), Chain(vocab, 22, truncated)),
        "one_hot_target": lambda: Case(Chain(vocab, 11, one_hot), q_dense),
        "one_hot_greedy_drafts": lambda: Case(p_dense, OneHotDrafts(q_dense), one_hot_drafts=True),
        # drafts pick the target's least likely token, usually one with p(x) = 0
        "one_hot_drafts_outside_p": lambda: Case(
            Chain(vocab, 11, sparse), OneHotDrafts(Chain(vocab, 11, sparse), np.argmin), one_hot_drafts=True),
    }
    return cases[name]()


CASES = ["random", "p_equals_q", "disjoint_supports", "q_zero_where_p_positive", "p_zero_where_q_positive",
         "top_k_top_p_truncated", "one_hot_target", "one_hot_greedy_drafts", "one_hot_drafts_outside_p"]


# --- exact enumeration ----------------------------------------------------------------------

def draft_paths(q: Chain, k: int, prefix: Prefix = (), weight: float = 1.0):
    """Every draft sequence of length k with its probability under q."""
    if len(prefix) == k:
        yield prefix, weight
        return
    for token, prob in enumerate(q(prefix)):
        if prob > 0:
            yield from draft_paths(q, k, prefix + (token,), weight * prob)


def step_distribution(case: Case, k: int) -> dict[Prefix, float]:
    """Exact distribution of one verify step's emitted tokens: drafts[:accepted] + (next,).

    Enumerates draft sequences and acceptance events in closed form (no sampling), with the
    acceptance probabilities and next-token distributions the sampler computes.
    """
    emitted = defaultdict(float)
    for drafts, weight in draft_paths(case.q, k):
        target, draft_probs, tokens = case.tensors(drafts)
        accept = acceptance_probs(target, draft_probs, tokens).tolist()
        reach = weight  # P(these drafts and the first n accepted)
        for n in range(k + 1):
            stop = reach * (1.0 - accept[n]) if n < k else reach
            if stop > 0:
                dist = next_token_distribution(target, draft_probs, tokens, n).numpy()
                for token in np.flatnonzero(dist):
                    emitted[drafts[:n] + (int(token),)] += stop * dist[token]
            if n < k:
                reach *= accept[n]
    return dict(emitted)


def continue_autoregressively(emitted: dict[Prefix, float], p: Chain, length: int) -> dict[Prefix, float]:
    """Distribution of the first ``length`` tokens when exact AR sampling continues each sequence."""
    out = defaultdict(float)
    pending = list(emitted.items())
    while pending:
        seq, weight = pending.pop()
        if len(seq) == length:
            out[seq] += weight
            continue
        for token, prob in enumerate(p(seq)):
            if prob > 0:
                pending.append((seq + (token,), weight * prob))
    return dict(out)


def autoregressive_distribution(p: Chain, length: int) -> dict[Prefix, float]:
    return continue_autoregressively({(): 1.0}, p, length)


def max_difference(a: dict, b: dict) -> float:
    return max(abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in set(a) | set(b))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("name", CASES)
def test_one_verify_step_then_ar_equals_ar_exactly_by_enumeration(name, k):
    case = make_case(name, vocab=5)
    emitted = step_distribution(case, k)
    assert abs(sum(emitted.values()) - 1.0) < 1e-9
    assert all(1 <= len(seq) <= k + 1 for seq in emitted)
    stream = continue_autoregressively(emitted, case.p, k + 1)
    assert max_difference(stream, autoregressive_distribution(case.p, k + 1)) < 1e-6


@pytest.mark.parametrize("k", [1, 3])
def test_first_emitted_token_is_distributed_as_p(k):
    case = make_case("random", vocab=6)
    first = defaultdict(float)
    for seq, prob in step_distribution(case, k).items():
        first[seq[0]] += prob
    assert np.allclose([first[t] for t in range(6)], case.p(()), atol=1e-9)


def test_p_equals_q_accepts_every_draft():
    case = make_case("p_equals_q", vocab=5)
    assert all(len(seq) == 4 for seq in step_distribution(case, 3))


def test_disjoint_supports_reject_the_first_draft_and_sample_p():
    case = make_case("disjoint_supports", vocab=6)
    emitted = step_distribution(case, 2)
    assert all(len(seq) == 1 for seq in emitted)
    assert np.allclose([emitted.get((t,), 0.0) for t in range(6)], case.p(()))


# --- sampling against the exact distributions -----------------------------------------------

def draw(row: np.ndarray, rng: np.random.Generator) -> int:
    return int(np.searchsorted(np.cumsum(row), rng.random() * row.sum(), side="right").clip(max=len(row) - 1))


def run_steps(case: Case, k: int, n: int, seed: int) -> tuple[Counter, Counter]:
    """Sample n verify steps; count emitted sequences and their AR-continued streams (length k+1)."""
    generator, rng = NoiseStream(seed), np.random.default_rng(seed)
    emitted_counts, stream_counts = Counter(), Counter()
    for _ in range(n):
        drafts = ()
        for _ in range(k):
            drafts += (draw(case.q(drafts), rng),)
        outcome = verify_sampled(*case.tensors(drafts), generator)
        emitted = drafts[: outcome.accepted] + (outcome.next_token,)
        stream = emitted
        while len(stream) < k + 1:
            stream += (draw(case.p(stream), rng),)
        emitted_counts[emitted] += 1
        stream_counts[stream] += 1
    return emitted_counts, stream_counts


def chi_square_pvalue(counts: Counter, probs: dict[Prefix, float]) -> float:
    """Goodness of fit, pooling the least likely cells until every cell expects >= 5."""
    n = sum(counts.values())
    support = [key for key, prob in probs.items() if prob > 1e-12]
    assert set(counts) <= set(support), f"sampled outside the support: {set(counts) - set(support)}"
    expected = np.array([probs[key] * n for key in support])
    observed = np.array([counts[key] for key in support], dtype=float)
    order = np.argsort(expected)
    expected, observed = expected[order], observed[order]
    pooled = 0
    while pooled < len(expected) and (expected[pooled] < 5 or 0 < expected[:pooled].sum() < 5):
        pooled += 1
    if pooled:
        expected = np.concatenate([[expected[:pooled].sum()], expected[pooled:]])
        observed = np.concatenate([[observed[:pooled].sum()], observed[pooled:]])
    if len(expected) < 2:
        return 1.0
    expected *= observed.sum() / expected.sum()  # scipy wants equal totals to 1e-8
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize("name", CASES)
def test_sampled_verify_matches_exact_distributions_chi_square(name):
    k, n = 2, 8_000
    case = make_case(name, vocab=4)
    emitted_counts, stream_counts = run_steps(case, k, n, seed=1234)
    assert chi_square_pvalue(emitted_counts, step_distribution(case, k)) > 0.001
    assert chi_square_pvalue(stream_counts, autoregressive_distribution(case.p, k + 1)) > 0.001


def test_sampled_verify_with_no_drafts_samples_p():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]], dtype=torch.float64)
    generator = NoiseStream(5)
    tokens = Counter(verify_sampled(p, None, torch.zeros(0, dtype=torch.long), generator).next_token
                     for _ in range(3000))
    assert chi_square_pvalue(tokens, {0: 0.5, 1: 0.3, 2: 0.2, 3: 0.0}) > 0.001


def test_same_seed_gives_the_same_outcomes():
    case = make_case("random", vocab=5)
    args = case.tensors((1, 3, 0))

    def outcomes(seed):
        generator = NoiseStream(seed)
        return [verify_sampled(*args, generator) for _ in range(50)]

    assert outcomes(9) == outcomes(9)
    assert outcomes(9) != outcomes(10)


# --- edge-case guards -----------------------------------------------------------------------

def test_draft_with_zero_draft_probability_is_accepted_iff_target_allows_it():
    target = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    draft = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    # draft 0 is token 0 with q = 0 < p; draft 1 is token 2 with q = p = 0
    accept = acceptance_probs(target, draft, torch.tensor([0, 2]))
    assert torch.equal(accept, torch.tensor([1.0, 0.0]))


def test_residual_without_mass_falls_back_to_p():
    target = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    draft = torch.tensor([[0.5, 0.75]])  # q >= p everywhere: max(0, p - q) is all zero
    dist = next_token_distribution(target, draft, torch.tensor([1]), accepted=0)
    assert torch.equal(dist, target[0])


def test_one_hot_draft_rejection_never_resamples_the_rejected_token():
    target = torch.tensor([[0.6, 0.4, 0.0], [0.1, 0.1, 0.8]])
    dist = next_token_distribution(target, None, torch.tensor([0]), accepted=0)
    assert torch.allclose(dist, torch.tensor([0.0, 1.0, 0.0]))


def test_all_accepted_samples_the_bonus_from_the_last_row():
    target = torch.tensor([[0.6, 0.4, 0.0], [0.1, 0.1, 0.8]])
    draft = torch.tensor([[0.6, 0.4, 0.0]])
    assert torch.equal(next_token_distribution(target, draft, torch.tensor([0]), accepted=1), target[1])


def test_sampled_verify_with_one_hot_target_equals_greedy_verify():
    rng = torch.Generator().manual_seed(0)
    generator = NoiseStream(0)
    for trial in range(200):
        k = trial % 4
        logits = torch.randn(k + 1, 6, generator=rng)
        target = logits_to_probs(logits, SamplingParams(temperature=0.0))
        draft = torch.softmax(torch.randn(k, 6, generator=rng), dim=-1)
        tokens = torch.where(torch.rand(k, generator=rng) < 0.5, logits[:k].argmax(-1),
                             torch.randint(0, 6, (k,), generator=rng))
        assert verify_sampled(target, draft, tokens, generator) == verify_greedy(logits, tokens)
        assert verify_sampled(target, None, tokens, generator) == verify_greedy(logits, tokens)


def test_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match=r"\[k\+1, V\]"):
        verify_greedy(torch.zeros(2, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sampled(torch.full((2, 4), 0.25), torch.full((2, 4), 0.25), torch.tensor([0]), NoiseStream(0))


# --- greedy verification --------------------------------------------------------------------

def logits_with_argmaxes(argmaxes: list[int], vocab: int = 5) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 1.0
    return logits


@pytest.mark.parametrize(
    "argmaxes, drafts, expected",
    [
        ([2, 4, 1, 3], [2, 4, 1], (3, 3)),  # all accepted: bonus from the last row
        ([2, 4, 1, 3], [0, 4, 1], (0, 2)),  # first draft wrong: correction from row 0
        ([2, 4, 1, 3], [2, 0, 1], (1, 4)),  # later matches after a miss do not count
        ([2, 4, 1, 3], [2, 4, 0], (2, 1)),
        ([3], [], (0, 3)),  # no drafts: plain greedy step
    ],
)
def test_greedy_verify_accepts_matching_prefix_and_corrects_with_argmax(argmaxes, drafts, expected):
    outcome = verify_greedy(logits_with_argmaxes(argmaxes), torch.tensor(drafts, dtype=torch.long))
    assert outcome == VerifyOutcome(*expected)
    assert isinstance(outcome.accepted, int) and isinstance(outcome.next_token, int)


def test_greedy_verify_breaks_ties_toward_the_lowest_index():
    logits = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]])
    assert verify_greedy(logits, torch.tensor([2])) == (0, 1)
    assert verify_greedy(logits, torch.tensor([1])) == (1, 0)


# --- on the GPU -----------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_verify_syncs_with_the_host_exactly_once_on_cuda():
    generator = NoiseStream(0)
    target = torch.softmax(torch.randn(4, 1000, device="cuda"), dim=-1)
    draft = torch.softmax(torch.randn(3, 1000, device="cuda"), dim=-1)
    tokens = torch.multinomial(draft, 1, generator=torch.Generator(device="cuda").manual_seed(0)).squeeze(1)
    calls = [lambda: verify_sampled(target, draft, tokens, generator),
             lambda: verify_sampled(target, None, tokens, generator),
             lambda: verify_greedy(target, tokens)]
    for call in calls:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # (torch also warns once that the debug mode "is a prototype feature": not a sync)
        syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
        assert len(syncs) == 1, [str(w.message) for w in syncs]
