"""The Triton sampling kernels (mtplx/kernels/sampling.py) against the PyTorch functions they
replace (``sampling.process_logits``, ``speculative.rejection_outcome``). On the CPU they run
under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest -q tests/test_sampling_kernels.py
"""

from __future__ import annotations

import os

import pytest
import torch

from mtplx.engine.sampling import SamplerTensors, SamplingParams, process_logits
from mtplx.engine.speculative import rejection_outcome
from mtplx.kernels import fused
from mtplx.kernels import sampling as kernel

pytestmark = pytest.mark.skipif(
    not fused.available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 20000  # several kernel blocks, a ragged last one

PARAMS = [
    SamplingParams(),                                     # greedy: a one-hot of the argmax
    SamplingParams(temperature=0.7, top_p=0.95),
    SamplingParams(temperature=1.0),                      # no filter
    SamplingParams(temperature=1.3, top_k=40),
    SamplingParams(temperature=0.8, top_k=300, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=0.5, min_p=0.1),
    SamplingParams(temperature=2.0, top_p=0.999),         # a wide nucleus: many candidates
    SamplingParams(temperature=1.0, top_p=1e-6),          # only the top token
]


def logits_rows(rows: int, positions: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, positions, VOCAB, generator=g) * 3
    logits[..., 7] = logits[..., 11] = logits.amax(-1) + 1  # tied maxima: the first one wins
    logits[0, 0, 100:200] = -1e30                              # pruned tokens (a draft vocabulary)
    logits[-1, -1, 9000:] = -60.0                              # a long tail of negligible weight
    return logits.to(DEVICE)


def settings(params: list[SamplingParams]) -> SamplerTensors:
    s = SamplerTensors(len(params), torch.device(DEVICE))
    s.write(params)
    return s


def assert_kept_alike(got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor, params: list[SamplingParams]):
    """The kept tokens of every (row, position) are the reference's, except at most one token at a
    top-p boundary met to float32 rounding: in float64 the mass of the tokens more probable than
    it lies within 1e-6 of top_p (both sum tens of thousands of weights, in different orders)."""
    for r, p in enumerate(params):
        for i in range(got.shape[1]):
            differ = ((got[r, i] > 0) != (want[r, i] > 0)).nonzero().flatten()
            if differ.numel() == 0:
                continue
            assert differ.numel() == 1 and p.top_p < 1, f"row {r} position {i}: kept tokens {differ.tolist()} differ"
            scaled = (logits[r, i].double() - logits[r, i].double().max()) / p.temperature
            if p.top_k:
                scaled = scaled.masked_fill(scaled < scaled.topk(p.top_k).values[-1], float("-inf"))
            probs = torch.softmax(scaled, -1)
            before = float(probs[probs > probs[differ[0]]].sum())
            assert abs(before - p.top_p) < 1e-6, f"row {r} position {i}: token {int(differ[0])} is no boundary case"


@pytest.mark.parametrize("positions", [1, 3])
def test_process_matches_process_logits(positions):
    logits = logits_rows(len(PARAMS), positions)
    s = settings(PARAMS)
    want = process_logits(logits, s)
    got, picks = kernel.process(logits, s.greedy, s.temperature, s.top_k, s.top_p, s.min_p)
    assert picks is None
    assert_kept_alike(got, want, logits, PARAMS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    assert torch.equal(got[0, 0].nonzero().flatten(), torch.tensor([7], device=DEVICE))


def test_process_takes_bfloat16_logits():
    logits = logits_rows(3, 1).to(torch.bfloat16)
    s = settings(PARAMS[:3])
    got, _ = kernel.process(logits, s.greedy, s.temperature, s.top_k, s.top_p, s.min_p)
    torch.testing.assert_close(got, process_logits(logits, s), rtol=1e-5, atol=1e-7)


def test_process_race_draws_the_argmax_of_p_over_noise():
    logits = logits_rows(len(PARAMS), 2, seed=1)
    s = settings(PARAMS)
    race = torch.empty(len(PARAMS), 2, VOCAB, device=DEVICE).exponential_(generator=None)
    probs, picks = kernel.process(logits, s.greedy, s.temperature, s.top_k, s.top_p, s.min_p, race)
    assert torch.equal(picks, torch.argmax(probs / race, dim=-1))
    assert torch.equal(picks[0], torch.tensor([7, 7], device=DEVICE))  # greedy: the first maximum


def test_the_race_winner_is_the_rejection_kernels_token_at_depth_0():
    """A sampled AR step of a chained cycle takes ``process``'s race winner as its token
    (runner.cycle_forward): the token ``rejection`` draws from the same p and noise without drafts."""
    logits = logits_rows(len(PARAMS), 1, seed=3)
    s = settings(PARAMS)
    race = torch.empty(len(PARAMS), VOCAB, device=DEVICE).exponential_(generator=None)
    probs, picks = kernel.process(logits, s.greedy, s.temperature, s.top_k, s.top_p, s.min_p, race[:, None])
    rows = len(PARAMS)
    packed = kernel.rejection(probs, None, torch.zeros(rows, 0, dtype=torch.long, device=DEVICE),
                              torch.zeros(rows, 1, dtype=torch.long, device=DEVICE),
                              torch.rand(rows, 1, device=DEVICE), race)
    assert torch.equal(packed[:, 1], picks[:, 0]) and not packed[:, 0].any()


def test_process_over_a_pruned_vocabulary_writes_the_whole_rows_by_id():
    """``process(..., ids=, vocab_size=)``: the pruned logits' distribution written at their ids
    (zero elsewhere), the race read there and the picks given as ids: what ``process`` over the
    pruned row gives, scattered, with the race gathered at the ids. Every setting, filters too."""
    g = torch.Generator().manual_seed(4)
    whole = 3 * VOCAB // 2
    ids = torch.randperm(whole, generator=g)[:VOCAB].sort().values.to(DEVICE)
    logits = logits_rows(len(PARAMS), 2, seed=4)
    s = settings(PARAMS)
    race = torch.empty(len(PARAMS), 2, whole, device=DEVICE).exponential_(generator=None)
    probs, picks = kernel.process(logits, s.greedy, s.temperature, s.top_k, s.top_p, s.min_p, race, ids=ids,
                                  vocab_size=whole)
    want, want_picks = kernel.process(logits, s.greedy, s.temperature, s.top_k, s.top_p, s.min_p, race[..., ids])
    assert probs.shape == (len(PARAMS), 2, whole)
    assert torch.equal(probs[..., ids], want) and float(probs.sum()) == pytest.approx(float(want.sum()))
    assert torch.equal(picks, ids[want_picks])


def test_process_top_p_threshold_on_a_known_distribution():
    # probabilities 0.4, 0.3, 0.2, 0.1 (then nothing): top_p 0.7 keeps two, 0.71 three (the
    # mass before the third token, 0.7, is short of 0.71), 0.5 two
    base = torch.full((VOCAB,), float("-inf"))
    base[[3, 9, 4000, 4999]] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    for top_p, kept in ((0.7, 2), (0.71, 3), (0.5, 2), (0.3, 1), (1.0, 4)):
        s = settings([SamplingParams(temperature=1.0, top_p=top_p)])
        got, _ = kernel.process(base[None, None].to(DEVICE), s.greedy, s.temperature, s.top_k, s.top_p, s.min_p)
        assert int((got > 0).sum()) == kept, top_p
        torch.testing.assert_close(got, process_logits(base[None, None].to(DEVICE), s))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=300),
                                    SamplingParams(temperature=1.0, top_p=0.99),
                                    SamplingParams(temperature=1.0, min_p=6e-6)])
