"""Quantized weights: the int4/int8 kernels against dequantize-then-matmul, GGUF block decoding
against the gguf package's own dequantization, and models loaded quantized.

Two CPU backends: "cpu" (kernels/cpu.py's C++ kernel: float32 activations, float16 scales and
offsets; int16 activations by default, on AVX-512 VNNI or AVX2 products, int8 where asked) and "int4pack" (PyTorch's packed int4 kernel: bf16
activations and scales, fp32 accumulation). Each reference is the exact (float64) product of
what the kernel holds: the weight rebuilt from the integers and the rounded scales, times the
activations as the kernel rounds them; the tolerance is the kernel's own rounding."""

import json

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize
from safetensors.torch import save_file

import mtplx
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.sequence import Sequence
from mtplx.errors import InvalidParameter
from mtplx.kernels import cpu as cpu_kernels
from mtplx.loading.gguf_file import load_gguf
from mtplx.loading.gguf_quant import EXACT, SUPPORTED, quantized_weight
from mtplx.kernels import quant_gemv
from mtplx.models.quant import (QuantizedWeight, QuantLinear, linear_weight_bytes, quantize_fp8, quantize_rtn,
                                 weight_formats)
from tests.tiny_models import hf_reference

CPU_BACKENDS = ["cpu", "int4pack"]
# the backend a CPU model takes here (the C++ kernel wherever it builds: AVX2, g++ and ninja)
DEFAULT_CPU = "cpu" if cpu_kernels.available() else "int4pack"
needs_kernel = pytest.mark.skipif(not cpu_kernels.cpu_supported(), reason="no AVX2 CPU, or no g++/ninja")


def _backends():
    return [pytest.param(b, marks=needs_kernel) if b == "cpu" else b for b in CPU_BACKENDS]


def _random_weight(out, inp, bits, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (out, inp), generator=g, dtype=torch.int8)
    q[0, :2] = torch.tensor([lo, hi - 1])  # both ends of the range
    scale = torch.rand(out, inp // group, generator=g) * 0.1 + 0.01
    zero = torch.randn(out, inp // group, generator=g) * 0.05
    return QuantizedWeight(q, scale, zero, bits, group)


def _held(t: torch.Tensor, backend: str) -> torch.Tensor:
    """A scale or offset as the backend holds it: float16 ("cpu"), bf16 ("int4pack")."""
    return (t.half() if backend == "cpu" else t.bfloat16()).float()


def _held_weight(qw: QuantizedWeight, backend: str) -> torch.Tensor:
    """The weight [out, in] float64 the backend multiplies by. "cpu" stores int4 offsets as
    zero - 8 scale (the nibble is q + 8), rounded to float16."""
    if backend == "cpu":
        scale = _held(qw.scale, "cpu").double()
        if qw.bits == 4:
            offset = _held(qw.zero - 8 * qw.scale, "cpu").double()
            u = (qw.q.double() + 8).unflatten(1, (-1, qw.group_size))
            return (u * scale.unsqueeze(-1) + offset.unsqueeze(-1)).flatten(1)
        zero = _held(qw.zero, "cpu").double()
        return (qw.q.double().unflatten(1, (-1, qw.group_size)) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).flatten(1)
    return QuantizedWeight(qw.q, _held(qw.scale, backend), _held(qw.zero, backend), qw.bits,
                           qw.group_size).dequantize().double()


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x with each 32 inputs of a row rounded to int8 on one scale, max |x| / 127 (the kernel's
    int8 activations), written out independently of the C++ code."""
    groups = x.reshape(x.shape[0], -1, 32)
    d = groups.abs().amax(-1, keepdim=True) / 127
    return (torch.round(groups / torch.where(d > 0, d, 1)) * d).reshape(x.shape)


def _int16_rows(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x as the kernel's int16 activations stand for it: each ``block`` inputs of a row (32 on
    AVX-512 VNNI, the whole row on AVX2) times 32767 / max |x| in float32, rounded to the nearest
    integer (ties to even), times max |x| / 32767 (float32); written out independently of the
    C++ code."""
    groups = x.float().reshape(x.shape[0], -1, block)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 32767.0) / amax, torch.zeros_like(amax))  # a true division
    return (torch.round(groups * inv).double() * (amax / 32767).double()).reshape(x.shape)


