"""The Triton kernels for quantized weights (mtplx/kernels/quant_gemv.py) against the product
with the weight rebuilt from the portable form (``QuantizedWeight.dequantize``, float64).

Runs on a CUDA device, or on the CPU under Triton's interpreter (slow: shapes are tiny):
    TRITON_INTERPRET=1 python -m pytest -q tests/test_quant_kernels_triton.py
(skipped where Triton is not installed or neither holds, as in CPU-only CI; benchmarks/gpu.py
--quant checks every quantized layer of the 8B shape the same way before it times anything).
"""

from __future__ import annotations

import os

import pytest
import torch

from mtplx import kernels
from mtplx.kernels import fused, quant_gemv
from mtplx.models.quant import QuantizedWeight, QuantLinear, quantize_fp8

pytestmark = pytest.mark.skipif(
    not fused.available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(fmt: str, out: int, inp: int, group: int, seed: int = 0, offsets: bool = True) -> QuantizedWeight:
    """Random integers over the whole range (both ends included) or e4m3 values over theirs,
    scales in float16's normal range (so the kernel's float16 scales are exact roundings)."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "fp8":
        qw = quantize_fp8(torch.randn(out, inp, generator=g) * torch.rand(out, 1, generator=g))
        qw.q[0, :2] = torch.tensor([-448.0, 448.0]).to(torch.float8_e4m3fn)
        qw.q[-1, -1] = torch.tensor(2.0 ** -9).to(torch.float8_e4m3fn)  # the smallest subnormal
        return qw
    bits = int(fmt[3:])
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (out, inp), generator=g, dtype=torch.int8)
    q[0, :2] = torch.tensor([lo, hi - 1])
    scale = torch.rand(out, inp // group, generator=g) * 0.1 + 0.01
    zero = torch.randn(out, inp // group, generator=g) * 0.05 if offsets else torch.zeros_like(scale)
    zero[zero.abs() < 1e-3] = 0.0
    return QuantizedWeight(q, scale, zero, bits, group)


def _reference(x: torch.Tensor, qw: QuantizedWeight, scale_dtype: torch.dtype, bias=None) -> torch.Tensor:
    """x @ W.T (+ bias) in float64 with W rebuilt from the integers and the scales and offsets
    rounded to the layer's storage dtype (``compact_scales``: float16 or float32)."""
    w = QuantizedWeight(qw.q, qw.scale.to(scale_dtype).float(), qw.zero.to(scale_dtype).float(), qw.bits,
                        qw.group_size).dequantize().double()
    out = x.double() @ w.T
    return out if bias is None else out + bias.double()


def _check(got: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight, layer: QuantLinear, bias=None) -> None:
    ref = _reference(x.cpu(), qw, layer.scale.dtype, None if bias is None else bias.cpu())
    magnitude = x.cpu().double().abs() @ qw.dequantize().double().abs().T
    if bias is not None:
        magnitude += bias.cpu().double().abs()
    if x.dtype == torch.bfloat16:
        # the output's rounding to bf16 (the interpreter truncates: up to 2^-7), and for many rows
        # the weight's and the bias's (dequantized to bf16 for the matmul)
        bound = (ref.abs() + magnitude) * 2.0 ** -7
    else:  # fp32 accumulation over `inp` terms, in another order
        bound = 1e-5 * magnitude + 1e-6
    err = (got.cpu().double() - ref).abs()
    assert got.dtype == x.dtype and got.shape == ref.shape
    assert (err <= bound).all(), f"max error {float(err.max())}"


# (out, in, group): out not a multiple of any BLOCK_N, in not a whole chunk (int4 chunks are
# 256 inputs, 8-bit ones 128), several groups per field run and per chunk, and fp8 per-row
SHAPES = {"int4": [(37, 96, 32), (12, 320, 64)], "int8": [(37, 96, 32), (20, 256, 128)],
          "fp8": [(37, 96, 96), (20, 80, 80)]}


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 19])
def test_quantized_kernels_equal_dequantize_then_matmul(fmt, rows):
    for i, (out, inp, group) in enumerate(SHAPES[fmt]):
        qw = _weight(fmt, out, inp, group, seed=i)
        layer = QuantLinear(qw, device=DEVICE, backend="triton")
        x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
        with torch.no_grad():
            _check(layer(x), x, qw, layer)