def test_process_when_the_kept_tokens_reach_below_the_candidate_cut(params):
    # a few likely tokens and a long tail of small, distinct weights (below 2^-16 of the top
    # one's): 300 tokens, 99% of the mass or min-p 6e-6 reach into the tail, so every token is
    # a candidate (the kernel's second compaction)
    g = torch.Generator().manual_seed(9)
    base = -12.0 + 0.1 * torch.randn(VOCAB, generator=g)
    base[:5] = torch.tensor([0.0, -0.1, -0.2, -0.3, -0.4])
    s = settings([params])
    got, _ = kernel.process(base[None, None].to(DEVICE), s.greedy, s.temperature, s.top_k, s.top_p, s.min_p)
    want = process_logits(base[None, None].to(DEVICE), s)
    assert 5 < int((want > 0).sum()) < VOCAB
    # summing 12,000 weights in another order moves the top-p boundary by a token at most
    # (here the 12,360th token's mass before it is 0.98999989 against top_p 0.99)
    assert int(((got > 0) != (want > 0)).sum()) <= 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-6)


def test_process_top_k_keeps_ties_at_the_kth_value():
    base = torch.full((VOCAB,), -5.0)
    base[:6] = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    s = settings([SamplingParams(temperature=1.0, top_k=2)])
    got, _ = kernel.process(base[None, None].to(DEVICE), s.greedy, s.temperature, s.top_k, s.top_p, s.min_p)
    assert (got[0, 0] > 0).nonzero().flatten().tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(got, process_logits(base[None, None].to(DEVICE), s))


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_rejection_matches_rejection_outcome(with_q, k):
    if with_q and k == 0:
        pytest.skip("no drafts, no draft distribution")
    rows = 6
    g = torch.Generator().manual_seed(k)
    p = torch.softmax(torch.randn(rows, k + 1, VOCAB, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(rows, k, VOCAB, generator=g) * 2, -1) if with_q else None
    drafts = torch.randint(0, VOCAB, (rows, k), generator=g)
    if k:
        drafts[:3] = p[:3, :k].argmax(-1)  # likely accepted: exercise several outcomes
        p[4, 0] = 0
        p[4, 0, drafts[4, 0]] = 1.0        # a one-hot target at the draft: accepted surely
    depths = torch.tensor([[k], [k], [max(k - 1, 0)], [k], [k], [0]])
    uniforms = torch.rand(rows, max(k, 1), generator=g)
    race = torch.empty(rows, VOCAB).exponential_(generator=g)
    args = [t.to(DEVICE) if t is not None else None for t in (p, q, drafts, depths, uniforms, race)]
    want = rejection_outcome(*args)
    got = kernel.rejection(*args)
    assert torch.equal(got, want)


def test_argmax_is_the_first_maximum():
    logits = logits_rows(4, 3, seed=5)
    logits[1, 2] = 0.0  # every value tied: index 0
    assert torch.equal(kernel.argmax(logits), logits.argmax(-1))
    assert torch.equal(kernel.argmax(logits.to(torch.bfloat16)), logits.to(torch.bfloat16).argmax(-1))
    assert int(kernel.argmax(logits)[1, 2]) == 0



def test_mirror_draft_over_a_pruned_vocabulary_is_the_whole_rows_draft():
    # the chained cycle's mirror draft from a pruned draft vocabulary's own logits (kernel path)
    # against the same draft from those logits scattered to the whole vocabulary: same tokens,
    # same q (zero outside the vocabulary), from the same noise
    from mtplx.engine.runner import CycleSampling
    from mtplx.models.mtp import PRUNED_LOGIT
    params = [SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.8, top_k=30), SamplingParams()]  # the last drafts an argmax
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(VOCAB, generator=g)[:5000].sort().values.to(DEVICE)
    kept = (torch.randn(len(params), ids.numel(), generator=g) * 3).to(DEVICE)
    whole = torch.full((len(params), VOCAB), PRUNED_LOGIT, device=DEVICE).scatter_(1, ids.expand(len(params), -1), kept)
    c = CycleSampling(len(params), 2, VOCAB, "mirror", torch.device(DEVICE))
    c.write_params(params, [True, True, True, False])
    c.draft_race.exponential_(generator=None)
    for j in range(2):
        with torch.inference_mode():  # (the kernels run outside autograd)
            want_picks, want_q = c.draft(whole, j)
            picks, q = c.draft(kept, j, ids=ids)
        assert torch.equal(picks, want_picks)
        assert int(picks[3]) == int(ids[kept[3].argmax()])
        assert float(q[:, ~torch.isin(torch.arange(VOCAB, device=DEVICE), ids)].abs().max()) == 0.0
        torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-7)
