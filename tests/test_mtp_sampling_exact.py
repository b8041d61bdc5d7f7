"""Sampled MTP decoding has exactly the AR distribution.

On a tiny-vocabulary model the exact distribution of 3-token continuations is enumerated from
the reference model's own probabilities; thousands of MTP samples must fit it (chi-square)."""


import pytest
import torch
from scipy.stats import chisquare

from mtplx.engine.adaptive_depth import AutoDepth, DepthCosts
from mtplx.engine.sampling import SamplingParams, logits_to_probs
from mtplx.forge.data import decode_rows
from mtplx.models.quant import QuantLinear, quantize_linears
from tests.tiny_models import repeat_head, tiny_engine

V = 8
PROMPT = [1, 2, 3]
N = 1500
TINY_VOCAB = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def exact_distribution(hf, params: SamplingParams, length: int = 3) -> dict[tuple, float]:
    """P(x1..xL | prompt) enumerated from transformers' logits, processed by the sampler."""
    dist = {(): 1.0}
    for _ in range(length):
        prefixes = list(dist)
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1].float()
        probs = logits_to_probs(logits, params)
        dist = {p + (t,): dist[p] * float(probs[i, t]) for i, p in enumerate(prefixes) for t in range(V)}
    return dist


def sample_mtp(engine, n: int, depth: int, policy: str, samplers: list[dict] | None = None, length: int = 3,
               **sampler) -> list[tuple]:
    """n independent ``length``-token MTP continuations, decoded as rows of one batch (row i
    with ``samplers[i % len(samplers)]`` where given)."""
    requests = [(i, engine.make_request(PROMPT, mode="mtp", depth=depth, max_tokens=length, seed=10_000 + i,
                                        draft_policy=policy, **(samplers[i % len(samplers)] if samplers else sampler)))
                for i in range(n)]
    done = dict(decode_rows(engine, iter(requests), n))
    seqs = [done[i] for i in range(n)]
    assert engine.runner.blocks.num_used_blocks == 0
    return [tuple(s.generated) for s in seqs]


def assert_fits(samples: list[tuple], dist: dict[tuple, float]):
    counts = {k: 0 for k in dist}
    for s in samples:
        counts[s] += 1
    # merge rare outcomes so every expected count is >= 5
    keys = sorted(dist, key=dist.get, reverse=True)
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for k in keys:
        e = dist[k] * len(samples)
        if e >= 5:
            obs.append(counts[k]); exp.append(e)
        else:
            rest_o += counts[k]; rest_e += e
    if rest_e > 0:
        obs.append(rest_o); exp.append(rest_e)
    if len(obs) == 1:  # a deterministic distribution: every sample is the one outcome
        assert obs[0] == len(samples)
        return
    scale = sum(obs) / sum(exp)
    p = chisquare(obs, [e * scale for e in exp]).pvalue
    assert p > 1e-3, f"chi-square p={p:.2e} over {len(obs)} bins"


def _engine(head_sharpness: float = 1.0, head: str = "random", kv_tokens_per_row: int = 12,
            draft_vocab: list[int] | None = None, kv_dtype=None):
    engine, hf = tiny_engine("llama", seed=3, head_seed=4, block_size=4, kv_cache_tokens=N * kv_tokens_per_row,
                             draft_vocab=draft_vocab, kv_dtype=kv_dtype, **TINY_VOCAB)
    with torch.no_grad():  # peaked, varied next-token distributions (random init is near uniform)
        hf.lm_head.weight.mul_(25.0)
        engine.loaded.model.lm_head.weight.mul_(25.0)
    if head == "repeat":  # drafts often accepted: exercises partial and full acceptance
        engine.runner.head.load_state_dict(repeat_head(engine.loaded.model, draft_vocab=draft_vocab).state_dict())
    if draft_vocab is not None:  # the trunk's output rows changed above: the head's copy of them too
        engine.runner.head.bind_draft_vocab(engine.loaded.model)
    if head_sharpness != 1.0:  # an over-confident head: near one-hot drafts
        with torch.no_grad():
            engine.runner.head.norm.weight.mul_(head_sharpness)
    return engine, hf