# rows of 35 chunks (int4 chunks are 32 inputs, 8-bit ones 16): with one warp a tile is 32 chunks,
# so a program loops over two tiles, or two splits take 32 and 3 chunks
LONG_ROWS = {"int4": (13, 35 * 32 - 8, 32), "int8": (13, 35 * 16 - 8, 32), "fp8": (13, 35 * 16 - 8, 35 * 16 - 8)}


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("config", [(8, 1, 1, 0), (4, 1, 2, 0), (2, 1, 3, 0), (16, 4, 1, 4), (16, 4, 3, 8)])
def test_gemv_over_several_tiles_and_split_k_sums_every_chunk_once(fmt, config):
    """CUDA-core configs (DOT_C 0) and tensor-core ones (tiles of DOT_C chunks)."""
    out, inp, group = LONG_ROWS[fmt]
    if inp % group:  # int4/int8 groups need whole groups: cut the row to them
        inp -= inp % group
    qw = _weight(fmt, out, inp, group, seed=7)
    bias = torch.randn(out, generator=torch.Generator().manual_seed(8))
    layer = QuantLinear(qw, bias, device=DEVICE, backend="triton")
    for rows in (1, 3, 8):
        x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
        with torch.no_grad():
            got = quant_gemv.gemv(x, layer.words, layer.scale, layer.zero, layer.bias, config=config,
                                  **layer._kernel_args())
        _check(got, x, qw, layer, bias)


def _check_silu_mul(got: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight, layer: QuantLinear, bias=None) -> None:
    """got against silu(gate) * up of the float64 product, gate and up its halves; the bound
    carries each half's bound through silu (|silu'| < 1.1) and adds the output's rounding."""
    ref = _reference(x.cpu(), qw, layer.scale.dtype, None if bias is None else bias.cpu())
    magnitude = x.cpu().double().abs() @ qw.dequantize().double().abs().T
    if bias is not None:
        magnitude += bias.cpu().double().abs()
    rel = 2.0 ** -7 if x.dtype == torch.bfloat16 else 1e-5
    bound = (ref.abs() + magnitude) * rel + 1e-6
    (g, u), (bg, bu) = ref.chunk(2, dim=-1), bound.chunk(2, dim=-1)
    want = torch.nn.functional.silu(g) * u
    bound_out = 1.1 * bg * (u.abs() + bu) + torch.nn.functional.silu(g).abs() * bu + want.abs() * rel
    err = (got.cpu().double() - want).abs()
    assert got.dtype == x.dtype and got.shape == want.shape
    assert (err <= bound_out).all(), f"max error {float(err.max())}"


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 8, 19])
def test_silu_mul_forward_equals_silu_of_gate_times_up(fmt, rows):
    """A fused gate/up layer (2 I rows, gate first) with SiLU * up in the GEMV's epilogue (up
    to 8 rows), or after the dequantized matmul (19): I odd, so the last program is partial."""
    for i, (out, inp, group) in enumerate(SHAPES[fmt]):
        qw = _weight(fmt, 2 * out, inp, group, seed=i)
        layer = QuantLinear(qw, device=DEVICE, backend="triton")
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
            with torch.no_grad():
                _check_silu_mul(layer.silu_mul_forward(x), x, qw, layer)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("config", [(8, 1, 1, 0), (4, 1, 2, 0), (2, 1, 3, 0), (16, 4, 1, 4), (16, 4, 3, 8)])
