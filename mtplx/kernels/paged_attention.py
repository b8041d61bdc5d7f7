"""Triton paged attention for query chunks of any length: decode, MTP draft and verify (1..8
tokens), and prefill.

For a short chunk one program per (row, kv head, split) holds all of the row's query tokens
times the kv head's query heads as the M dimension of its tiles, walks its share of the row's
keys in chunks of BLOCK_N slots through the block table (reading only slots up to the row's last
query position), and keeps an online softmax. Causality inside the chunk comes from each query's
own position. A longer chunk (prefill) is cut into blocks of LONG_M query rows, one program per
(row, query block, kv head, split), each reading keys only up to its own last token: the same
program, so a CUDA graph can capture a prefill too (the reference path's gather and dense mask
read the whole block table).

Split-KV ("flash-decoding"): rows * kv_heads programs leave most of the GPU idle at small
batches (8 programs for one Qwen3-8B row on 132 SMs), so the row's chunks are cut into SPLITS
contiguous shares, one program each. A split writes its partial (running max m, sum l,
unnormalised acc, fp32) to a workspace and a second kernel merges the partials per (row, query
token, head). The row's length is read on the device, so each split finds its share at run time
and a CUDA graph replays for any length; a split past the row's end writes a neutral partial
(m = -inf, l = 0; its acc is never read). SPLITS depends on shapes only (``choose_splits``):
enough for about PROGRAMS_PER_SM programs per SM, at most MAX_SPLITS and one per chunk of the
block table, 1 once rows * kv_heads alone reaches that. With SPLITS = 1 the kernel writes the
output directly, as before the split existed. The cost of a fixed SPLITS: on an H200, long
contexts run several times faster (one Qwen3-8B row, 4096 keys: 129 -> 13 us per call), short
ones slower (one row, 128 keys: 5.8 -> 6.8 us; 16 rows, 4 queries, 128 keys: 8.0 -> 14.6 us;
benchmarks/results/paged_attention_split_h200.json), since empty splits and the merge still run.
"""

from __future__ import annotations

import functools

import torch

from mtplx.kernels.fused import launch_options

try:
    import triton
    import triton.language as tl

    from mtplx.kernels.fused import pdl_start, pdl_wait
except ImportError:  # CPU-only installs run the reference path
    triton = None

MAX_SPLITS = 32
SHORT_QUERY = 8  # up to this many query tokens, one program holds them all (decode, draft, verify)
# warps of a short chunk's program: on 4 it spilled (ptxas, sm_90a: 255 registers, 104 bytes at
# one token) and the H100's 8B int4 AR step ran 421.9 tok/s against 428.1-428.4 on 8
SHORT_WARPS = 8
LONG_M = 64  # query rows (tokens x group) per program for longer chunks (prefill)
PROGRAMS_PER_SM = 4  # long contexts ran fastest at about 4 programs per SM on an H200 (benchmarks/check_kernels.py)
CPU_SMS = 132  # the interpreter has no SM count; use an H200's so CPU tests choose as the GPU does


def available() -> bool:
    return triton is not None


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_block_n(page: int) -> int:
    return max(16, min(64, page * 4))


