"""MTP on hybrid models: greedy output equals AR greedy output at depths 1-3, and sampled MTP
decoding has exactly the AR distribution (the recurrent state is cut back to the accepted
prefix on every partial acceptance)."""

import functools

import pytest
import torch

from mtplx.engine.sampling import SamplingParams, logits_to_probs
from tests.hybrid_models import ARCHS, hf_hybrid, hybrid_engine, one_thread, script_drafts
from tests.test_mtp_sampling_exact import PROMPT, assert_fits, exact_distribution, sample_mtp

PROMPTS = [[1, 2, 3], [5, 17, 33, 2, 8, 9, 10, 11, 40]]
NEW_TOKENS = 24


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.mark.parametrize("state_commit", ["capture", "reforward"])
@pytest.mark.parametrize("drafts", ["head", "scripted"])
@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_mtp_greedy_equals_ar_greedy(arch, drafts, state_commit):
    """'head': the random MTP head's drafts (almost all rejected); 'scripted': the AR output
    with every fifth token wrong (partial and full acceptances at every depth)."""
    engine, _ = hybrid_engine(arch)
    engine.runner.state_commit = state_commit
    for prompt in PROMPTS:
        ar = engine.generate(prompt, mode="ar", max_tokens=NEW_TOKENS)
        assert ar.token_ids == _hf_greedy(arch, tuple(prompt))  # AR itself equals transformers'
        truth = ar.token_ids + [0] * 8
        if drafts == "scripted":
            script_drafts(engine, lambda prefix: truth[len(prefix)] + (len(prefix) % 5 == 3))
        for depth in (1, 2, 3):
            mtp = engine.generate(prompt, mode="mtp", depth=depth, max_tokens=NEW_TOKENS)
            assert mtp.token_ids == ar.token_ids, (prompt, depth)
            assert len(mtp.stats["drafted_by_depth"]) == depth
            if drafts == "scripted":
                assert 0 < mtp.stats["bonus_tokens"] and 0 < mtp.stats["accepted_tokens"]
                assert mtp.stats["correction_tokens"] > 0
    assert engine.runner.states.num_used_slots == 0


@functools.cache
def _hf_greedy(arch: str, prompt: tuple[int, ...]) -> list[int]:
    hf, _ = hf_hybrid(arch)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


V = 8
N = 1200
TINY_VOCAB = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def _sampling_engine():
    engine, hf = hybrid_engine("qwen3_5", seed=3, kv_cache_tokens=N * 12, **TINY_VOCAB)
    with torch.no_grad():  # peaked, varied next-token distributions (random init is near uniform)
        hf.lm_head.weight.mul_(25.0)
        engine.loaded.model.lm_head.weight.mul_(25.0)
    return engine, hf


def _target_argmax(hf, params: SamplingParams, length: int = 3) -> dict[tuple, int]:
    """The most likely next token after every continuation prefix shorter than ``length``."""
    prefixes = [()]
    for _ in range(length - 1):
        prefixes += [p + (t,) for p in prefixes if len(p) == len(prefixes[-1]) for t in range(V)]
    with torch.no_grad():
        best = {}
        for p in prefixes:
            logits = hf(torch.tensor([PROMPT + list(p)])).logits[:, -1].float()
            best[p] = int(logits_to_probs(logits, params).argmax())
    return best


def test_hybrid_mirror_drafts_keep_the_distribution():
    """Depth 1, many rejections: a state not cut back to the accepted prefix fails this
    (p ~ 1e-9 when checked by breaking ``commit_state``)."""
    engine, hf = _sampling_engine()
    sampler = dict(temperature=1.0)
    samples = sample_mtp(engine, N, 1, "mirror", **sampler)
    assert engine.runner.states.num_used_slots == 0
    assert_fits(samples, exact_distribution(hf, SamplingParams(**sampler)))


def test_hybrid_often_accepted_drafts_keep_the_distribution():
    """One-hot drafts of the target's most likely token: accepted with probability p(x), so
    samples take every acceptance length."""
    engine, hf = _sampling_engine()
    params = SamplingParams(temperature=0.7)
    best = _target_argmax(hf, params)
    script_drafts(engine, lambda prefix: best.get(tuple(prefix), 0))
    samples = sample_mtp(engine, N, 3, "greedy", temperature=0.7)
    assert_fits(samples, exact_distribution(hf, params))
