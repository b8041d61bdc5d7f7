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

from mtplx import kernels
from mtplx.cache import attention
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
        kernels.ENABLED = False
        try:
            return fn()
        finally:
            kernels.ENABLED = True
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
@pytest.mark.parametrize("rows", range(1, gemv.MAX_ROWS + 1))
def test_gemv_variants_match_reference(dtype, rows, reference_path):
    """Every prologue, with and without the residual add and the bias, for 1..MAX_ROWS rows whose
    inputs are strided views (as hidden[:, -1] is): each row as F.linear on the reference path's
    inputs."""
    g = torch.Generator().manual_seed(rows)
    k, n = 300, 70  # neither a multiple of the tiles

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)

    x = rand(1, rows, k + 8)[..., :k]
    delta = rand(1, rows, k)
    w, b = rand(n, k, scale=k ** -0.5), rand(n)
    norm = RMSNorm(k, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(k, generator=g))
    with torch.inference_mode():
        for bias in (None, b):
            assert rel(gemv.gemv(x, w, bias), F.linear(x, w, bias)) < tol(dtype)
            s, got = gemv.norm_gemv(x, delta, norm.weight, norm.eps, w, bias)
            ref_s, ref_h = reference_path(lambda: norm.add_forward(x, delta))
            assert rel(s, ref_s) < tol(dtype) and rel(got, F.linear(ref_h, w, bias)) < tol(dtype)
            s, got = gemv.norm_gemv(x, None, norm.weight, norm.eps, w, bias)
            assert s is x and rel(got, F.linear(reference_path(lambda: norm(x)), w, bias)) < tol(dtype)
            gate_up = rand(rows, 2 * k + 8)[:, :2 * k]
            gate, up = gate_up.chunk(2, dim=-1)
            assert rel(gemv.silu_gemv(gate_up, w, bias), F.linear(F.silu(gate) * up, w, bias)) < tol(dtype)


def test_gemv_takes_one_row_or_a_few_for_small_weights():
    like = dict(device=DEVICE, dtype=torch.bfloat16)
    small, big = torch.empty(8, 16, **like), torch.empty(gemv.SMALL_WEIGHT // 16 + 1, 16, **like)
    with torch.inference_mode():
        assert gemv.usable(torch.randn(2, gemv.MAX_ROWS // 2, 16, **like), small)
        assert not gemv.usable(torch.randn(gemv.MAX_ROWS + 1, 16, **like), small)
        assert gemv.usable(torch.randn(1, 1, 16, **like), big) and not gemv.usable(torch.randn(2, 16, **like), big)
    assert not gemv.usable(torch.randn(1, 16, **like, requires_grad=True), small)  # the kernel has no backward
    assert not gemv.usable(torch.randn(1, 16, **like), small)  # nor under autograd at all


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_tiny_model_forward_matches_reference(family, reference_path, monkeypatch):
    """A whole tiny Qwen3 (q/k norms) or Qwen2 (qkv bias) with fused projections over the paged
    cache: fused kernels vs reference, through a prefill of 4 sequences and forwards of more
    than MAX_ROWS token rows (the elementwise kernels), and through the GEMV blocks: AR steps
    of 1..4 sequences, verifies of 1 + 1..3 tokens and a padded verify of two sequences."""
    from mtplx.engine.llm_engine import Engine
    from mtplx.loading.checkpoint import LoadedModel
    from mtplx.models.layers import fuse_projections
    from tests.tiny_models import hf_reference, ours_from_hf

    hf, cfg = hf_reference(family)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # on CUDA the GEMV takes half precision
    model = ours_from_hf(hf, cfg).to(DEVICE, dtype)
    fuse_projections(model)
    gemv_rows = set()
    launch = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda x2, *a, **kw: gemv_rows.add(x2.shape[0]) or launch(x2, *a, **kw))
    forwards = [  # (sequences, token rows, starts), run in this order over one cache
        (4, [list(range(3 + r, 20 + r)) for r in range(4)], [0] * 4),
        *[(r, [[7]] * r, [17] * r) for r in (2, 3, 4)],
        *[(1, [list(range(4, 4 + q))], [18]) for q in range(2, gemv.MAX_ROWS + 1)],
        (2, [[8, 9, 10]] * 2, [22, 18]),
        (2, [[12, 13], [14]], [25, 21]),
        (1, [[11]], [27]),
    ]
    outs = []
    for enabled in (True, False):
        engine = Engine(LoadedModel(model, None, None, model.config, source=None), kv_cache_tokens=256, block_size=4)
        kernels.ENABLED = enabled
        try:
            seqs = [engine.new_sequence(engine.make_request(rows, mode="ar", max_tokens=16))
                    for rows in forwards[0][1]]
            for seq in seqs:
                engine.generator.admit(seq)
            with torch.inference_mode():
                runner = engine.runner
                outs.append([])
                for n, token_rows, starts in forwards:
                    for seq, rows, start in zip(seqs, token_rows, starts):  # slots before the forward
                        engine.kv.reserve(seq, start + len(rows))
                    outs[-1].append(runner.logits(runner.trunk(seqs[:n], token_rows, starts)))
        finally:
            kernels.ENABLED = True
    assert gemv_rows == set(range(1, gemv.MAX_ROWS + 1))
    errors = [rel(got, ref) for got, ref in zip(outs[0], outs[1])]
    assert max(errors) < (1e-5 if dtype == torch.float32 else 2e-2), errors


def test_autograd_takes_the_reference_path():
    """The kernels have no backward: with autograd on (forge trains a head through these
    modules) the norm and the projections run the reference path and gradients reach the
    weights. (Forge's GPU training failed with 'does not require grad' before.)"""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the GEMV's dtypes on CUDA
    norm = RMSNorm(64, 1e-6).to(DEVICE, dtype)
    proj = torch.nn.Linear(64, 32, bias=False).to(DEVICE, dtype)
    x = torch.randn(1, 1, 64, device=DEVICE, dtype=dtype)  # one row: the GEMV kernel's shape
    out = gemv.gemv(norm(x), proj.weight) if gemv.usable(norm(x), proj.weight) else proj(norm(x))
    out.sum().backward()
    assert norm.weight.grad is not None and proj.weight.grad is not None
    with torch.inference_mode():
        assert fused.usable(x) and gemv.usable(x, proj.weight)