def test_silu_epilogue_over_split_k_and_bias(fmt, config):
    """The epilogue in the GEMV (SPLIT 1) and in the split-summing kernel, with a bias added
    before the SiLU."""
    out, inp, group = LONG_ROWS[fmt]
    if inp % group:
        inp -= inp % group
    qw = _weight(fmt, 2 * out, inp, group, seed=9)
    bias = torch.randn(2 * out, generator=torch.Generator().manual_seed(10))
    layer = QuantLinear(qw, bias, device=DEVICE, backend="triton")
    for rows in (1, 3, 8):
        x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
        with torch.no_grad():
            got = quant_gemv.gemv(x, layer.words, layer.scale, layer.zero, layer.bias, config=config, silu=True,
                                  **layer._kernel_args())
        _check_silu_mul(got, x, qw, layer, bias)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_quantized_kernels_add_bias_keep_leading_dims_and_round_to_bf16(fmt):
    out, inp, group = SHAPES[fmt][0]
    qw = _weight(fmt, out, inp, group, offsets=False)
    bias = torch.randn(out)
    layer = QuantLinear(qw, bias, device=DEVICE, backend="triton")
    assert layer.zero is None  # symmetric: no offsets stored or read
    g = torch.Generator().manual_seed(3)
    for shape in ((2, 3, inp), (1, 17, inp)):  # 6 rows (the GEMV), 17 (dequantize + matmul)
        x = torch.randn(*shape, generator=g).to(DEVICE)
        with torch.no_grad():
            got = layer(x)
            assert got.shape == (*shape[:-1], out)
            _check(got.reshape(-1, out), x.reshape(-1, inp), qw, layer, bias)
            xb = x.bfloat16()
            _check(layer(xb).reshape(-1, out), xb.reshape(-1, inp), qw, layer, bias)


