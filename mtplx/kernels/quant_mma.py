"""Weight-only int4 and int8 GEMV on the tensor cores, for bf16 activations of 1 to 8 token rows
(decode steps, drafts, verifies) on CUDA GPUs with bf16 ``mma`` (compute capability 8.0+).

    out[m, n] = sum_k x[m, k] * (q[n, k] * scale[n, k // group] + zero[n, k // group])      q: int4 or int8

Why: ``quant_gemv``'s CUDA-core kernel spends about four instructions per int4 weight decoding
and multiplying (docs/performance.md, session 9): at one row it issues instructions about as
fast as memory delivers the weights, and a verify of 4 rows costs it 2x a step because every
row is a separate multiply. Here a warp decodes its weights straight into the A operand of
``mma.sync.m16n8k16`` (bf16 in, float32 sums) and the token rows are the B operand's 8
columns, so 1 to 8 rows cost the same instructions (about three per int4 weight and lane in
Triton 3.6's sm_90 build) and the multiplies run on the tensor cores. Measured on the H200
(docs/performance.md, session 12): at 4 rows 1.4-2.5x faster than the CUDA-core kernel, at 1
row 5-25% slower (it waits on memory more than it issues), so an int4 verify of 1 + 3 tokens
costs 1.04x an AR step where it cost 2.0x.

Decoding (inline PTX, ``_asm``): one ``lop3`` puts two 4-bit fields u, at
bits 0 and 16 of a word (after a shift of 0, 4, 8 or 12), into the mantissas of two bf16 128.0,
giving 128 + u exactly, which is the A register pair. The offset (the 128, and the 8 of
offset-binary: q = u - 8) is taken off with two more mma per group half whose A is the constant
-136: the products are exact in float32 and the float32 sums of these small integers times the
activations lose nothing that matters (relative 2^-24 * 136 of sum |x|). The group's float32 sums
are then multiplied by its scale (one FFMA per output), which is exactly what the CUDA-core
kernel computes, up to the order of the float32 sums. int8 weights are two planes of 4 bits,
u = 16 uh + ul: the high field is decoded into bf16 2048.0's mantissa, whose unit is 16, so
2048 + 16 uh, and the low one into 128 + ul; each pair of B elements repeats one activation
(``prmt``), and the constant A is (-128, -2176). A group offset z (GGUF's Q4_1 and Q4_K
minima) adds z * (the half's activation sum), which is the constant chain's sum times
-z / kappa (``bias_of``): one more FFMA per output and half.

Layout (``pack``): rows in tiles of 16, inputs in tiles of KT (64 int4 or 32 int8); a tile is
32 lanes x 4 int32 words (512 bytes, one 16-byte load per lane), word s of lane l = 4 g + t
holding mma step s's A fragment: the shift-4j pair of nibbles is A register j, whose two
elements are (row g + 8 (j % 2), k) for

    int4: k = 16 s + 4 t + 2 (j // 2) + e       (e = 0 for bits 0-15, 1 for bits 16-31)
    int8: k = 8 s + 2 t + j // 2                (the low 4 bits, then the high 4 bits)

which is the PTX fragment order (a0 a1: row g, a2 a3: row g + 8, a4 a5: row g, more k; a6 a7:
row g + 8) with the mma's k axis permuted so that a lane's B values for a step are consecutive
activations: 4 (int4) or 2 (int8) of them per step, loaded as one 8- or 4-byte word. Steps 0-1
and 2-3 each lie in one scale group (groups are multiples of 32 inputs). Rows and inputs are
padded with q = 0 to whole tiles.

Scales (``pack_scales``; offsets alike): where a group holds whole input tiles (int4 groups of
64, 128, 256; every int8 group), one pair (row g, row g + 8) a group and lane group, which both
halves of each of the group's tiles read: [row tiles, groups, 8, 2]. Else (int4 groups of 32,
two to a tile) one a half tile and row: [row tiles, input tiles, 8, 4]. A layout of one scale a
half tile for every group size stored each scale of a group of 128 four times: 64 bytes of
scales to a tile's 512 of weights (4.5 bits a weight) where 16 hold them (4.125).

The lane layout relies on Triton giving lane l of a warp elements 4 l .. 4 l + 3 of each
128-element row (a tile) of the kernel's tensors, the layout of the coalesced 16-byte weight
loads, which Triton 3.6 and 3.9 both choose (checked in their TTGIR): ``tests/test_quant_mma.py`` checks the
layout's arithmetic in PyTorch (an emulation of the fragments) and runs the inline PTX on a small
simulator of its instructions; tests/test_quant_kernels_triton.py (on CUDA), benchmarks/gpu.py and
benchmarks/quant_gemv.py check every layer against its dequantized weight on the GPU before
timing. Prompts (more than 8 rows) dequantize the weight with ``dequantize`` and use cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtplx import kernels
from mtplx.kernels import fused, quant_gemv

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never reach these kernels
    triton = None

ROW_TILE = 16
LANES = 32
WORDS = 4  # per lane per tile: mma steps
MAX_ROWS = 8  # the B operand's columns
GROUP_MULTIPLE = 32


def tile_k(bits: int) -> int:
    """Inputs per tile: 64 int4 or 32 int8."""
    return 64 if bits == 4 else 32


def supports(bits: int, group: int, k: int, fp8: bool) -> bool:
    """Formats this layout holds: int4 or int8 (with or without offsets) in whole groups of a
    multiple of 32, rows of whole input tiles (no activation is read past a row's end)."""
    return (bits in (4, 8) and not fp8 and group % GROUP_MULTIPLE == 0 and k % group == 0
            and k % tile_k(bits) == 0)


def bias_of(bits: int) -> float:
    """kappa: the constant mma adds -kappa * (the half's activation sum) to the weights' sums
    (128 + 8 for int4, 2048 + 128 + 128 for int8), which is how an offset's term is recovered."""
    return 136.0 if bits == 4 else 2304.0


def device_ok(device: torch.device) -> bool:
    """A CUDA device with bf16 mma (sm_80+), kernels enabled, Triton installed."""
    return (kernels.ENABLED and triton is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 8)


def _fragment_index(bits: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each (lane, word s, nibble position p) of a tile: (row in the tile, k in the tile,
    which 4 bits of the int8 value: 0 low, 1 high; always 0 for int4), each [32, 4, 8]."""
    lane = torch.arange(LANES, device=device).view(LANES, 1, 1)
    s = torch.arange(WORDS, device=device).view(1, WORDS, 1)
    p = torch.arange(8, device=device).view(1, 1, 8)
    g, t, j, e = lane // 4, lane % 4, p % 4, p // 4
    row = g + 8 * (j % 2)
    if bits == 4:
        k, half = 16 * s + 4 * t + 2 * (j // 2) + e, torch.zeros_like(e)
    else:
        k, half = 8 * s + 2 * t + j // 2, e
    shape = (LANES, WORDS, 8)
    return row.expand(shape), k.expand(shape), half.expand(shape)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [N, K] int8 (int4 values in [-8, 7]) -> int32 [ceil(N / 16), ceil(K / KT), 32, 4] in
    the layout above, on q's device."""
    n, k = q.shape
    kt = tile_k(bits)
    u = q.to(torch.int32) + (8 if bits == 4 else 128)  # offset-binary; padding is q = 0
    u = F.pad(u, (0, -k % kt, 0, -n % ROW_TILE), value=8 if bits == 4 else 128)
    tiles = u.view(u.shape[0] // ROW_TILE, ROW_TILE, u.shape[1] // kt, kt).transpose(1, 2)
    row, kk, half = _fragment_index(bits, q.device)
    fields = (tiles[:, :, row, kk] >> (4 * half)) & 15  # [R, C, 32, 4, 8]
    shifts = 4 * torch.arange(8, device=q.device, dtype=torch.int64)
    words = (fields.to(torch.int64) << shifts).sum(-1)  # disjoint fields: the sum is their or
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).contiguous()


def whole_tile_groups(bits: int, group: int) -> bool:
    """Whether each input tile lies in one group (the scales' compact layout)."""
    return group % tile_k(bits) == 0


def tiles_per_group(words: torch.Tensor, scales: torch.Tensor) -> int:
    """Input tiles a group of ``pack_scales``'s compact layout spans, from the packed shapes; 0 for
    the layout of one scale a half tile."""
    return words.shape[1] // scales.shape[1] if scales.shape[-1] == 2 else 0


def pack_scales(scale: torch.Tensor, bits: int, group: int, n: int, k: int) -> torch.Tensor:
    """scale [n, k // group] -> in scale's dtype (0 for padding rows; offsets take the same layout):
    - groups of whole input tiles (``whole_tile_groups``): [ceil(n / 16), k // group, 8, 2], for
      row tile r, group j and lane group g the scales of rows g and g + 8;
    - else [ceil(n / 16), ceil(k / KT), 8, 4], for row tile r, input tile c and lane group g the
      scales of (row g, first half of the tile's inputs), (row g + 8, first half), (row g, second
      half), (row g + 8, second half): one 8-byte load per lane for float16 scales, 16 for float32."""
    kt = tile_k(bits)
    r, c = -(-n // ROW_TILE), -(-k // kt)
    if whole_tile_groups(bits, group):
        padded = F.pad(scale, (0, 0, 0, r * ROW_TILE - n))  # [r * 16, groups]
        return padded.view(r, 2, 8, -1).permute(0, 3, 2, 1).contiguous()
    g = torch.arange(8, device=scale.device).view(1, 1, 8, 1)
    v = torch.arange(4, device=scale.device).view(1, 1, 1, 4)
    row = torch.arange(r, device=scale.device).view(r, 1, 1, 1) * ROW_TILE + g + 8 * (v % 2)
    grp = (torch.arange(c, device=scale.device).view(1, c, 1, 1) * kt + (kt // 2) * (v // 2)) // group
    padded = F.pad(scale, (0, 0, 0, r * ROW_TILE - n))
    return padded[row.expand(r, c, 8, 4), grp.expand(r, c, 8, 4)].contiguous()


def unpack(words: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    """``pack``'s inverse in PyTorch: q [n, k] as int32."""
    r, c = words.shape[:2]
    kt = tile_k(bits)
    shifts = 4 * torch.arange(8, device=words.device, dtype=torch.int32)
    fields = (words.unsqueeze(-1) >> shifts) & 15  # [R, C, 32, 4, 8]
    row, kk, half = _fragment_index(bits, words.device)
    at = (row * kt + kk).reshape(1, 1, -1).expand(r, c, -1)
    u = torch.zeros(r, c, ROW_TILE * kt, dtype=torch.int32, device=words.device)
    u.scatter_add_(2, at, (fields << (4 * half)).to(torch.int32).reshape(r, c, -1))  # int8: the two halves add
    u = u.view(r, c, ROW_TILE, kt).transpose(1, 2).reshape(r * ROW_TILE, c * kt)[:n, :k]
    return u - (8 if bits == 4 else 128)


def unpack_scales(scales: torch.Tensor, bits: int, group: int, n: int, k: int) -> torch.Tensor:
    """``pack_scales``'s inverse: [n, k // group]."""
    kt = tile_k(bits)
    if scales.shape[-1] == 2:  # the compact layout
        return scales.permute(0, 3, 2, 1).reshape(-1, scales.shape[1])[:n]
    rows = torch.arange(n, device=scales.device)
    starts = torch.arange(k // group, device=scales.device) * group  # each group's first input
    c, half = starts // kt, (starts % kt) // (kt // 2)
    return scales[(rows // ROW_TILE).view(-1, 1), c.view(1, -1), (rows % 8).view(-1, 1),
                  (2 * half).view(1, -1) + ((rows % ROW_TILE) // 8).view(-1, 1)]


def dequantize_reference(words, scales, zeros=None, *, n: int, k: int, group: int, bits: int) -> torch.Tensor:
    """The float32 weight [n, k] the kernel computes with, in PyTorch (zeros: the offsets in
    ``pack_scales``'s layout, or None)."""
    q = unpack(words, bits, n, k).float()
    w = q.unflatten(1, (-1, group)) * unpack_scales(scales, bits, group, n, k).float().unsqueeze(-1)
    if zeros is not None:
        w = w + unpack_scales(zeros, bits, group, n, k).float().unsqueeze(-1)
    return w.flatten(1)


def emulate(x: torch.Tensor, words, scales, zeros=None, *, n: int, k: int, bits: int) -> torch.Tensor:
    """What the kernel computes, in PyTorch (float32), from the PTX definitions: each lane's A
    registers decoded from its word as the inline PTX does (128 + u; int8: 128 + ul and
    2048 + 16 uh), its B registers loaded from x as the kernel loads them, both placed in the
    16 x 16 A and 16 x 8 B matrices by the mma fragment rules, multiplied, the constant mma
    added, each group half scaled (and its offset's term, -offset / kappa times the constant
    mma's sums, added), and D read back by the C fragment rule. x [rows <= 8, k] ->
    [rows, n]. For tests: it checks the layout's arithmetic without a GPU."""
    rows = x.shape[0]
    kt = tile_k(bits)
    r_tiles, c_tiles = words.shape[:2]
    tpg = tiles_per_group(words, scales)
    xp = torch.zeros(MAX_ROWS, c_tiles * kt)
    xp[:rows, :k] = x.float()
    lane = torch.arange(LANES)
    g, t = lane // 4, lane % 4
    j, e = torch.arange(4).view(1, 4, 1), torch.arange(2).view(1, 1, 2)
    a_row = (g.view(-1, 1, 1) + 8 * (j % 2)).expand(LANES, 4, 2)  # A register j, element e
    a_col = (2 * t.view(-1, 1, 1) + e + 8 * (j // 2)).expand(LANES, 4, 2)
    b, eb = torch.arange(2).view(1, 2, 1), torch.arange(2).view(1, 1, 2)
    b_row = (2 * t.view(-1, 1, 1) + eb + 8 * b).expand(LANES, 2, 2)  # B register b, element e
    b_col = g.view(-1, 1, 1).expand(LANES, 2, 2)
    if bits == 4:
        const = torch.full((16, 16), -136.0)
    else:  # register elements alternate (low 4 bits, high 4 bits)
        const = torch.tensor([-128.0, -2176.0]).repeat(8).expand(16, 16)
    out = torch.zeros(MAX_ROWS, r_tiles * ROW_TILE)
    for r in range(r_tiles):
        acc = torch.zeros(ROW_TILE, MAX_ROWS)
        for c in range(c_tiles):
            for h in range(2):  # group halves: steps 0-1, 2-3
                d = torch.zeros(ROW_TILE, MAX_ROWS)
                e_sum = torch.zeros(ROW_TILE, MAX_ROWS)  # the constant mma's chain
                for s in (2 * h, 2 * h + 1):
                    w = words[r, c, :, s].to(torch.int64) & 0xFFFFFFFF
                    pair = w.view(-1, 1) >> (4 * torch.arange(4)).view(1, 4)
                    lo, hi = (pair & 15).float(), ((pair >> 16) & 15).float()
                    regs = torch.stack((128 + lo, (128 + hi) if bits == 4 else (2048 + 16 * hi)), dim=-1)
                    a = torch.zeros(16, 16)
                    a[a_row, a_col] = regs
                    if bits == 4:  # x[g][base + 4 t + 2 b + e]
                        at = c * kt + 16 * s + 4 * t.view(-1, 1, 1) + 2 * b + eb
                    else:  # x[g][base + 2 t + b], both elements
                        at = c * kt + 8 * s + 2 * t.view(-1, 1, 1) + b
                    bm = torch.zeros(16, MAX_ROWS)
                    bm[b_row, b_col] = xp[g.view(-1, 1, 1).expand(LANES, 2, 2), at.expand(LANES, 2, 2)]
                    d += a @ bm
                    e_sum += const @ bm
                at = (r, c // tpg, slice(None), slice(0, 2)) if tpg else (r, c, slice(None), slice(2 * h, 2 * h + 2))
                sc = scales[at].float().T.reshape(ROW_TILE)  # rows 0-7, then 8-15
                acc += (d + e_sum) * sc.view(-1, 1)
                if zeros is not None:
                    zq = zeros[at].float().T.reshape(ROW_TILE) * (-1.0 / bias_of(bits))
                    acc += e_sum * zq.view(-1, 1)
        out[:, r * ROW_TILE:(r + 1) * ROW_TILE] = acc.T
    return out[:rows, :n]


def _load_asm(bits: int, coherent: bool = False) -> str:
    """Inline PTX loading one lane's activations for a tile's 4 mma steps from the address of
    step 0's (int4: $8, after the 8 outputs, $9-$11 copies; int8: $4, $5-$7 copies): int4, 8
    bytes a step (the lane's 4 activations), 32 bytes apart, as the B registers $0-$3
    (activations 0-1 of steps 0-3) and $4-$7 (2-3); int8, 4 bytes (a pair), 16 bytes apart, as
    $0-$3. The loads are written in PTX, not Triton, so that
    Triton keeps every operand in the words' layout instead of moving the words through shared
    memory into the activations' (these addresses are not contiguous across a warp's lanes).
    coherent: plain loads instead of the read-only path (``.nc``, which assumes the data does not
    change while the kernel runs: under programmatic dependent launch the kernel before this one
    may still be writing the activations when this one starts)."""
    op = "ld.global" if coherent else "ld.global.nc"
    if bits == 4:
        loads = [f"{op}.v2.b32 {{${s}, ${4 + s}}}, [$8+{32 * s}];" for s in range(4)]
    else:
        loads = [f"{op}.b32 ${s}, [$4+{16 * s}];" for s in range(4)]
    return "\n".join(loads)


def _pair_asm(bits: int) -> str:
    """Inline PTX loading a lane group's scale pair (row g, row g + 8) of the compact layout
    (float16 or float32 ``bits``) from the address $4 ($5-$7 copies) into the tile PTX's 4 scale
    operands $0-$3: the pair for the first half of the tile's inputs, then again for the second.
    The scales never change while a kernel runs: the read-only path."""
    if bits == 32:
        return "ld.global.nc.v2.f32 {$0, $1}, [$4];\nmov.f32 $2, $0;\nmov.f32 $3, $1;"
    return ("{\n.reg .b16 lo, hi;\nld.global.nc.v2.b16 {lo, hi}, [$4];\ncvt.f32.f16 $0, lo;\ncvt.f32.f16 $1, hi;\n"
            "mov.f32 $2, $0;\nmov.f32 $3, $1;\n}")


def _asm(bits: int, offsets: bool) -> str:
    """The inline PTX of one lane's tile: 4 words -> 16 A registers, 4 mma steps and the
    constant's 4 in two chains per group half, each half's sums scaled into the 4 float32 sums.
    Operands (pack 4): $0-$3 the sums out; $4-$7 the words; int4: $8-$11 and $12-$15 each step's
    B registers (activations 0-1 and 2-3 of the lane's four), int8: $8-$11 each step's pair of
    activations; then 4 scales ((row g, half 0), (row g + 8, half 0), (g, 1), (g + 8, 1)), with
    ``offsets`` 4 offsets times -1 / kappa (``bias_of``) in the same order, and the 4 sums in. An
    offset z adds z * (sum of the half's activations) = -z / kappa * (the constant's chain)."""
    magic, const = ("0x43004300", "0xC308C308") if bits == 4 else ("0x45004300", "0xC508C300")
    sc = 16 if bits == 4 else 12
    zq, acc = sc + 4, sc + (8 if offsets else 4)
    lines = ["{", ".reg .b32 a<16>, t<3>, b<8>, c;", ".reg .f32 d<8>, e<8>, f<4>;", f"mov.b32 c, {const};"]
    for s in range(4):  # B registers of step s: b{2s}, b{2s+1}
        if bits == 4:
            lines += [f"mov.b32 b{2 * s}, ${8 + s};", f"mov.b32 b{2 * s + 1}, ${12 + s};"]
        else:  # (x0, x0) and (x1, x1) from the pair (x0, x1)
            lines += [f"prmt.b32 b{2 * s}, ${8 + s}, 0, 0x1010;", f"prmt.b32 b{2 * s + 1}, ${8 + s}, 0, 0x3232;"]
    for s in range(4):
        lines.append(f"lop3.b32 a{4 * s}, ${4 + s}, 0x000F000F, {magic}, 0xEA;")
        for j in range(1, 4):
            lines.append(f"shr.u32 t{j - 1}, ${4 + s}, {4 * j};")
            lines.append(f"lop3.b32 a{4 * s + j}, t{j - 1}, 0x000F000F, {magic}, 0xEA;")
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%s}, {%s}, {%s}, {%s};"
    zero = "0f00000000, 0f00000000, 0f00000000, 0f00000000"
    for h in range(2):  # chains: d (the weights' two steps), e (the constant's)
        dh, eh = ", ".join(f"d{4 * h + i}" for i in range(4)), ", ".join(f"e{4 * h + i}" for i in range(4))
        for n, s in enumerate((2 * h, 2 * h + 1)):
            regs, bregs = ", ".join(f"a{4 * s + j}" for j in range(4)), f"b{2 * s}, b{2 * s + 1}"
            lines += [mma % (dh, regs, bregs, zero if n == 0 else dh),
                      mma % (eh, "c, c, c, c", bregs, zero if n == 0 else eh)]
    for h in range(2):
        for i in range(4):
            prev = f"${acc + i}" if h == 0 else f"f{i}"
            lines += [f"add.f32 d{4 * h + i}, d{4 * h + i}, e{4 * h + i};",
                      f"fma.rn.f32 f{i}, d{4 * h + i}, ${sc + 2 * h + i // 2}, {prev};"]
            if offsets:
                lines.append(f"fma.rn.f32 f{i}, e{4 * h + i}, ${zq + 2 * h + i // 2}, f{i};")
    lines += [f"mov.f32 ${i}, f{i};" for i in range(4)] + ["}"]
    return "\n".join(lines)


if triton is not None:
    from mtplx.kernels.fused import pdl_start, pdl_wait
    from mtplx.kernels.quant_gemv import silu_mul_rounded

    _ASM4 = tl.constexpr(_asm(4, False))
    _ASM8 = tl.constexpr(_asm(8, False))
    _ASM4Z = tl.constexpr(_asm(4, True))
    _ASM8Z = tl.constexpr(_asm(8, True))
    _LOAD4 = tl.constexpr(_load_asm(4))
    _LOAD8 = tl.constexpr(_load_asm(8))
    _LOAD4_COHERENT = tl.constexpr(_load_asm(4, coherent=True))
    _LOAD8_COHERENT = tl.constexpr(_load_asm(8, coherent=True))
    _PAIR16 = tl.constexpr(_pair_asm(16))
    _PAIR32 = tl.constexpr(_pair_asm(32))

    @triton.jit
    def _load_x(x_at, INT8: tl.constexpr, PDL: tl.constexpr):
        """The B registers of the tiles whose step-0 activations are at x_at (int64 addresses):
        int8, one tensor (the pairs of steps 0-3 in each lane's 4 elements); int4, two. Under
        PDL the loads are plain ones, and marked as having effects, so that none is moved above
        ``pdl_wait`` and none reads a stale line of the read-only cache."""
        if INT8:
            if PDL:
                return tl.inline_asm_elementwise(_LOAD8_COHERENT, "=r,=r,=r,=r" + ",l" * 4, [x_at], dtype=tl.int32,
                                                 is_pure=False, pack=4)
            return tl.inline_asm_elementwise(_LOAD8, "=r,=r,=r,=r" + ",l" * 4, [x_at], dtype=tl.int32,
                                             is_pure=True, pack=4)
        else:
            if PDL:
                return tl.inline_asm_elementwise(_LOAD4_COHERENT, "=r,=r,=r,=r,=r,=r,=r,=r" + ",l" * 4, [x_at],
                                                 dtype=(tl.int32, tl.int32), is_pure=False, pack=4)
            return tl.inline_asm_elementwise(_LOAD4, "=r,=r,=r,=r,=r,=r,=r,=r" + ",l" * 4, [x_at],
                                             dtype=(tl.int32, tl.int32), is_pure=True, pack=4)

    @triton.jit
    def _tile(words, xs, sc, zq, acc, INT8: tl.constexpr, HAS_ZERO: tl.constexpr):
        """``acc`` plus the tiles' products (the inline PTX of ``_asm``), a lane's 4 elements each."""
        if INT8:
            if HAS_ZERO:
                out = tl.inline_asm_elementwise(_ASM8Z, "=f,=f,=f,=f" + ",r" * 8 + ",f" * 12, [words, xs, sc, zq, acc],
                                                dtype=tl.float32, is_pure=True, pack=4)
            else:
                out = tl.inline_asm_elementwise(_ASM8, "=f,=f,=f,=f" + ",r" * 8 + ",f" * 8, [words, xs, sc, acc],
                                                dtype=tl.float32, is_pure=True, pack=4)
        else:
            if HAS_ZERO:
                out = tl.inline_asm_elementwise(_ASM4Z, "=f,=f,=f,=f" + ",r" * 12 + ",f" * 12,
                                                [words, xs[0], xs[1], sc, zq, acc], dtype=tl.float32, is_pure=True,
                                                pack=4)
            else:
                out = tl.inline_asm_elementwise(_ASM4, "=f,=f,=f,=f" + ",r" * 12 + ",f" * 8,
                                                [words, xs[0], xs[1], sc, acc], dtype=tl.float32, is_pure=True,
                                                pack=4)
        return out

    @triton.jit
    def _group_scale_at(row_tile, c, g, tiles_k, TPG: tl.constexpr):
        """Where lane group g finds the compact layout's pair (row g, row g + 8) of input tile c's
        group (TPG tiles a group) of row tile ``row_tile``: an element offset."""
        return (row_tile * (tiles_k // TPG) + c // TPG) * 16 + g * 2

    @triton.jit
    def _load_group_scales(ptr, at, ok):
        """The pairs at element offsets ``at`` (``_group_scale_at``) as the 4 float32 a lane's
        tile PTX takes, (row g, row g + 8) for either half, 0 where not ``ok``: one 4-byte load (8
        for float32 scales) in PTX, so that the operand keeps the weights' layout (a Triton load of
        2 distinct values into 4 elements a lane let Triton choose another layout for the tile's
        operands, which broke the lane mapping the mma needs: wrong sums on an H100 in session 38;
        ``benchmarks/compile_kernels.py`` checks the layout)."""
        base = ptr.to(tl.int64)
        addr = tl.where(ok, at.to(tl.int64) * ptr.dtype.element_ty.primitive_bitwidth // 8 + base, base)
        if ptr.dtype.element_ty == tl.float32:
            out = tl.inline_asm_elementwise(_PAIR32, "=f,=f,=f,=f" + ",l" * 4, [addr], dtype=tl.float32,
                                            is_pure=True, pack=4)
        else:
            out = tl.inline_asm_elementwise(_PAIR16, "=f,=f,=f,=f" + ",l" * 4, [addr], dtype=tl.float32,
                                            is_pure=True, pack=4)
        return tl.where(ok, out, 0.0)

    @triton.jit
    def _mma_gemv_kernel(x_ptr, sx, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, rows, N, tiles_k, split_tiles, half_rows,
                         zk, INT8: tl.constexpr, PAIRS: tl.constexpr, WARPS: tl.constexpr, UNITS: tl.constexpr,
                         HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                         SILU: tl.constexpr, PDL: tl.constexpr, TPG: tl.constexpr = 0):
        """out[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for the 16 weight rows of row tile
        program_id(0) (with SILU also those of tile program_id(0) + half_rows / 16, the up rows:
        PAIRS = 2) over input tiles [s * split_tiles, (s + 1) * split_tiles) of split s =
        program_id(1). Each step of the loop takes WARPS * UNITS consecutive tiles, one a row of
        the [PAIRS, WARPS * UNITS, 128] tensors (a lane's 4 words, scales and sums at 4 l .. 4 l + 3).
        Stores as ``quant_gemv._store_sums`` does (PARTIAL: float32 [SPLIT, rows, N] partials).
        TPG: input tiles a group spans in the scales' compact layout (0: one scale a half tile).
        The first step's weights, scales and offsets are loaded before ``pdl_wait``."""
        pdl_start(PDL)
        KT: tl.constexpr = 32 if INT8 else 64
        STEP: tl.constexpr = WARPS * UNITS
        pid_r = tl.program_id(0)
        pid_k = tl.program_id(1)
        # [PAIRS, STEP, 128]: the last axis is a tile's 32 lanes x 4 words, contiguous in memory, so
        # that every Triton version lays it out as 4 consecutive elements per thread and 32
        # threads per warp (the layout of the coalesced weight load), which the mma needs
        p = tl.arange(0, PAIRS)[:, None, None]
        wu = tl.arange(0, STEP)[None, :, None]
        e = tl.arange(0, 128)[None, None, :]
        lane = e // 4
        v = e % 4
        g = lane // 4
        t = lane % 4
        c_lo = pid_k * split_tiles
        c_hi = tl.minimum(c_lo + split_tiles, tiles_k)
        row_tile = pid_r + p * (half_rows // 16)
        tile = row_tile * tiles_k + c_lo + wu  # [PAIRS, STEP, 1]
        w_at = w_ptr + tile * 128 + e
        s_at = s_ptr + tile * 32 + g * 4 + v
        # B columns past the rows read row rows - 1 (their sums are not stored), tiles past the
        # split read its first tile (their scales load as 0): no activation load needs a mask
        xb = (tl.minimum(g, rows - 1) * sx).to(tl.int64) * 2 + x_ptr.to(tl.int64)  # bytes
        x_step = (KT * STEP) * 2  # bytes
        x_first = xb + c_lo * KT * 2  # what tiles past the split read (their scales load as 0)
        if INT8:  # step 0's pair of activations (the load adds 16 bytes a step)
            x_at = xb + ((c_lo + wu) * KT + 2 * t).to(tl.int64) * 2
        else:  # step 0's four activations (the load adds 32 bytes a step)
            x_at = xb + ((c_lo + wu) * KT + 4 * t).to(tl.int64) * 2
        # offsets enter as offset * zk, zk = -1 / kappa (``bias_of``)
        z_at = (z_ptr if HAS_ZERO else s_ptr) + tile * 32 + g * 4 + v
        # each step loads the next step's weights, scales and activations before it computes (one
        # step in flight ahead)
        ok = c_lo + wu < c_hi
        words = tl.load(w_at, mask=ok, other=0)
        if TPG:
            g_at = _group_scale_at(row_tile, c_lo + wu, g, tiles_k, TPG)
            sc = _load_group_scales(s_ptr, g_at, ok)
            zq = _load_group_scales(z_ptr, g_at, ok) * zk if HAS_ZERO else sc
        else:
            sc = tl.load(s_at, mask=ok, other=0.0).to(tl.float32)
            zq = tl.load(z_at, mask=ok, other=0.0).to(tl.float32) * zk if HAS_ZERO else sc
        pdl_wait(PDL)
        xs = _load_x(tl.where(ok, x_at, x_first), INT8, PDL)
        acc = tl.zeros([PAIRS, STEP, 128], tl.float32)
        for c0 in range(c_lo, c_hi, STEP):
            ok = c0 + STEP + wu < c_hi
            w_at += STEP * 128
            s_at += STEP * 32
            z_at += STEP * 32
            x_at += x_step
            words_next = tl.load(w_at, mask=ok, other=0)
            if TPG:
                if STEP % TPG == 0:  # steps start on group boundaries (splits hold whole steps)
                    g_at += (STEP // TPG) * 16
                else:
                    g_at = _group_scale_at(row_tile, c0 + STEP + wu, g, tiles_k, TPG)
                sc_next = _load_group_scales(s_ptr, g_at, ok)
                zq_next = _load_group_scales(z_ptr, g_at, ok) * zk if HAS_ZERO else sc_next
            else:
                sc_next = tl.load(s_at, mask=ok, other=0.0).to(tl.float32)
                zq_next = tl.load(z_at, mask=ok, other=0.0).to(tl.float32) * zk if HAS_ZERO else sc_next
            xs_next = _load_x(tl.where(ok, x_at, x_first), INT8, PDL)
            acc = _tile(words, xs, sc, zq, acc, INT8, HAS_ZERO)
            words = words_next
            sc = sc_next
            zq = zq_next
            xs = xs_next
        e2 = tl.arange(0, 128)[None, :]
        tok = 2 * ((e2 // 4) % 4) + e2 % 2
        o = pid_r * 16 + e2 // 16 + 8 * ((e2 % 4) // 2)
        store_sums(tl.sum(acc, axis=1), tok, o, out_ptr, b_ptr, rows, N, half_rows, pid_k, HAS_BIAS, PARTIAL, SILU)

    @triton.jit
    def store_sums(sums, tok, o, out_ptr, b_ptr, rows, N, half_rows, pid_k, HAS_BIAS: tl.constexpr,
                   PARTIAL: tl.constexpr, SILU: tl.constexpr):
        """Write an mma chain's sums [PAIRS, 128] (per lane c0 c1: output row g, c2 c3: row g + 8;
        token rows ``tok``, outputs ``o``, both [1, 128]) as ``quant_gemv._store_sums`` does: out
        (+ bias), with SILU silu(gate) * up of the two weight rows' sums, or (PARTIAL) float32
        partials [SPLIT, rows, N]. Also ``mma_gemv``'s."""
        dtype = out_ptr.dtype.element_ty
        if SILU:
            gate, up = tl.split(tl.permute(sums, [1, 0]))
            gate = gate[None, :]
            up = up[None, :]
            if PARTIAL:
                ok = (tok < rows) & (o < half_rows)
                at = (pid_k * rows + tok) * N + o
                tl.store(out_ptr + at, gate, mask=ok)
                tl.store(out_ptr + at + half_rows, up, mask=ok)
            else:
                if HAS_BIAS:
                    gate += tl.load(b_ptr + o, mask=o < half_rows, other=0.0).to(tl.float32)
                    up += tl.load(b_ptr + half_rows + o, mask=o < half_rows, other=0.0).to(tl.float32)
                tl.store(out_ptr + tok * half_rows + o, silu_mul_rounded(gate, up, dtype),
                         mask=(tok < rows) & (o < half_rows))
        else:
            out = tl.sum(sums, axis=0)[None, :]
            ok = (tok < rows) & (o < N)
            if PARTIAL:
                tl.store(out_ptr + (pid_k * rows + tok) * N + o, out, mask=ok)
            else:
                if HAS_BIAS:
                    out += tl.load(b_ptr + o, mask=o < N, other=0.0).to(tl.float32)
                tl.store(out_ptr + tok * N + o, out.to(dtype), mask=ok)

    @triton.jit
    def _dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, tiles_k, INT8: tl.constexpr, HAS_ZERO: tl.constexpr,
                           TILES: tl.constexpr, TPG: tl.constexpr):
        """out[n, k] = q[n, k] * scale (+ zero) in out's dtype for row tile program_id(0) and input tiles
        [program_id(1) * TILES, ...): the layout's index arithmetic, written out."""
        KT: tl.constexpr = 32 if INT8 else 64
        r = tl.program_id(0)
        c = tl.program_id(1) * TILES + tl.arange(0, TILES)[:, None, None]
        lane = tl.arange(0, 32)[None, :, None]
        s = tl.arange(0, 4)[None, None, :]
        g = lane // 4
        t = lane % 4
        c_ok = c < tiles_k
        words = tl.load(w_ptr + ((r * tiles_k + c) * 32 + lane) * 4 + s, mask=c_ok, other=0)
        dtype = out_ptr.dtype.element_ty
        for j in tl.static_range(4):
            n = (r * 16 + g + 8 * (j % 2)).to(tl.int64)  # n * K passes 2^31 in large matrices
            if TPG:  # the compact layout: the group's pair (row g, row g + 8)
                at = ((r * (tiles_k // TPG) + c // TPG) * 8 + g) * 2 + j % 2
            else:
                at = ((r * tiles_k + c) * 8 + g) * 4 + 2 * (s // 2) + j % 2
            sc = tl.load(s_ptr + at, mask=c_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + at, mask=c_ok, other=0.0).to(tl.float32) if HAS_ZERO else 0.0
            lo = (words >> (4 * j)) & 15
            hi = (words >> (16 + 4 * j)) & 15
            if INT8:
                k = c * KT + 8 * s + 2 * t + j // 2
                ok = c_ok & (n < N) & (k < K)
                tl.store(out_ptr + n * K + k, ((16 * hi + lo - 128).to(tl.float32) * sc + z).to(dtype), mask=ok)
            else:
                k = c * KT + 16 * s + 4 * t + 2 * (j // 2)
                ok = c_ok & (n < N) & (k < K)
                tl.store(out_ptr + n * K + k, ((lo - 8).to(tl.float32) * sc + z).to(dtype), mask=ok)
                tl.store(out_ptr + n * K + k + 1, ((hi - 8).to(tl.float32) * sc + z).to(dtype), mask=ok)


def usable(x: torch.Tensor) -> bool:
    """Whether the GEMV runs for activations like x: ``quant_gemv.usable``'s rule (kernels on, no
    autograd), on CUDA only (inline PTX: no interpreter) and for bf16 activations."""
    return quant_gemv.usable(x) and x.is_cuda and x.dtype == torch.bfloat16


def fits(x: torch.Tensor, n: int, k: int, silu: bool = False) -> bool:
    """Whether ``gemv`` takes x for a weight [n, k]: ``usable``, at most MAX_ROWS rows, and with
    silu halves of whole row tiles."""
    return usable(x) and x.numel() // k <= MAX_ROWS and (not silu or (n // 2) % ROW_TILE == 0)


def config_for(n: int, k: int, silu: bool = False, offsets: bool = False, bits: int = 4,
               group_tiles: int = 0) -> tuple[int, int, int]:
    """(WARPS, UNITS, SPLIT) for a weight [n, k] of ``bits`` (silu: a fused gate/up weight with
    the SiLU epilogue, whose programs each hold a gate tile and an up tile; offsets: with group
    offsets; group_tiles: ``tiles_per_group``, 0 for one scale a half tile). Four warps but for
    the LM head of compact int4 scales; from benchmarks/quant_gemv.py's sweeps of the 8B shape's
    matrices at 1 and 4 rows (gpu_h200_s12_quant_gemv.json: int4 and int8, groups of 32, up to
    four tiles a warp; int4 on the H100, groups of 128, up to eight:
    gpu_h100_s36_mma_sweep_wide_{r14,offsets}_g128.json):
    - the LM head (many row tiles): one tile per warp per loop step; int4 in compact scales without
      offsets (measured at groups of 128) two warps of two tiles (H100, session 39: 120.5 / 125.7
      us at 1 / 4 rows against four warps of one tile's 142.8 / 147.0,
      gpu_h100_s39_mma_sweep_wide_g128_compact.json; the 8B step end to end 422.6 tok/s either
      way, gpu_h100_s39_quant_8b_lm_head_2x2.json);
    - fused gate/up: two tiles (H200, session 12), but int4 with the SiLU epilogue and no
      offsets one (H100: 23.5 / 24.1 us at 1 / 4 rows against two tiles' 28.9 / 26.8; with
      offsets one tile lost, 39.1 / 33.7 against 32.9 / 29.0);
    - int4 without offsets, few row tiles (at most two programs an SM) over long rows (o, down:
      4,096 and 12,288 inputs), no SiLU epilogue: eight tiles a warp, so that each SM has more
      weights in flight (H100: o 6.1 / 6.5 us against four tiles' 7.2 / 7.6, down 13.8 / 15.4
      against four splits of one tile's 16.2 / 16.9). Eight tiles spill (Triton 3.6's ptxas for
      sm_90a, compiled without the run-time 16-byte alignment: 948 bytes, 8 with it; 6,704 with
      offsets, where o measured slower: 7.6 / 8.3 against 6.9 / 7.2 us), and with the SiLU
      epilogue's two tiles a program took about 900 us;
    - else (q/k/v) four tiles a warp, or for rows of 8,192 inputs or more four splits of them."""
    row_tiles = -(-n // ROW_TILE)
    plain_int4 = bits == 4 and not offsets
    if row_tiles >= 4096:
        return (2, 2, 1) if plain_int4 and group_tiles else (4, 1, 1)
    if row_tiles >= 1024:
        return (4, 1, 1) if silu and plain_int4 else (4, 2, 1)
    if row_tiles <= quant_gemv.TWO_PER_SM and k >= 4096 and plain_int4 and not silu:
        return 4, 8, 1
    if k >= 8192:
        return 4, 1, 4
    return 4, 4, 1


def gemv(x: torch.Tensor, words, scales, zeros, bias, *, n: int, k: int, bits: int, silu: bool = False,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [..., k] (bf16, at most MAX_ROWS rows) @ w.T (+ bias) -> [..., n] in bf16, w given by
    ``pack`` and ``pack_scales`` (zeros: the offsets, or None); silu: w is gate and up stacked
    ([2 I, k], I a multiple of 16) and out is silu(gate) * up [..., I]."""
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    n_out = n // 2 if silu else n
    if rows > MAX_ROWS or (silu and n_out % ROW_TILE):
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows (got {rows}), with silu halves of whole "
                         f"{ROW_TILE}-row tiles (got {n_out})")
    if rows == 0:
        return x.new_empty(*x.shape[:-1], n_out)
    if x2.stride(-1) != 1 or x2.stride(0) % 4 or x2.data_ptr() % 8:
        x2 = x2.clone(memory_format=torch.contiguous_format)  # whole 8-byte loads
    tpg = tiles_per_group(words, scales)
    warps, units, split = config or config_for(n, k, silu, zeros is not None, bits, tpg)
    tiles_k = words.shape[1]
    per, split = quant_gemv.split_ranges(tiles_k, split, warps * units)  # whole loop steps per split
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    _mma_gemv_kernel[(-(-n_out // ROW_TILE), split)](
        x2, x2.stride(0), words, scales, zeros if zeros is not None else scales,
        bias if bias is not None else scales, part, rows, n, tiles_k, per, n_out if silu else 0, -1.0 / bias_of(bits),
        INT8=bits == 8,
        PAIRS=2 if silu else 1, WARPS=warps, UNITS=units, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None,
        PARTIAL=split > 1, SILU=silu, TPG=tpg, num_warps=warps,
        **fused.launch_options(x.device))
    if split > 1:
        total = rows * n_out
        quant_gemv._sum_splits_kernel[(triton.cdiv(total, 1024),)](
            part, bias if bias is not None else part, out, total, n, SPLIT=split, HAS_BIAS=bias is not None,
            SILU=silu, BLOCK=1024, num_warps=4, **fused.launch_options(x.device))
    return out.view(*x.shape[:-1], n_out)


def dequantize(words, scales, zeros, *, n: int, k: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [n, k] in ``dtype``, by ``_dequantize_kernel``."""
    out = torch.empty(n, k, dtype=dtype, device=words.device)
    tiles = 8
    _dequantize_kernel[(words.shape[0], triton.cdiv(words.shape[1], tiles))](
        words, scales, zeros if zeros is not None else scales, out, n, k, words.shape[1], INT8=bits == 8,
        HAS_ZERO=zeros is not None, TILES=tiles, TPG=tiles_per_group(words, scales), num_warps=4)
    return out


def matmul(x: torch.Tensor, words, scales, zeros, bias, *, n: int, k: int, bits: int) -> torch.Tensor:
    """x [..., k] @ w.T (+ bias): the GEMV where it ``fits``, else the weight dequantized into x's
    dtype (by ``dequantize`` where the kernels run, else in PyTorch) and multiplied by cuBLAS.
    (The SiLU epilogue is ``gemv(silu=True)``'s; QuantLinear.silu_mul_forward decides.)"""
    if fits(x, n, k):
        return gemv(x, words, scales, zeros, bias, n=n, k=k, bits=bits)
    if kernels.ENABLED and triton is not None and (x.is_cuda or fused._INTERPRET):
        w = dequantize(words, scales, zeros, n=n, k=k, bits=bits, dtype=x.dtype)
    else:  # the reference path (the layout's group: a compact one's, else each half tile one)
        tpg = tiles_per_group(words, scales)
        group = tpg * tile_k(bits) if tpg else tile_k(bits) // 2
        w = dequantize_reference(words, scales, zeros, n=n, k=k, group=group, bits=bits).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))