def _reference(x: torch.Tensor, qw: QuantizedWeight, backend: str = DEFAULT_CPU) -> torch.Tensor:
    a = x.double() if backend == "cpu" else x.bfloat16().double()
    return a @ _held_weight(qw, backend).T


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out,inp,group", [(64, 128, 32), (40, 96, 32), (48, 256, 64), (32, 512, 128), (16, 256, 256),
                                           (33, 64, 32)])
@pytest.mark.parametrize("rows", [1, 2, 5, 20, 60])  # 60: past cpu.SMALL_ROWS, the dequantized weight's matmul
def test_quantized_matmul_equals_dequantize_then_matmul(backend, bits, out, inp, group, rows, monkeypatch):
    monkeypatch.setenv(cpu_kernels.ACTIVATIONS_SWITCH, "float32")  # int16: the test below
    if backend == "int4pack" and out % 16:
        out += 16 - out % 16  # (the packed kernel pads rows to 16 itself; keep its cases as they were)
    qw = _random_weight(out, inp, bits, group)
    layer = QuantLinear(qw, backend=backend)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(1))
    got = layer(x)
    ref = _reference(x, qw, backend)
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    magnitude = x.abs().double() @ _held_weight(qw, backend).abs().T
    if backend == "cpu":  # fp32 sums of u * a per 32 inputs (u up to 15 times the scale), then scaled
        bound = 1e-5 * (x.abs().double() @ (qw.q.double().abs() + 8 + qw.zero.abs().double().repeat_interleave(group, 1)
                                              / qw.scale.double().repeat_interleave(group, 1)).mul(
            qw.scale.double().repeat_interleave(group, 1)).T) + 1e-6
    else:  # bf16 output rounding (half an ulp, 2^-9 relative) plus fp32 accumulation over `inp` terms
        bound = ref.abs() * 2.0 ** -8 + 1e-6 * magnitude
    assert ((got.double() - ref).abs() <= bound).all()


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_int8_activations_multiply_the_rounded_activations_exactly(bits, group, monkeypatch):
    monkeypatch.setenv(cpu_kernels.ACTIVATIONS_SWITCH, "int8")
    qw = _random_weight(40, 128, bits, group)
    layer = QuantLinear(qw, backend="cpu")
    assert layer.activation_bits == 8
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    # the integers times the rounded activations; the offsets times the float group sums
    w = _held_weight(qw, "cpu")
    offset = _held(qw.zero - 8 * qw.scale if bits == 4 else qw.zero, "cpu").double()  # [out, groups]
    scaled = w - offset.repeat_interleave(group, 1)
    ref = _int8_rows(x).double() @ scaled.T + x.double().reshape(3, -1, group).sum(-1) @ offset.T
    # integer products are exact; what remains is fp32 rounding of the scaled chunk sums
    bound = 1e-5 * (x.abs().double() @ _held_weight(qw, "cpu").abs().T) + 1e-5
    assert ((layer(x).double() - ref).abs() <= bound).all()


def _int16_widths():
    """The vector widths whose int16 tiles this CPU runs: 256 (AVX2's vpmaddwd) wherever the
    kernels build, 512 (AVX-512 VNNI) where it has that."""
    if not cpu_kernels.cpu_supported() or not cpu_kernels.available():
        return [pytest.param(256, marks=pytest.mark.skip(reason="no AVX2 CPU, or no g++/ninja"))]
    return [256] + ([512] if cpu_kernels.extension().quant_has_vnni() else [])


@pytest.fixture(params=_int16_widths())
def int16_width(request, force_width):
    """Runs the test with the quantized products at this vector width (int16 activations on
    tile_int16_avx2 at 256, tile_int16 at 512; conftest's force_width puts the width back)."""
    force_width(request.param)
    return request.param


