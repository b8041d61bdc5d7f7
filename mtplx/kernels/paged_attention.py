"""Triton paged attention for short query chunks (decode, MTP draft and verify: 1..8 tokens).

One program per (row, kv head) holds all of the row's query tokens times the kv head's query
heads as the M dimension of its tiles, walks the row's keys in chunks of BLOCK_N slots through
the block table (reading only slots up to the row's last query position), and keeps an online
softmax. Causality inside the chunk comes from each query's own position. Prefill (long query
chunks) stays on the reference path.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference path
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _attend(q, qpos, last, start, k_ptr, v_ptr, tables_ptr, row, kvh, d, m_i, l_i, acc,
                sk_b, sk_s, sk_h, st_r, key_start, scale, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr):
        """One chunk of BLOCK_N key slots: gather through the block table, online softmax update."""
        kpos = start + tl.arange(0, BLOCK_N)
        in_range = kpos <= last
        block = tl.load(tables_ptr + row * st_r + kpos // PAGE, mask=in_range, other=0)
        base = block * sk_b + (kpos % PAGE) * sk_s + kvh * sk_h
        k = tl.load(k_ptr + base[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_ptr + base[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] >= key_start)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        return m_new, l_i, acc

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, pos_ptr,
        sq_r, sq_t, sq_h, sk_b, sk_s, sk_h, so_r, so_t, so_h, st_r, sp_r,
        q_len, key_start, scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        M_PAD: tl.constexpr, MAX_KEYS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
        DYNAMIC_BOUND: tl.constexpr,
    ):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        m = tl.arange(0, M_PAD)
        tok = m // GROUP
        head = kvh * GROUP + m % GROUP
        valid_m = tok < q_len
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + row * sq_r + tok[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
                    mask=valid_m[:, None], other=0.0)
        qpos = tl.load(pos_ptr + row * sp_r + tok, mask=valid_m, other=-1)
        last = tl.load(pos_ptr + row * sp_r + q_len - 1)
        m_i = tl.full([M_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([M_PAD], tl.float32)
        acc = tl.zeros([M_PAD, HEAD_DIM], tl.float32)
        # compiled: stop at the row's own length (read from memory, so a CUDA graph replays
        # correctly for any length); the CPU interpreter needs a compile-time bound instead
        if DYNAMIC_BOUND:
            for start in range(0, last + 1, BLOCK_N):
                m_i, l_i, acc = _attend(q, qpos, last, start, k_ptr, v_ptr, tables_ptr, row, kvh, d, m_i, l_i, acc,
                                        sk_b, sk_s, sk_h, st_r, key_start, scale, PAGE, BLOCK_N, PRECISION)
        else:
            for start in range(0, MAX_KEYS, BLOCK_N):
                m_i, l_i, acc = _attend(q, qpos, last, start, k_ptr, v_ptr, tables_ptr, row, kvh, d, m_i, l_i, acc,
                                        sk_b, sk_s, sk_h, st_r, key_start, scale, PAGE, BLOCK_N, PRECISION)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + row * so_r + tok[:, None] * so_t + head[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=valid_m[:, None])


def paged_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           positions: torch.Tensor, block_tables: torch.Tensor, key_start: int,
                           scale: float) -> torch.Tensor:
    """Same contract as ``engine.attention.paged_attention`` for q_len <= 8.

    q: [rows, q_len, heads, head_dim]; pools: [blocks, page, kv_heads, head_dim];
    positions: [rows, q_len] long; block_tables: [rows, blocks] long."""
    rows, q_len, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_pool.shape
    group = heads // kv_heads
    m_pad = max(16, triton.next_power_of_2(q_len * group))
    q = q.contiguous()
    out = torch.empty_like(q)
    positions = positions.contiguous()
    block_tables = block_tables.contiguous()
    _paged_attention_kernel[(rows, kv_heads)](
        q, k_pool, v_pool, out, block_tables, positions,
        q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        out.stride(0), out.stride(1), out.stride(2), block_tables.stride(0), positions.stride(0),
        q_len, key_start, scale,
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, M_PAD=m_pad, BLOCK_N=max(16, min(64, page * 4)),
        DYNAMIC_BOUND=q.is_cuda, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        MAX_KEYS=0 if q.is_cuda else block_tables.shape[1] * page,
    )
    return out
