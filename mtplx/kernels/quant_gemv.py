"""Triton kernels for weight-only quantized linear maps on CUDA: int4 and int8 weights with
group-wise scales (and offsets), and fp8 e4m3 weights with per-channel or group scales.

    w[n, k] = f[n, k] * scale[n, k // g] (+ zero[n, k // g])

with f the stored field: a signed int4 or int8, or an e4m3 float.

Layout (``pack``): each weight row is cut into chunks of WORDS int32 words, 128 bytes, one
cache line; a chunk holds ``WORDS * per`` inputs (per = 8 int4 or 4 bytes per word), and field j
of word i holds input ``chunk * WORDS * per + j * WORDS + i``. So one load of a [BLOCK_N, WORDS]
tile reads whole cache lines, and each field of the tile is a contiguous run of WORDS inputs
that lie in one scale group (groups are multiples of WORDS inputs, or a whole row): the kernel
takes fields apart with shifts (no reshape, no shared memory) and loads one scale per row per
field. Rows are zero-padded to whole chunks. Scales and offsets are float16 where every value
is a float16 normal number (GGUF's own scales are float16; ``compact_scales``), else float32;
an all-zero offset (round-to-nearest is symmetric) is not stored at all.

e4m3 fields are decoded by bit moves into float16 (sign, then exponent and mantissa shifted
into place; the result is the e4m3 value times 2^-8, subnormals included), which needs no fp8
hardware and runs under Triton's interpreter; the 2^8 is folded into the scale.

Forwards of up to MAX_ROWS token rows (decode steps, drafts, verifies of 1 + D tokens) run
``_qgemv_kernel``: one program owns BLOCK_N outputs for every row, streams its weight rows two
chunks per step, and multiply-adds on the CUDA cores, summing once at the end (as
kernels/gemv.py does for 16-bit weights). More rows (prefill) dequantize the weight into the
activation dtype with ``_dequantize_kernel`` and use cuBLAS.
Both launch only kernels and allocate only their outputs, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtplx import kernels
from mtplx.kernels import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never reach these kernels
    triton = None

WORDS = 32  # int32 words per row per chunk: 128 bytes
MAX_ROWS = 8  # token rows the GEMV takes; more go through dequantize + cuBLAS
_FP16_MIN, _FP16_MAX = 6.2e-5, 65504.0  # float16's normal range


def fields_per_word(bits: int) -> int:
    return 32 // bits


def check_group(group: int, k: int) -> None:
    """A field's WORDS inputs must share a scale: groups of a multiple of WORDS, or whole rows."""
    if group % WORDS and group != k:
        raise ValueError(f"group size {group} is not a multiple of {WORDS} (nor the row length {k})")


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q: [N, K] int8 (int4 values in [-8, 7]) or float8_e4m3fn -> [N, chunks * WORDS] int32
    in the layout above, on q's device."""
    n, k = q.shape
    per = fields_per_word(bits)
    chunk = WORDS * per
    u = q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q
    u = u.to(torch.int64) & ((1 << bits) - 1)
    u = F.pad(u, (0, -k % chunk)).view(n, -1, per, WORDS)
    shifts = (bits * torch.arange(per, device=q.device)).view(1, 1, per, 1)
    words = (u << shifts).sum(dim=2)  # disjoint fields: the sum is their bitwise or, below 2^32
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).view(n, -1)