def test_layer_with_kernels_off_computes_the_same_product():
    qw = _weight("int4", 37, 96, 32)
    layer = QuantLinear(qw, device=DEVICE, backend="triton")
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.no_grad():
        fast = layer(x)
        kernels.ENABLED = False
        try:
            slow = layer(x)
        finally:
            kernels.ENABLED = True
    _check(fast, x, qw, layer)
    _check(slow, x, qw, layer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_quantized_gemv_replays_in_a_cuda_graph():
    qw = _weight("int4", 4096, 1024, 32)
    layer = QuantLinear(qw, device="cuda")
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = layer(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(x)
        x.normal_()
        graph.replay()
        assert torch.equal(captured, layer(x))
        assert not torch.equal(captured, eager)


def _layer_chain(layers, norm_weight, x):
    """x through a stack of decoder-like steps of kernels that each read the one before: RMSNorm
    (residual add), a quantized product, its SiLU epilogue, a split-K product's sum kernel, and
    the bf16 GEMV of the first row at the end."""
    from mtplx.kernels import gemv

    delta = torch.zeros_like(x)
    for qkv, gate_up, down in layers:
        x, h = fused.rms_norm(x, norm_weight, 1e-6, delta=delta)
        h = qkv(h)[..., : x.shape[-1]]
        x, h = fused.rms_norm(x, norm_weight, 1e-6, delta=h)
        delta = down(gate_up.silu_mul_forward(h))
    return gemv.gemv((x + delta)[:1], norm_weight.expand(8, -1).contiguous())


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability 9.0 (Hopper) or newer")
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_dependent_launches_in_a_cuda_graph_equal_serial_launches(rows):
    """With ``kernels.PDL`` each kernel may start before the one it reads has finished (and
    loads its weights then): a captured chain of them must give exactly what the same kernels
    give launched one after another without it, for a new input at every replay (a kernel that
    read its input too early would see the previous replay's values)."""
    h = 512
    layers = []
    # the tensor-core GEMV splits inputs of 8,192 into four (a sum kernel); 5-8 rows of the
    # CUDA-core one run its tensor-core variant, split too; up to 4 rows, the CUDA-core int8
    # product over 4,096 inputs takes two loop steps (the second after the wait)
    kinds = [("mma", "int4", 8192), ("triton", "int8", 4096), ("triton", "int4", 1024), ("mma", "int8", 1024)]
    for i, (backend, fmt, inter) in enumerate(kinds):
        shapes = [(3 * h, h), (2 * inter, h), (h, inter)]
        layers.append(tuple(QuantLinear(_weight(fmt, n, k, 32, seed=3 * i + j), device="cuda", backend=backend,
                                        dtype=torch.bfloat16) for j, (n, k) in enumerate(shapes)))
    norm_weight = torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    saved = kernels.PDL
    try:
        with torch.no_grad():
            kernels.PDL = True
            assert fused.launch_options(x.device)["PDL"], "PDL is not on for this device and Triton"
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                _layer_chain(layers, norm_weight, x)  # compiles outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = _layer_chain(layers, norm_weight, x)
            for i in range(8):
                x.copy_(torch.randn(rows, h, generator=torch.Generator().manual_seed(100 + i)))
                graph.replay()
                got = captured.clone()
                kernels.PDL = False
                serial = _layer_chain(layers, norm_weight, x)
                kernels.PDL = True
                assert torch.equal(got, serial), f"replay {i}"
                assert serial.abs().sum() > 0
    finally:
        kernels.PDL = saved


# The tensor-core layout (kernels/quant_mma.py): its dequantizing kernel (prefill) runs under the
# interpreter too; its GEMV is inline PTX (mma.sync), so only a CUDA device runs it.
MMA_SHAPES = [(37, 128, 32), (16, 192, 64), (40, 256, 128)]  # rows not a multiple of 16


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("offsets", [False, True])
def test_mma_layout_dequantize_kernel_equals_the_weight(fmt, offsets):
    from mtplx.kernels import quant_mma

    for i, (out, inp, group) in enumerate(MMA_SHAPES):
        qw = _weight(fmt, out, inp, group, seed=i, offsets=offsets)
        layer = QuantLinear(qw, device=DEVICE, backend="mma")
        w = quant_mma.dequantize(layer.words, layer.scale, layer.zero, n=out, k=inp, bits=qw.bits,
                                 dtype=torch.float32)
        ref = QuantizedWeight(qw.q, qw.scale.half().float(), qw.zero.half().float(), qw.bits, group).dequantize()
        assert torch.equal(w.cpu(), ref)
        x = torch.randn(19, inp, generator=torch.Generator().manual_seed(i)).to(DEVICE)  # prefill rows
        with torch.no_grad():
            _check(layer(x), x, qw, layer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX (mma.sync) runs on a CUDA device only")
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("offsets", [False, True])
def test_mma_gemv_equals_dequantize_then_matmul(fmt, rows, offsets):
    from mtplx.kernels import quant_mma

    for i, (out, inp, group) in enumerate(MMA_SHAPES + [(96, 4096, 32), (48, 4096, 128)]):
        qw = _weight(fmt, out, inp, group, seed=i, offsets=offsets)
        layer = QuantLinear(qw, device=DEVICE, backend="mma")
        bias = torch.randn(out, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
        x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)).to(DEVICE, torch.bfloat16)
        args = dict(n=out, k=inp, bits=qw.bits)
        with torch.no_grad():
            for config in (None, (1, 1, 1), (2, 1, 3), (4, 2, 2)):
                got = quant_mma.gemv(x, layer.words, layer.scale, layer.zero, None, config=config, **args)
                _check(got, x, qw, layer)
            _check(layer(x), x, qw, layer)
            layer.bias = torch.nn.Parameter(bias, requires_grad=False)
            _check(layer(x), x, qw, layer, bias)
            if out % 32 == 0:  # whole row tiles on both halves: the SiLU epilogue
                for config in (None, (1, 1, 3)):
                    got = quant_mma.gemv(x, layer.words, layer.scale, layer.zero, bias, silu=True, config=config,
                                         **args)
                    _check_silu_mul(got, x, qw, layer, bias)