@pytest.mark.parametrize("out,inp,group", [(64, 128, 32), (48, 256, 64), (32, 512, 128), (16, 256, 256),
                                           (33, 1536, 32), (8, 64, 32), (16, 576, 192), (6, 576, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 48])
@pytest.mark.parametrize("bits,offsets", [(4, True), (8, True), (8, False)])
def test_int16_activations_multiply_the_rounded_activations_exactly(out, inp, group, rows, bits, offsets, int16_width):
    """int4 and int8 weights: the default. The integers times the int16-rounded activations, the
    offsets times the float group sums; exact integer sums, float32 scaling, on either tile.
    int8 without offsets is GGUF's Q8_0 (the default model's output matrix)."""
    assert cpu_kernels.activation_bits() == 16
    qw = _random_weight(out, inp, bits, group, seed=rows)
    if not offsets:
        qw = QuantizedWeight(qw.q, qw.scale, torch.zeros_like(qw.zero), bits, group)
    layer = QuantLinear(qw, backend="cpu")
    assert layer.zero.shape[1] == (qw.zero.shape[1] if offsets else 0)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :32] *= 40  # an outlier chunk: on VNNI its own scale, the others keep theirs
    w = _held_weight(qw, "cpu")
    offset = _held(qw.zero - 8 * qw.scale if bits == 4 else qw.zero, "cpu").double()
    scaled = w - offset.repeat_interleave(group, 1)
    sums = x.double().reshape(rows, -1, group).sum(-1) @ offset.T
    block, other = (32, inp) if int16_width == 512 else (inp, 32)
    ref = _int16_rows(x, block) @ scaled.T + sums
    bound = 2e-6 * (x.abs().double() @ w.abs().T) + 1e-6
    got = layer(x).double()
    assert ((got - ref).abs() <= bound).all()
    # the other tile's rounding (a scale per 32 inputs, or per row) misses it: the outlier chunk
    # of row 0 coarsens that row's scale by 40
    if inp > 32:
        assert ((_int16_rows(x, other) @ scaled.T + sums - ref).abs() > bound).any()
    # and float32 activations would have missed this reference (the test can tell them apart)
    floats = x.double() @ w.T
    assert ((floats - ref).abs() > bound).any()
    # each row's outputs are the ones it gets alone (a verify's rows are an AR step's)
    assert torch.equal(layer(x[-1:]).double(), got[-1:])


def test_int16_activations_keep_a_non_finite_input_visible(int16_width):
    """A row holding inf or NaN gives NaN outputs (as float32 activations would give inf or NaN),
    the rows beside it their own numbers."""
    layer = QuantLinear(_random_weight(16, 128, 4, 32), backend="cpu")
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    clean = layer(x)
    x[0, 70], x[2, 3] = float("inf"), float("nan")
    got = layer(x)
    assert got[0].isnan().all() and got[2].isnan().all()
    assert torch.equal(got[1], clean[1])


def test_int16_activations_of_large_finite_inputs_stay_finite(int16_width):
    """Inputs whose float32 sum would overflow, each finite, are rounded and multiplied like any
    other (only an inf or NaN input makes a row NaN)."""
    qw = _random_weight(16, 576, 4, 32)
    layer = QuantLinear(qw, backend="cpu")
    x = torch.full((1, 576), 1e36)
    floats = x.double() @ _held_weight(qw, "cpu").T
    got = layer(x).double()
    assert got.isfinite().all()
    torch.testing.assert_close(got, floats, rtol=1e-3, atol=1e-3 * float(floats.abs().max()))


def test_int16_activations_of_tiny_chunks_and_of_no_rows(int16_width):
    """Inputs below 2^-60 (32767 / max would overflow float32) are scaled up first: the result
    still matches the float one to the rounding's precision; a product of no rows is empty."""
    qw = _random_weight(16, 128, 4, 32)
    layer = QuantLinear(qw, backend="cpu")
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(6)) * 1e-36
    floats = x.double() @ _held_weight(qw, "cpu").T
    torch.testing.assert_close(layer(x).double(), floats, rtol=1e-3, atol=1e-3 * float(floats.abs().max()))
    assert layer(torch.empty(0, 128)).shape == (0, 16)


@pytest.mark.parametrize("bits,inp,group", [(8, 96, 32), (4, 96, 32), (4, 192, 96)])
def test_int16_activations_leave_other_layouts_on_float32(bits, inp, group, monkeypatch, int16_width):
    """An input width not a multiple of 64, or groups of neither 32 nor a multiple of 64, take
    the float32 products."""
    qw = _random_weight(24, inp, bits, group)
    x = torch.randn(2, inp, generator=torch.Generator().manual_seed(5))
    default = QuantLinear(qw, backend="cpu")(x)
    monkeypatch.setenv(cpu_kernels.ACTIVATIONS_SWITCH, "float32")
    assert torch.equal(default, QuantLinear(qw, backend="cpu")(x))