CASES = [
    ("greedy", 1, dict(temperature=1.0)),
    ("mirror", 1, dict(temperature=1.0)),
    ("greedy", 3, dict(temperature=1.0)),
    ("mirror", 3, dict(temperature=1.0)),
    ("mirror", 2, dict(temperature=1.0, top_k=3)),
    ("greedy", 2, dict(temperature=1.5, top_p=0.9)),
    ("mirror", 2, dict(temperature=1.5, top_p=0.9, min_p=0.05)),
]


@pytest.mark.parametrize("policy,depth,sampler", CASES, ids=lambda x: str(x))
def test_mtp_samples_match_exact_ar_distribution(policy, depth, sampler):
    engine, hf = _engine()
    dist = exact_distribution(hf, SamplingParams(**sampler))
    assert_fits(sample_mtp(engine, N, depth, policy, **sampler), dist)


@pytest.mark.parametrize("policy", ["greedy", "mirror"])
def test_adversarial_overconfident_head_with_disjoint_top_k(policy):
    """A near one-hot head under top_k=2: its support is often disjoint from the target's."""
    engine, hf = _engine(head_sharpness=40.0)
    sampler = dict(temperature=1.5, top_k=2)
    dist = exact_distribution(hf, SamplingParams(**sampler))
    assert_fits(sample_mtp(engine, N, 3, policy, **sampler), dist)


@pytest.mark.parametrize("policy", ["greedy", "mirror"])
def test_often_accepted_head_keeps_the_distribution(policy):
    engine, hf = _engine(head="repeat")
    sampler = dict(temperature=0.7)
    samples = sample_mtp(engine, N, 3, policy, **sampler)
    assert_fits(samples, exact_distribution(hf, SamplingParams(**sampler)))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_head_keeps_the_distribution(fmt):
    """head_quantize: the head's maps in 8 or 4 bits draft (and give mirror drafts' q) on the
    quantized kernels; the verify stays the trunk's, so the samples keep AR's distribution."""
    engine, hf = _engine(head="repeat")
    assert quantize_linears(engine.runner.head, fmt) == 5  # fc, q/k/v (one matrix), o, gate/up (one), down
    assert any(isinstance(m, QuantLinear) for m in engine.runner.head.layers.modules())
    for policy, sampler in (("mirror", dict(temperature=1.0, top_p=0.9)), ("greedy", dict(temperature=0.7))):
        samples = sample_mtp(engine, N, 2, policy, **sampler)
        assert_fits(samples, exact_distribution(hf, SamplingParams(**sampler)))


def test_chi_square_detects_a_wrong_distribution():
    """The test has power: AR samples at temperature 1 do not fit the temperature-0.5 distribution."""
    engine, hf = _engine()
    samples = sample_mtp(engine, N, 2, "mirror", temperature=1.0)
    with pytest.raises(AssertionError):
        assert_fits(samples, exact_distribution(hf, SamplingParams(temperature=0.5)))


FILTERED = [dict(temperature=1.0), dict(temperature=1.5, top_p=0.9, top_k=5)]  # the graph variant with top-k
PLAIN = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)]  # temperature and top-p alone


@pytest.mark.parametrize("depth,head,policy,samplers", [
    (1, "random", "greedy", FILTERED), (3, "repeat", "greedy", FILTERED), (2, "repeat", "greedy", PLAIN),
    (2, "random", "mirror", FILTERED), (3, "repeat", "mirror", PLAIN), ("auto", "repeat", "mirror", FILTERED)])
def test_chained_sampled_rows_of_different_settings_keep_each_distribution(depth, head, policy, samplers):
    """The chained path (the one a GPU runs): rows of two different samplers in one batch, each
    row's drafts (argmax, or under the mirror policy sampled from the head) accepted by
    rejection sampling on the device from its own noise; each half of the rows fits its own
    sampler's exact AR distribution."""
    engine, hf = _engine(head=head, kv_tokens_per_row=24)  # a chain holds three cycles' slots per row
    engine.generator.chain.enabled = True
    launches = []
    engine.generator.observers.append(lambda event, seq: launches.append(event == "chain_start"))
    if depth == "auto":
        _auto_depth_rows_keep_each_distribution(engine, hf, policy, samplers)
    else:
        samples = sample_mtp(engine, N, depth, policy, samplers=samplers)
        for i, sampler in enumerate(samplers):
            assert_fits(samples[i::2], exact_distribution(hf, SamplingParams(**sampler)))
    assert any(launches)  # the rows decoded chained


