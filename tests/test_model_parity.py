"""Our PyTorch models give transformers' logits: prefill, paged decode, and after a prefix hit."""

import pytest
import torch

from mtplx.engine.runner import ModelRunner
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.sequence import Sequence
from tests.tiny_models import hf_reference, ours_from_hf

ARCHS = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("qwen2", {}),
    ("qwen3", {}),
]
TOL = 1e-4


def _seq(prompt):
    return Sequence(prompt_ids=list(prompt), params=SamplingParams(), max_tokens=1)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch,overrides", ARCHS, ids=lambda x: x if isinstance(x, str) else str(sorted(x)))
def test_prefill_and_paged_decode_match_transformers(arch, overrides):
    hf, cfg = hf_reference(arch, **overrides)
    ours = ours_from_hf(hf, cfg)
    runner = ModelRunner(ours, None, num_blocks=32, block_size=4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (23,), generator=g).tolist()
    ref = _hf_logits(hf, ids)

    seq = _seq(ids[:9])
    runner.blocks.allocate(seq.seq_id, seq.prompt_ids)
    runner.blocks.ensure_capacity(seq.seq_id, len(ids))  # the slots decoded below (an engine reserves them)
    prefill = runner.logits(runner.trunk([seq], [ids[:9]], [0]))[0]
    assert (prefill - ref[:9]).abs().max() <= TOL
    for pos in range(9, len(ids)):  # token by token through the paged cache
        step = runner.logits(runner.trunk([seq], [[ids[pos]]], [pos]))[0, 0]
        assert (step - ref[pos]).abs().max() <= TOL, pos


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_after_prefix_cache_hit_matches_transformers(arch):
    hf, cfg = hf_reference(arch)
    ours = ours_from_hf(hf, cfg)
    runner = ModelRunner(ours, None, num_blocks=32, block_size=4)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, cfg["vocab_size"], (13,), generator=g).tolist()
    first = shared + [5, 6, 7]
    second = shared + [9, 10, 11, 12]

    a = _seq(first)
    runner.blocks.allocate(a.seq_id, first)
    runner.trunk([a], [first], [0])
    runner.blocks.commit(a.seq_id, first)
    runner.blocks.free(a.seq_id)

    b = _seq(second)
    cached = runner.blocks.allocate(b.seq_id, second)
    assert cached == 12  # three full blocks of the shared prefix
    logits = runner.logits(runner.trunk([b], [second[cached:]], [cached]))[0]
    ref = _hf_logits(hf, second + [3])
    assert (logits - ref[cached:len(second)]).abs().max() <= TOL
    step = runner.logits(runner.trunk([b], [[3]], [len(second)]))[0, 0]
    assert (step - ref[len(second)]).abs().max() <= TOL


def test_batched_rows_of_different_lengths_match_single_rows():
    hf, cfg = hf_reference("llama")
    ours = ours_from_hf(hf, cfg)
    runner = ModelRunner(ours, None, num_blocks=64, block_size=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    seqs = [_seq(p) for p in prompts]
    for s in seqs:
        runner.blocks.allocate(s.seq_id, s.prompt_ids)
    hidden = runner.trunk(seqs, prompts, [0, 0, 0])
    logits = runner.logits(hidden)
    for r, p in enumerate(prompts):
        ref = _hf_logits(hf, p)
        assert (logits[r, : len(p)] - ref).abs().max() <= TOL


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_projections_give_the_same_logits(arch):
    """The GPU path fuses q/k/v and gate/up matmuls; the model must compute the same function."""
    from mtplx.models.layers import fuse_projections

    hf, cfg = hf_reference(arch, attention_bias=True) if arch == "llama" else hf_reference(arch)
    ours = ours_from_hf(hf, cfg)
    ids = list(range(5, 30))
    runner = ModelRunner(ours, None, num_blocks=32, block_size=4)
    seq = _seq(ids)
    runner.blocks.allocate(seq.seq_id, ids)
    before = runner.logits(runner.trunk([seq], [ids], [0]))
    params = sum(p.numel() for p in ours.parameters())
    assert fuse_projections(ours) == 2 * cfg["num_hidden_layers"]
    after = runner.logits(runner.trunk([seq], [ids], [0]))
    assert (before - after).abs().max() <= 1e-5
    assert sum(p.numel() for p in ours.parameters()) == params  # views, no second copy
    # A second engine over the same model must not re-fuse: graphs captured by the first read
    # the fused weights' addresses (re-fusing freed them and broke those graphs on the GPU).
    pointers = [(a.qkv_weight.data_ptr(), m.gate_up_weight.data_ptr())
                for a, m in ((layer.self_attn, layer.mlp) for layer in ours.model.layers)]
    assert fuse_projections(ours) == 0
    assert pointers == [(a.qkv_weight.data_ptr(), m.gate_up_weight.data_ptr())
                        for a, m in ((layer.self_attn, layer.mlp) for layer in ours.model.layers)]
