"""The Triton paged-attention kernel (mtplx/kernels/paged_attention.py), unsplit and split-KV,
against the PyTorch reference path.

Runs on a CUDA device, or on the CPU under Triton's interpreter:
    TRITON_INTERPRET=1 python -m pytest -q tests/test_paged_attention_kernel.py
(skipped where Triton is not installed, as in CPU-only CI; benchmarks/check_kernels.py runs the
same comparison on the GPU before it times anything).
"""

from __future__ import annotations

import os

import pytest
import torch

from mtplx.cache.attention import AttentionMetadata, paged_attention_reference
from mtplx.kernels import paged_attention as kernel

pytestmark = pytest.mark.skipif(
    not kernel.available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 4
LENGTHS = (1, 6, 37, 70)  # one key; shorter than a chunk (most splits empty); several chunks
# float32: rounding only; 16-bit: the output's rounding and the 16-bit p @ v
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def paged_case(lengths, q_len, heads, kv_heads, head_dim, dtype, seed):
    """Random pools, shuffled block tables padded with a scratch block, each row's q_len
    queries at the end of its sequence (clipped at 0, so short rows repeat position 0)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in lengths]
    blocks = sum(need) + 3
    k_pool = torch.randn(blocks + 1, PAGE, kv_heads, head_dim, generator=g)
    v_pool = torch.randn(blocks + 1, PAGE, kv_heads, head_dim, generator=g)
    q = torch.randn(len(lengths), q_len, heads, head_dim, generator=g)
    order = torch.randperm(blocks, generator=g).tolist()
    width = max(need) + 1  # one more than any row needs: the kernel must stop at the row's length
    tables, positions = [], []
    for n, nb in zip(lengths, need):
        tables.append(order[:nb] + [blocks] * (width - nb))
        order = order[nb:]
        positions.append([max(0, p) for p in range(n - q_len, n)])
    tables = torch.tensor(tables, device=DEVICE)
    positions = torch.tensor(positions, device=DEVICE)
    to = dict(device=DEVICE, dtype=dtype)
    return q.to(**to), k_pool.to(**to), v_pool.to(**to), positions, tables


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check(dtype, q_len, heads, kv_heads, head_dim, key_start, splits, block_n=None, lengths=LENGTHS, seed=0):
    q, k_pool, v_pool, positions, tables = paged_case(lengths, q_len, heads, kv_heads, head_dim, dtype, seed)
    scale = head_dim ** -0.5
    got = kernel.paged_attention_triton(q, k_pool, v_pool, positions, tables, key_start, scale,
                                        splits=splits, block_n=block_n)
    meta = AttentionMetadata(positions, positions, tables, key_start)
    # the reference in float32 from the same (bf16-rounded) inputs; a query with no allowed key
    # (position 0 when key_start is 1) must come out 0, whatever the reference's SDPA gives there
    ref = paged_attention_reference(q.float(), k_pool.float(), v_pool.float(), meta, scale).nan_to_num(0.0)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert not got.isnan().any()
    if key_start == 1:
        assert (got[positions == 0] == 0).all()
    assert rel(got, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("splits", [1, 2, 3, 7, None])
@pytest.mark.parametrize("key_start", [0, 1])
def test_splits_match_reference(splits, key_start):
    check(torch.float32, 2, 8, 2, 64, key_start, splits)


@pytest.mark.parametrize("q_len,heads,kv_heads,head_dim", [(1, 3, 1, 64), (3, 6, 2, 64), (4, 4, 1, 128),
                                                         (1, 2, 2, 128)])
@pytest.mark.parametrize("splits", [1, 4])
def test_gqa_groups_and_query_lengths(q_len, heads, kv_heads, head_dim, splits):
    check(torch.float32, q_len, heads, kv_heads, head_dim, 1, splits, seed=q_len)


@pytest.mark.parametrize("q_len,heads,kv_heads,lengths", [
    (9, 9, 3, (9, 40)),          # just past the short path: one query block of 21 tokens (group 3)
    (70, 9, 3, (70, 100)),       # 4 query blocks, a cached prefix of 30 keys on the second row
    (23, 16, 1, (23, 64)),       # group 16: 4 tokens per block, 6 blocks
    (40, 8, 2, (40, 41, 90)),    # group 4: 16 tokens per block, the last block part-filled
])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_long_chunks_in_query_blocks(q_len, heads, kv_heads, lengths, splits):
    """Prefill-length chunks: several programs per row along the queries, each reading keys up
    to its own last token, with and without split-KV partials."""
    check(torch.float32, q_len, heads, kv_heads, 64, 0, splits, lengths=lengths, seed=q_len)
    check(torch.float32, q_len, heads, kv_heads, 64, 1, splits, lengths=lengths, seed=q_len + 1)


def test_query_blocks_rule():
    assert kernel.query_blocks(8, 3) == 1 and kernel.query_blocks(1, 32) == 1  # short chunks: one program
    assert kernel.query_blocks(9, 3) == 1  # 64 query rows hold 21 tokens of 3 heads
    assert kernel.query_blocks(22, 3) == 2
    assert kernel.query_blocks(256, 4) == 16
    assert kernel.query_blocks(9, 128) == 9  # a group wider than the tile: one token per program


@pytest.mark.parametrize("block_n", [16, 64])
def test_chunk_size_is_free(block_n):
    check(torch.float32, 2, 4, 1, 64, 0, 3, block_n=block_n)


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype, splits):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton 3.6's interpreter computes bf16 tl.dot wrongly (float16 covers the same path)")
    check(dtype, 2, 8, 2, 64, 1, splits)


def test_more_splits_than_chunks():
    """Every split but the first gets no keys (neutral partials)."""
    check(torch.float32, 1, 4, 1, 64, 0, 16, lengths=(1, 3, 16))


def test_choose_splits_rule():
    cpu = torch.device("cpu")
    assert kernel.choose_splits(200, 8, 4096, 32, cpu) == 1  # enough programs already
    assert kernel.choose_splits(1, 8, 4096, 32, cpu) == kernel.MAX_SPLITS
    assert kernel.choose_splits(8, 8, 4096, 32, cpu) == kernel.PROGRAMS_PER_SM * kernel.CPU_SMS // 64
    assert kernel.choose_splits(1, 8, 64, 32, cpu) == 2  # no more splits than chunks in the table


def test_compile_variants_launches_every_tile_and_merge_bucket():
    """Start-up compilation covers each query tile size (whole and partial output) and one
    merge per power-of-two split bucket, for grouped-query shapes of two model families, and
    prefill's query-block tile (whole and partial)."""
    for heads, kv_heads in ((9, 3), (32, 8)):  # SmolLM2-135M, Qwen3-8B: two tiles each for 1..8 queries
        n = kernel.compile_variants(heads, kv_heads, 64, 16, torch.float32, torch.device(DEVICE))
        assert n == 2 + (1 + len([2, 4, 8, 16, 32])) + 2
