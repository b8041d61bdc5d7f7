"""Triton kernels for weight-only quantized linear maps on CUDA: int4 and int8 weights with
group-wise scales (and offsets), and fp8 e4m3 weights with per-channel or group scales.

    w[n, k] = f[n, k] * scale[n, k // g] (+ zero[n, k // g])

with f the stored field: a signed int4 or int8, or an e4m3 float.

Layout (``pack``): each weight row is cut into chunks of CHUNK = 4 int32 words, 16 bytes (one
thread's load); a chunk holds ``CHUNK * per`` inputs (per = 8 int4 or 4 bytes per word), and
field j of word v holds input ``chunk * CHUNK * per + CHUNK * j + v``. So the words of one
chunk are one vector load, a field of them is CHUNK consecutive inputs (one vector load of the
activations), and a chunk lies in one scale group (groups are multiples of 32 inputs, or a
whole row): a thread sums a chunk's products before it applies the chunk's one scale. Integer
fields are stored offset-binary (q + 2^(bits-1), unsigned); rows are padded to whole chunks
with fields of value 0. Scales and offsets are float16 where every value is a float16 normal
number (GGUF's own scales are float16; ``compact_scales``), else float32; an all-zero offset
(round-to-nearest is symmetric) is not stored at all.

Decoding costs few instructions because a GEMV of one token row does about four per weight
and has a budget of a few (an int4 weight is 0.5 bytes, an H200 moves ~30 bytes per SM per
clock and issues 128 thread instructions): an integer field u at bits [b*s, b*s + b) of a
16-bit half of a word is masked in place and or-ed into the float 2^23 (one LOP3; the magic
constant is a kernel argument so that mask and or fuse), and 2^23 + u * 2^(b*s) minus
2^23 + 2^(b-1) * 2^(b*s) is q * 2^(b*s) exactly (one FADD); the 2^-(b*s) is folded into that
field's activations, which each thread loads once for the BLOCK_N rows it holds. Fields in the
high half take one shift per word. No int-to-float conversion (16 per SM per clock on Hopper)
is left in the loop. e4m3 fields are decoded by bit moves into float16 (sign, then exponent and
mantissa shifted into place; the result is the e4m3 value times 2^-8, subnormals included),
which needs no fp8 hardware and runs under Triton's interpreter; the 2^8 is folded into the scale.

Forwards of up to 4 token rows (decode steps, drafts, verifies of 1 + 3 tokens) run
``_qgemv_kernel`` on the CUDA cores: program (i, s) owns BLOCK_N outputs for every row and the
s-th of SPLIT ranges of chunks; its tile is 32 * num_warps chunks wide, one chunk per thread, so
each thread holds BLOCK_N rows of the same inputs (the activations' layout is then the weights'
own, with no exchange through shared memory) and sums in float32. With SPLIT > 1 the programs
write float32 partial sums and ``_sum_splits_kernel`` adds them (and the bias). A fused gate/up
weight (gate rows, then up rows) can end in SiLU(gate) * up (``gemv(silu=True)``): each program
holds gate row o and up row I + o side by side for its BLOCK_N // 2 outputs, so the epilogue
(or the split sum) writes the MLP's activation directly, and a decode step loses the separate
SiLU and multiply kernels of every layer. 5 to MAX_ROWS
rows run ``_qdot_kernel``: the tile dequantized into x's dtype and multiplied on the tensor
cores, rows padded to 16. On the H200 (docs/performance.md, session 9) one row reaches 1.6-2.9
TB/s for int4 (2.1-2.9x bf16 cuBLAS) and 2.3-3.7 TB/s for int8, bound by instruction issue
as much as by memory; 4 rows cost about as much as bf16. More rows (prefill) dequantize the
weight into the activation dtype with ``_dequantize_kernel`` and use cuBLAS.
Everything launches only kernels and allocates only its outputs and temporaries through torch,
so it can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtplx import kernels
from mtplx.kernels import fused

try:
    import triton
    import triton.language as tl

    from mtplx.kernels.fused import pdl_start, pdl_wait
except ImportError:  # CPU-only installs never reach these kernels
    triton = None

CHUNK = 4  # int32 words per chunk: 16 bytes
GROUP_MULTIPLE = 32  # inputs: scale groups are multiples of this, or whole rows
MAX_ROWS = 8  # token rows the GEMV takes; more go through dequantize + cuBLAS
MAGIC = 0x4B000000  # the float 2^23, whose mantissa's units are 1
TWO_PER_SM = 2 * 132  # programs: two for each of the H100's and H200's 132 SMs (a grid's target size)
_FP16_MIN, _FP16_MAX = 6.2e-5, 65504.0  # float16's normal range


def fields_per_word(bits: int) -> int:
    return 32 // bits


def inputs_per_chunk(bits: int) -> int:
    return CHUNK * fields_per_word(bits)


def check_group(group: int, k: int) -> None:
    """A chunk's inputs must share a scale: groups of a multiple of GROUP_MULTIPLE, or whole rows."""
    if group % GROUP_MULTIPLE and group != k:
        raise ValueError(f"group size {group} is not a multiple of {GROUP_MULTIPLE} (nor the row length {k})")


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q: [N, K] int8 (int4 values in [-8, 7]) or float8_e4m3fn -> [N, chunks * CHUNK] int32
    in the layout above, on q's device."""
    n, k = q.shape
    per = fields_per_word(bits)
    if q.dtype == torch.float8_e4m3fn:
        u, pad = q.view(torch.uint8).to(torch.int64), 0
    else:  # offset-binary
        u, pad = (q.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1), 1 << (bits - 1)
    u = F.pad(u, (0, -k % inputs_per_chunk(bits)), value=pad).view(n, -1, per, CHUNK)
    shifts = (bits * torch.arange(per, device=q.device)).view(1, 1, per, 1)
    words = (u << shifts).sum(dim=2)  # disjoint fields: the sum is their bitwise or, below 2^32
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).view(n, -1)


