"""A Triton matrix-vector product for forwards of a few token rows (batch-1 AR steps and drafts;
for small weights also verifies of 1 + D tokens and AR steps of a few sequences), with the
work before it fused in as a prologue.

Decoding reads every weight once per step, so these products are bound by memory bandwidth.
For one row, cuBLAS picks split-K kernels plus a reduction kernel for the attention-output
and down projections of the 8B shape and reaches 2.6-3.4 TB/s where a copy reaches 4.2 TB/s;
on SmolLM2's small matrices each product costs a launch-dominated 3-5 us. Here one program
owns BLOCK_N outputs, streams their weight rows in [BLOCK_N, BLOCK_K] tiles and accumulates
multiply-adds on the CUDA cores, summing once at the end; with several input rows, each weight
tile is multiplied by every row's inputs, so the weights are read once for all rows.
Prologues: RMSNorm of the input (with the residual add before it) or SiLU(gate) * up,
computed per tile from the small input.

Measured against cuBLAS plus the separate elementwise kernel on the H200
(benchmarks/gpu_profile.py --gemv-sweep; one row: benchmarks/results/gemv_sweep_h200.json). One row:
faster for every SmolLM2 projection (2.7 vs 5.3 us for norm + qkv) and for the 8B shape's o,
down and LM head; slower for the 8B shape's norm + qkv and norm + gate/up, which keep cuBLAS
(see ``prologue_pays``). Four rows: faster for SmolLM2's layer (qkv 3.3 vs 5.2 us, o 2.2 vs
3.4, gate/up 5.0 vs 5.9, down 4.7 vs 6.8), slower for weights above SMALL_WEIGHT (the 8B
shape's qkv 33 vs 19 us, LM head 460 vs 300): with M multiply-adds per weight element and an
input exchange through shared memory per tile the kernel stops keeping up with memory, so
those keep cuBLAS for several rows (``usable``), as do forwards of more than MAX_ROWS rows. A
16-row ``tl.dot`` version measured 2-3x slower than cuBLAS.
"""

from __future__ import annotations

import torch

from mtplx.kernels import fused

try:
    import triton
    import triton.language as tl

    from mtplx.kernels.fused import pdl_start, pdl_wait
except ImportError:  # CPU-only installs use torch's matmul
    triton = None

