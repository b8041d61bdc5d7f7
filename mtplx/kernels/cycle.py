"""Triton kernels for a chained cycle's integer bookkeeping (issues 15, 16).

A chained cycle ends by judging its drafts and writing the next cycle's inputs on the device
(``engine/speculative.greedy_outcome``, ``engine/runner.advance_cycle``). In PyTorch ops that
is about 60 launches of a few integers each in a depth-1 cycle (about 18 in an AR step): on the
H200 a cycle of the default model is a chain of ~300 short kernels in which each launch costs
its place, and these ones also break programmatic dependent launch's overlap (session 22's
profile: a greedy depth-1 cycle spent 146 us of its ~745 in PyTorch's small kernels, an AR step
52 of ~600). Here each is one launch of one program per row:

- ``greedy_outcome``: the packed outcome (drafts, accepted count, next token) from the verify's
  argmax tokens and the drafts, acceptance capped at each row's depth;
- ``advance_cycle``: the next cycle's integer inputs from a packed outcome (any acceptance
  rule's), through the rows' block tables, padding rows left as they are.

Both compute exactly what the PyTorch versions compute (integers: no rounding); those stay the
reference and the path everywhere else (tests/test_cycle_kernels.py checks one against the
other on the GPU and under Triton's interpreter, at depths 0-3 with padding rows and rows of
smaller depth). With them and ``fused.rope_cos_sin``, greedy MTP (depth "auto") on the H200 went
from 1.53x to 1.68x AR (docs/performance.md, session 22).
"""

from __future__ import annotations

import torch

from mtplx.kernels import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference path
    triton = None


def usable(t: torch.Tensor) -> bool:
    """Where these kernels run: ``fused.usable``'s devices, long tensors."""
    return fused.usable(t) and t.dtype == torch.long


