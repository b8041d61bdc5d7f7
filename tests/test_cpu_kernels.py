"""kernels/cpu.py's fused CPU ops against the PyTorch ops they replace (written out here), and
their use in a model: the same logits as with the kernels off, and no cross-row effects."""

import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from mtplx.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.cpu_supported(), reason="no AVX2 CPU, or no g++/ninja")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_is_the_residual_add_then_rmsnorm(with_delta):
    x, d = (torch.randn(5, 96, generator=_gen(i)) for i in range(2))
    w = torch.randn(96, generator=_gen(2))
    s, y = cpu_kernels.add_rms_norm(x, d if with_delta else None, w, 1e-5)
    ref_s = x + d if with_delta else x
    ref_y = w * (ref_s * torch.rsqrt(ref_s.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(s, ref_s)
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-6)


def _rope(v, cos, sin, rd):
    rot, rest = v[..., :rd], v[..., rd:]
    half = rd // 2
    out = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), -1) * sin
    return torch.cat((out, rest), -1)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 8])  # whole head, and partial rotary
def test_rope_write_rotates_q_and_k_and_writes_the_cache(qk_norm, rotary_dim):
    heads, kv_heads, d, t = 4, 2, 16, 3
    qkv = torch.randn(1, t, (heads + 2 * kv_heads) * d, generator=_gen(0))
    pos = torch.tensor([5, 6, 7], dtype=torch.float32)
    freqs = pos[:, None] * (1.0 / 10000 ** (torch.arange(0, rotary_dim, 2) / rotary_dim))
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    k_pool, v_pool = torch.zeros(4, 4, kv_heads, d), torch.zeros(4, 4, kv_heads, d)
    slots = torch.tensor([9, 2, 14])
    qn, kn = (torch.randn(d, generator=_gen(5)), torch.randn(d, generator=_gen(6))) if qk_norm else (None, None)
    q = cpu_kernels.rope_write(qkv, cos, sin, slots, k_pool, v_pool, heads, kv_heads, d, qn, kn, 1e-6)

    def norm(x, w):
        return x if w is None else w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    rq, rk, rv = qkv[0].split([heads * d, kv_heads * d, kv_heads * d], -1)
    c, s = cos[:, None, :], sin[:, None, :]
    ref_q = _rope(norm(rq.view(t, heads, d), qn), c, s, rotary_dim)
    ref_k = _rope(norm(rk.view(t, kv_heads, d), kn), c, s, rotary_dim)
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k_pool.view(-1, kv_heads, d)[slots], ref_k, rtol=1e-5, atol=1e-6)
    assert torch.equal(v_pool.view(-1, kv_heads, d)[slots], rv.view(t, kv_heads, d))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert not k_pool.view(-1, kv_heads, d)[untouched].any()


@pytest.mark.parametrize("key_start", [0, 1])
def test_row_attention_attends_each_query_to_its_own_keys(key_start):
    heads, kv_heads, d, block = 6, 2, 8, 4
    k_pool, v_pool = torch.randn(8, block, kv_heads, d, generator=_gen(1)), torch.randn(8, block, kv_heads, d, generator=_gen(2))
    table = torch.tensor([5, 0, 7, 3])  # keys 0..15 live in blocks 5, 0, 7, 3
    positions = torch.tensor([9, 10, 13])
    q = torch.randn(3, heads, d, generator=_gen(3))
    out = cpu_kernels.row_attention(q, k_pool, v_pool, table, positions, key_start, 0.3)
    keys = k_pool[table].reshape(-1, kv_heads, d)
    values = v_pool[table].reshape(-1, kv_heads, d)
    for i, p in enumerate(positions.tolist()):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = keys[key_start:p + 1, kv] @ q[i, h] * 0.3
            ref = scores.softmax(-1) @ values[key_start:p + 1, kv]
            torch.testing.assert_close(out[i, h * d:(h + 1) * d], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width", [512, 256])
@pytest.mark.parametrize("key_start", [0, 1, 130])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 16), (8, 1, 32), (8, 2, 128), (7, 1, 64),
                                              (6, 2, 20)])
def test_row_attention_over_spans_of_keys(width, key_start, heads, kv_heads, d, force_width):
    """Queries over up to 300 keys against softmax(q k / sqrt) v in float64, each query the same
    alone as among others: three spans of 128 keys, the KV head's query heads sharing its rows
    (the spans depend on key positions only), 16 lanes at a time on the AVX-512 path (d a
    multiple of 16) and 8 on the AVX2 one (width 256, or d not a multiple of 16), a span's
    (query, head) value sums in batches of 16 or 8 (seven heads a KV head: 35 such sums); d = 20
    the scalar tails."""
    force_width(width)
    block, blocks = 16, 24
    k_pool = torch.randn(blocks, block, kv_heads, d, generator=_gen(7))
    v_pool = torch.randn(blocks, block, kv_heads, d, generator=_gen(8))
    table = torch.randperm(blocks, generator=_gen(9))[:20]  # keys 0..319
    positions = torch.tensor([299, 127, 128, 255, 140])
    q = torch.randn(len(positions), heads, d, generator=_gen(10)) * 0.5
    out = cpu_kernels.row_attention(q, k_pool, v_pool, table, positions, key_start, d ** -0.5)
    keys = k_pool[table].reshape(-1, kv_heads, d).double()
    values = v_pool[table].reshape(-1, kv_heads, d).double()
    for i, p in enumerate(positions.tolist()):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = keys[key_start:p + 1, kv] @ q[i, h].double() * d ** -0.5
            ref = scores.softmax(-1) @ values[key_start:p + 1, kv]
            torch.testing.assert_close(out[i, h * d:(h + 1) * d].double(), ref, rtol=1e-5, atol=2e-6)
        alone = cpu_kernels.row_attention(q[i:i + 1], k_pool, v_pool, table, positions[i:i + 1], key_start,
                                          d ** -0.5)
        assert torch.equal(alone[0], out[i])


