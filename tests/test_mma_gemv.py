"""The bf16 tensor-core GEMV for 5-16 token rows (mtplx/kernels/mma_gemv.py).

On the CPU: the packed layout's arithmetic, through a model of the PTX fragment rules of
``mma.sync.m16n8k16`` (A row-major 16 x 16, B column-major 16 x 8, C 16 x 8; PTX ISA, "Matrix
Fragments for mma.m16n8k16") written here from those rules, not from the kernel. On a CUDA device:
the kernel against float32 products of the same bf16 weights, and a tiny model's forwards of 5-16
token rows through it against the same forwards through cuBLAS.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtplx.kernels import mma_gemv

CUDA = torch.cuda.is_available() and mma_gemv.triton is not None and torch.cuda.get_device_capability()[0] >= 8


def fragments_product(x: torch.Tensor, words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """What the mma chain computes from ``pack``'s words and x [rows <= 8, k] (each B operand's
    8 token rows; more rows are more B operands over the same A), tile by tile: lane
    l = 4 g + t's register r holds A elements 2r, 2r + 1; element i sits at row g (+ 8 for i in
    2, 3, 6, 7) and mma column 2 t + i % 2 (+ 8 for i >= 4); its B registers are the 8-byte load of
    x[g, 16 c + 4 t ..] and hold B elements 0-3 at mma rows 2 t, 2 t + 1, 2 t + 8, 2 t + 9 of column g;
    D row i, column j is output i of token row j."""
    r_tiles, c_tiles = words.shape[:2]
    regs = words.contiguous().view(torch.bfloat16).view(r_tiles, c_tiles, 32, 8).float()
    xp = torch.zeros(8, c_tiles * 16)
    xp[:x.shape[0], :k] = x.float()
    out = torch.zeros(8, r_tiles * 16)
    for r in range(r_tiles):
        for c in range(c_tiles):
            a, b = torch.zeros(16, 16), torch.zeros(16, 8)
            for lane in range(32):
                g, t = divmod(lane, 4)
                for i in range(8):
                    a[g + (8 if i in (2, 3, 6, 7) else 0), 2 * t + i % 2 + (8 if i >= 4 else 0)] = regs[r, c, lane, i]
                loaded = xp[g, 16 * c + 4 * t:16 * c + 4 * t + 4]
                for i in range(4):
                    b[2 * t + i % 2 + (8 if i >= 2 else 0), g] = loaded[i]
            out[:, 16 * r:16 * (r + 1)] += (a @ b).T
    return out[:x.shape[0], :n]


@pytest.mark.parametrize("n,k", [(16, 16), (40, 48), (33, 80)])
def test_pack_round_trip_and_fragment_arithmetic(n, k):
    torch.manual_seed(n + k)
    w = torch.randn(n, k).bfloat16()
    words = mma_gemv.pack(w)
    assert words.shape == (-(-n // 16), -(-k // 16), 32, 4) and words.dtype == torch.int32
    assert torch.equal(mma_gemv.unpack(words, n, k), w)
    x = torch.randn(13, k).bfloat16()  # two B operands: rows 0-7 and 8-12, over the same A
    ref = x.float() @ w.float().T
    got = torch.cat([fragments_product(x[:8], words, n, k), fragments_product(x[8:], words, n, k)])
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)


@torch.no_grad()  # (under autograd the kernel is never usable: it has no backward)
def test_usable_only_for_5_to_16_bf16_rows_of_small_weights_on_cuda():
    w = torch.randn(64, 32).bfloat16()
    assert not mma_gemv.usable(torch.randn(6, 32).bfloat16(), w)  # the CPU: no
    if CUDA:
        w = w.cuda()
        assert mma_gemv.usable(torch.randn(6, 32, device="cuda").bfloat16(), w)
        assert not mma_gemv.usable(torch.randn(4, 32, device="cuda").bfloat16(), w)  # gemv's
        assert mma_gemv.usable(torch.randn(16, 32, device="cuda").bfloat16(), w)
        assert not mma_gemv.usable(torch.randn(17, 32, device="cuda").bfloat16(), w)  # cuBLAS's
        assert not mma_gemv.usable(torch.randn(6, 32, device="cuda"), w.float())
        assert not mma_gemv.usable(torch.randn(6, 24, device="cuda").bfloat16(), torch.randn(64, 24).bfloat16().cuda())


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device with bf16 mma")
@pytest.mark.parametrize("rows", [*range(1, 10), 12, 16])
@pytest.mark.parametrize("config", [None, (4, 1, 1), (2, 4, 2), (1, 8, 3)])
def test_kernel_matches_float32_products(rows, config):
    torch.manual_seed(rows)
    dev = "cuda"
    for n, k in ((96, 64), (200, 576), (64, 1536)):
        w = (torch.randn(n, k, device=dev) / k ** 0.5).bfloat16()
        bias = torch.randn(n, device=dev).bfloat16()
        x = torch.randn(rows, k, device=dev).bfloat16()
        for b in (None, bias):
            got = mma_gemv.gemv(x, mma_gemv.pack(w), b, n=n, k=k, config=config)
            ref = F.linear(x.float(), w.float(), None if b is None else b.float())
            assert got.shape == (rows, n) and got.dtype == torch.bfloat16
            assert torch.allclose(got.float(), ref, atol=2e-2, rtol=1e-2), (n, k, b is None)
    for k in (64, 1536):  # gate, up: SiLU * up in the epilogue (1536: split, for the split configs)
        w = (torch.randn(2 * 48, k, device=dev) / k ** 0.5).bfloat16()
        bias = torch.randn(2 * 48, device=dev).bfloat16()
        x = torch.randn(rows, k, device=dev).bfloat16()
        for b in (None, bias):
            got = mma_gemv.gemv(x, mma_gemv.pack(w), b, n=96, k=k, silu=True, config=config)
            summed = F.linear(x.float(), w.float(), None if b is None else b.float())
            gate, up = summed.bfloat16().float().chunk(2, dim=-1)
            assert torch.allclose(got.float(), F.silu(gate) * up, atol=2e-2, rtol=1e-2), (k, b is None)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device with bf16 mma")
def test_strided_and_misaligned_inputs_are_taken_as_their_values():
    w = (torch.randn(64, 128, device="cuda") / 12).bfloat16()
    words = mma_gemv.pack(w)
    wide = torch.randn(6, 300, device="cuda").bfloat16()
    for x in (wide[:, 3:131], wide[:, :256:2], wide.T.contiguous().T[:, 10:138]):
        got = mma_gemv.gemv(x, words, None, n=64, k=128)
        assert torch.allclose(got.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=1e-2)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device with bf16 mma")
def test_the_packed_copy_follows_an_edited_weight_in_place():
    """An in-place edit of the weight (its version counter moves) is packed again into the same
    tensor, which a captured CUDA graph reads."""
    from torch import nn

    owner = nn.Module()
    w = (torch.randn(32, 64, device="cuda") / 8).bfloat16()
    x = torch.randn(6, 64, device="cuda").bfloat16()
    first = mma_gemv.matmul(x, w, None, owner, "w")
    packed = owner._mma_packed["w"][1]
    w.mul_(2)
    second = mma_gemv.matmul(x, w, None, owner, "w")
    assert owner._mma_packed["w"][1] is packed
    assert torch.allclose(second.float(), 2 * first.float(), atol=2e-2, rtol=1e-2)
    with torch.inference_mode():  # inference tensors have no version counter
        frozen = torch.cat([w, w])
        assert mma_gemv.matmul(x, frozen, None, owner, "frozen").shape == (6, 64)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device with bf16 mma")
def test_tiny_model_forwards_of_5_to_16_rows_match_cublas(monkeypatch):
    """A tiny Qwen2 (qkv bias) in bf16: AR steps of 5-8 sequences and 4-sequence verifies of 1 + 1
    and 1 + 3 tokens through the tensor-core GEMV (an 8-sequence verify of 1 + 3, 32 rows, through
    cuBLAS), against the same forwards with it off (cuBLAS)."""
    from mtplx.engine.llm_engine import Engine
    from mtplx.loading.checkpoint import LoadedModel
    from mtplx.models.layers import DecoderLayer, fuse_projections
    from tests.tiny_models import hf_reference, ours_from_hf

    hf, cfg = hf_reference("qwen2")
    model = ours_from_hf(hf, cfg).to("cuda", torch.bfloat16)
    fuse_projections(model)
    taken = []
    forward_mma = DecoderLayer._forward_mma
    monkeypatch.setattr(DecoderLayer, "_forward_mma", lambda self, x, *a: taken.append(x.shape) or forward_mma(self, x, *a))
    forwards = [(8, [list(range(3 + r, 12 + r)) for r in range(8)], [0] * 8),
                *[(r, [[7]] * r, [9] * r) for r in (5, 6, 7, 8)],
                (4, [[8, 9]] * 4, [10] * 4), (4, [[10, 11, 12, 13]] * 4, [12] * 4),
                (8, [[14, 15, 16, 17]] * 8, [16] * 8)]  # 32 rows: cuBLAS in both
    outs = []
    for enabled in (True, False):
        monkeypatch.setattr(mma_gemv, "ENABLED", enabled)
        engine = Engine(LoadedModel(model, None, None, model.config, source=None), kv_cache_tokens=512, block_size=4)
        seqs = [engine.new_sequence(engine.make_request(rows, mode="ar", max_tokens=16)) for rows in forwards[0][1]]
        for seq in seqs:
            engine.generator.admit(seq)
        with torch.inference_mode():
            outs.append([])
            for n, token_rows, starts in forwards:
                for seq, rows, start in zip(seqs, token_rows, starts):
                    engine.kv.reserve(seq, start + len(rows))
                outs[-1].append(engine.runner.logits(engine.runner.trunk(seqs[:n], token_rows, starts)).float())
    sizes = {s[0] * s[1] for s in taken}  # (the runner pads 5 and 7 sequences to 6 and 8)
    assert {8, 16} <= sizes and min(sizes) >= 5 and max(sizes) <= 16, sizes
    for got, ref in zip(*outs):
        assert float((got - ref).norm() / ref.norm()) < 2e-2
