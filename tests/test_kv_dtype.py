"""The KV cache's element type (``runtime.resolve_kv_dtype``): float16 by default on the CPU for a
float32 model, the model's dtype elsewhere; what each choice allows, and what float16 entries
change (rounding only) and keep (greedy MTP = AR, a seed's tokens)."""

from __future__ import annotations

import pytest
import torch

from mtplx.errors import InvalidParameter
from mtplx.runtime import resolve_kv_dtype
from tests.tiny_models import tiny_engine

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_choices_by_device_and_model_dtype():
    assert resolve_kv_dtype(None, CPU, torch.float32) == torch.float16
    assert resolve_kv_dtype("auto", CPU, torch.float32) == torch.float16
    assert resolve_kv_dtype("float32", CPU, torch.float32) == torch.float32
    assert resolve_kv_dtype(torch.float16, CPU, torch.float32) == torch.float16
    assert resolve_kv_dtype(None, CPU, torch.bfloat16) == torch.bfloat16  # a 16-bit model keeps its own
    assert resolve_kv_dtype("float32", CPU, torch.bfloat16) == torch.float32
    assert resolve_kv_dtype(None, CUDA, torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("bf16", CUDA, torch.bfloat16) == torch.bfloat16
    with pytest.raises(InvalidParameter, match="float16 is not available on cuda with a bfloat16 model"):
        resolve_kv_dtype("float16", CUDA, torch.bfloat16)
    with pytest.raises(InvalidParameter, match="bfloat16 is not available on cpu with a float32 model"):
        resolve_kv_dtype("bfloat16", CPU, torch.float32)
    with pytest.raises(InvalidParameter, match="float16 is not available on cpu with a bfloat16 model"):
        resolve_kv_dtype("float16", CPU, torch.bfloat16)  # (no float16 kernels for bf16 activations)
    with pytest.raises(InvalidParameter, match="'int8' is not one of auto, float32, float16, bfloat16"):
        resolve_kv_dtype("int8", CPU, torch.float32)


def test_float16_entries_are_the_float32_ones_rounded():
    """The same prompt's forward through both caches: every written entry of the float16 cache
    is the float32 cache's rounded to nearest (the prompt's 40 tokens attend through SDPA over the
    widened pools, the next token through the C++ row attention), and the hidden states differ
    by that rounding only."""
    (e16, _), (e32, _) = (tiny_engine("qwen3", head=False, seed=5, kv_dtype=k) for k in (None, "float32"))
    assert e16.runner.cache.kv_dtype == torch.float16 and e32.runner.cache.kv_dtype == torch.float32
    assert e16.runner.cache.last_hidden.dtype == torch.float32  # the head's resume state stays exact
    prompt = torch.randint(0, 64, (41,), generator=torch.Generator().manual_seed(1)).tolist()
    hidden = []
    for engine in (e16, e32):
        seq = engine.new_sequence(engine.make_request(prompt, mode="ar", max_tokens=1))
        engine.runner.blocks.allocate(seq.seq_id, seq.prompt_ids)
        engine.runner.trunk([seq], [prompt[:40]], [0])
        hidden.append(engine.runner.trunk([seq], [prompt[40:]], [40]))
    first_entries = None
    for k16, k32 in zip(e16.runner.cache.k + e16.runner.cache.v, e32.runner.cache.k + e32.runner.cache.v):
        if first_entries is None:  # layer 0's inputs are the same embeddings in both: exactly the rounding
            first_entries = torch.equal(k16, k32.half())
        assert k16.dtype == torch.float16
        torch.testing.assert_close(k16.float(), k32, rtol=2e-2, atol=2e-3)
    assert first_entries
    assert not torch.equal(hidden[0], hidden[1])
    torch.testing.assert_close(hidden[0], hidden[1], rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_mtp_equals_ar_through_a_float16_cache(depth):
    engine, _ = tiny_engine("llama", seed=2)
    assert engine.runner.cache.kv_dtype == torch.float16
    ar = engine.generate([3, 1, 4, 1, 5], mode="ar", max_tokens=24)
    assert engine.generate([3, 1, 4, 1, 5], mode="mtp", depth=depth, max_tokens=24).token_ids == ar.token_ids


def test_a_seed_fixes_sampled_tokens_through_a_float16_cache():
    engine, _ = tiny_engine("llama", seed=2)
    runs = [engine.generate([2, 7, 1], mode="mtp", depth=2, max_tokens=20, temperature=0.9, seed=11).token_ids
            for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kernels", [True, False])
def test_a_value_past_float16s_range_is_reported_once(kernels, monkeypatch, caplog):
    """A float32 model whose values pass 65,504 writes inf into a float16 cache: the engine logs
    it once (through the C++ writes and through write_kv's), and a float32 cache or a model
    within range logs nothing."""
    import logging

    from mtplx.cache import attention
    from mtplx.kernels import cpu as cpu_kernels

    if kernels and not cpu_kernels.available():
        pytest.skip("the CPU kernels are not built here")
    if not kernels:
        monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    attention.took_kv_overflow()  # nothing left over from earlier tests
    prompt = list(range(1, 30))
    for kv_dtype, blow_up, warned in (("float16", False, False), ("float32", True, False), ("float16", True, True)):
        engine, _ = tiny_engine("llama", kv_dtype=kv_dtype)
        if blow_up:
            with torch.no_grad():  # every layer's values far past float16's range
                for layer in engine.loaded.model.model.layers:
                    proj = layer.self_attn.v_proj if layer.self_attn.v_proj is not None else layer.self_attn.qkv_proj
                    proj.weight.mul_(1e6)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mtplx"):
            engine.generate(prompt, mode="ar", max_tokens=4)
            engine.generate(prompt[:20], mode="ar", max_tokens=4)
        notes = [r for r in caplog.records if "past float16's range" in r.getMessage()]
        assert len(notes) == (1 if warned else 0), (kv_dtype, blow_up, [r.getMessage() for r in notes])
