"""Triton kernels that fuse a decoder layer's elementwise work (issue 7).

A batch-1 decode step of an 8B model spent ~40% of its GPU time in ~1,400 small kernels
around the matmuls: dtype casts, the RMSNorm's pieces, RoPE's slices and cats, the KV
scatter, SiLU and the residual adds (benchmarks/gpu_profile.py). These kernels do that work
in three launches per use:

- ``rms_norm``: optional residual add, then RMSNorm, one program per token;
- ``qkv_rope_write``: optional q/k RMSNorm, rotate-half RoPE, the keys and values written to
  their cache slots, the queries to a fresh tensor, one program per (token, head);
- ``silu_mul``: SwiGLU's ``silu(gate) * up`` from the fused gate/up matmul's output;
- ``rope_cos_sin``: RoPE's cos and sin for a forward's positions, computed once and read by
  every layer's ``qkv_rope_write`` (PyTorch's six small kernels per forward in one).

Each computes in float32 and rounds where the PyTorch reference rounds (the residual sum, the
norm's output before the weight), so outputs match the reference to bf16 rounding. The models
call them only on CUDA tensors while ``mtplx.kernels.ENABLED`` is on; the CPU path
is the reference (tests/test_fused_kernels.py checks both against each other under Triton's
interpreter, benchmarks/gpu.py on the GPU before it times anything).
"""

from __future__ import annotations

import os

import torch

from mtplx import kernels  # its ENABLED switches these kernels off too

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference path
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None


def usable(x: torch.Tensor) -> bool:
    """True where the fused kernels run: CUDA tensors (or any, under Triton's interpreter),
    outside autograd (the kernels have no backward: forge trains a head through these modules)."""
    return (kernels.ENABLED and triton is not None and (x.is_cuda or _INTERPRET)
            and not torch.is_grad_enabled())


def launch_options(device) -> dict:
    """The launch keywords of a kernel that takes the ``PDL`` flag (``kernels.pdl``)."""
    on = kernels.pdl(device) and not _INTERPRET
    return dict(PDL=on, launch_pdl=on) if on else dict(PDL=False)