@pytest.mark.parametrize("width", [512, 256])
def test_row_attention_of_a_short_context_splits_the_heads(width, force_width):
    """One span of keys and few KV heads: a job per query head (more jobs than threads), the
    same numbers as the reference and as each query alone."""
    force_width(width)
    heads, kv_heads, d = 9, 3, 64
    k_pool, v_pool = (torch.randn(4, 16, kv_heads, d, generator=_gen(s)) for s in (12, 13))
    table, positions = torch.tensor([2, 0, 3, 1]), torch.tensor([40, 41])
    q = torch.randn(2, heads, d, generator=_gen(14))
    out = cpu_kernels.row_attention(q, k_pool, v_pool, table, positions, 0, 0.125)
    keys, values = (p[table].reshape(-1, kv_heads, d).double() for p in (k_pool, v_pool))
    for i, p in enumerate(positions.tolist()):
        for h in range(heads):
            ref = (keys[:p + 1, h // 3] @ q[i, h].double() * 0.125).softmax(-1) @ values[:p + 1, h // 3]
            torch.testing.assert_close(out[i, h * d:(h + 1) * d].double(), ref, rtol=1e-5, atol=2e-6)
        alone = cpu_kernels.row_attention(q[i:i + 1], k_pool, v_pool, table, positions[i:i + 1], 0, 0.125)
        assert torch.equal(alone[0], out[i])


@pytest.mark.parametrize("width", [512, 256])
def test_row_attention_keeps_a_nan_key_visible(width, force_width):
    """A NaN key makes its KV head's query heads NaN (over spans, 16 or 8 lanes at a time),
    the other heads their own numbers."""
    force_width(width)
    heads, kv_heads, d = 6, 2, 64
    k_pool, v_pool = (torch.randn(40, 16, kv_heads, d, generator=_gen(s)) for s in (15, 16))
    table, positions = torch.randperm(40, generator=_gen(17)), torch.tensor([600])
    q = torch.randn(1, heads, d, generator=_gen(18))
    clean = cpu_kernels.row_attention(q, k_pool, v_pool, table, positions, 0, 0.125).view(heads, d)
    for key in (5, 300, 600):
        k = k_pool.clone()
        k.view(-1, kv_heads, d)[table[key // 16] * 16 + key % 16, 0] = float("nan")
        out = cpu_kernels.row_attention(q, k, v_pool, table, positions, 0, 0.125).view(heads, d)
        assert out[:3].isnan().all(), key
        assert torch.equal(out[3:], clean[3:]), key


@pytest.mark.parametrize("width", [512, 256])
@pytest.mark.parametrize("heads,kv_heads,d,positions", [(9, 3, 64, [299, 127, 128, 5]), (6, 2, 24, [40, 7]),
                                                     (6, 2, 20, [40, 7]), (4, 1, 12, [33])])
def test_row_attention_over_float16_pools(width, heads, kv_heads, d, positions, force_width):
    """float16 pools: each element widened exactly as it is read, so the output is bit for bit
    the float32 path's over the pools' ``.float()`` (16 lanes at a time, and 8: AVX2 width, or a
    head size not a multiple of 16, with scalar tails past a multiple of 8)."""
    force_width(width)
    block, blocks = 16, 24
    k_pool, v_pool = (torch.randn(blocks, block, kv_heads, d, generator=_gen(s)).half() for s in (20, 21))
    table = torch.randperm(blocks, generator=_gen(22))[:20]
    pos = torch.tensor(positions)
    q = torch.randn(len(positions), heads, d, generator=_gen(23)) * 0.5
    for key_start in (0, 1):
        half = cpu_kernels.row_attention(q, k_pool, v_pool, table, pos, key_start, d ** -0.5)
        wide = cpu_kernels.row_attention(q, k_pool.float(), v_pool.float(), table, pos, key_start, d ** -0.5)
        assert half.dtype == torch.float32 and torch.equal(half, wide)


@pytest.mark.parametrize("d", [64, 12])  # (12: eight at a time, then one at a time)
def test_rope_write_rounds_into_float16_pools(d):
    """The same queries as with float32 pools, and each written key and value the float32 one
    rounded to nearest (``.half()``); other slots untouched."""
    heads, kv_heads, t = 9, 3, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=_gen(24)) * 3
    cos, sin = torch.randn(t, d, generator=_gen(25)), torch.randn(t, d, generator=_gen(26))
    slots = torch.tensor([3, 17, 18, 40])
    wide = torch.zeros(6, 8, kv_heads, d), torch.zeros(6, 8, kv_heads, d)
    half = torch.zeros(6, 8, kv_heads, d, dtype=torch.float16), torch.zeros(6, 8, kv_heads, d, dtype=torch.float16)
    kn = torch.randn(d, generator=_gen(27))
    q_wide = cpu_kernels.rope_write(qkv, cos, sin, slots, *wide, heads, kv_heads, d, None, kn, 1e-6)
    q_half = cpu_kernels.rope_write(qkv, cos, sin, slots, *half, heads, kv_heads, d, None, kn, 1e-6)
    assert torch.equal(q_wide, q_half)
    assert torch.equal(half[0], wide[0].half()) and torch.equal(half[1], wide[1].half())
    # values past float16's range and below its normals round as .half() rounds them (v is
    # written as it is computed: no norm, no RoPE); a NaN stays NaN
    special = torch.tensor([1e-6, 6e-8, 2.0 ** -25, 3e-5, 65519.0, 65520.0, 7e4, -7e4, 1.0 + 2.0 ** -11,
                            float("inf"), float("nan")])
    qkv[:, (heads + kv_heads) * d:] = special.repeat(t * kv_heads * d // len(special) + 1)[:t * kv_heads * d].view(t, -1)
    cpu_kernels.rope_write(qkv, cos, sin, slots, *wide, heads, kv_heads, d, None, kn, 1e-6)
    cpu_kernels.rope_write(qkv, cos, sin, slots, *half, heads, kv_heads, d, None, kn, 1e-6)
    want = wide[1].half()
    assert torch.equal(half[1].isnan(), want.isnan())
    assert torch.equal(half[1].nan_to_num(0.0), want.nan_to_num(0.0))
    with pytest.raises(RuntimeError, match="float32 or float16 pools"):
        cpu_kernels.rope_write(qkv, cos, sin, slots, *(p.bfloat16() for p in wide), heads, kv_heads, d, None, kn,
                               1e-6)


@pytest.mark.parametrize("d", [64, 12])  # vectors of eight, and a tail written one at a time
def test_a_finite_value_past_float16s_range_sets_the_overflow_record(d):
    """65,520 and beyond (halfway past 65,504) become inf in a float16 pool: the write records
    it, read once by take_half_overflow; 65,519, inf and NaN inputs, and float32 pools, do not."""
    heads, kv_heads, t = 2, 1, 1
    cos, sin = torch.ones(t, d), torch.zeros(t, d)
    slots = torch.tensor([5])
    cpu_kernels.take_half_overflow()  # nothing left over
    for value, pool_dtype, overflows in ((65519.0, torch.float16, False), (float("inf"), torch.float16, False),
                                         (float("nan"), torch.float16, False), (65520.0, torch.float16, True),
                                         (-1e6, torch.float16, True), (1e6, torch.float32, False)):
        qkv = torch.ones(t, (heads + 2 * kv_heads) * d)
        qkv[0, -1] = value  # the last value of the row: the tail at d = 12
        pools = torch.zeros(2, 4, kv_heads, d, dtype=pool_dtype), torch.zeros(2, 4, kv_heads, d, dtype=pool_dtype)
        cpu_kernels.rope_write(qkv, cos, sin, slots, *pools, heads, kv_heads, d, None, None, 1e-6)
        assert cpu_kernels.take_half_overflow() == overflows, (value, pool_dtype)
        assert not cpu_kernels.take_half_overflow()  # read once


@pytest.mark.parametrize("width", [512, 256])
def test_row_attention_of_no_keys_is_zero(width, force_width):
    """A query whose keys all lie before key_start attends nothing: zeros, as before."""
    force_width(width)
    pool = torch.randn(2, 16, 1, 16, generator=_gen(11))
    out = cpu_kernels.row_attention(torch.randn(1, 2, 16), pool, pool, torch.tensor([1, 0]), torch.tensor([5]), 6, 0.25)
    assert torch.equal(out, torch.zeros(1, 32))


@pytest.mark.parametrize("key_start", [0, 1])
@pytest.mark.parametrize("q_len", [1, 3])
def test_a_batchs_attention_on_the_cpu_is_each_rows_own(key_start, q_len):
    """Several rows (a batch's AR steps or verifies) attend row by row over their own keys, as
    the masked product over every row's gathered block table does (the path they took before)."""
    from mtplx.cache.attention import AttentionMetadata, _gathered, paged_attention_reference

    heads, kv_heads, d, block = 6, 2, 8, 4
    k_pool, v_pool = torch.randn(12, block, kv_heads, d, generator=_gen(1)), torch.randn(12, block, kv_heads, d, generator=_gen(2))
    tables = torch.tensor([[5, 0, 7, 3], [1, 2, 11, 11], [9, 4, 6, 8]])  # row 1's table padded (block 11 as scratch)
    positions = torch.tensor([[9 + j for j in range(q_len)], [5 + j for j in range(q_len)], [12 + j for j in range(q_len)]])
    q = torch.randn(3, q_len, heads, d, generator=_gen(3))
    meta = AttentionMetadata(positions, positions.clone(), tables, key_start=key_start)
    with torch.inference_mode():
        got = paged_attention_reference(q, k_pool, v_pool, meta, 0.3)
        one = [paged_attention_reference(q[r: r + 1], k_pool, v_pool, AttentionMetadata(
            positions[r: r + 1], positions[r: r + 1], tables[r: r + 1], key_start=key_start), 0.3) for r in range(3)]
    torch.testing.assert_close(got, _gathered(q, k_pool, v_pool, meta, 0.3), rtol=1e-5, atol=1e-6)
    assert torch.equal(got, torch.cat(one))  # a row's result does not depend on the rows beside it


def test_row_attention_refuses_positions_beyond_the_table():
    k_pool = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="beyond the block table"):
        cpu_kernels.row_attention(torch.zeros(1, 1, 8), k_pool, k_pool, torch.tensor([0]), torch.tensor([4]), 0, 1.0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_kernels.row_attention(torch.zeros(1, 1, 8), k_pool, k_pool, torch.tensor([2]), torch.tensor([3]), 0, 1.0)


def test_silu_mul_is_silu_of_gate_times_up():
    x = torch.randn(2, 3, 40, generator=_gen(4)) * 4
    torch.testing.assert_close(cpu_kernels.silu_mul(x), F.silu(x[..., :20]) * x[..., 20:], rtol=1e-5, atol=1e-6)


def _tiny_quantized_model(tmp: str):
    """A tiny Qwen3 (q/k norms) written to ``tmp`` (load it with quantize="int4"), and a function
    giving an engine's logits for 12 token ids fed in chunks of the given sizes."""
    import json
    import pathlib

    from safetensors.torch import save_file

    from mtplx.engine.sampling import SamplingParams
    from mtplx.engine.sequence import Sequence
    from tests.tiny_models import hf_reference

    hf, cfg = hf_reference("qwen3")
    path = pathlib.Path(tmp)
    (path / "config.json").write_text(json.dumps(cfg, default=str))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(path / "model.safetensors"))
    ids = torch.randint(0, cfg["vocab_size"], (12,), generator=_gen(7)).tolist()

    def logits(engine, chunks):
        runner = engine.runner
        seq = Sequence(prompt_ids=ids, params=SamplingParams(), max_tokens=1)
        runner.blocks.allocate(seq.seq_id, seq.prompt_ids)
        outs, start = [], 0
        with torch.inference_mode():
            for n in chunks:
                outs.append(runner.logits(runner.trunk([seq], [ids[start:start + n]], [start]))[0])
                start += n
        return torch.cat([o.reshape(-1, o.shape[-1]) for o in outs])
    return path, logits


def test_a_model_gives_the_same_logits_with_the_kernels_off(monkeypatch, tmp_path):
    """The whole CPU forward, fused ops against PyTorch's, on a tiny Qwen3 (q/k norms) with a
    quantized trunk: close logits, and every token row the same alone as in a 5-token verify."""
    import mtplx

    path, logits = _tiny_quantized_model(str(tmp_path))
    engine = mtplx.load(path, device="cpu", quantize="int4")
    fused = logits(engine, [7, 5])
    singles = logits(engine, [7, 1, 1, 1, 1, 1])
    assert torch.equal(fused[-5:], singles[-5:])  # a 5-token forward gives AR's numbers
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    cpu_kernels.extension.cache_clear()
    try:
        plain = logits(mtplx.load(path, device="cpu", quantize="int4"), [7, 5])
    finally:
        monkeypatch.delenv(cpu_kernels.ENV_SWITCH)
        cpu_kernels.extension.cache_clear()
    # PyTorch's int4 kernel rounds activations to bf16: close, not equal
    assert (fused - plain).abs().max() < 0.05 * max(1.0, float(plain.abs().max()))
    assert math.isfinite(float(fused.abs().max()))


def test_a_layer_as_one_call_gives_the_numbers_of_its_calls_one_by_one(monkeypatch, tmp_path):
    """kernels/cpu.layer (the whole decoder layer from C++) makes the same calls in the same
    order as the layer's Python forward: bit-identical logits, for a prompt chunk, a verify of
    5 tokens and single decode steps; and it is the path those forwards take."""
    from mtplx.models import layers

    import mtplx

    path, logits = _tiny_quantized_model(str(tmp_path))
    engine = mtplx.load(path, device="cpu", quantize="int4")
    built = []
    original = layers.DecoderLayer._cpu_layer
    monkeypatch.setattr(layers.DecoderLayer, "_cpu_layer", lambda self: built.append(original(self)) or built[-1])
    one_call = logits(engine, [7, 5])
    singles = logits(engine, [7, 1, 1, 1, 1, 1])
    assert built and all(b is not None for b in built)
    monkeypatch.setattr(layers.DecoderLayer, "_cpu_layer", lambda self: None)
    assert torch.equal(one_call, logits(engine, [7, 5]))
    assert torch.equal(singles, logits(engine, [7, 1, 1, 1, 1, 1]))
    assert torch.equal(one_call[-5:], singles[-5:])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,group", [(192, 64), (576, 32)])
def test_avx512_and_avx2_products_agree_with_the_dequantized_weight(bits, k, group):
    """The AVX-512 float-activation products (chosen where the CPU has them) and the AVX2 ones
    both give a @ dequantize(w)^T within float32 summation error, for 1-6 rows, offsets on
    every group (3 or 18 of them: the AVX2 pass takes eight at a time); each row the same alone
    as among others."""
    from mtplx.models.quant import QuantizedWeight, quantize_rtn

    w = torch.randn(38, k, generator=_gen(11))
    before = cpu_kernels.vector_width()
    if before != 512:
        pytest.skip("no AVX-512 here")
    qw = quantize_rtn(w, bits, group)
    zero = torch.randn(qw.scale.shape, generator=_gen(12)) * 0.05
    qw = QuantizedWeight(qw.q, qw.scale, zero, bits, group)
    words, scale, zero = cpu_kernels.pack(qw.q, qw.scale, qw.zero, bits, group)
    reference_w = cpu_kernels.dequantize(words, scale, zero, group, bits).double()
    torch.testing.assert_close(reference_w[:38].float(), qw.dequantize(), rtol=0, atol=1e-2)  # held in fp16
    try:
        for width in (512, 256):
            cpu_kernels.vector_width(width)
            for rows in range(1, 7):
                a = torch.randn(rows, k, generator=_gen(rows))
                out = cpu_kernels.matmul(a, words, scale, zero, group, bits)
                torch.testing.assert_close(out.double(), a.double() @ reference_w.T, rtol=1e-5, atol=1e-4)
                assert torch.equal(out[-1], cpu_kernels.matmul(a[-1:], words, scale, zero, group, bits)[0])
    finally:
        cpu_kernels.vector_width(before)


@pytest.mark.parametrize("width", [256, 512])
def test_bf16_weights_multiply_as_their_float32_copy(width, force_width):
    """bf16_matmul: a [M, K] float32 times a bfloat16 weight gives the product with that weight
    widened to float32, within float32 summation error, each row the same alone as among others,
    at both vector widths."""
    force_width(width)
    w = torch.randn(37, 96, generator=_gen(21)).to(torch.bfloat16)
    for rows in (1, 2, 3, 5):
        a = torch.randn(rows, 96, generator=_gen(rows + 30))
        out = cpu_kernels.bf16_matmul(a, w)
        torch.testing.assert_close(out.double(), a.double() @ w.double().T, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[-1], cpu_kernels.bf16_matmul(a[-1:], w)[0])


@pytest.mark.parametrize("width", [256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dense_weights_multiply_as_their_float32_values(width, dtype, force_width):
    """dense_matmul: a bfloat16, float16 or float32 weight widened exactly to float32, within
    float32 summation error of the float64 product, each row the same alone as among others."""
    force_width(width)
    w = torch.randn(37, 96, generator=_gen(22)).to(dtype)
    for rows in (1, 2, 3, 5, 49):
        a = torch.randn(rows, 96, generator=_gen(rows + 40))
        out = cpu_kernels.dense_matmul(a, w)
        torch.testing.assert_close(out.double(), a.double() @ w.double().T, rtol=1e-5, atol=1e-5)
        for r in (0, rows - 1):
            assert torch.equal(out[r], cpu_kernels.dense_matmul(a[r:r + 1], w)[0])


def test_a_float_output_matrix_reads_its_narrowest_exact_width():
    """A float output matrix on the CPU: decode rows go through dense_matmul over the narrowest
    copy that holds its values (bf16, float16, else float32 itself), within float32 summation
    error of F.linear, every row as it is alone; and greedy MTP still equals AR."""
    from mtplx.models.layers import _narrowest
    from tests.test_mtp_greedy import PROMPTS
    from tests.tiny_models import tiny_engine

    base = torch.randn(96, 64, generator=_gen(5))
    assert _narrowest(base.bfloat16().float()).dtype == torch.bfloat16
    assert _narrowest(base.half().float()).dtype == torch.float16
    assert _narrowest(base).dtype == torch.float32
    engine, _ = tiny_engine("llama", draft_vocab=list(range(0, 96, 2)))
    model = engine.loaded.model
    with torch.no_grad():
        model.lm_head.weight.copy_(model.lm_head.weight.half().float())
    hidden = torch.randn(3, 64, generator=_gen(6))
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
        torch.testing.assert_close(logits, torch.nn.functional.linear(hidden, model.lm_head.weight),
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(logits[1], model.compute_logits(hidden[1:2])[0])
        assert model.lm_head.__dict__["_dense_copy"][1].dtype == torch.float16
        # a weight replaced without an in-place op is re-read, not served from the old copy
        model.lm_head.weight.data = model.lm_head.weight.data * 2
        torch.testing.assert_close(model.compute_logits(hidden), 2 * logits, rtol=1e-5, atol=1e-5)
        for prompt in PROMPTS[:2]:
            ar = engine.generate(prompt, max_tokens=16, mode="ar")
            mtp = engine.generate(prompt, max_tokens=16, mode="mtp", depth=2)
            assert mtp.token_ids == ar.token_ids


def test_a_head_shipped_in_bf16_runs_in_one_call_and_decodes_exactly():
    """An MTP head whose float32 weights bfloat16 holds exactly (as a head shipped in bf16) runs
    its decoder layer as one C++ call over bf16 copies of its weights, and greedy MTP still
    equals AR greedy; a head whose weights bf16 does not hold keeps the float path."""
    from tests.test_mtp_greedy import PROMPTS
    from tests.tiny_models import tiny_engine

    engine, _ = tiny_engine("llama", num_hidden_layers=4)
    head = engine.runner.head
    assert head.layers[0]._cpu_layer() is None  # random float32 weights: not bf16
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert head.layers[0]._cpu_layer() is not None  # rebuilt: the weights' versions moved
    for prompt in PROMPTS:
        ar = engine.generate(prompt, mode="ar", max_tokens=24).token_ids
        for depth in (1, 3):
            assert engine.generate(prompt, mode="mtp", depth=depth, max_tokens=24).token_ids == ar


@pytest.mark.parametrize("key_start", [0, 1])
def test_a_prompt_from_its_first_entry_attends_as_with_an_explicit_causal_mask(monkeypatch, key_start):
    """A prompt's forward from its first entry on the CPU (the trunk's from position 0, the MTP
    head's from 1) takes SDPA's own causal mask over its paged keys (blocks out of order in the
    pool), not the explicit mask; each query still attends exactly keys key_start..its position:
    the result matches attention written out with softmax over those keys."""
    from mtplx.cache import attention
    from mtplx.cache.attention import AttentionMetadata, paged_attention_reference

    def explicit_mask(*args):
        raise AssertionError("a prompt from its first entry took the explicit mask")

    monkeypatch.setattr(attention, "_gathered", explicit_mask)
    q_len, heads, kv_heads, d, block = 37, 6, 2, 16, 8
    k_pool = torch.randn(9, block, kv_heads, d, generator=_gen(40))
    v_pool = torch.randn(9, block, kv_heads, d, generator=_gen(41))
    table = torch.tensor([[7, 2, 5, 0, 8, 3]])
    q = torch.randn(1, q_len, heads, d, generator=_gen(42))
    positions = torch.arange(key_start, key_start + q_len)[None]
    meta = AttentionMetadata(positions=positions, slot_mapping=torch.zeros(1, q_len, dtype=torch.long),
                             block_tables=table, key_start=key_start)
    out = paged_attention_reference(q, k_pool, v_pool, meta, 0.25)
    keys = k_pool[table[0]].reshape(-1, kv_heads, d).double()
    values = v_pool[table[0]].reshape(-1, kv_heads, d).double()
    for i, p in enumerate(positions[0].tolist()):
        for h in range(heads):
            w = torch.softmax(keys[key_start: p + 1, h // 3] @ q[0, i, h].double() * 0.25, dim=0)
            torch.testing.assert_close(out[0, i, h].double(), w @ values[key_start: p + 1, h // 3],
                                       rtol=1e-5, atol=1e-5)


def _race_reference(target, draft, drafts, depths, keys, fills):
    """speculative.rejection_outcome from noise.fill's uniforms and exponentials (ones for a
    race fill below 0): what ``cpu_kernels.race`` decides in one call."""
    from mtplx.engine.speculative import rejection_outcome
    from mtplx.kernels import noise

    rows, k1, vocab = target.shape
    uniforms = noise.fill(torch.empty(rows, 1, max(k1 - 1, 1)), keys, fills[:, :1].contiguous(), False)[:, 0]
    race = noise.fill(torch.empty(rows, 1, vocab), keys, fills[:, 1:].contiguous(), True)[:, 0]
    race = torch.where(fills[:, 1:] < 0, torch.ones(()), race)
    return rejection_outcome(target, draft, drafts, depths[:, None], uniforms, race)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("vocab", [7, 100, 4097, 49152])  # one and several spans of 4,096, tails of 32
def test_the_race_decides_as_rejection_sampling_over_fills_does(vocab, threads):
    """The C++ race against speculative.rejection_outcome over noise.fill's numbers (its
    exponentials are philox_fill's, bit for bit): one-hot and sampled drafts, rows with depths
    of their own, greedy rows (no race fill), k = 0 (a plain sample), up to 3 rows, a position
    whose distribution is NaN (torch.argmax's answer: the first NaN)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for trial in range(24):
            g = _gen(trial)
            rows, k = 1 + trial % 3, trial % 4
            logits = torch.randn(rows, k + 1, vocab, generator=g) * (1 + trial % 5)
            target = torch.softmax(logits, -1)
            if trial % 6 == 5:  # a position of no allowed token (a grammar's end): NaN, as softmax gives it
                target[0, -1] = float("nan")
            sampled = trial % 2 == 0 and k > 0
            draft = torch.softmax(logits[:, :k] + torch.randn(rows, k, vocab, generator=g), -1) if sampled else None
            if sampled:
                drafts = torch.multinomial(draft.reshape(-1, vocab), 1, generator=g).view(rows, k)
            else:  # the target's argmax (often accepted) or any token (often rejected)
                drafts = logits[:, :k].argmax(-1) if trial % 3 == 0 else torch.randint(0, vocab, (rows, k), generator=g)
            depths = torch.tensor([min(k, 1 + (trial + r) % 4) for r in range(rows)])
            keys = torch.randint(-2 ** 62, 2 ** 62, (rows,), generator=g)
            fills = torch.tensor([[2 * trial + r, 2 * trial + 7 * r + 1 if (trial + r) % 5 else -1] for r in range(rows)])
            got = cpu_kernels.race(target, draft, drafts, depths, keys, fills)
            assert torch.equal(got, _race_reference(target, draft, drafts, depths, keys, fills)), trial
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("vocab", [8, 100])
def test_a_race_over_nans_picks_the_first_nan_as_torch_argmax_does(vocab):
    """A position where nothing is allowed (a grammar's end) has NaN probabilities; its race must
    still name a token of the vocabulary (the lanes past a short vocabulary once won it): the
    first NaN, as torch.argmax over the PyTorch path's ratios. Plain samples, greedy rows, and
    the bonus position after an accepted draft."""
    target = torch.softmax(torch.randn(3, 2, vocab, generator=_gen(0)), -1)
    target[:, 1] = float("nan")
    target[2, 1, :3] = 0.5  # NaN from index 3 on
    drafts = target[:, 0].argmax(-1, keepdim=True)  # p(x) >= 1 / vocab: some accepted
    keys = torch.tensor([5, 6, 7])
    for fills in ([[0, 1], [2, 3], [4, -1]], [[9, 10], [11, -1], [12, 13]]):
        args = (target, None, drafts, torch.tensor([1, 1, 0]), keys, torch.tensor(fills))
        got = cpu_kernels.race(*args)
        assert torch.equal(got, _race_reference(*args)) and bool((got[:, 2] < vocab).all())
    plain = target[:, 1:].contiguous()
    args = (plain, None, torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long), keys,
            torch.tensor([[-1, 1], [-1, -1], [-1, 2]]))
    got = cpu_kernels.race(*args)
    assert got[:, 1].tolist() == [0, 0, 3] and torch.equal(got, _race_reference(*args))


def test_a_rejected_draft_whose_residual_has_no_mass_races_over_p():
    """p = [0.25, 0.5], q = [0.5, 0.5]: draft 0 is accepted with probability 1/2, and its residual
    max(0, p - q) is empty, so the token is drawn from p (rejection_outcome's rule for a residual
    that rounding empties)."""
    target = torch.tensor([[[0.25, 0.5], [0.5, 0.5]]])
    draft = torch.tensor([[[0.5, 0.5]]])
    rejected = set()
    for fill in range(40):
        fills = torch.tensor([[fill, 1000 + fill]])
        args = (target, draft, torch.tensor([[0]]), torch.tensor([1]), torch.tensor([3]), fills)
        got = cpu_kernels.race(*args)
        assert torch.equal(got, _race_reference(*args))
        if int(got[0, 1]) == 0:
            rejected.add(int(got[0, 2]))
    assert rejected == {0, 1}  # both of p's tokens were drawn after a rejection


@pytest.mark.parametrize("vocab", [5, 100, 3000, 49152])
def test_the_nucleus_threshold_is_the_one_a_full_sort_finds(vocab, monkeypatch):
    """kernels/cpu.nucleus_threshold against sampling._nucleus_threshold's PyTorch path (top-k
    grown until its mass suffices, cumsum): peaked and flat rows (the flat ones need every
    token), ties across half the vocabulary, top_p from 0.05 to just below 1; rows with top_p
    >= 1 are unfiltered (their threshold unused)."""
    from mtplx.engine import sampling

    cases = []
    for trial in range(20):
        g = _gen(trial)
        logits = torch.randn(1 + trial % 3, 2, vocab, generator=g) * (0.3, 1, 3, 8, 20)[trial % 5]
        if trial % 4 == 0:
            logits[..., : vocab // 2] = logits[..., :1]  # ties
        top_p = torch.full((logits.shape[0], 1, 1), (0.05, 0.5, 0.9, 0.95, 0.99, 0.999999)[trial % 6])
        top_p[0] = (0.3, 0.95, 1.0)[trial % 3]
        cases.append((torch.softmax(logits, -1), top_p))
    got = [sampling._nucleus_threshold(probs, top_p) for probs, top_p in cases]
    monkeypatch.setattr(cpu_kernels, "sampling_usable", lambda *a: False)
    for (probs, top_p), threshold in zip(cases, got):
        want = sampling._nucleus_threshold(probs, top_p)
        filtered = (top_p < 1).expand_as(want)
        assert torch.equal(threshold[filtered], want[filtered])


def test_process_probs_keeps_what_the_pytorch_ops_keep(monkeypatch):
    """kernels/cpu.process_probs (process_logits on the CPU where no row asks for top-k or min-p)
    against process_logits through PyTorch's ops: greedy rows a one-hot of the first maximum (a
    NaN first, as torch.argmax), NaN rows and rows of -inf alike, a masked (-inf) token exactly 0
    and subnormal probabilities kept as PyTorch keeps them, top-p per row; the same tokens kept,
    the probabilities within float32 rounding (both within ~7e-6 of float64)."""
    from mtplx.engine.sampling import SamplerTensors, SamplingParams, process_logits

    cases = []
    for trial in range(40):
        g = _gen(trial)
        vocab, rows, positions = (7, 100, 4097, 49152)[trial % 4], 1 + trial % 3, 1 + trial % 2
        logits = torch.randn(rows, positions, vocab, generator=g) * (0.5, 2, 5, 10, 40)[trial % 5]
        if trial % 5 == 0:
            logits[0, 0, : vocab // 2] = float("-inf")  # a grammar's mask
        if trial % 7 == 0:
            logits[-1, -1, 3] = float("nan")
        if trial % 9 == 0:
            logits[0, -1] = float("-inf")  # nothing allowed
        params = [SamplingParams(temperature=(0.0, 0.3, 0.7, 1.0, 1.5)[(trial + r) % 5],
                                 top_p=(1.0, 0.95, 0.5, 0.9)[(trial + r) % 4]) for r in range(rows)]
        s = SamplerTensors(rows, torch.device("cpu"))
        s.write(params)
        flags = dict(top_k=False, min_p=False, top_p=any(p.top_p < 1 for p in params),
                     greedy=any(p.greedy for p in params))
        cases.append((logits, s, flags))
    got = [process_logits(logits, s, **flags) for logits, s, flags in cases]
    monkeypatch.setattr(cpu_kernels, "sampling_usable", lambda *a: False)
    for (logits, s, flags), probs in zip(cases, got):
        want = process_logits(logits, s, **flags)
        assert torch.equal(probs.isnan(), want.isnan())
        real = ~want.isnan()
        differ = real & ((probs > 0) != (want > 0))
        if differ.any():  # only a token at the nucleus's edge, within float32 rounding of top_p
            assert flags["top_p"] and differ.sum() <= 1, "kept tokens differ away from a nucleus edge"
            r, position, token = differ.nonzero()[0].tolist()
            p64 = torch.softmax(logits[r, position].double() / float(s.temperature[r]), -1)
            before = p64[p64 > p64[token]].sum()  # the mass of the tokens above it
            assert abs(float(before) - float(s.top_p[r])) < 1e-5, float(before)
        same = real & ~differ
        torch.testing.assert_close(probs[same], want[same], rtol=2e-5, atol=1e-30)
        masked = (logits == float("-inf")) & real  # 0 exactly (a greedy row of -inf: the one-hot at 0, as torch)
        assert torch.equal(probs[masked], want[masked])


# --- argmax and greedy acceptance ---------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1000, 49152])
def test_argmax_is_torchs_first_maximum(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-3, 4, (6, n), generator=g).float()  # many ties
    x[1] = torch.randn(n, generator=g)
    x[2] = -math.inf
    x[3, n // 2] = math.inf
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(-1))
    assert torch.equal(cpu_kernels.argmax(x.reshape(2, 3, n)), x.reshape(2, 3, n).argmax(-1))


@pytest.mark.parametrize("n", [1, 9, 40, 49152])
def test_argmax_of_a_row_with_nans_is_its_first_nan_as_torchs(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4, n, generator=g)
    x[0, n - 1] = math.nan
    x[1, 0] = math.nan
    x[2, n // 3] = math.nan
    x[2, n - 1] = math.nan
    x[3, n // 2] = math.inf  # no NaN: the maximum
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(-1))


def test_argmax_reads_a_non_contiguous_view_as_its_values():
    x = torch.randn(40, 64)[:, ::2]
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(-1))


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("capped", [False, True])
def test_greedy_verify_is_greedy_outcome_over_the_argmax(k, capped):
    from mtplx.engine.speculative import greedy_outcome

    g = torch.Generator().manual_seed(10 * k + capped)
    rows, vocab = 5, 50
    logits = torch.randn(rows, k + 1, vocab, generator=g)
    target = logits.argmax(-1)
    drafts = target[:, :k].clone()  # accepted ...
    for r in range(rows):  # ... up to a miss at a different place in each row
        if r < k:
            drafts[r, r] = (drafts[r, r] + 1) % vocab
    depths = torch.randint(0, k + 1, (rows, 1), generator=g) if capped else None
    assert torch.equal(cpu_kernels.greedy_verify(logits, drafts, depths), greedy_outcome(target, drafts, depths))


def test_a_build_lock_left_by_a_killed_process_is_removed_and_a_live_one_waited_for(tmp_path, caplog):
    """cpp_extension.load takes its build directory's lock even to find the module built, and
    waits without end while the file exists: a server stopped mid-start left one, and every
    mtplx process after it hung silently. An old lock is removed (with a warning); a fresh one
    is waited for until its holder lets it go."""
    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    with caplog.at_level("WARNING", logger="mtplx"):
        cpu_kernels.clear_stale_lock(lock)
    assert not lock.exists() and "removing" in caplog.text
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()  # its holder finishes
    t0 = time.perf_counter()
    cpu_kernels.clear_stale_lock(lock, poll_s=0.05)
    assert 0.25 < time.perf_counter() - t0 < 5 and not lock.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="building_in reads /proc")
def test_a_left_lock_goes_once_no_build_runs_where_no_other_mtplx_process_loads(tmp_path, caplog):
    """With the build guard held (no other mtplx process is loading the module), a lock past
    ``idle_s`` goes at once where no process works in its directory, and stays while one does
    (a killed holder's ninja still compiling): a server killed mid-build held the next start
    for the whole ``STALE_LOCK_S`` (10 minutes) before. Without the guard only the age counts.
    The directory is matched as a file: through a symlink too."""
    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 60, time.time() - 60))
    threading.Timer(0.3, lock.unlink).start()  # its holder, which this process cannot see, finishes
    t0 = time.perf_counter()
    cpu_kernels.clear_stale_lock(lock, poll_s=0.05, alone=False, idle_s=0)
    assert time.perf_counter() - t0 > 0.25  # not alone: only the age counts, and 60 s is under stale_s
    lock.touch()
    os.utime(lock, (time.time() - 60, time.time() - 60))
    assert cpu_kernels.building_in(tmp_path) is False
    alias = tmp_path.parent / (tmp_path.name + "_alias")
    alias.symlink_to(tmp_path)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"], cwd=tmp_path)
    try:
        deadline = time.time() + 5
        while not cpu_kernels.building_in(tmp_path) and time.time() < deadline:
            time.sleep(0.02)
        assert cpu_kernels.building_in(tmp_path) is True and cpu_kernels.building_in(alias) is True
        t0 = time.perf_counter()
        with caplog.at_level("WARNING", logger="mtplx"):
            cpu_kernels.clear_stale_lock(lock, poll_s=0.05, alone=True)
        waited = time.perf_counter() - t0
    finally:
        builder.kill()
        builder.wait()
    assert 0.3 < waited < 5 and not lock.exists() and "none building" in caplog.text
    lock.touch()  # a fresh lock: waited for, alone or not
    os.utime(lock, (time.time() - 5, time.time() - 5))
    threading.Timer(0.3, lock.unlink).start()
    t0 = time.perf_counter()
    cpu_kernels.clear_stale_lock(lock, poll_s=0.05, alone=True)
    assert 0.25 < time.perf_counter() - t0 < 5


@pytest.mark.skipif(cpu_kernels.fcntl is None, reason="build_guard needs fcntl (POSIX)")
def test_the_build_guard_lets_one_mtplx_process_in_at_a_time_and_its_death_lets_the_next_in(tmp_path):
    """build_guard is an flock on a file in the build directory: a second process waits while
    the first holds it, and gets it as soon as the first dies (the kernel drops its lock)."""
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, time
fd = os.open({str(tmp_path / cpu_kernels.GUARD_FILE)!r}, os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        threading.Timer(0.5, holder.kill).start()  # dies holding it
        t0 = time.perf_counter()
        with cpu_kernels.build_guard(tmp_path) as alone:
            waited = time.perf_counter() - t0
            assert alone
    finally:
        holder.kill()
        holder.wait()
    assert 0.4 < waited < 10
    with cpu_kernels.build_guard(None) as alone:
        assert not alone
