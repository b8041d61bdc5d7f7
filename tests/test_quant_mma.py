"""The tensor-core GEMV's weight layout (mtplx/kernels/quant_mma.py) on the CPU: packing round
trips, and the kernel's arithmetic emulated from the PTX fragment rules (``quant_mma.emulate``:
each lane's decoded A registers and loaded B registers placed where mma.sync reads them) against
the product with the unpacked weight in float64. The GPU kernel itself (inline PTX) runs only on
CUDA: tests/test_quant_kernels_triton.py checks it there, and benchmarks/quant_gemv.py and
benchmarks/gpu.py --quant check every layer against its dequantized weight before timing."""

from __future__ import annotations

import pytest
import torch

from mtplx.kernels import quant_mma


def _weight(bits: int, n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    q[0, :2] = torch.tensor([lo, hi - 1])  # both ends of the range
    scale = (torch.rand(n, k // group, generator=g) * 0.1 + 1e-3).half()
    return q, scale


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (40, 128, 64), (33, 192, 32), (7, 256, 128)])
def test_pack_round_trips(bits, n, k, group):
    q, scale = _weight(bits, n, k, group)
    words = quant_mma.pack(q, bits)
    assert words.shape == (-(-n // 16), k // quant_mma.tile_k(bits), 32, 4) and words.dtype == torch.int32
    assert torch.equal(quant_mma.unpack(words, bits, n, k), q.int())
    scales = quant_mma.pack_scales(scale, bits, group, n, k)
    assert torch.equal(quant_mma.unpack_scales(scales, bits, group, n, k), scale)
    w = quant_mma.dequantize_reference(words, scales, n=n, k=k, group=group, bits=bits)
    assert torch.equal(w, (q.float().unflatten(1, (-1, group)) * scale.float().unsqueeze(-1)).flatten(1))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n,k,group", [(40, 128, 32), (33, 192, 64), (16, 256, 128)])
def test_emulated_kernel_matches_the_weight(bits, rows, n, k, group):
    q, scale = _weight(bits, n, k, group, seed=rows)
    words = quant_mma.pack(q, bits)
    scales = quant_mma.pack_scales(scale, bits, group, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    w = q.double().unflatten(1, (-1, group)) * scale.double().unsqueeze(-1)
    w = w.flatten(1)
    ref = x.double() @ w.T
    got = quant_mma.emulate(x, words, scales, n=n, k=k, group=group, bits=bits).double()
    magnitude = x.double().abs() @ w.abs().T
    # float32 sums of exact products, less the constant's sum (128 + 8 or 2048 + 128 + 128 times
    # sum x): a few float32 roundings of terms up to 2304 |x| * scale
    assert float(((got - ref).abs() / magnitude).max()) < 1e-5


def test_supports_only_what_the_layout_holds():
    assert quant_mma.supports(4, 32, 4096, False, False) and quant_mma.supports(8, 128, 4096, False, False)
    assert not quant_mma.supports(4, 32, 4096, False, True)  # offsets (GGUF Q4_1)
    assert not quant_mma.supports(8, 32, 4096, True, False)  # fp8
    assert not quant_mma.supports(4, 48, 4800, False, False)  # groups not a multiple of 32
    assert not quant_mma.supports(4, 32, 96, False, False)  # rows not whole 64-input tiles
    assert quant_mma.supports(8, 32, 96, False, False)  # int8 tiles are 32 inputs
