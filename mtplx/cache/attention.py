"""Paged attention: one interface, a pure-PyTorch reference path.

Every forward (prefill, AR decode, MTP draft, verify) describes its queries with an
``AttentionMetadata``: static-shaped tensors on the device, so a step never needs the host.
A CUDA kernel can replace ``paged_attention`` behind the same signature.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtplx import kernels
from mtplx.kernels import cpu as cpu_kernels, paged_attention as triton_kernel

# Not cuDNN: it builds a plan for every new (query, key) length on first sight, tens of ms each,
# and prompts and pre-feeds come in every length (stalls of about 70 ms inside requests on an H200)
REFERENCE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class AttentionMetadata:
    """Where the queries of one forward sit in the paged cache.

    positions:    [rows, q] long, each query token's index in its sequence (also its RoPE position).
    slot_mapping: [rows, q] long, flat cache slot each new key/value is written to
                  (padding tokens point at the cache's scratch slot).
    block_tables: [rows, blocks] long, the blocks each row reads, in order (padding: scratch block).
    key_start:    first sequence index a query may attend to (1 for MTP head layers, whose
                  slot 0 holds no entry; 0 for the trunk).

    Hybrid models (linear-attention layers with a recurrent state, cache/state_cache.py) also use:
    state_slots:  [rows] long, each row's slot in the recurrent state cache.
    query_lens:   [rows] long, each row's real (unpadded) number of new tokens.
    capture:      keep what rebuilds the recurrent state after any prefix of the new tokens
                  (verify forwards), so ``RecurrentStateCache.commit_captured`` can keep an
                  accepted prefix without a second forward.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    key_start: int = 0
    state_slots: torch.Tensor | None = None
    query_lens: torch.Tensor | None = None
    capture: bool = False

    def for_head(self) -> "AttentionMetadata":
        return replace(self, key_start=1, capture=False)

    def first_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables[0], positions[0]): a lone row's table and positions, as the CPU layer
        kernel takes them, made once per forward (every layer asks; about 0.7 us a view). The
        fields are never reassigned (``for_head`` makes a new object), so the views stay true."""
        row = self.__dict__.get("_first_row")
        if row is None:
            row = self.__dict__["_first_row"] = (self.block_tables[0], self.positions[0])
        return row

    def valid_tokens(self, rows: int, q_len: int) -> torch.Tensor:
        """[rows, q_len] bool: True for real tokens, False for the padding after a row's last one."""
        if self.query_lens is None:
            return torch.ones(rows, q_len, dtype=torch.bool, device=self.positions.device)
        return torch.arange(q_len, device=self.positions.device)[None, :] < self.query_lens[:, None]


_narrowed_overflow = False  # write_kv turned a finite float32 entry into float16's inf


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into the pool.

    k_pool, v_pool: [blocks, block_size, kv_heads, head_dim]; k, v: [rows, q, kv_heads, head_dim].
    """
    global _narrowed_overflow
    kv_heads, head_dim = k_pool.shape[-2:]
    slots = slot_mapping.reshape(-1)
    for pool, x in ((k_pool, k), (v_pool, v)):
        entries = x.reshape(-1, kv_heads, head_dim).to(pool.dtype)
        if pool.dtype == torch.float16 and x.dtype == torch.float32 and not _narrowed_overflow:
            _narrowed_overflow = bool((entries.isinf() & x.reshape(entries.shape).isfinite()).any())
        pool.view(-1, kv_heads, head_dim).index_copy_(0, slots, entries)


def took_kv_overflow() -> bool:
    """Whether a finite key or value became float16's inf in a pool (past 65,504) since the last
    call, through ``write_kv`` or the CPU kernels' writes; clears the record."""
    global _narrowed_overflow
    hit, _narrowed_overflow = _narrowed_overflow, False
    return cpu_kernels.take_half_overflow() or hit


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of new queries over everything cached for their row.

    On CUDA every forward (decode, draft, verify and prefill) takes the Triton kernel, which
    reads only each row's own keys; the CPU, and queries that need a gradient (the kernel has
    no backward), take the reference path below."""
    if (kernels.ENABLED and q.is_cuda and triton_kernel.available()
            and not (q.requires_grad and torch.is_grad_enabled())):
        return triton_kernel.paged_attention_triton(q, k_pool, v_pool, meta.positions, meta.block_tables,
                                                    meta.key_start, scale)
    return paged_attention_reference(q, k_pool, v_pool, meta, scale)


def paged_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of new queries over everything cached for their row (pure PyTorch).

    q: [rows, q_len, heads, head_dim]; pools: [blocks, block_size, kv_heads, head_dim].
    A query at sequence index p attends keys at indices key_start..p. Returns [rows, q_len, heads, head_dim].
    """
    rows, q_len, heads, head_dim = q.shape
    if not q.is_cuda and q_len <= ROW_EXACT_QUERIES:
        if cpu_kernels.usable(q) and cpu_kernels.pools_usable(k_pool):
            # row by row over each row's own keys (a batch's AR steps and verifies too: gathering
            # every row's whole block table for one masked product cost ~7 ms a layer at 8 rows)
            q = q.contiguous()
            out = [cpu_kernels.row_attention(q[r], k_pool, v_pool, meta.block_tables[r], meta.positions[r],
                                             meta.key_start, scale) for r in range(rows)]
            return (out[0] if rows == 1 else torch.stack(out)).view(rows, q_len, heads, head_dim)
        if rows == 1:
            return _one_row_by_query(q, k_pool, v_pool, meta, scale)
    if not q.is_cuda and rows == 1 and _whole_prompt(meta.positions[0], q_len, meta.key_start):
        return _causal_prompt(q, k_pool, v_pool, meta.block_tables[0], meta.key_start, scale)
    return _gathered(q, k_pool, v_pool, meta, scale)