def test_activation_bits_follow_the_switch(monkeypatch, force_width):
    for mode, bits in (("float32", 32), ("int8", 8)):
        monkeypatch.setenv(cpu_kernels.ACTIVATIONS_SWITCH, mode)
        assert cpu_kernels.activation_bits() == bits
    monkeypatch.setenv(cpu_kernels.ACTIVATIONS_SWITCH, "fp16")
    with pytest.raises(ValueError, match="float32, int16 or int8"):
        cpu_kernels.activation_bits()
    monkeypatch.delenv(cpu_kernels.ACTIVATIONS_SWITCH)
    # int16 where it runs on VNNI or on the AVX2 tile (an AVX-512 CPU without VNNI keeps float32)
    kernels = cpu_kernels.available()
    assert cpu_kernels.activation_bits() == (
        16 if kernels and (cpu_kernels.extension().quant_has_vnni() or cpu_kernels.vector_width() == 256) else 32)
    if kernels:
        force_width(256)
        assert cpu_kernels.activation_bits() == 16
    monkeypatch.setenv(cpu_kernels.ACTIVATIONS_SWITCH, "int16")
    assert cpu_kernels.activation_bits() == 16


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gives_the_same_numbers_alone_and_among_others(bits):
    """What lets a verify of 1 + D tokens reproduce AR steps on the CPU: no cross-row effects."""
    layer = QuantLinear(_random_weight(48, 256, bits, 32), backend="cpu")
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3))
    together = layer(x)
    for i in range(9):
        assert torch.equal(layer(x[i:i + 1])[0], together[i])


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_layer_keeps_leading_dims_and_adds_bias(backend, bits):
    qw = _random_weight(32, 64, bits, 32)
    bias = torch.randn(32)
    layer = QuantLinear(qw, bias, backend=backend)
    x = torch.randn(2, 3, 64)
    flat = QuantLinear(qw, backend=backend)(x.reshape(6, 64)).reshape(2, 3, 32)
    assert torch.equal(layer(x), flat + bias)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_gives_the_kernels_weight(backend, bits):
    qw = _random_weight(40, 96, bits, 32)
    assert torch.equal(QuantLinear(qw, backend=backend).dequantize(), _held_weight(qw, backend).float())


@needs_kernel
@pytest.mark.parametrize("bits,offsets", [(4, True), (8, True), (8, False)])
def test_selected_rows_give_the_layers_outputs_at_those_rows(bits, offsets):
    qw = _random_weight(50, 64, bits, 32)
    if not offsets:  # Q8_0: no offsets stored
        qw = QuantizedWeight(qw.q, qw.scale, torch.zeros_like(qw.zero), bits, 32)
    layer = QuantLinear(qw, torch.randn(50), backend="cpu")
    ids = torch.tensor([0, 3, 4, 17, 49])
    x = torch.randn(2, 64)
    rows = layer.select_rows(ids)
    assert rows.zero.shape[1] == (2 if offsets else 0)
    assert torch.equal(rows(x), layer(x)[:, ids])


@needs_kernel
def test_int8_weights_without_offsets_store_none_and_dequantize_to_their_integers():
    """GGUF's Q8_0 (every offset 0): the packed layout keeps no offsets (the kernels then read
    none), and the weight it stands for is q * scale."""
    qw = _random_weight(40, 128, 8, 32)
    qw = QuantizedWeight(qw.q, qw.scale, torch.zeros_like(qw.zero), 8, 32)
    layer = QuantLinear(qw, backend="cpu")
    assert tuple(layer.zero.shape) == (40, 0)
    assert torch.equal(layer.dequantize(), _held_weight(qw, "cpu").float())
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(8))
    zeros = torch.zeros(40, 4).half()
    for activations in (32, 16, 8):
        with_zeros = cpu_kernels.matmul(x, layer.words, layer.scale, zeros, 32, 8, activations)
        assert torch.equal(cpu_kernels.matmul(x, layer.words, layer.scale, layer.zero, 32, 8, activations), with_zeros)


@needs_kernel
def test_a_group_of_zero_inputs_is_refused():
    words, scale, zero = cpu_kernels.pack(torch.zeros(2, 64, dtype=torch.int8), torch.ones(2, 2), torch.zeros(2, 2), 8, 32)
    with pytest.raises(RuntimeError, match="multiple"):
        cpu_kernels.extension().quant_matmul(torch.randn(1, 64), words, scale[:, :0], zero, 0, 8, 16)
    with pytest.raises(RuntimeError, match="multiple"):
        cpu_kernels.extension().quant_dequantize(words, scale[:, :0], zero, 0, 8)


@pytest.mark.parametrize("bits", [4, 8])
def test_round_to_nearest_error_is_at_most_half_a_step(bits):
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(2))
    qw = quantize_rtn(w, bits, 32)
    step = qw.scale.repeat_interleave(32, dim=1)
    assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert qw.q.abs().max() == (7 if bits == 4 else 127)


