"""Hybrid models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) give transformers' logits: chunked prefill,
token-by-token decode, verify forwards cut back to a partially accepted prefix, batched rows.
The recurrent state lives in the engine's state cache and follows the sequence's lifecycle."""

import pytest
import torch

from mtplx.engine.runner import ModelRunner, recurrent_state_bytes
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.sequence import Sequence
from mtplx.models.gated_deltanet import delta_rule_chunked, delta_rule_recurrent, state_after_prefix
from tests.hybrid_models import ARCHS, hybrid_engine, hybrid_pair, one_thread

TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _seq(prompt):
    return Sequence(prompt_ids=list(prompt), params=SamplingParams(), max_tokens=1)


def _admit(runner, prompt, room: int = 40):
    """Admit a sequence straight into the runner's pool: its prompt's blocks, ``room`` more
    slots for what the test decodes after it (the engine's allocator does this in an engine),
    and a recurrent-state slot."""
    seq = _seq(prompt)
    runner.blocks.allocate(seq.seq_id, seq.prompt_ids)
    runner.blocks.ensure_capacity(seq.seq_id, len(prompt) + room)
    seq.state_slot = runner.states.allocate()
    return seq


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _ids(n, seed=0, vocab=96):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    return hybrid_pair(request.param)


def _delta_rule_inputs(rows, length, heads=3, dk=8, dv=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(rows, length, heads, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(rows, length, heads, dv, generator=g)
    decay = -torch.rand(rows, length, heads, generator=g)
    beta = torch.rand(rows, length, heads, generator=g)
    return q, k, v, decay, beta, torch.randn(rows, heads, dk, dv, generator=g)


def test_chunked_and_recurrent_delta_rule_agree():
    q, k, v, decay, beta, state = _delta_rule_inputs(2, 150)
    recurrent = delta_rule_recurrent(q, k, v, decay, beta, state)
    chunked = delta_rule_chunked(q, k, v, decay, beta, state, chunk_size=64)
    for a, b in zip(recurrent, chunked):  # outputs, final state, per-token updates
        assert (a - b).abs().max() <= 1e-4


def test_state_after_prefix_equals_running_only_the_prefix():
    q, k, v, decay, beta, state = _delta_rule_inputs(3, 4, seed=1)
    _, _, deltas = delta_rule_recurrent(q, k, v, decay, beta, state)
    kept = torch.tensor([1, 4, 2])
    rebuilt = state_after_prefix(state, k, deltas, decay, kept)
    for r, n in enumerate(kept.tolist()):
        rows = slice(r, r + 1)
        _, direct, _ = delta_rule_recurrent(q[rows, :n], k[rows, :n], v[rows, :n], decay[rows, :n],
                                            beta[rows, :n], state[rows])
        assert (rebuilt[r] - direct[0]).abs().max() <= 1e-5


def test_prefill_in_chunks_and_paged_decode_match_transformers(pair):
    hf, ours = pair
    runner = ModelRunner(ours, None, num_blocks=64, block_size=4)
    ids = _ids(110)
    ref = _hf_logits(hf, ids)
    seq = _admit(runner, ids[:90])
    first = runner.logits(runner.trunk([seq], [ids[:70]], [0]))[0]  # > 64 tokens: two chunks
    second = runner.logits(runner.trunk([seq], [ids[70:90]], [70]))[0]  # continues the state
    assert (first - ref[:70]).abs().max() <= TOL
    assert (second - ref[70:90]).abs().max() <= TOL
    for pos in range(90, len(ids)):
        step = runner.logits(runner.trunk([seq], [[ids[pos]]], [pos]))[0, 0]
        assert (step - ref[pos]).abs().max() <= TOL, pos


@pytest.mark.parametrize("state_commit", ["capture", "reforward"])
def test_decode_after_partially_accepted_verify_matches_transformers(pair, state_commit):
    """Verify [t, d1, d2, d3] with d1 right and d2 wrong, keep 2 tokens; then a fully accepted
    verify; then one with nothing accepted; decode continues exactly."""
    hf, ours = pair
    runner = ModelRunner(ours, None, num_blocks=64, block_size=4, state_commit=state_commit)
    ids = _ids(40, seed=1)
    ref = _hf_logits(hf, ids)
    seq = _admit(runner, ids[:20])
    runner.trunk([seq], [ids[:20]], [0])
    pos = 20
    for kept in (2, 4, 1, 3):
        true = ids[pos:pos + 4]
        row = true[:kept] + [(t + 1) % 96 for t in true[kept:]]  # drafts wrong after the kept prefix
        logits = runner.logits(runner.trunk([seq], [row], [pos], keep_states=True))[0]
        assert (logits[:kept] - ref[pos:pos + kept]).abs().max() <= TOL
        runner.commit_state([seq], [kept])
        pos += kept
    for p in range(pos, pos + 5):
        step = runner.logits(runner.trunk([seq], [[ids[p]]], [p]))[0, 0]
        assert (step - ref[p]).abs().max() <= TOL, (state_commit, p)


@pytest.mark.parametrize("state_commit", ["capture", "reforward"])
def test_batched_rows_of_different_lengths_match_single_rows(state_commit):
    """Padding must not advance a shorter row's recurrent state."""
    hf, ours = hybrid_pair("qwen3_5")
    runner = ModelRunner(ours, None, num_blocks=64, block_size=4, state_commit=state_commit)
    texts = [_ids(30, seed=s) for s in (2, 3, 4)]
    prompts = [texts[0][:7], texts[1][:3], texts[2][:12]]
    seqs = [_admit(runner, p) for p in prompts]
    logits = runner.logits(runner.trunk(seqs, prompts, [0, 0, 0]))
    refs = [_hf_logits(hf, t) for t in texts]
    for r, p in enumerate(prompts):
        assert (logits[r, : len(p)] - refs[r][: len(p)]).abs().max() <= TOL
    # a batched verify of uneven rows, each cut to its own accepted prefix
    starts, kept = [len(p) for p in prompts], [3, 1, 2]
    rows = [t[s:s + n] for t, s, n in zip(texts, starts, (4, 2, 3))]
    rows = [row[:k] + [(x + 7) % 96 for x in row[k:]] for row, k in zip(rows, kept)]
    runner.trunk(seqs, rows, starts, keep_states=True)
    runner.commit_state(seqs, kept)
    nexts = [s + k for s, k in zip(starts, kept)]
    step = runner.logits(runner.trunk(seqs, [[t[n]] for t, n in zip(texts, nexts)], nexts))[:, 0]
    for r in range(3):
        assert (step[r] - refs[r][nexts[r]]).abs().max() <= TOL


def test_state_slots_follow_the_sequence_lifecycle():
    engine, _ = hybrid_engine("qwen3_5")
    states = engine.runner.states
    engine.generate([1, 2, 3, 4, 5], mode="mtp", depth=2, max_tokens=12)
    engine.generate([1, 2, 3, 4, 5], mode="ar", max_tokens=5)
    assert states.num_used_slots == 0 and engine.runner.blocks.num_used_blocks == 0
    # cancelled mid-generation: closing the stream releases blocks and the state slot
    stream = engine.run(engine.make_request([7, 8, 9], mode="mtp", depth=3, max_tokens=50))
    next(stream), next(stream)
    assert states.num_used_slots == 1
    stream.close()
    assert states.num_used_slots == 0 and engine.runner.blocks.num_used_blocks == 0


def test_prefix_cache_is_disabled_with_a_reason():
    engine, _ = hybrid_engine("qwen3_next")
    prompt = list(range(3, 30))
    first = engine.generate(prompt, mode="mtp", depth=2, max_tokens=10)
    again = engine.generate(prompt, mode="mtp", depth=2, max_tokens=10)
    assert again.stats["cached_prompt_tokens"] == 0
    assert first.token_ids == again.token_ids
    stats = engine.runner.blocks.stats()
    assert stats["prefix_hit_tokens"] == 0 and stats["cached_blocks"] == 0
    assert "recurrent state" in stats["prefix_cache_disabled_reason"]
    assert engine.runner.prefix_cache_disabled_reason == stats["prefix_cache_disabled_reason"]


def test_layer_mix_and_kv_layers():
    _, ours = hybrid_pair("qwen3_next", mlp_only_layers=[1])
    config = ours.config
    assert config.layer_mix() == {"full_attention": 1, "linear_attention": 3, "pattern": "LLLF",
                                  "moe_layers": 3, "experts": "2 of 4 + 1 shared"}
    runner = ModelRunner(ours, None, num_blocks=8, block_size=4)
    assert len(runner.cache.k) == config.num_kv_layers == 1
    per_slot = sum(t[0].numel() * t.element_size() for t in runner.states.conv + runner.states.ssm)
    assert recurrent_state_bytes(config, torch.float32) == per_slot