def _gathered(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
              scale: float) -> torch.Tensor:
    """``paged_attention_reference`` as one masked product over every row's whole block table."""
    rows, _, heads, head_dim = q.shape
    kv_heads = k_pool.shape[2]
    keys = k_pool[meta.block_tables].reshape(rows, -1, kv_heads, head_dim).to(q.dtype)
    values = v_pool[meta.block_tables].reshape(rows, -1, kv_heads, head_dim).to(q.dtype)
    key_idx = torch.arange(keys.shape[1], device=q.device)
    allowed = (key_idx.view(1, 1, -1) <= meta.positions.unsqueeze(-1)) & (key_idx >= meta.key_start)
    with sdpa_kernel(REFERENCE_BACKENDS) if q.is_cuda else nullcontext():
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=allowed.unsqueeze(1),
            scale=scale,
            enable_gqa=kv_heads != heads,
        )
    return out.transpose(1, 2)


ROW_EXACT_QUERIES = 16  # decode, draft and verify forwards on the CPU, each row's queries up to this


def _whole_prompt(positions: torch.Tensor, q_len: int, key_start: int) -> bool:
    """Whether one row's q_len queries are positions key_start .. key_start + q_len - 1: a
    prompt's forward from its first token (the trunk's, key_start 0; the MTP head's, whose first
    entry sits at 1). Host reads: on the CPU there is no device to wait for."""
    return (q_len > ROW_EXACT_QUERIES and int(positions[0]) == key_start
            and int(positions[-1]) == key_start + q_len - 1)


def _causal_prompt(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                   key_start: int, scale: float) -> torch.Tensor:
    """``paged_attention_reference`` for a prompt's forward from its first entry (``_whole_prompt``)
    on the CPU: its keys are exactly its queries' positions, so SDPA's own causal mask applies and
    its flash kernel skips the masked half (a 1,908-token prompt: 0.068 s a layer against 0.14 s
    with an explicit mask, one thread, the same outputs; the head's 3,998 entries of a 4,000-token
    prompt, two threads: 338 ms through the mask). q [1, q_len, heads, head_dim] -> the same shape."""
    q_len, kv_heads = q.shape[1], k_pool.shape[2]
    keys, values = (_row_keys(pool, table, key_start + q_len)[key_start:].transpose(0, 1)[None].to(q.dtype)
                    for pool in (k_pool, v_pool))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=True, scale=scale,
                                         enable_gqa=kv_heads != q.shape[2])
    return out.transpose(1, 2)


def _row_keys(pool: torch.Tensor, table: torch.Tensor, count: int) -> torch.Tensor:
    """One row's first ``count`` cached entries [count, kv_heads, head_dim] from a pool [blocks,
    block_size, kv_heads, head_dim] through its block table [blocks] (index_select: a third of
    the time of ``pool[table]``)."""
    return pool.index_select(0, table[: -(-count // pool.shape[1])]).flatten(0, 1)[:count]


def _one_row_by_query(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    """``paged_attention_reference`` for one row of a few queries on the CPU: each query attends
    exactly keys[key_start: its position + 1], alone. A verify then gives every token the
    numbers an AR step gives it (SDPA's CPU kernel rounds differently for one and for several
    queries, and over different key counts; a quantized model rounds activations to bf16, which
    turns those last-bit differences into different greedy tokens). No mask is built.

    Each query's heads are grouped by the key/value head they read ([kv_heads, group, head_dim],
    head h reading kv head h // group, as ``enable_gqa`` does), so the scores are two small batched
    matmuls with no repeated keys: about a third of SDPA's time on one query (its math path
    expands the keys for GQA)."""
    positions = meta.positions[0].tolist()  # host read: on the CPU there is no device to wait for
    _, _, kv_heads, head_dim = k_pool.shape
    heads = q.shape[2]
    count = max(positions) + 1
    keys = _row_keys(k_pool, meta.block_tables[0], count).transpose(0, 1).to(q.dtype)  # [kv_heads, keys, head_dim]
    values = _row_keys(v_pool, meta.block_tables[0], count).transpose(0, 1).to(q.dtype)
    outs = []
    for i, p in enumerate(positions):
        grouped = q[0, i].reshape(kv_heads, heads // kv_heads, head_dim)
        scores = torch.bmm(grouped, keys[:, meta.key_start:p + 1].transpose(1, 2)).float() * scale
        weights = scores.softmax(-1).to(values.dtype)
        outs.append(torch.bmm(weights, values[:, meta.key_start:p + 1]).reshape(heads, head_dim))
    return torch.stack(outs).unsqueeze(0)