@pytest.mark.parametrize("backend", _backends())
def test_weight_bytes_count_integers_and_scales(backend):
    layer = QuantLinear(_random_weight(64, 128, 4, 32), backend=backend)
    assert layer.weight_bytes() == 64 * 128 // 2 + 64 * 4 * 2 * 2  # nibbles + 16-bit (scale, zero) per group
    eight = QuantLinear(_random_weight(64, 128, 8, 32), backend=backend)
    planes = 2 if backend == "int4pack" else 1  # int4pack holds int8 as two int4 planes, each with scales
    assert eight.weight_bytes() == 64 * 128 + planes * 64 * 4 * 2 * 2


def _e4m3_values() -> torch.Tensor:
    """Every finite float8 e4m3fn value, from its bits: (-1)^s 2^(e-7) (1 + m/8), subnormals
    2^-6 m/8 (the format's definition, independent of torch's float8 casts)."""
    b = torch.arange(256)
    s, e, m = b >> 7, (b >> 3) & 15, b & 7
    mag = torch.where(e > 0, 2.0 ** (e - 7).double() * (1 + m / 8), 2.0 ** -6 * m / 8)
    v = torch.where(s == 1, -mag, mag)
    return v[(b & 0x7F) != 0x7F]  # 0x7F / 0xFF are NaN


def test_fp8_rounds_each_weight_to_the_nearest_e4m3_value_of_its_row_scale():
    w = torch.randn(24, 80, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.01, 3, 24)[:, None]
    qw = quantize_fp8(w)
    assert qw.kind == "fp8" and qw.group_size == 80 and qw.scale.shape == (24, 1)
    scaled = (w / qw.scale).double()
    values = _e4m3_values().unique()
    nearest_gap = (scaled.unsqueeze(-1) - values).abs().min(-1).values
    assert ((qw.q.double() - scaled).abs() <= nearest_gap + 1e-12).all()
    assert float(qw.q.float().abs().amax(1).min()) == 448.0  # each row's largest magnitude is the format's


