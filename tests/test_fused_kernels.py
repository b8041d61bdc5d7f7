"""The fused Triton kernels (mtplx/kernels/fused.py) against the PyTorch reference path.

Runs on a CUDA device, or on the CPU under Triton's interpreter:
    TRITON_INTERPRET=1 python -m pytest -q tests/test_fused_kernels.py
(skipped where Triton is not installed, as in CPU-only CI; benchmarks/gpu.py runs the same
comparison on the GPU before it times anything).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from mtplx.engine import attention
from mtplx.kernels import fused, gemv
from mtplx.models.config import ModelConfig
from mtplx.models.layers import RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.skipif(
    not fused.available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def tol(dtype) -> float:
    """float32: rounding only; bf16: a few roundings (the interpreter truncates instead of
    rounding to nearest, which doubles the error)."""
    if dtype == torch.float32:
        return 1e-5
    return 1e-2 if DEVICE == "cuda" else 2.5e-2


@pytest.fixture
def reference_path():
    """Run the block with the fused kernels switched off (the reference)."""
    def run(fn):
        attention.KERNELS_ENABLED = False
        try:
            return fn()
        finally:
            attention.KERNELS_ENABLED = True
    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("n", [64, 96])
def test_rms_norm_with_and_without_residual(dtype, zero_centered, n, reference_path):
    g = torch.Generator().manual_seed(n)
    norm = RMSNorm(n, 1e-6, zero_centered).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g))
    x = torch.randn(3, 5, n, generator=g).to(DEVICE, dtype) * 3
    delta = torch.randn(3, 5, n, generator=g).to(DEVICE, dtype)
    with torch.inference_mode():
        got = norm(x)
        got_sum, got_norm = norm.add_forward(x, delta)
        ref = reference_path(lambda: norm(x))
        ref_sum, ref_norm = reference_path(lambda: norm.add_forward(x, delta))
    if DEVICE == "cuda":  # the add rounds exactly as PyTorch's does (the interpreter truncates to bf16)
        assert torch.equal(got_sum, ref_sum)
    assert rel(got_sum, ref_sum) < tol(dtype)
    assert rel(got, ref) < tol(dtype) and rel(got_norm, ref_norm) < tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_qkv_rope_write_matches_reference(dtype, qk_norm, partial):
    heads, kv_heads, d, rows, q_len, page = 4, 2, 32, 2, 3, 4
    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=10, hidden_size=heads * d, intermediate_size=8,
                                   num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   head_dim=d, partial_rotary_factor=partial, rope_theta=10000.0))
    g = torch.Generator().manual_seed(7)
    rope = RotaryEmbedding(cfg).to(DEVICE)
    qkv = torch.randn(rows, q_len, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)  # strided views, as in the model
    positions = torch.tensor([[5, 6, 7], [0, 1, 1]], device=DEVICE)
    slots = torch.tensor([[9, 10, 11], [0, 1, 12]], device=DEVICE)
    pools = [torch.full((4, page, kv_heads, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    qw = torch.randn(d, generator=g).to(DEVICE, dtype)
    kw = torch.randn(d, generator=g).to(DEVICE, dtype)
    bound = rope.bind(positions, dtype)
    with torch.inference_mode():
        got_q = fused.qkv_rope_write(q, k, v, bound.cos, bound.sin, slots, pools[0], pools[1], heads, kv_heads, d,
                                     qw if qk_norm else None, kw if qk_norm else None, 1e-6)
        rq = q.reshape(rows, q_len, heads, d)
        rk = k.reshape(rows, q_len, kv_heads, d)
        if qk_norm:
            qn, kn = RMSNorm(d, 1e-6).to(DEVICE, dtype), RMSNorm(d, 1e-6).to(DEVICE, dtype)
            qn.weight.copy_(qw)
            kn.weight.copy_(kw)
            rq, rk = qn._reference(rq), kn._reference(rk)
        ref_q, ref_k = bound(rq), bound(rk)
        attention.write_kv(pools[2], pools[3], ref_k, v.reshape(rows, q_len, kv_heads, d), slots)
    assert rel(got_q, ref_q) < tol(dtype)
    written = slots.reshape(-1)
    for got, ref in ((pools[0], pools[2]), (pools[1], pools[3])):
        g_flat, r_flat = got.view(-1, kv_heads, d), ref.view(-1, kv_heads, d)
        assert not torch.isnan(g_flat[written]).any()
        assert rel(g_flat[written], r_flat[written]) < tol(dtype)
        untouched = torch.ones(g_flat.shape[0], dtype=torch.bool)
        untouched[written.cpu()] = False
        assert torch.isnan(g_flat[untouched.to(DEVICE)]).all()  # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 2 * 1500, generator=g).to(DEVICE, dtype) * 4
    gate, up = x.chunk(2, dim=-1)
    assert rel(fused.silu_mul(x), F.silu(gate) * up) < tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_variants_match_reference(dtype, reference_path):
    g = torch.Generator().manual_seed(1)
    rows, k, n = 1, 300, 70  # neither a multiple of the tiles
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    delta = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    norm = RMSNorm(k, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(k, generator=g))
    with torch.inference_mode():
        assert rel(gemv.gemv(x, w, b), F.linear(x, w, b)) < tol(dtype)
        s, got = gemv.norm_gemv(x, delta, norm.weight, norm.eps, w)
        ref_s, ref_h = reference_path(lambda: norm.add_forward(x, delta))
        assert rel(s, ref_s) < tol(dtype) and rel(got, F.linear(ref_h, w)) < tol(dtype)
        s, got = gemv.norm_gemv(x, None, norm.weight, norm.eps, w, b)
        assert s is x and rel(got, F.linear(reference_path(lambda: norm(x)), w, b)) < tol(dtype)
        gate_up = torch.randn(rows, 2 * k, generator=g).to(DEVICE, dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        assert rel(gemv.silu_gemv(gate_up, w), F.linear(F.silu(gate) * up, w)) < tol(dtype)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_tiny_model_forward_matches_reference(family, reference_path):
    """A whole tiny Qwen3 (q/k norms) or Qwen2 (qkv bias) with fused projections: fused
    kernels vs reference, through prefill and a 3-token forward (the elementwise kernels)
    and one-token forwards (the one-row GEMV blocks) over the paged cache."""
    from mtplx.engine.llm_engine import Engine
    from mtplx.loading.checkpoint import LoadedModel
    from mtplx.models.layers import fuse_projections
    from tests.tiny_models import hf_reference, ours_from_hf

    hf, cfg = hf_reference(family)
    model = ours_from_hf(hf, cfg).to(DEVICE)
    fuse_projections(model)
    outs = []
    for enabled in (True, False):
        engine = Engine(LoadedModel(model, None, None, model.config, source=None), kv_cache_tokens=256, block_size=4)
        attention.KERNELS_ENABLED = enabled
        try:
            seq = engine.new_sequence(engine.make_request(list(range(3, 20)), mode="ar", max_tokens=8))
            engine.generator.admit(seq)
            with torch.inference_mode():
                runner = engine.runner
                prefill = runner.logits(runner.trunk([seq], [seq.prompt_ids], [0]))
                step = runner.logits(runner.trunk([seq], [[4, 5, 6]], [17]))
                one = runner.logits(runner.trunk([seq], [[7]], [20]))
            outs.append((prefill, step, one))
        finally:
            attention.KERNELS_ENABLED = True
    for got, ref in zip(outs[0], outs[1]):
        assert rel(got, ref) < 1e-5
