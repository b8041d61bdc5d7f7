"""Grammar-constrained decoding keeps MTP exact: a constrained MTP request samples the
constrained AR distribution (the target's processed distribution restricted to the grammar
and renormalised at every position), still accepts drafts, and greedy constrained MTP equals
greedy constrained AR token for token.

The reference distribution is enumerated from transformers' logits and a hand-written table of
what the grammar allows after each prefix, not from the code under test."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from mtplx.engine.constraints import GrammarCompiler
from mtplx.engine.sampling import SamplingParams, logits_to_probs
from mtplx.forge.data import decode_rows
from tests.test_mtp_sampling_exact import PROMPT, V, _engine, assert_fits
from tests.test_server_harness import char_tokenizer, tiny_text_engine

LETTERS = "abcdefgh"  # token t is the letter LETTERS[t]
# after "a": c-e then anything; after "b": f-h then a or b; after c-h: anything then "a"
GRAMMAR = 'root ::= "a" [c-e] [a-h] | "b" [f-h] [ab] | [c-h] [a-h] "a"'
N = 1200


def allowed(prefix: tuple[int, ...]) -> set[int]:
    """What GRAMMAR allows next after ``prefix`` (token ids), written out by hand."""
    letters = "".join(LETTERS[t] for t in prefix)
    if not letters:
        return set(range(V))
    first = letters[0]
    if len(letters) == 1:
        return {2, 3, 4} if first == "a" else {5, 6, 7} if first == "b" else set(range(V))
    return set(range(V)) if first == "a" else {0, 1} if first == "b" else {0}


def constrained_distribution(hf, params: SamplingParams, length: int = 3) -> dict[tuple, float]:
    dist = {(): 1.0}
    for _ in range(length):
        prefixes = list(dist)
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1].float()
        for i, p in enumerate(prefixes):
            keep = torch.zeros(V, dtype=torch.bool)
            keep[list(allowed(p))] = True
            logits[i] = logits[i].masked_fill(~keep, float("-inf"))
        probs = logits_to_probs(logits, params)
        dist = {p + (t,): dist[p] * float(probs[i, t]) for i, p in enumerate(prefixes) for t in range(V)
                if probs[i, t] > 0}
    return dist


def decode(engine, grammar, n: int, mode: str, depth: int = 0, policy: str = "greedy", **sampler) -> list:
    """n independent 3-token continuations under ``grammar``, rows of one batch; the sequences."""
    requests = []
    for i in range(n):
        req = engine.make_request(PROMPT, mode=mode, depth=depth or None, max_tokens=3, seed=20_000 + i,
                                  draft_policy=policy, **sampler)
        req.grammar = grammar
        requests.append((i, req))
    done = dict(decode_rows(engine, iter(requests), n))
    return [done[i] for i in range(n)]


@pytest.fixture(scope="module")
def tiny():
    engine, hf = _engine(head="repeat")
    compiler = GrammarCompiler(None, V, [], vocab=list(LETTERS))
    return engine, hf, compiler.ebnf(GRAMMAR)


@pytest.mark.parametrize("policy, depth, sampler", [
    ("greedy", 2, dict(temperature=1.0)),
    ("mirror", 3, dict(temperature=1.5, top_k=4)),
])
def test_constrained_mtp_samples_the_constrained_ar_distribution(tiny, policy, depth, sampler):
    engine, hf, grammar = tiny
    seqs = decode(engine, grammar, N, "mtp", depth, policy, **sampler)
    samples = [tuple(s.generated) for s in seqs]
    assert all(len(s) == 3 and allowed(s[:1]) >= {s[1]} and allowed(s[:2]) >= {s[2]} for s in samples)
    assert_fits(samples, constrained_distribution(hf, SamplingParams(**sampler)))
    assert sum(s.stats.accepted_tokens for s in seqs) > 0  # drafts are still accepted


def test_constrained_ar_samples_the_same_distribution(tiny):
    engine, hf, grammar = tiny
    samples = [tuple(s.generated) for s in decode(engine, grammar, N, "ar", temperature=1.0)]
    assert_fits(samples, constrained_distribution(hf, SamplingParams(temperature=1.0)))


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_greedy_constrained_mtp_equals_greedy_constrained_ar_and_validates():
    engine = tiny_text_engine(head="repeat", context=512)
    grammar = GrammarCompiler(char_tokenizer().hf, 96, [2]).json_schema(SCHEMA)
    outs = {}
    for mode in ("ar", "mtp"):
        req = engine.make_request("Answer in JSON:", mode=mode, max_tokens=40, temperature=0.0)
        req.grammar = grammar
        pieces = []
        for seq, piece in engine.run(req):
            pieces.append(piece)
        outs[mode] = ("".join(pieces), seq.finish_reason, seq.stats.as_dict())
    assert outs["mtp"][:2] == outs["ar"][:2] and outs["ar"][1] == "stop"  # the grammar ended it with EOS
    jsonschema.validate(json.loads(outs["ar"][0]), SCHEMA)
    assert outs["mtp"][2]["drafted_tokens"] > 0
