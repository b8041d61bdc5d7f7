"""A Triton matrix-vector product for one-row forwards (batch-1 AR steps and MTP drafts), with
the work before it fused in as a prologue.

Decoding one token reads every weight once, so these products are bound by memory bandwidth.
For one row, cuBLAS picks split-K kernels plus a reduction kernel for the attention-output
and down projections of the 8B shape and reaches 2.6-3.4 TB/s where a copy reaches 4.2 TB/s;
on SmolLM2's small matrices each product costs a launch-dominated 3-5 us. Here one program
owns BLOCK_N outputs, streams their weight rows in [BLOCK_N, BLOCK_K] tiles and accumulates
multiply-adds on the CUDA cores, summing once at the end. Prologues: RMSNorm of the input
(with the residual add before it) or SiLU(gate) * up, computed per tile from the small input.

Measured against cuBLAS plus the separate elementwise kernel on the H200
(benchmarks/gpu_profile.py --gemv1-sweep; benchmarks/results/gemv_sweep_h200.json): faster for
every SmolLM2 projection (2.7 vs 5.3 us for norm + qkv) and for the 8B shape's o, down and LM
head; slower for the 8B shape's norm + qkv and norm + gate/up, which keep cuBLAS (see
``prologue_pays``). Forwards of several rows (verify, batches) keep cuBLAS: a 16-row
``tl.dot`` version with the same prologues measured 2-3x slower than cuBLAS there.
"""

from __future__ import annotations

import torch

from mtplx.kernels import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use torch's matmul
    triton = None

SMALL_WEIGHT = 4 * 1024 * 1024  # elements: below this, launches dominate and fusion pays


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row, on CUDA in half precision (or any dtype under Triton's interpreter)."""
    return (x.numel() == x.shape[-1] and fused.usable(x) and weight.is_contiguous()
            and x.dtype == weight.dtype and (x.dtype in (torch.bfloat16, torch.float16) or not x.is_cuda))


def prologue_pays(weight: torch.Tensor) -> bool:
    """Whether a norm prologue beats RMSNorm kernel + cuBLAS for this weight (the sweep: small
    weights yes; the 8B shape's qkv and gate/up no)."""
    return weight.numel() <= SMALL_WEIGHT


def config_for(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a weight [n, k], from the sweep's best
    per shape class."""
    if n >= 65536:  # LM heads
        return (32, 256, 8, 4)
    if n * k <= SMALL_WEIGHT:
        return (8, 512, 8, 4)
    if k > n:  # down projections
        return (8, 512, 4, 3)
    return (16, 512, 8, 4)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, d_ptr, nw_ptr, sum_ptr, w_ptr, b_ptr, out_ptr, N, swn, eps,
                     K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[n] = sum_k a[k] w[n, k] (+ b[n]) where a is PROLOGUE 0: x; 1: rms_norm(x (+ delta))
        * norm_weight (program 0 stores the sum); 2: silu(x[:K]) * x[K:]."""
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


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias, K: int, prologue: int, delta=None, norm_weight=None,
            total=None, eps: float = 0.0, config=None) -> torch.Tensor:
    N = weight.shape[0]
    out = torch.empty(1, N, dtype=x2.dtype, device=x2.device)
    block_n, block_k, warps, stages = config or config_for(N, K)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x2, delta if delta is not None else x2, norm_weight if norm_weight is not None else weight,
        total if total is not None else out, weight, bias if bias is not None else weight, out,
        N, weight.stride(0), eps, K=K, PROLOGUE=prologue, HAS_DELTA=delta is not None,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): x [..., K] holding one row, weight [N, K] contiguous."""
    K = x.shape[-1]
    out = _launch(_rows(x), weight, bias, K, 0, config=config)
    return out.view(*x.shape[:-1], weight.shape[0])


def norm_gemv(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s) @ weight.T) with s = x + delta (x when delta is None), in one kernel:
    the norm (Llama/Qwen convention, ``RMSNorm`` with zero_centered=False) is the matmul's
    prologue."""
    K = x.shape[-1]
    x2 = _rows(x)
    total = None
    if delta is not None:
        delta = delta.reshape(-1, K).contiguous()
        total = torch.empty_like(x2)
    out = _launch(x2, weight, bias, K, 1, delta=delta, norm_weight=norm_weight, total=total, eps=eps)
    s = x if total is None else total.view(x.shape)
    return s, out.view(*x.shape[:-1], weight.shape[0])


def silu_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T for gate_up = [..., 2 * K] (gate first), in one kernel."""
    K = gate_up.shape[-1] // 2
    out = _launch(_rows(gate_up), weight, bias, K, 2)
    return out.view(*gate_up.shape[:-1], weight.shape[0])