def unpack(words: torch.Tensor, bits: int, fp8: bool, k: int) -> torch.Tensor:
    """``pack``'s inverse, in PyTorch (the reference path): the fields as float32 [N, K]."""
    n = words.shape[0]
    per = fields_per_word(bits)
    shifts = (bits * torch.arange(per, device=words.device, dtype=torch.int32)).view(1, 1, per, 1)
    u = (words.view(n, -1, 1, CHUNK) >> shifts) & ((1 << bits) - 1)  # int32: the mask drops the sign bits
    u = u.reshape(n, -1)[:, :k]
    if fp8:
        return u.to(torch.uint8).view(torch.float8_e4m3fn).float()
    return (u - (1 << (bits - 1))).float()


def compact_scales(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, zero or None) as stored for the kernel: float16 where every nonzero scale is a
    float16 normal number (relative rounding at most 2^-11) and every offset is in float16's
    range (a subnormal offset is off by at most 2^-25, a thousandth of the smallest scale's
    step), else float32; no zero where every offset is 0."""
    s = scale.float().abs()
    s = s[s > 0]
    fits = (s.numel() == 0 or bool((s.min() >= _FP16_MIN) & (s.max() <= _FP16_MAX))) and bool(
        zero.float().abs().max() <= _FP16_MAX)
    dtype = torch.float16 if fits else torch.float32
    has_zero = bool((zero != 0).any())
    return scale.to(dtype).contiguous(), zero.to(dtype).contiguous() if has_zero else None


def dequantize_reference(words, scale, zero, bits: int, fp8: bool, k: int, group: int) -> torch.Tensor:
    """The float32 weight [N, K] the kernels compute with, in PyTorch."""
    w = unpack(words, bits, fp8, k).unflatten(1, (-1, group)) * scale.float().unsqueeze(-1)
    if zero is not None:
        w = w + zero.float().unsqueeze(-1)
    return w.flatten(1)


def config_for(n: int, k: int, rows: int, bits: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, num_warps, SPLIT, DOT_C) for a weight [n, k] and ``rows`` token rows, from
    benchmarks/quant_gemv.py's sweep on the H200 (benchmarks/results/gpu_h200_s9_quant_gemv_sweep_*.json). DOT_C
    0: the CUDA-core kernel, tiles of 32 * num_warps chunks (int4 at one row: two tiles of 2
    warps for the wide matrices); up to 4 rows it beat the tensor-core kernel, whose decoding
    costs more per weight. Else the tensor-core kernel, tiles of DOT_C chunks (128 inputs) and
    SPLIT raised until there are two programs per SM of the H200's 132."""
    if rows == 1:
        return 8, (2 if bits == 4 and n >= 6144 else 4), 1, 0
    if rows <= 4:
        return (8 if bits == 4 else 4), 4, 1, 0
    chunks = -(-k // inputs_per_chunk(bits))
    dot_c = 128 // inputs_per_chunk(bits)
    block_n, split = 32, 1
    while triton.cdiv(n, block_n) * split < TWO_PER_SM and chunks // (2 * split) >= dot_c:
        split *= 2
    return block_n, 4, split, dot_c


if triton is not None:

    @triton.jit
    def _field(p, ph, magic, j: tl.constexpr, BITS: tl.constexpr, FP8: tl.constexpr):
        """Field j of the int32 words p (ph: p >> 16) as float32: an integer field's value times
        2^(BITS * (j % (16 // BITS))), an e4m3 field's value times 2^-8."""
        if FP8:
            b = (p >> (8 * j)) & 0xFF
            h = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
            v = h.to(tl.float32)
        else:
            if j < 16 // BITS:
                half = p
            else:
                half = ph
            at = BITS * (j % (16 // BITS))
            # (half & mask) | magic, written so that it stays one LOP3 (magic's bits are in the constant)
            f = ((half | magic) & (0x4B000000 | (((1 << BITS) - 1) << at))).to(tl.float32, bitcast=True)
            v = f - (8388608.0 + (1 << (BITS - 1)) * (1 << at))
        return v

    @triton.jit
    def silu_mul_rounded(g, u, dtype: tl.constexpr):
        """silu(g) * u in ``dtype`` from float32 sums g and u, each rounded to ``dtype`` first (as a
        product's output would be before ``fused.silu_mul``): the SiLU epilogue of the GEMVs."""
        g = g.to(dtype).to(tl.float32)
        u = u.to(dtype).to(tl.float32)
        return (g / (1.0 + tl.exp(-g)) * u).to(dtype)

    @triton.jit
    def _weight_rows(pid_n, N, BLOCK_N: tl.constexpr, SILU: tl.constexpr):
        """The weight rows [BLOCK_N] of program pid_n: BLOCK_N consecutive ones, or with SILU
        (N = 2 * I rows, gate then up) gate row o and up row I + o for each of its BLOCK_N // 2
        outputs o, interleaved (slot 2 i gate, 2 i + 1 up)."""
        slot = tl.arange(0, BLOCK_N)
        if SILU:
            return pid_n * (BLOCK_N // 2) + slot // 2 + (slot % 2) * (N // 2)
        return pid_n * BLOCK_N + slot

    @triton.jit
    def _store_sums(sums, mo, nw, pid_n, b_ptr, out_ptr, rows, N, pid_k, HAS_BIAS: tl.constexpr,
                    PARTIAL: tl.constexpr, SILU: tl.constexpr, BLOCK_N: tl.constexpr):
        """Store float32 sums [MM, BLOCK_N] for rows mo [MM, 1] and weight rows nw [1, BLOCK_N]
        (``_weight_rows``): PARTIAL, into split pid_k of the float32 [SPLIT, rows, N] partials
        (no bias, in weight-row order); else plus the bias, into out [rows, N] in its dtype, or
        with SILU out [rows, N // 2] = silu(gate) * up, each rounded to out's dtype first (as
        the product's output would be before ``fused.silu_mul``)."""
        ok = (mo < rows) & (nw < N)
        if PARTIAL:
            tl.store(out_ptr + (pid_k * rows + mo) * N + nw, sums, mask=ok)
        else:
            dtype = out_ptr.dtype.element_ty
            if HAS_BIAS:
                sums += tl.load(b_ptr + nw, mask=nw < N, other=0.0).to(tl.float32)
            if SILU:
                g, u = tl.split(tl.reshape(sums, [sums.shape[0], BLOCK_N // 2, 2]))
                o = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)[None, :]
                tl.store(out_ptr + mo * (N // 2) + o, silu_mul_rounded(g, u, dtype), mask=(mo < rows) & (o < N // 2))
            else:
                tl.store(out_ptr + mo * N + nw, sums.to(dtype), mask=ok)

    @triton.jit
    def _qgemv_tile(acc, p, c0, c_hi, x_ptr, sx, s_ptr, z_ptr, rows, N, K, G, magic, c, m, n3, v, c3, BITS: tl.constexpr,
                    PER: tl.constexpr, FP8: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP_CHUNKS: tl.constexpr):
        """acc [BLOCK_C, M, BLOCK_N] plus the products of the tile of chunks c0 + c, whose words p
        are loaded: ``_qgemv_kernel``'s loop step."""
        m_ok = m < rows
        ph = (p.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
        k0 = (c0 + c) * (4 * PER)
        x0 = tl.load(x_ptr + m * sx + k0 + v, mask=m_ok & (k0 + v < K), other=0.0).to(tl.float32)
        t = _field(p, ph, magic, 0, BITS, FP8) * x0
        xs = x0  # the chunk's activations, summed: for offsets
        for j in tl.static_range(1, PER):
            k = k0 + 4 * j + v
            xj = tl.load(x_ptr + m * sx + k, mask=m_ok & (k < K), other=0.0).to(tl.float32)
            if HAS_ZERO:
                xs += xj
            if not FP8:  # the inverse of _field's factor (the fp8 one is in the scale)
                xj = xj * (1.0 / (1 << (BITS * (j % (16 // BITS)))))
            t += _field(p, ph, magic, j, BITS, FP8) * xj
        cg = c0 + c3
        if GROUP_CHUNKS == 0:
            s_at = n3 * G + cg * 0
        else:
            s_at = n3 * G + cg // GROUP_CHUNKS
        s_ok = (n3 < N) & (cg < c_hi)
        s = tl.load(s_ptr + s_at, mask=s_ok, other=0.0).to(tl.float32)
        if FP8:
            s = s * 256.0
        acc += tl.sum(t, axis=3) * s
        if HAS_ZERO:
            acc += tl.sum(xs, axis=3) * tl.load(z_ptr + s_at, mask=s_ok, other=0.0).to(tl.float32)
        return acc

    @triton.jit
    def _qgemv_kernel(x_ptr, sx, p_ptr, s_ptr, z_ptr, b_ptr, out_ptr, rows, N, K, G, chunks, split_chunks, magic,
                      M: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, FP8: tl.constexpr,
                      HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_CHUNKS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, PARTIAL: tl.constexpr, SILU: tl.constexpr,
                      PDL: tl.constexpr):
        """out[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for m < rows <= M (a power of two) over
        this program's chunks [s * split_chunks, (s + 1) * split_chunks); x has row stride sx.
        PARTIAL: out is float32 [SPLIT, rows, N] and gets this split's sums (no bias), else out
        [rows, N] in its dtype (SILU: see ``_store_sums``). GROUP_CHUNKS: chunks per scale
        group, 0 for one group per row. Tensors are [BLOCK_C, M, BLOCK_N, CHUNK]: the chunk axis
        across threads, the rows in them. The first tile's words are loaded before ``pdl_wait``
        (32 * num_warps chunks of each row: for int4 with 4 warps, 4,096 inputs)."""
        pdl_start(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        nw = _weight_rows(pid_n, N, BLOCK_N, SILU)
        c = tl.arange(0, BLOCK_C)[:, None, None, None]
        m = tl.arange(0, M)[None, :, None, None]
        n = nw[None, None, :, None]
        v = tl.arange(0, 4)[None, None, None, :]
        c3 = tl.arange(0, BLOCK_C)[:, None, None]  # [BLOCK_C, 1, BLOCK_N]: one scale per chunk and row
        n3 = nw[None, None, :]
        n_ok = n < N
        c_lo = pid_k * split_chunks
        c_hi = tl.minimum(c_lo + split_chunks, chunks)
        row = p_ptr + n * (chunks * 4) + v
        p = tl.load(row + (c_lo + c) * 4, mask=n_ok & (c_lo + c < c_hi), other=0)
        pdl_wait(PDL)
        acc = _qgemv_tile(tl.zeros([BLOCK_C, M, BLOCK_N], tl.float32), p, c_lo, c_hi, x_ptr, sx, s_ptr, z_ptr,
                          rows, N, K, G, magic, c, m, n3, v, c3, BITS, PER, FP8, HAS_ZERO, GROUP_CHUNKS)
        for c0 in range(c_lo + BLOCK_C, c_hi, BLOCK_C):
            p = tl.load(row + (c0 + c) * 4, mask=n_ok & (c0 + c < c_hi), other=0)
            acc = _qgemv_tile(acc, p, c0, c_hi, x_ptr, sx, s_ptr, z_ptr, rows, N, K, G, magic, c, m, n3, v, c3,
                              BITS, PER, FP8, HAS_ZERO, GROUP_CHUNKS)
        _store_sums(tl.sum(acc, axis=0), tl.arange(0, M)[:, None], nw[None, :], pid_n, b_ptr, out_ptr, rows, N,
                    pid_k, HAS_BIAS, PARTIAL, SILU, BLOCK_N)

    @triton.jit
    def _qdot_kernel(x_ptr, sx, p_ptr, s_ptr, z_ptr, b_ptr, out_ptr, rows, N, K, G, chunks, split_chunks, magic,
                     BITS: tl.constexpr, PER: tl.constexpr, FP8: tl.constexpr, HAS_ZERO: tl.constexpr,
                     HAS_BIAS: tl.constexpr, GROUP_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_C: tl.constexpr, IEEE: tl.constexpr, PARTIAL: tl.constexpr, SILU: tl.constexpr,
                     PDL: tl.constexpr):
        """``_qgemv_kernel``'s product on the tensor cores, for 2 to 16 rows: each [BLOCK_N,
        BLOCK_C chunks] weight tile is dequantized (scale and offset applied) into x's dtype and
        multiplied by the rows' inputs padded to 16 rows (tl.dot, float32 accumulation; IEEE:
        weights and inputs multiplied in float32), so the decoding is paid once for all rows.
        Tensors are [BLOCK_N, BLOCK_C, PER, CHUNK]: flattened, the inputs in their natural order."""
        pdl_start(PDL)
        pdl_wait(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        nw = _weight_rows(pid_n, N, BLOCK_N, SILU)
        n = nw[:, None, None, None]
        c = tl.arange(0, BLOCK_C)[None, :, None, None]
        j = tl.arange(0, PER)[None, None, :, None]
        v = tl.arange(0, 4)[None, None, None, :]
        kk = tl.arange(0, BLOCK_C * 4 * PER)[:, None]
        m = tl.arange(0, 16)[None, :]
        n_ok = n < N
        c_lo = pid_k * split_chunks
        c_hi = tl.minimum(c_lo + split_chunks, chunks)
        row = p_ptr + n * (chunks * 4) + v
        acc = tl.zeros([BLOCK_N, 16], tl.float32)
        for c0 in range(c_lo, c_hi, BLOCK_C):
            cc = c0 + c
            c_ok = cc < c_hi
            p = tl.load(row + cc * 4, mask=n_ok & c_ok, other=0)
            if FP8:
                b = (p >> (8 * j)) & 0xFF
                h = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
                f = h.to(tl.float32)
            else:  # (u | magic) - magic - 2^(BITS-1): see _field
                u = (p >> (BITS * j)) | magic
                f = (u & (0x4B000000 | ((1 << BITS) - 1))).to(tl.float32, bitcast=True)
                f = f - (8388608.0 + (1 << (BITS - 1)))
            if GROUP_CHUNKS == 0:
                s_at = n * G + cc * 0
            else:
                s_at = n * G + cc // GROUP_CHUNKS
            s = tl.load(s_ptr + s_at, mask=n_ok & c_ok, other=0.0).to(tl.float32)
            if FP8:
                s = s * 256.0
            w = f * s
            if HAS_ZERO:
                w += tl.load(z_ptr + s_at, mask=n_ok & c_ok, other=0.0).to(tl.float32)
            w = tl.reshape(w, [BLOCK_N, BLOCK_C * 4 * PER])
            k = c0 * (4 * PER) + kk
            xt = tl.load(x_ptr + m * sx + k, mask=(m < rows) & (k < K) & (k < c_hi * (4 * PER)), other=0.0)
            if IEEE:
                acc = tl.dot(w, xt.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(x_ptr.dtype.element_ty), xt, acc)
        _store_sums(tl.trans(acc), tl.arange(0, 16)[:, None], nw[None, :], pid_n, b_ptr, out_ptr, rows, N, pid_k,
                    HAS_BIAS, PARTIAL, SILU, BLOCK_N)

    @triton.jit
    def _split_sum(part_ptr, b_ptr, at, nb, ok, stride, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
        """sum_s part[s * stride + at] (+ b[nb]) in float32."""
        acc = tl.load(part_ptr + at, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(part_ptr + s * stride + at, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + nb, mask=ok, other=0.0).to(tl.float32)
        return acc

    @triton.jit
    def _sum_splits_kernel(part_ptr, b_ptr, out_ptr, total, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                           SILU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """out[i] = sum_s part[s, i] (+ b[i % N]) for the flat [rows * N] output (total elements);
        with SILU, out [rows, N // 2] (total elements) = silu(gate) * up of the summed
        [rows, N] partials, as in ``_store_sums``."""
        pdl_start(PDL)
        pdl_wait(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < total
        if SILU:
            half = N // 2
            at = (i // half) * N + i % half
            g = _split_sum(part_ptr, b_ptr, at, at % N, ok, total * 2, SPLIT, HAS_BIAS)
            u = _split_sum(part_ptr, b_ptr, at + half, at % N + half, ok, total * 2, SPLIT, HAS_BIAS)
            tl.store(out_ptr + i, silu_mul_rounded(g, u, out_ptr.dtype.element_ty), mask=ok)
        else:
            acc = _split_sum(part_ptr, b_ptr, i, i % N, ok, total, SPLIT, HAS_BIAS)
            tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _dequantize_kernel(p_ptr, s_ptr, z_ptr, out_ptr, N, K, G, chunks, magic,
                           BITS: tl.constexpr, PER: tl.constexpr, FP8: tl.constexpr, HAS_ZERO: tl.constexpr,
                           GROUP_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        """out[n, k] = w[n, k] in out's dtype; one program per BLOCK_N rows and BLOCK_C chunks."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None]
        cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :, None]
        v = tl.arange(0, 4)[None, None, :]
        ok = (n < N) & (cc < chunks)
        p = tl.load(p_ptr + n * (chunks * 4) + cc * 4 + v, mask=ok, other=0)
        if GROUP_CHUNKS == 0:
            s_at = n * G + cc * 0
        else:
            s_at = n * G + cc // GROUP_CHUNKS
        s = tl.load(s_ptr + s_at, mask=ok, other=0.0).to(tl.float32)
        if FP8:
            s = s * 256.0
        if HAS_ZERO:
            z = tl.load(z_ptr + s_at, mask=ok, other=0.0).to(tl.float32)
        for j in tl.static_range(PER):
            k = cc * (4 * PER) + 4 * j + v
            w = _field(p, p >> 16, magic, j, BITS, FP8) * s
            if not FP8:
                w = w * (1.0 / (1 << (BITS * (j % (16 // BITS)))))
            if HAS_ZERO:
                w += z
            tl.store(out_ptr + n * K + k, w.to(out_ptr.dtype.element_ty), mask=ok & (k < K))


def usable(x: torch.Tensor) -> bool:
    """Where the kernels run: CUDA tensors (any, under Triton's interpreter), kernels enabled,
    outside autograd (no backward)."""
    return (kernels.ENABLED and triton is not None and (x.is_cuda or fused._INTERPRET)
            and not (x.requires_grad and torch.is_grad_enabled()))


def _group_chunks(scale: torch.Tensor, group: int, bits: int) -> int:
    """Chunks per scale group, 0 where one group spans the row (which need not be whole chunks)."""
    return 0 if scale.shape[1] == 1 else group // inputs_per_chunk(bits)


def split_ranges(chunks: int, split: int, block_c: int) -> tuple[int, int]:
    """(chunks per split, splits): ``split`` ranges of whole tiles of block_c chunks, fewer where
    the row has fewer tiles."""
    per = -(-(-(-chunks // split)) // block_c) * block_c
    return per, -(-chunks // per)


def gemv(x: torch.Tensor, words, scale, zero, bias, *, k: int, group: int, bits: int, fp8: bool,
         config: tuple[int, int, int, int] | None = None, silu: bool = False) -> torch.Tensor:
    """x @ w.T (+ bias) for x [..., K] of at most MAX_ROWS rows; out in x's dtype [..., N].
    silu: w is gate and up stacked ([2 I, K], gate first) and out is silu(gate) * up [..., I],
    computed in the product's epilogue (the same numbers as ``fused.silu_mul`` of the product).
    config: (BLOCK_N, num_warps, SPLIT, DOT_C), by default ``config_for``'s; BLOCK_N counts
    weight rows (with silu, BLOCK_N // 2 outputs)."""
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    rows, n = x2.shape[0], words.shape[0]
    chunks = words.shape[1] // CHUNK
    block_n, warps, split, dot_c = config or config_for(n, k, rows, bits)
    block_c = dot_c or 32 * warps
    split_chunks, split = split_ranges(chunks, split, block_c)
    n_out = n // 2 if silu else n
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    args = (x2, x2.stride(0), words, scale, zero if zero is not None else scale, bias if bias is not None else scale,
            part, rows, n, k, scale.shape[1], chunks, split_chunks, MAGIC)
    common = dict(BITS=bits, PER=fields_per_word(bits), FP8=fp8, HAS_ZERO=zero is not None, HAS_BIAS=bias is not None,
                  GROUP_CHUNKS=_group_chunks(scale, group, bits), BLOCK_N=block_n, BLOCK_C=block_c,
                  PARTIAL=split > 1, SILU=silu, num_warps=warps, **fused.launch_options(x.device))
    grid = (triton.cdiv(n_out, block_n // 2) if silu else triton.cdiv(n, block_n), split)
    if dot_c:
        # float32 inputs in float32; so too under the interpreter, whose dot of 16-bit floats is wrong
        _qdot_kernel[grid](*args, IEEE=x.dtype == torch.float32 or fused._INTERPRET, **common)
    else:
        _qgemv_kernel[grid](*args, M=triton.next_power_of_2(rows), **common)
    if split > 1:
        total = rows * n_out
        _sum_splits_kernel[(triton.cdiv(total, 1024),)](part, bias if bias is not None else part, out, total, n,
                                                         SPLIT=split, HAS_BIAS=bias is not None, SILU=silu,
                                                         BLOCK=1024, num_warps=4, **fused.launch_options(x.device))
    return out.view(*x.shape[:-1], n_out)


def dequantize(words, scale, zero, *, k: int, group: int, bits: int, fp8: bool, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in ``dtype``, by ``_dequantize_kernel``."""
    n = words.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=words.device)
    chunks = words.shape[1] // CHUNK
    _dequantize_kernel[(triton.cdiv(n, 16), triton.cdiv(chunks, 32))](
        words, scale, zero if zero is not None else scale, out, n, k, scale.shape[1], chunks, MAGIC,
        BITS=bits, PER=fields_per_word(bits), FP8=fp8, HAS_ZERO=zero is not None,
        GROUP_CHUNKS=_group_chunks(scale, group, bits), BLOCK_N=16, BLOCK_C=32, num_warps=4)
    return out


def matmul(x: torch.Tensor, words, scale, zero, bias, *, k: int, group: int, bits: int, fp8: bool,
           silu: bool = False) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias) in x's dtype (silu: then silu(gate) * up, see ``gemv``): the
    GEMV for up to MAX_ROWS rows, else the weight dequantized by a kernel and multiplied by
    cuBLAS."""
    if x.numel() // k <= MAX_ROWS:
        return gemv(x, words, scale, zero, bias, k=k, group=group, bits=bits, fp8=fp8, silu=silu)
    w = dequantize(words, scale, zero, k=k, group=group, bits=bits, fp8=fp8, dtype=x.dtype)
    out = F.linear(x, w, None if bias is None else bias.to(x.dtype))
    return fused.silu_mul(out) if silu else out
