"""Logprobs come from the target's distribution at each committed position, the same whether
the token came from an AR step or an accepted MTP draft: checked against transformers' own
logits for every reported position, and AR against MTP."""

from __future__ import annotations

import pytest
import torch

from mtplx.forge.data import decode_rows
from tests.test_mtp_sampling_exact import PROMPT, _engine

TOP = 3


@pytest.fixture(scope="module")
def tiny():
    return _engine(head="repeat", kv_dtype="float32")  # logprobs against the reference's to 1e-4


GREEDY_PROMPT = [0, 0, 4]  # greedy continues 4, 4, ...: the repeat head's drafts are accepted


def decode(engine, n: int, mode: str, depth: int | None = None, prompt: list[int] = PROMPT, **sampler):
    requests = []
    for i in range(n):
        req = engine.make_request(prompt, mode=mode, depth=depth, max_tokens=8, seed=500 + i, **sampler)
        req.logprobs = TOP
        requests.append((i, req))
    done = dict(decode_rows(engine, iter(requests), n))
    return [done[i] for i in range(n)]


def reference(hf, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """transformers' log-softmax(logits / T) after each prefix of ``tokens`` -> [len, V]."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: len(prompt) - 1 + len(tokens)]
    return torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)


@pytest.mark.parametrize("mode, depth, temperature", [("mtp", 3, 1.0), ("mtp", 2, 0.7), ("ar", None, 1.0),
                                                       ("mtp", 3, 0.0)])
def test_every_reported_logprob_is_the_targets(tiny, mode, depth, temperature):
    engine, hf = tiny
    prompt = GREEDY_PROMPT if temperature == 0 else PROMPT
    seqs = decode(engine, 12, mode, depth, prompt, temperature=temperature, top_k=5)
    for seq in seqs:
        ref = reference(hf, prompt, seq.generated, temperature)
        assert len(seq.logprobs) == len(seq.generated)
        for i, (token, (value, top)) in enumerate(zip(seq.generated, seq.logprobs)):
            assert value == pytest.approx(float(ref[i, token]), abs=1e-4)
            ids, values = zip(*top)
            assert len(top) == TOP and values == pytest.approx(ref[i].topk(TOP).values.tolist(), abs=1e-4)
            assert set(ids) <= set(ref[i].topk(TOP + 1).indices.tolist())  # ties aside, the same tokens
    if mode == "mtp":  # some positions were accepted drafts, so both sources were checked
        assert sum(s.stats.accepted_tokens for s in seqs) > 0


def test_greedy_ar_and_mtp_report_the_same_logprobs(tiny):
    engine, _ = tiny
    [ar] = decode(engine, 1, "ar", prompt=GREEDY_PROMPT, temperature=0.0)
    [mtp] = decode(engine, 1, "mtp", 3, GREEDY_PROMPT, temperature=0.0)
    assert ar.generated == mtp.generated and mtp.stats.accepted_tokens > 0
    for (a, top_a), (b, top_b) in zip(ar.logprobs, mtp.logprobs):
        assert a == pytest.approx(b, abs=1e-4) and [t for t, _ in top_a] == [t for t, _ in top_b]


def test_prompt_scoring_matches_the_target_even_after_a_prefix_cache_hit(tiny):
    engine, hf = tiny
    prompt = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2]  # over two KV blocks of 4: a second run would hit the cache
    ref = reference(hf, prompt[:1], prompt[1:], 0.7)
    for _ in range(2):
        req = engine.make_request(prompt, mode="mtp", max_tokens=1, temperature=0.7, seed=1)
        req.prompt_logprobs = 2
        seq = engine.new_sequence(req)
        engine.generator.admit(seq)
        assert seq.cached_prompt_tokens == 0  # scoring computes every position
        with torch.inference_mode():
            engine.generator.prefill(seq, chunk=4)  # in chunks, as the batching modes prefill
            while not engine.generator.prefill(seq, chunk=4):
                pass
        engine.generator.release(seq)
        assert len(seq.prompt_logprobs) == len(prompt) - 1
        for i, (token, (value, top)) in enumerate(zip(prompt[1:], seq.prompt_logprobs)):
            assert value == pytest.approx(float(ref[i, token]), abs=1e-4)
            assert [v for _, v in top] == pytest.approx(ref[i].topk(2).values.tolist(), abs=1e-4)