SMALL_WEIGHT = 4 * 1024 * 1024  # elements: below this, launches dominate and fusion pays
# token rows per product: a verify of 1 + 3 drafts, AR steps of up to 4 sequences (at 8 rows
# SmolLM2's layer measured 23.6 us against cuBLAS's 21.0)
MAX_ROWS = 4


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row, or up to MAX_ROWS rows for a weight of at most SMALL_WEIGHT elements (larger
    ones are faster through cuBLAS then); on CUDA in half precision (or any dtype under Triton's
    interpreter), outside autograd (the kernel has no backward)."""
    rows = x.numel() // x.shape[-1]
    return ((rows == 1 or (rows <= MAX_ROWS and weight.numel() <= SMALL_WEIGHT)) and fused.usable(x)
            and not x.requires_grad and weight.is_contiguous() and x.dtype == weight.dtype
            and (x.dtype in (torch.bfloat16, torch.float16) or not x.is_cuda))


def prologue_pays(weight: torch.Tensor) -> bool:
    """Whether a norm prologue beats RMSNorm kernel + cuBLAS for this weight (the sweep: small
    weights yes; the 8B shape's qkv and gate/up no)."""
    return weight.numel() <= SMALL_WEIGHT


def config_for(n: int, k: int, rows: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a weight [n, k] and ``rows`` input rows, from the sweeps'
    best per shape class. (num_stages is left at its default: Triton pipelines only loads that
    feed a tl.dot, and the machine code here is the same for every value.)"""
    if rows == 1:
        if n >= 65536:  # LM heads
            return (32, 256, 8)
        if n * k <= SMALL_WEIGHT:
            return (8, 512, 8)
        if k > n:  # down projections
            return (8, 512, 4)
        return (16, 512, 8)
    # several rows take the kernel only for small weights (``usable``): SmolLM2's, Qwen3-1.7B's o
    if n > k:  # qkv, gate/up
        return (8, 1024, 8) if rows <= 2 else (8, 256, 8)
    return (4, 512, 8) if rows <= 2 else (8, 512, 8)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, d_ptr, nw_ptr, sum_ptr, w_ptr, b_ptr, out_ptr, N, swn, eps,
                     K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """out[n] = sum_k a[k] w[n, k] (+ b[n]) where a is PROLOGUE 0: x; 1: rms_norm(x (+ delta))
        * norm_weight (program 0 stores the sum); 2: silu(x[:K]) * x[K:]."""
        pdl_start(PDL)
        pdl_wait(PDL)
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        n_ok = n < N
        dtype = out_ptr.dtype.element_ty
        if PROLOGUE == 1:
            ss = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + kk
                xv = tl.load(x_ptr + k, mask=k < K, other=0.0)
                if HAS_DELTA:
                    dv = tl.load(d_ptr + k, mask=k < K, other=0.0)
                    xv = (xv.to(tl.float32) + dv.to(tl.float32)).to(dtype)
                    tl.store(sum_ptr + k, xv, mask=(k < K) & (pid == 0))
                xf = xv.to(tl.float32)
                ss += xf * xf
            rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            k_ok = k < K
            w = tl.load(w_ptr + n[:, None] * swn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if PROLOGUE == 0:
                a = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            elif PROLOGUE == 1:
                xv = tl.load(x_ptr + k, mask=k_ok, other=0.0)
                if HAS_DELTA:
                    dv = tl.load(d_ptr + k, mask=k_ok, other=0.0)
                    xv = (xv.to(tl.float32) + dv.to(tl.float32)).to(dtype)
                nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                a = (nw * (xv.to(tl.float32) * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            else:
                g = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                u = tl.load(x_ptr + K + k, mask=k_ok, other=0.0).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g)) * u).to(dtype).to(tl.float32)
            acc += w.to(tl.float32) * a[None, :]
        out = tl.sum(acc, axis=1)
        if HAS_BIAS:
            out += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + n, out.to(dtype), mask=n_ok)


    @triton.jit
    def _gemv_rows_kernel(x_ptr, sx, d_ptr, nw_ptr, sum_ptr, w_ptr, b_ptr, out_ptr, rows, N, swn, eps,
                          K: tl.constexpr, M: tl.constexpr, PROLOGUE: tl.constexpr, HAS_DELTA: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PDL: tl.constexpr):
        """``_gemv_kernel`` for 1 < rows <= M (a power of two) input rows: out[m, n] for m < rows.
        x has row stride sx; delta, the sum and out are contiguous.

        The loop works on [M, BLOCK_N, BLOCK_K] tensors: the weight tile, loaded as [1, BLOCK_N,
        BLOCK_K], is broadcast over the rows inside each thread's registers, so every thread
        multiplies its weight elements by the M rows' inputs at the same k and the sum over k
        happens once, at the end, as in the one-row kernel. Triton moves each input tile through
        shared memory into that layout (a barrier per tile, as in the one-row kernel); inputs
        loaded at the full [M, BLOCK_N, BLOCK_K] shape avoid the exchange but repeat their loads
        per weight row, and measured 1.5-3x slower."""
        pdl_start(PDL)
        pdl_wait(PDL)
        pid = tl.program_id(0)
        m = tl.arange(0, M)[:, None, None]
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None]
        kk = tl.arange(0, BLOCK_K)[None, None, :]
        m_ok = m < rows
        n_ok = n < N
        dtype = out_ptr.dtype.element_ty
        if PROLOGUE == 1:
            ss = tl.zeros([M, 1, BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + kk
                ok = m_ok & (k < K)
                xv = tl.load(x_ptr + m * sx + k, mask=ok, other=0.0)
                if HAS_DELTA:
                    dv = tl.load(d_ptr + m * K + k, mask=ok, other=0.0)
                    xv = (xv.to(tl.float32) + dv.to(tl.float32)).to(dtype)
                    tl.store(sum_ptr + m * K + k, xv, mask=ok & (pid == 0))
                xf = xv.to(tl.float32)
                ss += xf * xf
            rstd = tl.rsqrt(tl.sum(ss, axis=2, keep_dims=True) / K + eps)
        acc = tl.zeros([M, BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            k_ok = k < K
            ok = m_ok & k_ok
            if PROLOGUE == 0:
                a = tl.load(x_ptr + m * sx + k, mask=ok, other=0.0).to(tl.float32)
            elif PROLOGUE == 1:
                xv = tl.load(x_ptr + m * sx + k, mask=ok, other=0.0)
                if HAS_DELTA:
                    dv = tl.load(d_ptr + m * K + k, mask=ok, other=0.0)
                    xv = (xv.to(tl.float32) + dv.to(tl.float32)).to(dtype)
                # loaded per row, like x, so that both share one layout (one exchange, not two)
                nw = tl.load(nw_ptr + m * 0 + k, mask=ok, other=0.0).to(tl.float32)
                a = (nw * (xv.to(tl.float32) * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            else:
                g = tl.load(x_ptr + m * sx + k, mask=ok, other=0.0).to(tl.float32)
                u = tl.load(x_ptr + m * sx + K + k, mask=ok, other=0.0).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g)) * u).to(dtype).to(tl.float32)
            # loaded after the input: Triton 3.6 then lays the accumulator out like this tile (warps
            # over N and K); loaded first, the accumulator took the input's layout (warps over the
            # rows) and every weight tile went through shared memory
            w = tl.load(w_ptr + n * swn + k, mask=n_ok & k_ok, other=0.0)
            acc += w.to(tl.float32) * a
        out = tl.sum(acc, axis=2)
        mo = tl.arange(0, M)[:, None]
        no = pid * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        if HAS_BIAS:
            out += tl.load(b_ptr + no, mask=no < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + mo * N + no, out.to(dtype), mask=(mo < rows) & (no < N))


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias, K: int, prologue: int, delta=None, norm_weight=None,
            total=None, eps: float = 0.0, config=None) -> torch.Tensor:
    rows, N = x2.shape[0], weight.shape[0]
    out = torch.empty(rows, N, dtype=x2.dtype, device=x2.device)
    block_n, block_k, warps = config or config_for(N, K, rows)
    pointers = (delta if delta is not None else x2, norm_weight if norm_weight is not None else weight,
                total if total is not None else out, weight, bias if bias is not None else weight, out)
    flags = dict(K=K, PROLOGUE=prologue, HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n,
                 BLOCK_K=block_k, num_warps=warps, **fused.launch_options(x2.device))
    grid = (triton.cdiv(N, block_n),)
    if rows == 1:
        _gemv_kernel[grid](x2, *pointers, N, weight.stride(0), eps, **flags)
    else:
        _gemv_rows_kernel[grid](x2, x2.stride(0), *pointers, rows, N, weight.stride(0), eps,
                                M=triton.next_power_of_2(rows), **flags)
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): x [..., K] holding at most MAX_ROWS rows, weight [N, K] contiguous."""
    K = x.shape[-1]
    out = _launch(_rows(x), weight, bias, K, 0)
    return out.view(*x.shape[:-1], weight.shape[0])


def norm_gemv(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s) @ weight.T) with s = x + delta (x when delta is None), in one kernel:
    the norm (Llama/Qwen convention, ``RMSNorm`` with zero_centered=False) is the matmul's
    prologue. x, delta: [..., K] holding at most MAX_ROWS rows."""
    K = x.shape[-1]
    x2 = _rows(x)
    total = None
    if delta is not None:
        delta = delta.reshape(-1, K).contiguous()
        total = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
    out = _launch(x2, weight, bias, K, 1, delta=delta, norm_weight=norm_weight, total=total, eps=eps)
    s = x if total is None else total.view(x.shape)
    return s, out.view(*x.shape[:-1], weight.shape[0])


def silu_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T for gate_up = [..., 2 * K] (gate first, at most MAX_ROWS
    rows), in one kernel."""
    K = gate_up.shape[-1] // 2
    out = _launch(_rows(gate_up), weight, bias, K, 2)
    return out.view(*gate_up.shape[:-1], weight.shape[0])