if triton is not None:
    from mtplx.kernels.fused import pdl_start, pdl_wait

    @triton.jit
    def _greedy_outcome_kernel(targets_ptr, drafts_ptr, depths_ptr, packed_ptr, st, sd, sdep, sp,
                               K: tl.constexpr, K_PAD: tl.constexpr, HAS_DEPTHS: tl.constexpr,
                               PDL: tl.constexpr):
        pdl_start(PDL)
        pdl_wait(PDL)
        r = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, K_PAD)
        drafts = tl.load(drafts_ptr + r * sd + i, mask=i < K, other=0)
        targets = tl.load(targets_ptr + r * st + i, mask=i < K, other=0)
        miss = (targets != drafts) | (i >= K)
        accepted = tl.min(tl.where(miss, i, K), axis=0).to(tl.int64)  # leading matches
        if HAS_DEPTHS:
            accepted = tl.minimum(accepted, tl.load(depths_ptr + r * sdep))
        nxt = tl.load(targets_ptr + r * st + accepted)
        tl.store(packed_ptr + r * sp + i, drafts, mask=i < K)
        tl.store(packed_ptr + r * sp + K, accepted)
        tl.store(packed_ptr + r * sp + K + 1, nxt)

    @triton.jit
    def _slot_of(tables_ptr, r, pos, block_size, TW: tl.constexpr):
        block = tl.load(tables_ptr + r * TW + tl.minimum(pos // block_size, TW - 1))
        return block * block_size + pos % block_size

    @triton.jit
    def _advance_kernel(packed_ptr, tables_ptr, ids_ptr, cpos_ptr, cslots_ptr, last_ptr, dpos_ptr, dslots_ptr,
                        primary_ptr, vpos_ptr, vslots_ptr, depths_ptr, sp, block_size, scratch_slot,
                        D: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr, J_PAD: tl.constexpr,
                        TW: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        pdl_wait(PDL)
        r = tl.program_id(0).to(tl.int64)
        if tl.load(vslots_ptr + r * W) != scratch_slot:  # a bucket's padding rows keep their inputs
            accepted = tl.load(packed_ptr + r * sp + D)
            nxt = tl.load(packed_ptr + r * sp + D + 1)
            tl.store(primary_ptr + r, nxt)
            if D == 0:  # an AR step: the next token goes in at the next position
                pos = tl.load(vpos_ptr + r) + 1
                tl.store(vpos_ptr + r, pos)
                tl.store(vslots_ptr + r, _slot_of(tables_ptr, r, pos, block_size, TW))
            else:
                own = tl.load(depths_ptr + r)
                start = tl.load(vpos_ptr + r * W) + 1  # this cycle's accepted tokens: the catch-up
                trunk = start + accepted               # the next verify's first position
                i = tl.arange(0, W_PAD)
                w = i < W
                drafts = tl.load(packed_ptr + r * sp + i, mask=i < accepted, other=0)
                cpos = start + tl.minimum(i, accepted)
                tl.store(ids_ptr + r * W + i, tl.where(i < accepted, drafts, nxt), mask=w)
                tl.store(cpos_ptr + r * W + i, cpos, mask=w)
                cslots = tl.where(i <= accepted, _slot_of(tables_ptr, r, cpos, block_size, TW), scratch_slot)
                tl.store(cslots_ptr + r * W + i, cslots, mask=w)
                tl.store(last_ptr + r, accepted)
                if D > 1:
                    j = tl.arange(0, J_PAD)
                    real = j + 1 < own
                    dpos = tl.where(real, trunk + 1 + j, trunk)
                    dslots = tl.where(real, _slot_of(tables_ptr, r, dpos, block_size, TW), scratch_slot)
                    tl.store(dpos_ptr + r * (D - 1) + j, dpos, mask=j < D - 1)
                    tl.store(dslots_ptr + r * (D - 1) + j, dslots, mask=j < D - 1)
                vpos = trunk + tl.minimum(i, own)
                vslots = tl.where(i <= own, _slot_of(tables_ptr, r, vpos, block_size, TW), scratch_slot)
                tl.store(vpos_ptr + r * W + i, vpos, mask=w)
                tl.store(vslots_ptr + r * W + i, vslots, mask=w)


def greedy_outcome(targets: torch.Tensor, drafts: torch.Tensor, depths: torch.Tensor | None) -> torch.Tensor:
    """``speculative.greedy_outcome`` in one launch: targets [R, k+1], drafts [R, k], depths
    [R, 1] or None, all long -> packed [R, k + 2]."""
    rows, k = drafts.shape
    targets, drafts = targets.contiguous(), drafts.contiguous()  # (no copy where they are already)
    packed = torch.empty(rows, k + 2, dtype=torch.long, device=targets.device)
    _greedy_outcome_kernel[(rows,)](
        targets, drafts if k else targets, depths if depths is not None else targets, packed, targets.stride(0),
        drafts.stride(0) if k else 0, depths.stride(0) if depths is not None else 0, packed.stride(0),
        K=k, K_PAD=max(2, triton.next_power_of_2(k + 1)), HAS_DEPTHS=depths is not None, num_warps=1,
        **fused.launch_options(targets.device))
    return packed


def advance_cycle(fields: dict[str, torch.Tensor], tables: torch.Tensor, packed: torch.Tensor,
                  block_size: int, scratch_slot: int) -> None:
    """``runner.advance_cycle`` in one launch (the same contract): the fields are [R, n] long
    views, each contiguous by rows (``CycleBuffers``), the tables [R, width] contiguous."""
    depth = packed.shape[1] - 2
    for name, t in fields.items():
        if t.numel() and not (t.stride(-1) == 1 and t.stride(0) == t.shape[1]):
            raise ValueError(f"advance_cycle: field {name} is not contiguous by rows")
    if not tables.is_contiguous():
        raise ValueError("advance_cycle: the block tables are not contiguous")

    def field(name: str) -> torch.Tensor:
        # a field of no columns (the catch-up at depth 0, the further drafts at depth 1) is
        # never read or written by the kernel: any long tensor stands in for its pointer
        return fields[name] if fields[name].numel() else packed

    _advance_kernel[(packed.shape[0],)](
        packed, tables, field("catch_up_ids"), field("catch_up_pos"), field("catch_up_slots"), field("last"),
        field("draft_pos"), field("draft_slots"), fields["primary"], fields["verify_pos"], fields["verify_slots"],
        field("depths"), packed.stride(0), block_size, scratch_slot,
        D=depth, W=depth + 1, W_PAD=triton.next_power_of_2(depth + 1),
        J_PAD=triton.next_power_of_2(max(depth - 1, 1)), TW=tables.shape[1], num_warps=1,
        **fused.launch_options(packed.device))