def _auto_depth_rows_keep_each_distribution(engine, hf, policy, samplers):
    """depth="auto" rows start at depth 1; a row's third cycle drafts 3 tokens if its first
    cycle's draft was accepted, else 1: its depth depends on its own earlier draws. Five
    tokens, so later cycles' tokens are tested: the last two tokens' joint distribution
    (marginalised from the enumerated five-token one) and the first three's."""
    engine.auto_depth = AutoDepth(3, DepthCosts((1.0, 1.1, 1.2), 0.1), greedy_prior=(0.3,) * 3,
                                  sampled_prior=(0.3,) * 3, rate=1.0)
    depths = set()
    engine.generator.observers.append(lambda event, seq: depths.add(len(seq.stats.cycles_by_depth)))
    samples = sample_mtp(engine, N, "auto", policy, samplers=samplers, length=5)
    assert depths >= {1, 3}  # rows that stayed at depth 1 and rows that went to 3
    for i, sampler in enumerate(samplers):
        dist = exact_distribution(hf, SamplingParams(**sampler), length=5)
        for part in (slice(0, 3), slice(3, 5)):
            marginal: dict[tuple, float] = {}
            for k, p in dist.items():
                marginal[k[part]] = marginal.get(k[part], 0.0) + p
            assert_fits([s[part] for s in samples[i::2]], marginal)


@pytest.mark.parametrize("chained,head", [(False, "random"), (True, "repeat")])
def test_a_pruned_draft_vocabulary_keeps_the_distribution(chained, head):
    """Mirror drafts from a head whose draft vocabulary leaves out three of the eight tokens
    (q is zero there), step by step and chained: the samples fit the exact AR distribution."""
    engine, hf = _engine(head=head, kv_tokens_per_row=24, draft_vocab=[0, 2, 3, 5, 7])
    engine.generator.chain.enabled = chained
    sampler = dict(temperature=1.0)
    assert_fits(sample_mtp(engine, N // 2, 3, "mirror", **sampler), exact_distribution(hf, SamplingParams(**sampler)))


def test_auto_rows_that_leave_drafting_for_ar_steps_on_their_own_draws_keep_the_distribution():
    """depth="auto" with AR steps (the CPU's): a row drafts first; where its draft is rejected,
    its steady estimate falls under what a cycle costs and it steps AR from then on, where it
    is accepted it keeps drafting. Whether a row's later tokens come from AR steps depends on
    its own earlier draws; rows decode one at a time, so each decides alone. The first three
    tokens' and the last two's distributions fit the enumerated AR ones."""
    engine, hf = _engine(head="repeat")
    engine.auto_depth = AutoDepth(3, DepthCosts((1.6, 2.0, 2.4), 0.4), greedy_prior=(0.55,) * 3,
                                  sampled_prior=(0.55,) * 3, ar_steps=True)
    sampler = dict(temperature=1.0, top_p=0.9)
    requests = [(i, engine.make_request(PROMPT, mode="mtp", depth="auto", max_tokens=5, seed=20_000 + i,
                                        draft_policy="mirror", **sampler)) for i in range(N)]
    done = dict(decode_rows(engine, iter(requests), 1))
    seqs = [done[i] for i in range(N)]
    assert engine.runner.blocks.num_used_blocks == 0
    stepped_ar = [s.stats.ar_steps > 0 for s in seqs]
    assert 0.1 * N < sum(stepped_ar) < 0.9 * N  # both kinds of rows
    assert all(s.stats.verify_calls > 0 for s in seqs)  # each drafted first
    dist = exact_distribution(hf, SamplingParams(**sampler), length=5)
    for part in (slice(0, 3), slice(3, 5)):
        marginal: dict[tuple, float] = {}
        for k, p in dist.items():
            marginal[k[part]] = marginal.get(k[part], 0.0) + p
        assert_fits([tuple(s.generated)[part] for s in seqs], marginal)
