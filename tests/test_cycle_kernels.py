"""The chained cycle's bookkeeping kernels (mtplx/kernels/cycle.py) and the RoPE table kernel
(``fused.rope_cos_sin``) against the PyTorch code they replace (``speculative.greedy_outcome``,
``runner.advance_cycle``, ``RotaryEmbedding.bind``). On the CPU they run under Triton's
interpreter (tests/test_kernels_interpreted.py starts them so in CI):

    TRITON_INTERPRET=1 python -m pytest -q tests/test_cycle_kernels.py
"""

from __future__ import annotations

import os

import pytest
import torch

from mtplx import kernels
from mtplx.engine.runner import CYCLE_FIELDS, advance_cycle
from mtplx.engine.speculative import greedy_outcome
from mtplx.kernels import cycle, fused
from mtplx.models.layers import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    not fused.available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK, SCRATCH_BLOCK = 4, 0
SCRATCH_SLOT = SCRATCH_BLOCK * BLOCK


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():  # the kernels run outside autograd, as the engine's forwards do
        yield


def reference(fn, *args):
    """``fn`` through the PyTorch ops (the kernels switched off)."""
    kernels.ENABLED = False
    try:
        return fn(*args)
    finally:
        kernels.ENABLED = True


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("with_depths", [True, False])
def test_greedy_outcome_equals_the_pytorch_ops(depth, with_depths):
    g = torch.Generator().manual_seed(depth)
    rows = 64
    drafts = torch.randint(0, 3, (rows, depth), generator=g)  # few values: runs of matches of every length
    targets = torch.randint(0, 3, (rows, depth + 1), generator=g)
    depths = torch.randint(0, depth + 1, (rows, 1), generator=g) if with_depths else None
    drafts, targets = drafts.to(DEVICE), targets.to(DEVICE)
    depths = depths.to(DEVICE) if depths is not None else None
    assert cycle.usable(targets)
    got = greedy_outcome(targets, drafts, depths)
    want = reference(greedy_outcome, targets, drafts, depths)
    assert torch.equal(got, want)
    if depth:  # every accepted count occurs
        assert set(want[:, depth].tolist()) == set(range(depth + 1)) or with_depths


def cycle_fields(rows: int, depth: int, table_width: int, g: torch.Generator):
    """Fields laid out as ``CycleBuffers`` lays them (views of one long tensor), with a
    packed outcome: rows of every own depth (1..depth), the last one a bucket's padding row."""
    W = depth + 1
    C = W if depth else 0
    widths = {"catch_up_ids": C, "catch_up_pos": C, "catch_up_slots": C, "last": 1,
              "draft_pos": max(depth - 1, 0), "draft_slots": max(depth - 1, 0), "primary": 1,
              "verify_pos": W, "verify_slots": W, "depths": 1}
    ints = torch.randint(1, 1000, (rows * sum(widths.values()),), generator=g)
    fields, at = {}, 0
    for name in CYCLE_FIELDS:
        fields[name] = ints[at: at + rows * widths[name]].view(rows, widths[name])
        at += rows * widths[name]
    own = torch.randint(1, max(depth, 1) + 1, (rows, 1), generator=g)  # each row's own depth
    if not depth:
        own.zero_()
    fields["depths"].copy_(own)
    start = torch.randint(0, BLOCK * table_width, (rows, 1), generator=g)  # some past the table: its last column
    fields["verify_pos"].copy_(start + torch.arange(W))
    fields["verify_slots"].copy_(torch.randint(BLOCK, 10_000, (rows, W), generator=g))
    fields["verify_slots"][-1, 0] = SCRATCH_SLOT  # a padding row
    tables = torch.randint(1, 500, (rows, table_width), generator=g)
    accepted = (torch.rand(rows, 1, generator=g) * (own + 1)).long().clamp(max=own)
    packed = torch.cat([torch.randint(0, 49_152, (rows, depth), generator=g), accepted,
                        torch.randint(0, 49_152, (rows, 1), generator=g)], dim=1)
    return ints, fields, tables, packed


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_advance_cycle_equals_the_pytorch_ops(depth):
    g = torch.Generator().manual_seed(10 + depth)
    ints, fields, tables, packed = cycle_fields(48, depth, table_width=6, g=g)
    ints, tables, packed = ints.to(DEVICE), tables.to(DEVICE), packed.to(DEVICE)
    results = []
    for use_kernel in (True, False):
        buf = ints.clone()
        views, at = {}, 0
        for name in CYCLE_FIELDS:
            views[name] = buf[at: at + fields[name].numel()].view(fields[name].shape)
            at += fields[name].numel()
        args = (views, tables, packed, BLOCK, SCRATCH_SLOT)
        if use_kernel:
            assert cycle.usable(packed)
            advance_cycle(*args)
        else:
            reference(advance_cycle, *args)
        results.append(buf)
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], ints)  # it wrote something
    for name in CYCLE_FIELDS:  # the padding row (the last) kept every input
        at = sum(fields[n].numel() for n in CYCLE_FIELDS[: CYCLE_FIELDS.index(name)])
        w = fields[name].shape[1]
        assert torch.equal(results[0][at + 47 * w: at + 48 * w], ints[at + 47 * w: at + 48 * w]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_cos_sin_equals_bind(dtype):
    from mtplx.models.config import ModelConfig

    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=192, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=96,
                         max_position_embeddings=40_000, rope_theta=100_000.0)
    rotary = RotaryEmbedding(config).to(DEVICE)
    positions = torch.tensor([[0, 1, 2, 17], [4095, 4096, 32_767, 39_999]], device=DEVICE)
    got = rotary.bind(positions, dtype)
    want = reference(rotary.bind, positions, dtype)
    assert got.cos.shape == want.cos.shape == (2, 4, 1, 96) and got.cos.dtype == dtype
    if DEVICE == "cuda":  # libdevice's cos / sin are CUDA's: the same values
        assert torch.equal(got.cos, want.cos) and torch.equal(got.sin, want.sin)
    else:  # numpy's under the interpreter: within a rounding of the dtype
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got.cos, want.cos, atol=tol, rtol=0)
        torch.testing.assert_close(got.sin, want.sin, atol=tol, rtol=0)
