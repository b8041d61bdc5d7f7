"""A bf16 GEMV on the tensor cores for 5 to 16 token rows of small weights: the verifies of a
4-stream batch (1 + 1 to 1 + 3 tokens a row), AR steps of 5-16 sequences (SmolLM2-sized layers, on
CUDA GPUs with bf16 ``mma``, compute capability 8.0+).

    out[m, n] = sum_k x[m, k] * w[n, k]

Why: ``gemv``'s CUDA-core kernel multiplies every weight once per token row, so past 4 rows it
falls behind cuBLAS; cuBLAS takes such products in about the same time for 8 and 16 rows but
costs a launch-dominated 3-7 us a product on SmolLM2's matrices and cannot overlap the kernel
before it (no programmatic dependent launch). Here, as in ``quant_mma``, a warp loads its weights
straight into the A operand of ``mma.sync.m16n8k16`` and the token rows are the B operand's 8
columns (9-16 rows: a second B operand times the same A registers), so 1 to 8 rows cost the same
instructions, and the kernel takes PDL like the others.

Layout (``pack``): rows in tiles of 16, inputs in tiles of 16; a tile is 32 lanes x 4 int32 words
(one 16-byte load per lane), lane l = 4 g + t holding the mma's A registers

    a0 = (w[g, 4t], w[g, 4t + 1]),  a1 = (w[g + 8, 4t], w[g + 8, 4t + 1]),
    a2 = (w[g, 4t + 2], w[g, 4t + 3]),  a3 = (w[g + 8, 4t + 2], w[g + 8, 4t + 3])

(k within the tile): the PTX fragment order with the mma's k axis permuted (its k 2t, 2t + 1,
2t + 8, 2t + 9 are the tile's 4t .. 4t + 3), so that a lane's B registers are the 4 consecutive
activations x[g, 4t .. 4t + 3] of token row g, one 8-byte load. Rows and inputs are padded with
zeros to whole tiles. Sums are float32 (the mma's), rounded to bf16 once at the end (with the
SiLU epilogue of a fused gate/up weight, as ``quant_mma``'s: ``quant_mma.store_sums``).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from mtplx import kernels
from mtplx.kernels import fused, quant_gemv
from mtplx.kernels.gemv import SMALL_WEIGHT  # (this module defines its own ``gemv``)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never reach these kernels
    triton = None

ROW_TILE = 16
K_TILE = 16
LANES = 32
# Fewer rows keep gemv's CUDA-core kernel, which fuses the norms before q/k/v and gate/up (this
# kernel's products alone measured about even with it at 1 row, 10.43 vs 10.46 us a layer, and
# faster at 4, 11.30 vs 12.33, without those norms; not compared end to end). More rows keep cuBLAS:
# a version with three and four B operands (not kept) measured 19.4 and 23.6 us a layer at 24 and
# 32 rows (each product's best configuration, summed) against cuBLAS's 18.7 and 18.8
# (benchmarks/results/gpu_h200_s23_mma_gemv_sweep_wide.json).
MIN_ROWS, MAX_ROWS = 5, 16
ENABLED = os.environ.get("MTPLX_MMA_GEMV", "1") != "0"  # "0": 5-16 rows through cuBLAS (A/B runs)


def _fragment_index(device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (lane, A register, element) of a tile: its (row, k) in the tile, [32, 4, 2] each
    (a0: row g, a1: g + 8, a2: g, a3: g + 8; k 4t + 2 (j // 2) + e)."""
    lane = torch.arange(LANES, device=device)
    g, t = lane // 4, lane % 4
    j = torch.arange(4, device=device)
    row = (g.view(-1, 1) + 8 * (j % 2)).view(LANES, 4, 1).expand(LANES, 4, 2)
    kk = (4 * t.view(-1, 1) + 2 * (j // 2)).view(LANES, 4, 1) + torch.arange(2, device=device)
    return row, kk


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] bf16 -> int32 [ceil(N / 16), ceil(K / 16), 32, 4] in the layout above."""
    n, k = w.shape
    wp = F.pad(w.to(torch.bfloat16), (0, -k % K_TILE, 0, -n % ROW_TILE))
    r, c = wp.shape[0] // ROW_TILE, wp.shape[1] // K_TILE
    tiles = wp.view(r, ROW_TILE, c, K_TILE).transpose(1, 2)  # [R, C, 16 rows, 16 k]
    row, kk = _fragment_index(w.device)
    pairs = tiles[:, :, row, kk]  # [R, C, 32, 4, 2] bf16
    return pairs.contiguous().view(torch.int32).view(r, c, LANES, 4)


def unpack(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``pack``'s inverse: w [n, k] bf16."""
    r, c = words.shape[:2]
    pairs = words.contiguous().view(torch.bfloat16).view(r, c, LANES, 4, 2)
    tiles = torch.zeros(r, c, ROW_TILE, K_TILE, dtype=torch.bfloat16, device=words.device)
    row, kk = _fragment_index(words.device)
    tiles[:, :, row, kk] = pairs
    return tiles.transpose(1, 2).reshape(r * ROW_TILE, c * K_TILE)[:n, :k]


def _load_asm(coherent: bool) -> str:
    """One lane's B registers of a tile: the 4 activations at $4 as $0-$1 ($2-$3 unused, zero).
    Plain loads under PDL (the kernel before may still be writing x when this one starts)."""
    op = "ld.global" if coherent else "ld.global.nc"
    return f"{op}.v2.b32 {{$0, $1}}, [$4];\nmov.b32 $2, 0;\nmov.b32 $3, 0;"


def _mma_asm(operands: int) -> str:
    """The inline PTX of one tile: the lane's A registers (its 4 words) times ``operands`` B
    operands (token rows 0-7, 8-15), each into its own 4 float32 sums. Operands (pack 4): $0 ..
    the sums out (4 per B operand), then the 4 words, each B operand's 4 registers (the first 2
    used), each B operand's 4 sums in. The products go to local registers and are moved out at
    the end, so no output can share a register with an input a later mma still reads."""
    words, xs = 4 * operands, 4 * operands + 4
    acc = xs + 4 * operands
    regs = lambda first, n: ", ".join(f"${first + i}" for i in range(n))  # noqa: E731
    lines = ["{", f".reg .f32 d<{4 * operands}>;"]
    for b in range(operands):
        local = ", ".join(f"d{4 * b + i}" for i in range(4))
        lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{local}}}, {{{regs(words, 4)}}}, "
                     f"{{{regs(xs + 4 * b, 2)}}}, {{{regs(acc + 4 * b, 4)}}};")
    lines += [f"mov.f32 ${i}, d{i};" for i in range(4 * operands)] + ["}"]
    return "\n".join(lines)