if triton is not None:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """Under programmatic dependent launch (``mtplx.kernels.PDL``), let the next kernel on the
        stream launch once every program of this one has started (each calls this first)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Under programmatic dependent launch, wait until the kernel before this one has finished
        and its writes are visible: a program reads nothing an earlier kernel writes, and writes
        nothing, before this."""
        if PDL:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def _rms_norm_kernel(x_ptr, delta_ptr, sum_ptr, out_ptr, w_ptr, n, eps,
                         HAS_DELTA: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        pdl_start(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
        if HAS_DELTA:  # x + delta, rounded to the activation dtype as the reference's add is
            d = tl.load(delta_ptr + row * n + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * n + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if ZERO_CENTERED:  # (x * rstd) * (1 + w) in float32, rounded once
            y = xf * rstd * (w + 1.0)
        else:  # w * round(x * rstd), as Hugging Face's Llama/Qwen norms compute it
            y = w * (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qkv_rope_kernel(q_ptr, k_ptr, v_ptr, sq, sk, sv, cos_ptr, sin_ptr, qw_ptr, kw_ptr, slot_ptr,
                         q_out_ptr, k_pool_ptr, v_pool_ptr, eps,
                         HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         ROT: tl.constexpr, QK_NORM: tl.constexpr, D_PAD: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        pdl_wait(PDL)
        tok = tl.program_id(0)
        h = tl.program_id(1)  # 0..HEADS-1 queries, then KV_HEADS keys, then KV_HEADS values
        d = tl.arange(0, D_PAD)
        dmask = d < HEAD_DIM
        slot = tl.load(slot_ptr + tok)
        if h >= HEADS + KV_HEADS:  # a value head: copy to its cache slot
            vh = h - HEADS - KV_HEADS
            v = tl.load(v_ptr + tok * sv + vh * HEAD_DIM + d, mask=dmask)
            tl.store(v_pool_ptr + slot * (KV_HEADS * HEAD_DIM) + vh * HEAD_DIM + d, v, mask=dmask)
        else:
            is_q = h < HEADS
            half: tl.constexpr = ROT // 2
            partner = tl.where(d < half, d + half, d - half)
            rot_mask = dmask & (d < ROT)
            if is_q:
                src = q_ptr + tok * sq + h * HEAD_DIM
                w_ptr = qw_ptr
            else:
                src = k_ptr + tok * sk + (h - HEADS) * HEAD_DIM
                w_ptr = kw_ptr
            x = tl.load(src + d, mask=dmask, other=0.0)
            xp = tl.load(src + partner, mask=rot_mask, other=0.0)
            if QK_NORM:  # per-head RMSNorm, rounded like the reference's norm output
                xf = x.to(tl.float32)
                rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / HEAD_DIM + eps)
                w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
                wp = tl.load(w_ptr + partner, mask=rot_mask, other=0.0).to(tl.float32)
                x = (w * (xf * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)
                xp = (wp * (xp.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)
            cos = tl.load(cos_ptr + tok * ROT + d, mask=rot_mask, other=1.0).to(tl.float32)
            sin = tl.load(sin_ptr + tok * ROT + d, mask=rot_mask, other=0.0).to(tl.float32)
            sign = tl.where(d < half, -1.0, 1.0)
            y = x.to(tl.float32) * cos + sign * xp.to(tl.float32) * sin
            y = tl.where(d < ROT, y, x.to(tl.float32))
            if is_q:
                tl.store(q_out_ptr + tok * (HEADS * HEAD_DIM) + h * HEAD_DIM + d,
                         y.to(q_out_ptr.dtype.element_ty), mask=dmask)
            else:
                tl.store(k_pool_ptr + slot * (KV_HEADS * HEAD_DIM) + (h - HEADS) * HEAD_DIM + d,
                         y.to(k_pool_ptr.dtype.element_ty), mask=dmask)

    @triton.jit
    def _rope_cos_sin_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr, H_PAD: tl.constexpr,
                             INTERPRET: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, H_PAD)
        m = k < HALF
        # float32 position x float32 frequency, then the precise cos / sin (libdevice's, as
        # torch's CUDA kernels call): RotaryEmbedding.bind's values exactly
        f = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + k, mask=m, other=0.0).to(tl.float32)
        if INTERPRET:  # the interpreter has no libdevice: numpy's (precise) cos / sin
            c, s = tl.cos(f), tl.sin(f)
        else:
            c, s = tl.extra.cuda.libdevice.cos(f), tl.extra.cuda.libdevice.sin(f)
        c, s = c.to(cos_ptr.dtype.element_ty), s.to(sin_ptr.dtype.element_ty)
        base = t * 2 * HALF
        tl.store(cos_ptr + base + k, c, mask=m)
        tl.store(cos_ptr + base + HALF + k, c, mask=m)
        tl.store(sin_ptr + base + k, s, mask=m)
        tl.store(sin_ptr + base + HALF + k, s, mask=m)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        pdl_wait(PDL)
        tok = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(x_ptr + tok * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + tok * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + tok * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(s)) with s = x + delta (s = x when delta is None). x, delta: [..., n]."""
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    out = torch.empty_like(x2)
    total = x2
    if delta is not None:
        total = torch.empty_like(x2)
        d2 = delta.reshape(-1, n).contiguous()
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](x2, d2 if delta is not None else x2, total, out, weight, n, eps,
                                     HAS_DELTA=delta is not None, ZERO_CENTERED=zero_centered, BLOCK=block,
                                     num_warps=4 if block <= 2048 else 8, **launch_options(x.device))
    return total.view(shape), out.view(shape)


def qkv_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, heads: int, kv_heads: int,
                   head_dim: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 1e-6) -> torch.Tensor:
    """Queries after (q-norm and) RoPE, shaped [rows, q_len, heads, head_dim]; keys (k-norm,
    RoPE) and values go to their cache slots. q, k, v: [rows, q_len, n * head_dim], each
    contiguous in its last dimension (views of one fused matmul are fine); cos, sin:
    [rows, q_len, 1, rot]; slots: [rows, q_len] long."""
    rows, q_len = q.shape[:2]
    tokens = rows * q_len
    q2, k2, v2 = (t.reshape(tokens, -1) for t in (q, k, v))
    rot = cos.shape[-1]
    cos2, sin2 = cos.reshape(tokens, rot).contiguous(), sin.reshape(tokens, rot).contiguous()
    q_out = torch.empty(rows, q_len, heads, head_dim, dtype=q.dtype, device=q.device)
    qk_norm = q_norm is not None
    _qkv_rope_kernel[(tokens, heads + 2 * kv_heads)](
        q2, k2, v2, q2.stride(0), k2.stride(0), v2.stride(0), cos2, sin2,
        q_norm if qk_norm else cos2, k_norm if qk_norm else cos2, slots.reshape(-1).contiguous(),
        q_out, k_pool, v_pool, eps,
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, ROT=rot, QK_NORM=qk_norm,
        D_PAD=triton.next_power_of_2(head_dim), num_warps=1 if head_dim <= 128 else 2,
        **launch_options(q.device))
    return q_out


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin [*positions.shape, 1, 2 * half] in ``dtype`` for long positions and
    inverse frequencies [half] (float32, or as the model's dtype: read as float32, as torch
    promotes them), in one launch (``RotaryEmbedding.bind``'s six)."""
    half = inv_freq.shape[0]
    pos = positions.reshape(-1).contiguous()
    cos = torch.empty(*positions.shape, 1, 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    _rope_cos_sin_kernel[(pos.numel(),)](pos, inv_freq.contiguous(), cos, sin, HALF=half,
                                         H_PAD=triton.next_power_of_2(half), INTERPRET=_INTERPRET, num_warps=1,
                                         **launch_options(positions.device))
    return cos, sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2 * inter] (gate first)."""
    inter = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, 2 * inter).contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, out, inter, BLOCK=block, num_warps=4,
                                                              **launch_options(x2.device))
    return out.view(*gate_up.shape[:-1], inter)
