"""Counter-based random numbers for sampling: Philox4x32-10 (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011), so that every sampling row's noise for a cycle is drawn
in one launch, inside the cycle's CUDA graph, and is still each row's own.

A request's noise is a sequence of *fills* (one draw of n numbers each: a token's exponential
race over the vocabulary, a cycle's acceptance uniforms, a mirror draft's race). Fill f of the
stream with 64-bit key K holds, at element i, the output word i mod 4 of Philox4x32-10 with

    counter = (i // 4, 0, f mod 2**32, f // 2**32),  key = (K mod 2**32, K // 2**32)

so it depends on (K, f, i) only: not on the fills before it, their sizes, the device, or which
rows run beside it. A word x becomes a uniform u = (floor(x / 2**9) + 1/2) / 2**23: 24 significant
bits, so exactly a float32, in [2**-24, 1 - 2**-24] (never 0 or 1; with a step of 2**-24, as first
written, the upper half rounded and the top word gave 1.0), and an exponential draw -log(u), in
(5.9e-8, 16.7): never 0, which would hand a race to a token of zero probability (0 / 0 is NaN,
and argmax takes NaN), never infinite.

``fill`` draws fills for many rows at once: out [R, F, n] from keys [R] and fill indices [R, F].
CUDA: one Triton launch. CPU: the C++ extension (kernels/cpu_fused.cpp), else ``philox`` here in
PyTorch, word for word the same (the CUDA and CPU logarithms may differ in the last bit).
"""

from __future__ import annotations

import torch

from mtplx.kernels import cpu as cpu_kernels
from mtplx.kernels import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
ROUNDS = 10
WORD = 0xFFFFFFFF
BLOCK = 1024  # counters (4 numbers each) a program draws


def signed_key(key: int) -> int:
    """A key in [0, 2**64) as the int64 that holds its bits (keys travel in int64 tensors)."""
    key %= 2 ** 64
    return key - 2 ** 64 if key >= 2 ** 63 else key


def indices(values: list, device: torch.device) -> torch.Tensor:
    """Keys or fill indices (lists of Python ints) as an int64 tensor on ``device``, copied without
    waiting for the device (asynchronously from pageable memory: no host sync)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def philox(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors holding 32-bit words (broadcast together): the 4 output words.
    Products of two words wrap in int64; their low and high words are read back by masking."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(ROUNDS):
        p0, p1 = c0 * MULTIPLIERS[0], c2 * MULTIPLIERS[1]
        c0, c1, c2, c3 = ((p1 >> 32) & WORD) ^ c1 ^ k0, p1 & WORD, ((p0 >> 32) & WORD) ^ c3 ^ k1, p0 & WORD
        k0, k1 = (k0 + KEY_STEPS[0]) & WORD, (k1 + KEY_STEPS[1]) & WORD
    return c0, c1, c2, c3


def words(keys: torch.Tensor, fills: torch.Tensor, n: int) -> torch.Tensor:
    """The raw words of ``fill`` (PyTorch): keys [R], fills [R, F] int64 -> [R, F, n] int64 in [0, 2**32)."""
    blocks = torch.arange(-(-n // 4), dtype=torch.int64, device=keys.device)
    key = ((keys & WORD)[:, None, None], ((keys >> 32) & WORD)[:, None, None])
    fills = fills[:, :, None]
    zero = torch.zeros((), dtype=torch.int64, device=keys.device)
    out = torch.stack(philox((blocks, zero, fills & WORD, (fills >> 32) & WORD), key), dim=-1)
    return out.flatten(2)[:, :, :n]


def uniforms_of(words_: torch.Tensor) -> torch.Tensor:
    """Words -> float32 uniforms in (0, 1): (floor(x / 2**9) + 1/2) / 2**23, exact in float32."""
    return ((words_ >> 9).to(torch.float32) + 0.5) * 2.0 ** -23


def fill(out: torch.Tensor, keys: torch.Tensor, fills: torch.Tensor, exponential: bool) -> torch.Tensor:
    """out [R, F, n] float32 (contiguous in n, any strides elsewhere) <- fill fills[r, f] of the
    stream keyed keys[r] (keys [R], fills [R, F] int64; strides of their own): uniforms, or
    exponential draws. Returns out."""
    R, F, n = out.shape
    if R * F * n == 0:
        return out
    if out.dtype != torch.float32 or out.stride(2) != 1 or fills.stride(1) != 1:
        raise ValueError("noise fills go to float32 rows contiguous in their numbers, from fill indices "
                         "contiguous per row")
    if out.is_cuda and triton is not None and fused.usable(out):
        _fill_kernel[(R * F, triton.cdiv(-(-n // 4), BLOCK))](
            keys, keys.stride(0), fills, fills.stride(0), out, out.stride(0), out.stride(1), F, n,
            EXPONENTIAL=exponential, BLOCK=BLOCK, num_warps=4)
        return out
    if out.device.type == "cpu" and cpu_kernels.available():
        return cpu_kernels.extension().philox_fill(out, keys.cpu(), fills.cpu(), exponential)
    u = uniforms_of(words(keys.to(out.device), fills.to(out.device), n))
    return out.copy_(u.log_().neg_() if exponential else u)


if triton is not None:

    @triton.jit
    def _fill_kernel(keys_ptr, sk, fills_ptr, sf, out_ptr, so_r, so_f, F, n,
                     EXPONENTIAL: tl.constexpr, BLOCK: tl.constexpr):
        """Program (r F + f, b): counters b BLOCK .. (b + 1) BLOCK of fill fills[r, f] of stream keys[r]."""
        rf = tl.program_id(0)
        r = rf // F
        f = rf % F
        key = tl.load(keys_ptr + r * sk)
        at = tl.load(fills_ptr + r * sf + f)
        k0 = (key & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
        block = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        c0 = block.to(tl.uint32)
        c1 = tl.zeros([BLOCK], tl.uint32)
        c2 = tl.zeros([BLOCK], tl.uint32) + (at & 0xFFFFFFFF).to(tl.uint32)
        c3 = tl.zeros([BLOCK], tl.uint32) + ((at >> 32) & 0xFFFFFFFF).to(tl.uint32)
        for _ in tl.static_range(10):
            c0, c1, c2, c3 = (tl.umulhi(c2, 0xCD9E8D57) ^ c1 ^ k0, c2 * 0xCD9E8D57,
                              tl.umulhi(c0, 0xD2511F53) ^ c3 ^ k1, c0 * 0xD2511F53)
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        row = out_ptr + r.to(tl.int64) * so_r + f.to(tl.int64) * so_f
        _store_numbers(row, 4 * block, c0, n, EXPONENTIAL)
        _store_numbers(row, 4 * block + 1, c1, n, EXPONENTIAL)
        _store_numbers(row, 4 * block + 2, c2, n, EXPONENTIAL)
        _store_numbers(row, 4 * block + 3, c3, n, EXPONENTIAL)

    @triton.jit
    def _store_numbers(row, at, word, n, EXPONENTIAL: tl.constexpr):
        u = ((word >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
        if EXPONENTIAL:
            u = -tl.log(u)
        tl.store(row + at, u, mask=at < n)