def test_fp8_layer_on_the_cpu_multiplies_the_dequantized_weight():
    qw = quantize_fp8(torch.randn(20, 64, generator=torch.Generator().manual_seed(5)))
    layer = QuantLinear(qw)
    assert layer.backend == "dequantize" and layer.format == "fp8 e4m3 per-row (rtn)"
    assert layer.weight_bytes() == 20 * 64 + 2 * 20 * 4  # one byte per weight, a float32 scale (and offset) per row
    x = torch.randn(3, 64)
    assert torch.allclose(layer(x).double(), x.double() @ (qw.q.double() * qw.scale.double()).T, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_kernel_layout_packs_every_field_where_the_kernels_read_it(fmt):
    """quant_gemv.pack puts input k of a row into chunk k // (4 per), field (k % (4 per)) // 4,
    word k % 4 of it (per = fields per word), integers offset-binary, padded to whole chunks
    with fields of value 0."""
    bits = 4 if fmt == "int4" else 8
    qw = _random_weight(5, 96, bits, 32) if fmt != "fp8" else quantize_fp8(torch.randn(5, 96))
    words = quant_gemv.pack(qw.q, bits)
    per = 32 // bits
    assert words.dtype == torch.int32 and words.shape == (5, 4 * -(-96 // (4 * per)))
    raw = qw.q.view(torch.uint8).long() if qw.fp8 else qw.q.long() + (1 << (bits - 1))
    w64 = words.long() & 0xFFFFFFFF
    for k in (0, 3, 4, 31, 32, 63, 95):
        chunk, field, word = k // (4 * per), (k % (4 * per)) // 4, k % 4
        assert torch.equal((w64[:, 4 * chunk + word] >> (bits * field)) & ((1 << bits) - 1), raw[:, k])
    assert torch.equal(quant_gemv.unpack(words, bits, qw.fp8, 96), qw.q.float())
    padded = quant_gemv.pack(qw.q[:, :90], bits)  # 90 inputs: the last chunk part padding
    width = padded.shape[1] * per
    assert torch.equal(quant_gemv.unpack(padded, bits, qw.fp8, width)[:, 90:], torch.zeros(5, width - 90))


# --- GGUF blocks ------------------------------------------------------------------------------

_HALF_FLOATS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2],
                Q.Q5_K: [0, 2]}


def _random_blocks(qtype, out, inp, seed=0):
    """Random bytes in qtype's block layout, with finite half-float scales."""
    rng = np.random.default_rng(seed)
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (out, inp // block, nbytes), dtype=np.uint8)
    for offset in _HALF_FLOATS.get(qtype, [nbytes - 2]):  # Q6_K keeps d last
        d = (rng.standard_normal((out, inp // block)) * 0.01).astype(np.float16)
        raw[..., offset:offset + 2] = d[..., None].view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", EXACT, ids=lambda t: t.name)
def test_gguf_blocks_decode_like_gguf_dequantize(qtype):
    raw = _random_blocks(qtype, 32, 512)
    expected = np.asarray(dequantize(raw.reshape(32, -1), qtype), dtype=np.float32)
    qw = quantized_weight(raw, qtype, (32, 512))
    assert qw.group_size == 32 and qw.bits == (4 if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else 8)
    # the same values; K-quants only differ by float rounding of d*sc*q - dmin*m's order
    np.testing.assert_allclose(qw.dequantize().numpy(), expected, rtol=0, atol=1e-6 * np.abs(expected).max())


def test_q6_k_is_requantized_to_int8_within_half_a_step():
    raw = _random_blocks(Q.Q6_K, 16, 512)
    expected = torch.from_numpy(np.asarray(dequantize(raw.reshape(16, -1), Q.Q6_K), dtype=np.float32))
    qw = quantized_weight(raw, Q.Q6_K, (16, 512))
    assert qw.bits == 8 and "Q6_K" in qw.source
    assert ((qw.dequantize() - expected).abs() <= qw.scale.repeat_interleave(32, 1) / 2 + 1e-6).all()


def test_every_supported_gguf_format_runs_through_the_layer():
    for qtype in SUPPORTED:
        qw = quantized_weight(_random_blocks(qtype, 32, 256), qtype, (32, 256))
        x = torch.randn(2, 256, generator=torch.Generator().manual_seed(int(qtype)))
        got, ref = QuantLinear(qw)(x).double(), _reference(x, qw)
        # bf16 rounding (int4pack), or int16 activations (each 32 inputs to 1 / 65,534 of their largest)
        magnitude = x.abs().double() @ _held_weight(qw, DEFAULT_CPU).abs().T
        assert ((got - ref).abs() <= 2 ** -7 * ref.abs() + 1e-4 * magnitude + 1e-3).all(), qtype


@pytest.mark.slow
def test_default_model_loads_its_q4_1_and_q8_0_blocks_exactly(default_gguf):
    _, floats, _ = load_gguf(default_gguf, dtype=torch.float32)
    _, quantized, _ = load_gguf(default_gguf, dtype=torch.float32, quantized=True)
    blocks = {k: v for k, v in quantized.items() if isinstance(v, QuantizedWeight)}
    assert len(blocks) == 30 * 7 + 1
    assert {v.source for k, v in blocks.items() if k != "lm_head.weight"} == {"gguf Q4_1"}
    assert blocks["lm_head.weight"].source == "gguf Q8_0"  # the tied embedding, as the output matrix
    assert torch.equal(quantized["model.embed_tokens.weight"], floats["model.embed_tokens.weight"])
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        assert torch.equal(blocks[name].dequantize(), floats[name]), name
    assert torch.equal(blocks["lm_head.weight"].dequantize(), floats["model.embed_tokens.weight"])


@pytest.mark.slow
def test_default_model_runs_from_its_blocks_and_the_head_stays_float(default_gguf):
    engine = mtplx.load(device="cpu", quantize="gguf")
    formats = weight_formats(engine.loaded.model)
    assert formats["lm_head"] == "int8 g32 (gguf Q8_0)"
    assert formats["model.layers.0.self_attn.qkv_proj"] == "int4 g32 (gguf Q4_1)"
    assert formats["model.layers.0.mlp.gate_up_proj"] == "int4 g32 (gguf Q4_1)"
    assert set(weight_formats(engine.loaded.head).values()) == {"float32"}
    # 4.5 bits per trunk weight (nibble + bf16 scale and offset per 32), 8.5 for the output matrix
    model = engine.loaded.model
    assert linear_weight_bytes(model) - linear_weight_bytes(model.draft_lm_head) < 0.2 * 135e6 * 4
    assert formats["draft_lm_head"] == "int4 g32 (rtn)"  # drafts read half the output matrix's bytes
    # the pruned draft vocabulary's rows: the 8-bit output matrix's rows rounded to 4 bits
    head = engine.loaded.head
    [rows] = head.quantized_draft_rows
    assert rows.bits == 4 and rows.out_features == head.draft_vocab.numel()
    n = rows.out_features
    eight_bit = model.lm_head.select_rows(head.draft_vocab).dequantize()[:n]
    torch.testing.assert_close(rows.dequantize()[:n], _rtn_reference(eight_bit, 4), rtol=0, atol=1e-6)
    # the verify reads the exact output matrix: MTP's greedy output is AR's
    messages = [{"role": "user", "content": "Name three rivers in Europe."}]
    ar = engine.generate(messages, chat=True, max_tokens=40, mode="ar", ignore_eos=True)
    mtp = engine.generate(messages, chat=True, max_tokens=40, mode="mtp", depth=2, ignore_eos=True)
    assert mtp.token_ids == ar.token_ids and mtp.stats["accepted_tokens"] > 0


# --- --quantize on a 16-bit safetensors model --------------------------------------------------

def _rtn_reference(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric round-to-nearest per 32 inputs, written out independently of models/quant.py,
    with the scale rounded as the CPU kernel holds it (float16, or bf16 for "int4pack")."""
    groups = w.reshape(w.shape[0], -1, 32)
    scale = (groups.abs().amax(-1, keepdim=True) / (7 if bits == 4 else 127))
    q = torch.clamp(torch.round(groups / scale), -8 if bits == 4 else -128, 7 if bits == 4 else 127)
    return (q * _held(scale, DEFAULT_CPU)).reshape(w.shape)


def _tiny_bf16_dir(tmp_path):
    hf, cfg = hf_reference("qwen2", tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg, default=str))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in hf.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    with torch.no_grad():
        hf.load_state_dict({k: v.bfloat16().float() for k, v in hf.state_dict().items()})
    return hf, cfg


def test_fp8_on_load_quantizes_every_trunk_projection(tmp_path):
    hf, _ = _tiny_bf16_dir(tmp_path)
    engine = mtplx.load(tmp_path, device="cpu", quantize="fp8")
    model, weights = engine.loaded.model, dict(hf.named_parameters())
    formats = weight_formats(model)
    assert formats["lm_head"] == "fp8 e4m3 per-row (rtn)"
    assert formats["model.layers.0.self_attn.qkv_proj"] == "fp8 e4m3 per-row (rtn)"
    o = weights["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(model.model.layers[0].self_attn.o_proj.dequantize(), quantize_fp8(o).dequantize())


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_on_load_rounds_every_trunk_projection_to_nearest(tmp_path, bits):
    hf, _ = _tiny_bf16_dir(tmp_path)
    engine = mtplx.load(tmp_path, device="cpu", quantize=f"int{bits}")
    model, weights = engine.loaded.model, dict(hf.named_parameters())
    formats = weight_formats(model)
    assert formats["lm_head"] == f"int{bits} g32 (rtn)"
    assert torch.equal(model.lm_head.dequantize(), _rtn_reference(weights["model.embed_tokens.weight"], bits))
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        qkv = torch.cat([weights[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        gate_up = torch.cat([weights[prefix + f"mlp.{p}_proj.weight"] for p in ("gate", "up")])
        for module, w in ((layer.self_attn.qkv_proj, qkv), (layer.self_attn.o_proj, weights[prefix + "self_attn.o_proj.weight"]),
                          (layer.mlp.gate_up_proj, gate_up), (layer.mlp.down_proj, weights[prefix + "mlp.down_proj.weight"])):
            assert torch.equal(module.dequantize(), _rtn_reference(w, bits))
        assert torch.equal(layer.self_attn.qkv_proj.bias, torch.cat([weights[prefix + f"self_attn.{p}_proj.bias"] for p in "qkv"]))


def test_int4_model_gives_the_round_to_nearest_models_logits(tmp_path):
    hf, cfg = _tiny_bf16_dir(tmp_path)
    engine = mtplx.load(tmp_path, device="cpu", quantize="int4")
    ids = torch.randint(0, cfg["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        float_logits = hf(ids).logits[0]
        hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.clone())  # untie: the embedding stays float
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(_rtn_reference(module.weight, 4))
        ref = hf(ids).logits[0]
    runner = engine.runner
    seq = Sequence(prompt_ids=ids[0].tolist(), params=SamplingParams(), max_tokens=1)
    runner.blocks.allocate(seq.seq_id, seq.prompt_ids)
    with torch.inference_mode():
        ours = runner.logits(runner.trunk([seq], [ids[0].tolist()], [0]))[0]
    # within the bf16 activation rounding of the kernel, far from the float model
    assert (ours - ref).abs().max() < 0.1 * (float_logits - ref).abs().max()


def test_unknown_quantize_value_is_refused():
    with pytest.raises(InvalidParameter, match="quantize"):
        mtplx.load(device="cpu", quantize="int3")


def test_auto_quantize_keeps_a_gguf_in_its_blocks_where_the_float_weights_would_not_fit(default_gguf, monkeypatch):
    """quantize auto on CUDA: float weights while they take at most GPU_FLOAT_SHARE of the free
    memory, the file's own blocks past that (the GPU's free memory stands in a monkeypatch: no
    GPU here); float32 on the CPU keeps taking the blocks, a directory of float weights never."""
    from pathlib import Path

    from mtplx.loading import checkpoint

    path = Path(default_gguf)
    float_bytes = checkpoint.gguf_float_bytes(path, torch.bfloat16)
    assert float_bytes == 2 * sum(v.numel() for v in load_gguf(path, dtype=torch.float32)[1].values())
    cuda = torch.device("cuda")
    for free, want in ((10 * float_bytes, None), (float_bytes, "gguf")):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, 2 * free))
        assert checkpoint.resolve_quantize(None, path, cuda, torch.bfloat16) == want
    assert checkpoint.resolve_quantize("none", path, cuda, torch.bfloat16) == "none"
    assert checkpoint.resolve_quantize(None, path.parent, cuda, torch.bfloat16) is None


# --- head_quantize: the MTP head's own linear maps ---------------------------------------------

@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_head_quantize_rounds_the_heads_maps_to_nearest_and_decoding_stays_exact(default_gguf, fmt):
    from mtplx.tuning import model_key

    plain = mtplx.load(device="cpu")  # the default model with its shipped head
    engine = mtplx.load(device="cpu", head_quantize=fmt)
    head, float_head = engine.loaded.head, plain.loaded.head
    assert set(weight_formats(head).values()) == {f"{fmt} g32 (rtn)"}  # fc, the fusion, q/k/v, o, gate/up, down
    weights = dict(float_head.named_parameters())
    attn, mlp = head.layers[0].self_attn, head.layers[0].mlp
    qkv = torch.cat([weights[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([weights[f"layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    bits = int(fmt[3:])
    for module, w in ((head.fc, weights["fc.weight"]), (head.feature_fc, weights["feature_fc.weight"]),
                      (attn.qkv_proj, qkv), (attn.o_proj, weights["layers.0.self_attn.o_proj.weight"]),
                      (mlp.gate_up_proj, gate_up), (mlp.down_proj, weights["layers.0.mlp.down_proj.weight"])):
        assert torch.equal(module.dequantize(), _rtn_reference(w, bits))
    assert torch.equal(head.norm.weight, float_head.norm.weight)  # norms stay float
    assert linear_weight_bytes(head) < 0.6 * linear_weight_bytes(float_head)
    # the trunk verifies every draft: greedy MTP is AR's, token for token
    messages = [{"role": "user", "content": "Name three rivers in Europe."}]
    ar = engine.generate(messages, chat=True, max_tokens=40, mode="ar", ignore_eos=True)
    mtp = engine.generate(messages, chat=True, max_tokens=40, mode="mtp", depth=2, ignore_eos=True)
    assert mtp.token_ids == ar.token_ids == plain.generate(messages, chat=True, max_tokens=40, mode="ar",
                                                           ignore_eos=True).token_ids
    assert mtp.stats["accepted_tokens"] > 0
    # a tuned verdict measured with the float head is not the quantized head's
    assert model_key(engine.loaded, "cpu", torch.float32).endswith(f"|head_quantize={fmt}")
    assert "head_quantize" not in model_key(plain.loaded, "cpu", torch.float32)


def test_unknown_head_quantize_value_is_refused_before_loading(tmp_path):
    with pytest.raises(InvalidParameter, match="head_quantize"):
        mtplx.load(tmp_path / "absent.gguf", device="cpu", head_quantize="gguf")


def test_head_quantize_on_a_model_without_a_head_says_it_has_no_effect(tmp_path, caplog):
    import logging

    _tiny_bf16_dir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="mtplx"):
        engine = mtplx.load(tmp_path, device="cpu", head_quantize="int8")
    assert not engine.has_mtp and engine.loaded.head_quantize is None
    assert any("head_quantize=int8 has no effect" in r.getMessage() for r in caplog.records)
