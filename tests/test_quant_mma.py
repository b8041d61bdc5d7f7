"""The tensor-core GEMV (mtplx/kernels/quant_mma.py) on the CPU: packing round trips; the
layout's arithmetic emulated from the PTX fragment rules (``quant_mma.emulate``: each lane's
decoded A registers and loaded B registers placed where mma.sync reads them); and the inline
PTX text itself, run on a small simulator of the instructions it uses, each against the product
with the unpacked weight in float64. The Triton kernel around the PTX runs only on CUDA:
tests/test_quant_kernels_triton.py checks it there, and benchmarks/quant_gemv.py and
benchmarks/gpu.py --quant check every layer against its dequantized weight before timing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtplx.kernels import quant_mma


def _weight(bits: int, n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    q[0, :2] = torch.tensor([lo, hi - 1])  # both ends of the range
    scale = (torch.rand(n, k // group, generator=g) * 0.1 + 1e-3).half()
    zero = (torch.randn(n, k // group, generator=g) * 0.3).half()  # GGUF's Q4_1 / Q4_K minima
    return q, scale, zero


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (40, 128, 64), (33, 192, 32), (7, 256, 128)])
def test_pack_round_trips(bits, n, k, group):
    q, scale, zero = _weight(bits, n, k, group)
    words = quant_mma.pack(q, bits)
    assert words.shape == (-(-n // 16), k // quant_mma.tile_k(bits), 32, 4) and words.dtype == torch.int32
    assert torch.equal(quant_mma.unpack(words, bits, n, k), q.int())
    scales = quant_mma.pack_scales(scale, bits, group, n, k)
    assert torch.equal(quant_mma.unpack_scales(scales, bits, group, n, k), scale)
    w = quant_mma.dequantize_reference(words, scales, n=n, k=k, group=group, bits=bits)
    assert torch.equal(w, (q.float().unflatten(1, (-1, group)) * scale.float().unsqueeze(-1)).flatten(1))
    zeros = quant_mma.pack_scales(zero, bits, group, n, k)
    w = quant_mma.dequantize_reference(words, scales, zeros, n=n, k=k, group=group, bits=bits)
    want = q.float().unflatten(1, (-1, group)) * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    assert torch.equal(w, want.flatten(1))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n,k,group", [(40, 128, 32), (33, 192, 64), (16, 256, 128)])
@pytest.mark.parametrize("offsets", [False, True])
def test_emulated_kernel_matches_the_weight(bits, rows, n, k, group, offsets):
    q, scale, zero = _weight(bits, n, k, group, seed=rows)
    words = quant_mma.pack(q, bits)
    scales = quant_mma.pack_scales(scale, bits, group, n, k)
    zeros = quant_mma.pack_scales(zero, bits, group, n, k) if offsets else None
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    w = q.double().unflatten(1, (-1, group)) * scale.double().unsqueeze(-1)
    if offsets:
        w = w + zero.double().unsqueeze(-1)
    w = w.flatten(1)
    ref = x.double() @ w.T
    got = quant_mma.emulate(x, words, scales, zeros, n=n, k=k, bits=bits).double()
    magnitude = x.double().abs() @ w.abs().T
    # float32 sums of exact products, less the constant's sum (128 + 8 or 2048 + 128 + 128 times
    # sum x), and the offset's term from that sum: a few float32 roundings of terms up to
    # 2304 |x| * scale
    assert float(((got - ref).abs() / magnitude).max()) < 1e-5


def test_supports_only_what_the_layout_holds():
    assert quant_mma.supports(4, 32, 4096, False) and quant_mma.supports(8, 128, 4096, False)
    assert not quant_mma.supports(8, 32, 4096, True)  # fp8
    assert not quant_mma.supports(4, 48, 4800, False)  # groups not a multiple of 32
    assert not quant_mma.supports(4, 32, 96, False)  # rows not whole 64-input tiles
    assert quant_mma.supports(8, 32, 96, False)  # int8 tiles are 32 inputs


# --- the inline PTX itself, run on a small simulator of the instructions it uses -------------------
# (lop3, shr, prmt, mov, ld.global, mma.sync.m16n8k16 with the PTX ISA's fragment layouts, add and
# fma in float32): 32 lanes in lockstep over one tile, so that the text the GPU compiles is checked
# here too, not only the layout's arithmetic (``quant_mma.emulate``).

def _f32(bits: int) -> float:
    return float(np.frombuffer(np.uint32(bits & 0xFFFFFFFF).tobytes(), np.float32)[0])


def _bits(value: float) -> int:
    return int(np.frombuffer(np.float32(value).tobytes(), np.uint32)[0])


def _bf16_pair(bits: int) -> tuple[float, float]:
    return _f32((bits & 0xFFFF) << 16), _f32(bits & 0xFFFF0000)


class _Warp:
    """32 lanes of 32-bit registers running straight-line PTX; memory: a bytes object."""

    def __init__(self, operands: list[list[int]], memory: bytes):
        self.regs = [{f"${i}": v for i, v in enumerate(lane)} for lane in operands]
        self.memory = memory

    def value(self, lane: int, token: str) -> int:
        token = token.strip()
        if token in self.regs[lane]:
            return self.regs[lane][token]
        if token.startswith("0f"):
            return int(token[2:], 16)
        return int(token, 0)

    def run(self, text: str) -> None:
        for line in text.splitlines():
            line = line.strip().rstrip(";")
            if not line or line in "{}" or line.startswith(".reg"):
                continue
            op, _, rest = line.partition(" ")
            if op.startswith("mma"):
                assert op == "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", op
                self.mma(rest)
                continue
            for lane in range(32):
                self.step(lane, op, rest)

    def step(self, lane: int, op: str, rest: str) -> None:
        if op.startswith("ld.global"):
            dst, addr = rest.split(", [")
            base, _, off = addr.rstrip("]").partition("+")
            at = self.value(lane, base) + int(off or 0)
            names = dst.strip("{} ").split(", ")
            width = 2 if op.endswith(".b16") else 4
            for i, name in enumerate(names):
                self.regs[lane][name] = int.from_bytes(self.memory[at + width * i: at + width * (i + 1)], "little")
            return
        args = [a.strip() for a in rest.split(",")]
        v = [self.value(lane, a) for a in args[1:]]
        if op in ("mov.b32", "mov.f32"):
            out = v[0]
        elif op == "lop3.b32":  # each result bit: the LUT's bit at (a << 2 | b << 1 | c) of the 0xF0/0xCC/0xAA roles
            a, b, c, lut = v
            out = 0
            for i in range(32):
                index = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
                out |= ((lut >> index) & 1) << i
        elif op == "shr.u32":
            out = (v[0] & 0xFFFFFFFF) >> v[1]
        elif op == "prmt.b32":  # bytes of {b, a} chosen by the selector's nibbles
            assert not v[2] & 0x8888, "the simulator has no sign-replicating prmt selectors"
            pool = (v[0] & 0xFFFFFFFF) | ((v[1] & 0xFFFFFFFF) << 32)
            out = sum(((pool >> (8 * ((v[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "cvt.f32.f16":
            out = _bits(float(np.frombuffer(np.uint16(v[0]).tobytes(), np.float16)[0]))
        elif op == "add.f32":
            out = _bits(np.float32(_f32(v[0])) + np.float32(_f32(v[1])))
        elif op == "fma.rn.f32":
            out = _bits(np.float32(_f32(v[0]) * _f32(v[1]) + _f32(v[2])))  # float64 product: exact enough
        else:
            raise AssertionError(f"the simulator has no {op}")
        self.regs[lane][args[0]] = out & 0xFFFFFFFF

    def mma(self, rest: str) -> None:
        """m16n8k16, bf16 in, f32 sums: fragments per the PTX ISA (groupID g = lane / 4, t = lane % 4)."""
        groups = [grp.strip(" {}").split(", ") for grp in rest.split("}, {")]
        d_regs, a_regs, b_regs, c_regs = groups
        a, b, c = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for j, name in enumerate(a_regs):
                lo, hi = _bf16_pair(self.value(lane, name))
                row, col = g + 8 * (j % 2), 2 * t + 8 * (j // 2)
                a[row, col], a[row, col + 1] = lo, hi
            for j, name in enumerate(b_regs):
                lo, hi = _bf16_pair(self.value(lane, name))
                b[2 * t + 8 * j, g], b[2 * t + 8 * j + 1, g] = lo, hi
            for j, name in enumerate(c_regs):
                c[g + 8 * (j // 2), 2 * t + j % 2] = _f32(self.value(lane, name))
        d = (a @ b + c).astype(np.float32)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for j, name in enumerate(d_regs):
                self.regs[lane][name] = _bits(d[g + 8 * (j // 2), 2 * t + j % 2])


def _lane_scales(tile: torch.Tensor) -> list[list[int]]:
    """The 4 float32 scale operands (bits) of each lane for one tile of ``pack_scales``'s layout:
    the lane group's 4 of [8, 4]; for the compact [8, 2] the pair PTX run on the simulator over
    the pairs' bytes (float16, or float32 as ``_pair_asm(32)`` loads them)."""
    if tile.shape[-1] == 4:
        return [[_bits(float(s)) for s in tile[lane // 4]] for lane in range(32)]
    size = tile.element_size()
    load = _Warp([[0] * 4 + [2 * size * (lane // 4)] * 4 for lane in range(32)], tile.contiguous().numpy().tobytes())
    load.run(quant_mma._pair_asm(8 * size))
    return [[load.regs[lane][f"${i}"] for i in range(4)] for lane in range(32)]


@pytest.mark.parametrize("bits,group,dtype", [(4, 32, torch.float16), (4, 64, torch.float16),
                                               (4, 128, torch.float32), (8, 32, torch.float16)])
@pytest.mark.parametrize("offsets", [False, True])
def test_inline_ptx_computes_a_tile(bits, group, dtype, offsets):
    """One tile (16 rows x 64 or 32 inputs), 8 token rows: the load PTX, then the tile PTX, for
    every lane, against the tile's float64 product. The scales as the kernel hands them to a
    lane: its lane group's four from the layout of one scale a half tile (int4 groups of 32), or
    its group's pair twice, (row g, row g + 8) for each half, from the compact one."""
    n, k = 16, quant_mma.tile_k(bits)
    width = max(k, group)  # a weight of whole groups; the first tile is run
    q, scale, zero = _weight(bits, n, width, group, seed=bits + offsets)
    scale, zero = scale.to(dtype), zero.to(dtype)  # float32 where float16 cannot hold them (compact_scales)
    words = quant_mma.pack(q, bits)[0, 0]  # [32, 4]
    scales = quant_mma.pack_scales(scale, bits, group, n, width)[0, 0]  # [8, 4], or compact [8, 2]
    zeros = quant_mma.pack_scales(zero, bits, group, n, width)[0, 0]
    assert scales.shape[-1] == (2 if quant_mma.whole_tile_groups(bits, group) else 4)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    memory = x.view(torch.int16).numpy().tobytes()
    u32 = lambda t: int(t) & 0xFFFFFFFF  # noqa: E731
    # the load: lane (g, t) reads token row g from input 4 t (int4) or 2 t (int8), byte addresses
    per_lane = 4 if bits == 4 else 2
    addresses = [2 * ((lane // 4) * k + per_lane * (lane % 4)) for lane in range(32)]
    outs = 8 if bits == 4 else 4
    load = _Warp([[0] * outs + [a] * 4 for a in addresses], memory)
    load.run(quant_mma._load_asm(bits))
    xs = [[load.regs[lane][f"${i}"] for i in range(outs)] for lane in range(32)]
    kappa = quant_mma.bias_of(bits)
    acc = np.float32(np.random.default_rng(7).normal(size=(16, 8)))
    sc_in, z_in = _lane_scales(scales), _lane_scales(zeros)
    operands = []
    for lane in range(32):
        g = lane // 4
        sc = sc_in[lane]
        zq = [_bits(float(np.float32(_f32(z)) * np.float32(-1.0 / kappa))) for z in z_in[lane]]
        # the sums coming in: each lane's c0-c3 (rows g, g + 8; tokens 2 t, 2 t + 1)
        acc_in = [_bits(float(acc[g + 8 * (j // 2), 2 * (lane % 4) + j % 2])) for j in range(4)]
        operands.append([0] * 4 + [u32(w) for w in words[lane]] + xs[lane] + sc + (zq if offsets else []) + acc_in)
    tile = _Warp(operands, memory)
    tile.run(quant_mma._asm(bits, offsets))
    got = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for j in range(4):
            got[g + 8 * (j // 2), 2 * t + j % 2] = _f32(tile.regs[lane][f"${j}"])
    w = q.double().unflatten(1, (-1, group)) * scale.double().unsqueeze(-1)
    if offsets:
        w = w + zero.double().unsqueeze(-1)
    w = w.flatten(1)[:, :k]
    ref = (x.double() @ w.T).T.numpy() + acc
    magnitude = (x.double().abs() @ w.abs().T).T.numpy() + np.abs(acc)
    assert (np.abs(got - ref) <= 1e-5 * magnitude).all()


@pytest.mark.parametrize("group,k", [(32, 128), (128, 256)])
def test_mma_layer_checks_its_format_and_runs_off_the_gpu(group, k):
    """A forced "mma" layer refuses what the layout cannot hold; where its GEMV cannot run (here:
    the CPU, kernels on or off) forward and the SiLU path take the dequantized weight. Its scales
    and offsets take 2 bytes a row and group (float16), in either layout."""
    from mtplx import kernels
    from mtplx.models.quant import QuantizedWeight, QuantLinear

    q, scale, zero = _weight(4, 32, 128, 32)
    with pytest.raises(ValueError, match="'mma' backend"):
        QuantLinear(QuantizedWeight(q[:, :96], scale[:, :3].float(), zero[:, :3].float(), 4, 32), backend="mma")
    q, scale, zero = _weight(4, 32, k, group)
    qw = QuantizedWeight(q, scale.float(), zero.float(), 4, group)
    layer = QuantLinear(qw, backend="mma")
    assert layer.weight_bytes() == 32 * k // 2 + 2 * (2 * 32 * (k // group))
    w = QuantizedWeight(q, scale.float(), zero.float(), 4, group).dequantize()
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    for enabled in (True, False):
        kernels.ENABLED = enabled
        try:
            assert torch.allclose(layer(x), x @ w.T, atol=1e-4)
            g, u = (x @ w.T).chunk(2, dim=-1)
            assert torch.allclose(layer.silu_mul_forward(x), torch.nn.functional.silu(g) * u, atol=1e-4)
        finally:
            kernels.ENABLED = True


def test_cuda_backend_choice():
    """int4 takes the tensor-core GEMV only for bf16 activations (float16 and float32 keep the
    CUDA-core kernel, which reads them as they are); MTPLX_CUDA_QUANT says otherwise or is refused."""
    from mtplx.kernels import fused
    from mtplx.models import quant

    q, scale, zero = _weight(4, 32, 128, 32)
    qw = quant.QuantizedWeight(q, scale.float(), zero.float(), 4, 32)
    cuda = torch.device("cuda")
    if fused.available():
        assert quant._backend_for(qw, cuda, torch.float16) == "triton"
        assert quant._backend_for(qw, cuda, torch.float32) == "triton"
    import os
    os.environ["MTPLX_CUDA_QUANT"] = "fast"
    try:
        with pytest.raises(ValueError, match="MTPLX_CUDA_QUANT"):
            quant._backend_for(qw, cuda, torch.bfloat16)
    finally:
        del os.environ["MTPLX_CUDA_QUANT"]