if triton is not None:
    from mtplx.kernels.fused import pdl_start, pdl_wait
    from mtplx.kernels.quant_mma import store_sums

    _LOAD = tl.constexpr(_load_asm(False))
    _LOAD_COHERENT = tl.constexpr(_load_asm(True))
    _MMA1 = tl.constexpr(_mma_asm(1))
    _MMA2 = tl.constexpr(_mma_asm(2))

    @triton.jit
    def _load_x(x_at, PDL: tl.constexpr):
        if PDL:
            return tl.inline_asm_elementwise(_LOAD_COHERENT, "=r,=r,=r,=r" + ",l" * 4, [x_at], dtype=tl.int32,
                                             is_pure=False, pack=4)
        return tl.inline_asm_elementwise(_LOAD, "=r,=r,=r,=r" + ",l" * 4, [x_at], dtype=tl.int32,
                                         is_pure=True, pack=4)

    @triton.jit
    def _bf16_mma_kernel(x_ptr, sx, w_ptr, b_ptr, out_ptr, rows, N, tiles_k, split_tiles, half_rows,
                         PAIRS: tl.constexpr, WARPS: tl.constexpr, UNITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PARTIAL: tl.constexpr, SILU: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr):
        """out[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for the 16 weight rows of row tile program_id(0)
        (with SILU also those of tile program_id(0) + half_rows / 16, the up rows: PAIRS = 2) over
        input tiles [s * split_tiles, (s + 1) * split_tiles) of split s = program_id(1); each loop step
        takes WARPS * UNITS consecutive tiles, one a row of the [PAIRS, WARPS * UNITS, 128] tensors (a
        lane's 4 words and sums at 4 l .. 4 l + 3). PARTIAL: float32 partial sums [SPLIT, rows, N].
        NB: 1 or 2 B operands (token rows 0-7, 8-15) times the same A registers."""
        pdl_start(PDL)
        STEP: tl.constexpr = WARPS * UNITS
        pid_r = tl.program_id(0)
        pid_k = tl.program_id(1)
        p = tl.arange(0, PAIRS)[:, None, None]
        wu = tl.arange(0, STEP)[None, :, None]
        e = tl.arange(0, 128)[None, None, :]
        lane = e // 4
        g = lane // 4
        t = lane % 4
        c_lo = pid_k * split_tiles
        c_hi = tl.minimum(c_lo + split_tiles, tiles_k)
        tile = (pid_r + p * (half_rows // 16)) * tiles_k + c_lo + wu  # [PAIRS, STEP, 1]
        w_at = w_ptr + tile * 128 + e
        # B columns past the rows read row rows - 1 (their sums are not stored); tiles past the
        # split read its first tile with zero weights
        xb = (tl.minimum(g, rows - 1) * sx).to(tl.int64) * 2 + x_ptr.to(tl.int64)  # bytes
        x_first = xb + (c_lo * 16 + 4 * t).to(tl.int64) * 2
        x_at = xb + ((c_lo + wu) * 16 + 4 * t).to(tl.int64) * 2
        x_step = (16 * STEP) * 2
        ok = c_lo + wu < c_hi
        words = tl.load(w_at, mask=ok, other=0)
        pdl_wait(PDL)
        # the second B operand reads token rows 8 + g (clamped): its addresses are the first's plus far2
        row0 = tl.minimum(g, rows - 1)
        far2 = ((tl.minimum(g + 8, rows - 1) - row0) * sx).to(tl.int64) * 2
        at = tl.where(ok, x_at, x_first)
        xs1 = _load_x(at, PDL)
        acc1 = tl.zeros([PAIRS, STEP, 128], tl.float32)
        if NB >= 2:
            xs2 = _load_x(at + far2, PDL)
            acc2 = tl.zeros([PAIRS, STEP, 128], tl.float32)
        for c0 in range(c_lo, c_hi, STEP):
            ok = c0 + STEP + wu < c_hi
            w_at += STEP * 128
            x_at += x_step
            at = tl.where(ok, x_at, x_first)
            words_next = tl.load(w_at, mask=ok, other=0)
            xs1_next = _load_x(at, PDL)
            if NB == 1:
                acc1 = tl.inline_asm_elementwise(_MMA1, "=f,=f,=f,=f" + ",r" * 8 + ",f" * 4, [words, xs1, acc1],
                                                 dtype=tl.float32, is_pure=True, pack=4)
            else:
                xs2_next = _load_x(at + far2, PDL)
                acc1, acc2 = tl.inline_asm_elementwise(
                    _MMA2, "=f" + ",=f" * 7 + ",r" * 12 + ",f" * 8, [words, xs1, xs2, acc1, acc2],
                    dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
                xs2 = xs2_next
            words = words_next
            xs1 = xs1_next
        e2 = tl.arange(0, 128)[None, :]
        tok = 2 * ((e2 // 4) % 4) + e2 % 2
        o = pid_r * 16 + e2 // 16 + 8 * ((e2 % 4) // 2)
        store_sums(tl.sum(acc1, axis=1), tok, o, out_ptr, b_ptr, rows, N, half_rows, pid_k, HAS_BIAS, PARTIAL, SILU)
        if NB >= 2:
            store_sums(tl.sum(acc2, axis=1), tok + 8, o, out_ptr, b_ptr, rows, N, half_rows, pid_k, HAS_BIAS,
                       PARTIAL, SILU)


def usable(x: torch.Tensor, weight: torch.Tensor, silu: bool = False) -> bool:
    """Whether ``matmul`` takes x [..., K] for this weight [N, K]: MIN_ROWS to MAX_ROWS bf16 rows on a
    CUDA device with bf16 mma (sm_80+), a bf16 weight of at most ``SMALL_WEIGHT`` (gemv's) elements
    (larger ones keep cuBLAS) with K a multiple of 16 (and with silu halves of whole row tiles),
    kernels on, outside autograd (``fused.usable``: the kernel has no backward). The checks of
    shape and dtype come before the device's, so that the CPU's tests run them too."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    n, k = weight.shape
    return (ENABLED and MIN_ROWS <= rows <= MAX_ROWS and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and weight.numel() <= SMALL_WEIGHT and k % K_TILE == 0
            and (not silu or (n // 2) % ROW_TILE == 0) and not x.requires_grad
            and fused.usable(x) and x.is_cuda and _sm80(x.device))


def _sm80(device: torch.device) -> bool:
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= 8


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def config_for(n: int, k: int, rows: int = 8, silu: bool = False) -> tuple[int, int, int]:
    """(WARPS, UNITS, SPLIT) for a weight [n, k], from benchmarks/mma_gemv.py's sweep on the H200
    (benchmarks/results/gpu_h200_s23_mma_gemv_sweep.json, SmolLM2's products, 30 layers in a graph):
    up to 8 rows four warps of eight tiles a loop step (the best or within 0.1 us of it for every
    product at 1, 4 and 8 rows); 9-16 rows hold twice the sums, and the fused gate/up weight's two
    rows at eight tiles a warp took 67 us (158 us a layer), so four tiles there, and two warps of
    eight for the short rows of q/k/v and o (the best at 12 and 16 rows; the wide sweep,
    gpu_h200_s23_mma_gemv_sweep_wide.json, chose the same at 16). Triton 3.6's PTX through ptxas
    -v for sm_90a: gate/up at eight tiles spills 4,468 bytes with two B operands (none at four
    tiles), and 3,132 bytes with one, where it was still the fastest measured (3.79 us at 8 rows)."""
    if rows <= 8:
        return 4, 8, 1
    if silu:
        return 4, 4, 1
    return (4, 8, 1) if k >= 1024 else (2, 8, 1)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner: object, name: str,
           silu: bool = False) -> torch.Tensor:
    """``gemv`` of x with the weight [N, K] (``usable``), packed once and kept on ``owner`` under
    ``name`` (a copy beside the weight, which the CUDA-core GEMV and cuBLAS still read: SmolLM2's
    layers add 212 MB). A weight replaced, or edited in a way its version counter records, is packed
    again, into the same tensor where the shape holds, so CUDA graphs captured over it read the new
    one; an edit through ``.data`` is not seen."""
    key = (id(weight), weight.data_ptr(), tuple(weight.shape), kernels.version(weight))
    store = owner.__dict__.setdefault("_mma_packed", {})
    cached = store.get(name)
    if cached is None or cached[0] != key:
        words = pack(weight.detach())
        if cached is not None and cached[1].shape == words.shape:
            words = cached[1].copy_(words)
        cached = store[name] = (key, words)
    return gemv(x, cached[1], bias, n=weight.shape[0], k=weight.shape[1], silu=silu)


def gemv(x: torch.Tensor, words: torch.Tensor, bias: torch.Tensor | None, *, n: int, k: int, silu: bool = False,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [..., k] (bf16, at most MAX_ROWS rows) @ w.T (+ bias) -> [..., n] bf16, w given by ``pack``;
    silu: w is gate and up stacked ([2 I, k], I a multiple of 16), out silu(gate) * up [..., I]."""
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    n_out = n // 2 if silu else n
    if rows > MAX_ROWS or (silu and n_out % ROW_TILE) or k % K_TILE:
        raise ValueError(f"the bf16 mma GEMV takes at most {MAX_ROWS} rows (got {rows}), inputs in whole "
                         f"{K_TILE}s (got {k}), silu halves of whole {ROW_TILE}-row tiles (got {n_out})")
    if rows == 0:
        return x.new_empty(*x.shape[:-1], n_out)
    if x2.stride(-1) != 1 or x2.stride(0) % 4 or x2.data_ptr() % 8:
        x2 = x2.clone(memory_format=torch.contiguous_format)  # whole 8-byte loads
    warps, units, split = config or config_for(n, k, rows, silu)
    tiles_k = words.shape[1]
    per, split = quant_gemv.split_ranges(tiles_k, split, warps * units)
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    _bf16_mma_kernel[(-(-n_out // ROW_TILE), split)](
        x2, x2.stride(0), words, bias if bias is not None else words, part, rows, n, tiles_k, per,
        n_out if silu else 0, PAIRS=2 if silu else 1, WARPS=warps, UNITS=units, HAS_BIAS=bias is not None,
        PARTIAL=split > 1, SILU=silu, NB=-(-rows // 8), num_warps=warps, **fused.launch_options(x.device))
    if split > 1:
        total = rows * n_out
        quant_gemv._sum_splits_kernel[(triton.cdiv(total, 1024),)](
            part, bias if bias is not None else part, out, total, n, SPLIT=split, HAS_BIAS=bias is not None,
            SILU=silu, BLOCK=1024, num_warps=4, **fused.launch_options(x.device))
    return out.view(*x.shape[:-1], n_out)