def unpack(words: torch.Tensor, bits: int, fp8: bool, k: int) -> torch.Tensor:
    """``pack``'s inverse, in PyTorch (the reference path): the fields as float32 [N, K]."""
    n = words.shape[0]
    per = fields_per_word(bits)
    shifts = (bits * torch.arange(per, device=words.device, dtype=torch.int32)).view(1, 1, per, 1)
    u = (words.view(n, -1, 1, WORDS) >> shifts) & ((1 << bits) - 1)  # int32: the mask drops the sign bits
    u = u.view(n, -1)[:, :k]
    if fp8:
        return u.to(torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.where(u >= 1 << (bits - 1), u - (1 << bits), u).float()


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


def config_for(n: int, rows: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps): enough programs to fill the device (a few per SM on an H200's 132)
    with at least 4 rows each. A first guess: benchmarks/gpu.py --quant sweeps the choices."""
    if rows > 4:
        return (8, 8) if n >= 8192 else (4, 4)
    if n >= 65536:
        return (32, 8)
    if n >= 16384:
        return (16, 8)
    return (8, 4) if n >= 4096 else (4, 4)


if triton is not None:

    @triton.jit
    def _field(p, j: tl.constexpr, BITS: tl.constexpr, FP8: tl.constexpr):
        """Field j of the int32 words p, as float32 (an e4m3 field: its value times 2^-8)."""
        if FP8:
            b = (p >> (8 * j)) & 0xFF
            h = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
            v = h.to(tl.float32)
        else:  # shift the field to the top, then arithmetic-shift it down: sign-extended
            v = ((p << (32 - BITS - BITS * j)) >> (32 - BITS)).to(tl.float32)
        return v

    @triton.jit
    def _chunk_products(acc, p, c, x_ptr, sx, s_ptr, z_ptr, m, m_ok, n, n_ok, i, K, G, group,
                        BITS: tl.constexpr, PER: tl.constexpr, FP8: tl.constexpr, HAS_ZERO: tl.constexpr,
                        WORDS: tl.constexpr):
        """acc [M, BLOCK_N, WORDS] += the products of chunk c's weights p [1, BLOCK_N, WORDS]
        with the rows' inputs (PER = 32 // BITS fields per word)."""
        for j in tl.static_range(PER):
            k0 = c * (WORDS * PER) + j * WORDS  # this field's first input
            k = k0 + i
            a = tl.load(x_ptr + m * sx + k, mask=m_ok & (k < K), other=0.0).to(tl.float32)
            s_at = n * G + k0 // group
            s_ok = n_ok & (n * 0 + k0 < K)  # (n * 0: a tensor mask, as the interpreter needs)
            s = tl.load(s_ptr + s_at, mask=s_ok, other=0.0).to(tl.float32)
            if FP8:
                s = s * 256.0
            w = _field(p, j, BITS, FP8) * s
            if HAS_ZERO:
                w += tl.load(z_ptr + s_at, mask=s_ok, other=0.0).to(tl.float32)
            acc += w * a
        return acc

    @triton.jit
    def _qgemv_kernel(x_ptr, sx, p_ptr, s_ptr, z_ptr, b_ptr, out_ptr, rows, N, K, G, group, chunks,
                      M: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, FP8: tl.constexpr,
                      HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
        """out[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for m < rows <= M (a power of two); x has
        row stride sx, out is contiguous. Two chunks are loaded before either is used, so
        each program has two cache lines per weight row in flight."""
        pid = tl.program_id(0)
        m = tl.arange(0, M)[:, None, None]
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None]
        i = tl.arange(0, WORDS)[None, None, :]
        m_ok, n_ok = m < rows, n < N
        row = p_ptr + n * (chunks * WORDS) + i
        acc = tl.zeros([M, BLOCK_N, WORDS], tl.float32)
        for c in range(0, chunks, 2):
            p0 = tl.load(row + c * WORDS, mask=n_ok, other=0)
            p1 = tl.load(row + (c + 1) * WORDS, mask=n_ok & (n * 0 + c + 1 < chunks), other=0)
            acc = _chunk_products(acc, p0, c, x_ptr, sx, s_ptr, z_ptr, m, m_ok, n, n_ok, i, K, G, group,
                                  BITS, PER, FP8, HAS_ZERO, WORDS)
            acc = _chunk_products(acc, p1, c + 1, x_ptr, sx, s_ptr, z_ptr, m, m_ok, n, n_ok, i, K, G, group,
                                  BITS, PER, FP8, HAS_ZERO, WORDS)
        out = tl.sum(acc, axis=2)
        mo = tl.arange(0, M)[:, None]
        no = pid * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        if HAS_BIAS:
            out += tl.load(b_ptr + no, mask=no < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + mo * N + no, out.to(out_ptr.dtype.element_ty), mask=(mo < rows) & (no < N))

    @triton.jit
    def _dequantize_kernel(p_ptr, s_ptr, z_ptr, out_ptr, N, K, G, group, chunks,
                           BITS: tl.constexpr, PER: tl.constexpr, FP8: tl.constexpr, HAS_ZERO: tl.constexpr,
                           BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
        """out[n, k] = w[n, k] in out's dtype; one program per BLOCK_N rows and chunk."""
        c = tl.program_id(1)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        i = tl.arange(0, WORDS)[None, :]
        n_ok = n < N
        p = tl.load(p_ptr + n * (chunks * WORDS) + c * WORDS + i, mask=n_ok, other=0)
        for j in tl.static_range(PER):
            k0 = c * (WORDS * PER) + j * WORDS
            k = k0 + i
            s_ok = n_ok & (n * 0 + k0 < K)
            s = tl.load(s_ptr + n * G + k0 // group, mask=s_ok, other=0.0).to(tl.float32)
            if FP8:
                s = s * 256.0
            w = _field(p, j, BITS, FP8) * s
            if HAS_ZERO:
                w += tl.load(z_ptr + n * G + k0 // group, mask=s_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + n * K + k, w.to(out_ptr.dtype.element_ty), mask=n_ok & (k < K))


def usable(x: torch.Tensor) -> bool:
    """Where the kernels run: CUDA tensors (any, under Triton's interpreter), kernels enabled,
    outside autograd (no backward)."""
    return (kernels.ENABLED and triton is not None and (x.is_cuda or fused._INTERPRET)
            and not (x.requires_grad and torch.is_grad_enabled()))


def gemv(x: torch.Tensor, words, scale, zero, bias, *, k: int, group: int, bits: int, fp8: bool,
         config: tuple[int, int] | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for x [..., K] of at most MAX_ROWS rows; out in x's dtype."""
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    rows, n = x2.shape[0], words.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_n, warps = config or config_for(n, rows)
    _qgemv_kernel[(triton.cdiv(n, block_n),)](
        x2, x2.stride(0), words, scale, zero if zero is not None else scale, bias if bias is not None else scale,
        out, rows, n, k, scale.shape[1], group, words.shape[1] // WORDS,
        M=triton.next_power_of_2(rows), BITS=bits, PER=fields_per_word(bits), FP8=fp8, HAS_ZERO=zero is not None, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, WORDS=WORDS, num_warps=warps)
    return out.view(*x.shape[:-1], n)


def dequantize(words, scale, zero, *, k: int, group: int, bits: int, fp8: bool, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in ``dtype``, by ``_dequantize_kernel``."""
    n = words.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=words.device)
    chunks = words.shape[1] // WORDS
    _dequantize_kernel[(triton.cdiv(n, 16), chunks)](
        words, scale, zero if zero is not None else scale, out, n, k, scale.shape[1], group, chunks,
        BITS=bits, PER=fields_per_word(bits), FP8=fp8, HAS_ZERO=zero is not None, BLOCK_N=16, WORDS=WORDS, num_warps=4)
    return out


def matmul(x: torch.Tensor, words, scale, zero, bias, *, k: int, group: int, bits: int, fp8: bool) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias) in x's dtype: the GEMV for up to MAX_ROWS rows, else the
    weight dequantized by a kernel and multiplied by cuBLAS."""
    if x.numel() // k <= MAX_ROWS:
        return gemv(x, words, scale, zero, bias, k=k, group=group, bits=bits, fp8=fp8)
    w = dequantize(words, scale, zero, k=k, group=group, bits=bits, fp8=fp8, dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))