def choose_splits(rows: int, kv_heads: int, max_keys: int, block_n: int, device: torch.device) -> int:
    """SPLITS for a launch, from shapes only (a captured graph replays it for every length):
    about PROGRAMS_PER_SM programs per SM, at most MAX_SPLITS and one per chunk of the table."""
    programs_wanted = PROGRAMS_PER_SM * _sm_count(device)
    return max(1, min(MAX_SPLITS, programs_wanted // (rows * kv_heads), triton.cdiv(max_keys, block_n)))


if triton is not None:

    @triton.jit
    def _attend(q, qpos, hi, start, k_ptr, v_ptr, tables_ptr, row, kvh, d, m_i, l_i, acc,
                sk_b, sk_s, sk_h, st_r, key_start, scale, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr):
        """One chunk of BLOCK_N key slots (those past ``hi`` masked): gather through the block
        table, online softmax update."""
        kpos = start + tl.arange(0, BLOCK_N)
        in_range = kpos <= hi
        block = tl.load(tables_ptr + row * st_r + kpos // PAGE, mask=in_range, other=0)
        base = block * sk_b + (kpos % PAGE) * sk_s + kvh * sk_h
        k = tl.load(k_ptr + base[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_ptr + base[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] >= key_start) & in_range[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        return m_new, l_i, acc

    # Lengths, offsets and the table width vary per call: left unspecialised, so a launch never
    # compiles a new variant just because a length became 1 or a multiple of 16.
    @triton.jit(do_not_specialize=["q_len", "q_blocks", "key_start", "st_r", "sp_r"])
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, pos_ptr, ml_ptr, acc_ptr,
        sq_r, sq_t, sq_h, sk_b, sk_s, sk_h, so_r, so_t, so_h, st_r, sp_r,
        q_len, q_blocks, key_start, scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        M_PAD: tl.constexpr, LOOP_CHUNKS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
        DYNAMIC_BOUND: tl.constexpr, PARTIAL: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_start(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0) // q_blocks
        q_block = tl.program_id(0) % q_blocks
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        splits = tl.num_programs(2)
        TOKENS: tl.constexpr = M_PAD // GROUP  # query tokens per program
        m = tl.arange(0, M_PAD)
        tok = q_block * TOKENS + m // GROUP
        head = kvh * GROUP + m % GROUP
        valid_m = (m < TOKENS * GROUP) & (tok < q_len)
        d = tl.arange(0, HEAD_DIM)
        # the last query token of this program's block bounds the keys it reads (causal)
        last = tl.load(pos_ptr + row * sp_r + tl.minimum(q_block * TOKENS + TOKENS, q_len) - 1)
        # this split's contiguous share of the row's chunks, from the length in memory
        chunks = (last + BLOCK_N) // BLOCK_N
        per_split = (chunks + splits - 1) // splits
        first = split * per_split
        stop = tl.minimum(first + per_split, chunks)
        hi = tl.minimum(last, stop * BLOCK_N - 1)
        q = tl.load(q_ptr + row * sq_r + tok[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
                    mask=valid_m[:, None] & (first < stop), other=0.0)
        qpos = tl.load(pos_ptr + row * sp_r + tok, mask=valid_m, other=-1)
        m_i = tl.full([M_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([M_PAD], tl.float32)
        acc = tl.zeros([M_PAD, HEAD_DIM], tl.float32)
        # compiled: loop to the share's own end (a CUDA graph replays correctly for any length);
        # the CPU interpreter needs a compile-time trip count, chunks past the share masked by hi
        if DYNAMIC_BOUND:
            for c in range(first, stop):
                m_i, l_i, acc = _attend(q, qpos, hi, c * BLOCK_N, k_ptr, v_ptr, tables_ptr, row, kvh, d, m_i, l_i,
                                        acc, sk_b, sk_s, sk_h, st_r, key_start, scale, PAGE, BLOCK_N, PRECISION)
        else:
            for i in range(0, LOOP_CHUNKS):
                m_i, l_i, acc = _attend(q, qpos, hi, (first + i) * BLOCK_N, k_ptr, v_ptr, tables_ptr, row, kvh, d,
                                        m_i, l_i, acc, sk_b, sk_s, sk_h, st_r, key_start, scale, PAGE, BLOCK_N,
                                        PRECISION)
        if PARTIAL:
            # workspace rows: (row, kv head, split, m) with m < q_len * GROUP, the valid query rows
            slot = ((row * tl.num_programs(1) + kvh) * splits + split) * (q_len * GROUP) + tok * GROUP + m % GROUP
            tl.store(ml_ptr + 2 * slot, m_i, mask=valid_m)
            tl.store(ml_ptr + 2 * slot + 1, l_i, mask=valid_m)
            # an empty share's acc is never read (its m is -inf): skip the write
            tl.store(acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], acc, mask=valid_m[:, None] & (first < stop))
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + row * so_r + tok[:, None] * so_t + head[:, None] * so_h + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=valid_m[:, None])

    @triton.jit(do_not_specialize=["q_len", "splits"])
    def _merge_splits_kernel(ml_ptr, acc_ptr, out_ptr, so_r, so_t, so_h, kv_heads, q_len, splits,
                             SPLITS_PAD: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                             PDL: tl.constexpr):
        """One (row, query token, head): rescale the partials to their common max and normalise
        (a query with no allowed key anywhere gets 0)."""
        pdl_start(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0)
        tok = tl.program_id(1)
        head = tl.program_id(2)
        s = tl.arange(0, SPLITS_PAD)
        valid_s = s < splits
        d = tl.arange(0, HEAD_DIM)
        slot = ((row * kv_heads + head // GROUP) * splits + s) * (q_len * GROUP) + tok * GROUP + head % GROUP
        m = tl.load(ml_ptr + 2 * slot, mask=valid_s, other=float("-inf"))
        l_s = tl.load(ml_ptr + 2 * slot + 1, mask=valid_s, other=0.0)
        acc = tl.load(acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], mask=(m > float("-inf"))[:, None], other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
        l_sum = tl.sum(w * l_s, axis=0)
        out = tl.sum(w[:, None] * acc, axis=0) / tl.where(l_sum == 0.0, 1.0, l_sum)
        tl.store(out_ptr + row * so_r + tok * so_t + head * so_h + d, out.to(out_ptr.dtype.element_ty))


def _m_pad(q_len: int, group: int) -> int:
    """The kernel's M tile: up to SHORT_QUERY tokens, the row's query tokens times the kv head's
    query heads, padded; longer chunks (prefill) are cut into blocks of LONG_M query rows (at
    least one token's heads), one program each."""
    if q_len > SHORT_QUERY:
        return max(LONG_M, triton.next_power_of_2(group))
    return max(16, triton.next_power_of_2(q_len * group))


def query_blocks(q_len: int, group: int) -> int:
    """Programs per (row, kv head, split) along the query tokens."""
    return triton.cdiv(q_len, _m_pad(q_len, group) // group)


def paged_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           positions: torch.Tensor, block_tables: torch.Tensor, key_start: int,
                           scale: float, splits: int | None = None, block_n: int | None = None,
                           num_warps: int | None = None) -> torch.Tensor:
    """Same contract as ``cache.attention.paged_attention``, any q_len.

    q: [rows, q_len, heads, head_dim]; pools: [blocks, page, kv_heads, head_dim];
    positions: [rows, q_len] long; block_tables: [rows, blocks] long.
    splits: key shares per (row, kv head), None for ``choose_splits``; block_n: key slots per
    chunk, None for up to four pages (64 slots); num_warps: the attention kernel's, None for
    SHORT_WARPS up to SHORT_QUERY tokens, else 4."""
    rows, q_len, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_pool.shape
    group = heads // kv_heads
    max_keys = block_tables.shape[1] * page
    block_n = block_n or default_block_n(page)
    q_blocks = query_blocks(q_len, group)
    if splits is None:
        splits = choose_splits(rows * q_blocks, kv_heads, max_keys, block_n, q.device)
    q = q.contiguous()
    out = torch.empty_like(q)
    positions = positions.contiguous()
    block_tables = block_tables.contiguous()
    ml = acc = out  # the unsplit kernel writes no partials
    if splits > 1:  # partials (m, l interleaved; acc) of the valid query rows
        ml = torch.empty(rows, kv_heads, splits, q_len * group, 2, device=q.device, dtype=torch.float32)
        acc = torch.empty(rows, kv_heads, splits, q_len * group, head_dim, device=q.device, dtype=torch.float32)
    _paged_attention_kernel[(rows * q_blocks, kv_heads, splits)](
        q, k_pool, v_pool, out, block_tables, positions, ml, acc,
        q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        out.stride(0), out.stride(1), out.stride(2), block_tables.stride(0), positions.stride(0),
        q_len, q_blocks, key_start, scale,
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, M_PAD=_m_pad(q_len, group),
        BLOCK_N=block_n, DYNAMIC_BOUND=q.is_cuda, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        LOOP_CHUNKS=0 if q.is_cuda else triton.cdiv(triton.cdiv(max_keys, block_n), splits), PARTIAL=splits > 1,
        num_warps=num_warps or (SHORT_WARPS if q_len <= SHORT_QUERY else 4), **launch_options(q.device),
    )
    if splits > 1:
        _merge_splits_kernel[(rows, q_len, heads)](
            ml, acc, out, out.stride(0), out.stride(1), out.stride(2), kv_heads, q_len, splits,
            SPLITS_PAD=triton.next_power_of_2(splits), GROUP=group, HEAD_DIM=head_dim,
            num_warps=1,  # tiny programs: one warp reduces over the splits without shared memory (2-3x faster)
            **launch_options(q.device),
        )
    return out


def compile_variants(heads: int, kv_heads: int, head_dim: int, page: int, dtype: torch.dtype,
                     device: torch.device, max_query: int = 8) -> int:
    """Compile every variant of the two kernels that calls with these shapes can launch, so no
    request pays for a compile (about a second each the first time, then Triton's disk cache):
    one per query tile size (M_PAD, from 1..max_query tokens) with whole or partial output, and
    one merge per power-of-two bucket of split counts; and prefill's query-block tile. Returns
    the number of launches."""
    group = heads // kv_heads
    block_n = default_block_n(page)
    blocks = MAX_SPLITS * block_n // page
    k_pool = torch.zeros(blocks + 1, page, kv_heads, head_dim, dtype=dtype, device=device)
    tables = torch.arange(1, blocks + 1, device=device)[None]
    tiles = {_m_pad(q, group): q for q in range(1, max_query + 1)}  # the longest per tile
    splits_buckets = [1] + [2 ** i + 1 for i in range(MAX_SPLITS.bit_length() - 1)]  # 1, then one per pad
    launches = 0
    for q_len in [*tiles.values(), 2 * LONG_M]:  # and a prefill chunk (several query blocks)
        q = torch.zeros(1, q_len, heads, head_dim, dtype=dtype, device=device)
        positions = torch.arange(blocks * page - q_len, blocks * page, device=device)[None]
        for splits in (splits_buckets if q_len == max_query else (1, 2)):
            paged_attention_triton(q, k_pool, k_pool, positions, tables, 1, 1.0, splits=min(splits, MAX_SPLITS))
            launches += 1
    return launches
