"""Triton kernels for the sampling work of a decode cycle (issue 15): the processed next-token
distributions of every row at once, and exact rejection sampling of a cycle's drafts.

On the H200 the PyTorch path (``engine.sampling.process_logits``, ``speculative.rejection_outcome``)
cost a sampled AR step 128 us and a depth-1 verify 212 us of GPU time, more than a fifth of the
step, in about 40 launches: a full radix sort of the vocabulary for top-p, single-row softmax,
argmax and cumsum reductions that use one multiprocessor each, and elementwise glue
(benchmarks/sampled_profile.py). Here:

- ``process``: one program per (row, position) makes the distribution of
  ``sampling.logits_to_probs`` (temperature, top-k, top-p, min-p; greedy rows a one-hot of the
  argmax) and, given exponential noise, draws a token from it by the exponential race. Top-k
  and top-p need a threshold, not a sort: one pass counts the candidates, the tokens whose
  weight is at least 2^-16 of the top token's, which hold every kept token when they are at
  least k (top-k) or hold top_p of the mass (top-p), else every token is a candidate, and a
  second copies them to a scratch row (each lane's from a slot that one scan of the lanes'
  counts gives: a scan per row, not one per block; about 170 candidates at T 0.7); a 16-way
  search over the candidates' float bits finds the exact threshold (the k-th largest scaled
  logit, ties kept; the least probability whose more probable tokens hold less than top_p of
  the mass). Each lane keeps its own sums and maxima across a pass (one block reduction per
  pass). H200 (benchmarks/sampled_profile.py): 17-19 us for a row without filters, 45-48 us
  with top-p (85 us with a scan per block; 127-212 us for the PyTorch path).
- ``argmax``: the first maximum of each row in one pass (greedy drafts and verifies).
- ``rejection``: one program per row accepts its drafts left to right (u < p(x) / q(x)), then
  draws the emitted token from the residual max(0, p - q) (or the bonus distribution) by the
  exponential race, in one pass over the vocabulary.

Both compute what the PyTorch functions compute, in float32; sums run in another order, so a
token whose inclusion is decided by the last bits of a sum (a top-p boundary met to the
rounding) can differ. The engine uses one path for the target and the draft distributions of
a cycle, so speculative decoding stays exact either way. tests/test_sampling_kernels.py checks
both kernels against the PyTorch functions under Triton's interpreter; benchmarks/
sampled_profile.py checks them on the GPU before timing.
"""

from __future__ import annotations

import torch

from mtplx import kernels  # its ENABLED switches these kernels off too
from mtplx.kernels import fused

try:
    import triton
    import triton.language as tl

    from mtplx.kernels.fused import pdl_start, pdl_wait
except ImportError:  # CPU-only installs use the PyTorch path
    triton = None

BLOCK = 4096   # tokens per step of a pass over a row (each lane keeps its own sums and maxima)
TILE = 256     # candidates per step of the threshold search (a row at T 0.7 has about 170)
WIDE = 1024    # ... where there are more than WIDE
NUM_WARPS = 16


def usable(logits: torch.Tensor) -> bool:
    """Whether ``process`` and ``rejection`` run for tensors like ``logits`` (CUDA, or any
    under Triton's interpreter, kernels enabled, outside autograd)."""
    return fused.usable(logits)


def available(device: torch.device) -> bool:
    """Whether forwards on ``device`` sample through these kernels (``usable`` outside autograd)."""
    return kernels.ENABLED and triton is not None and (device.type == "cuda" or fused._INTERPRET)


if triton is not None:

    @triton.jit
    def _skey(x):
        """float32 -> int32 whose signed order is the floats' order (for every non-NaN)."""
        b = x.to(tl.int32, bitcast=True)
        return b ^ ((b >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _first_max(values, at, V):
        """Per-lane maxima and where they were -> (the maximum, the least index holding it)."""
        m = tl.max(values, axis=0)
        return m, tl.min(tl.where(values == m, at, V), axis=0)

    @triton.jit
    def _scaled(logits, cols, V, best, temp):
        """A block of a row's scaled logits s = (x - max) / T (past the row: -inf) and weights exp(s)."""
        x = tl.load(logits + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        s = (x - best) / temp
        return s, tl.exp(s)

    @triton.jit
    def _row_argmax(row_ptr, V, BLOCK: tl.constexpr):
        """(max, first index of it) of a row of V values, each lane keeping its own maximum
        (one block reduction at the end, not one per step)."""
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_at = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            better = x > best  # strict: a lane keeps its first maximum
            best = tl.where(better, x, best)
            best_at = tl.where(better, cols, best_at)
        return _first_max(best, best_at, V)

    @triton.jit
    def _stats(src, n, mids, kth, top_k_mode: tl.constexpr, TILE: tl.constexpr):
        """For each of the 16 keys ``mids``: top_k_mode, how many of the n candidates have
        skey >= it; else the weight of the candidates with skey >= kth whose weight's bits exceed it."""
        acc = tl.zeros([16, TILE], dtype=tl.float32)
        for start in range(0, n, TILE):
            cols = start + tl.arange(0, TILE)
            s = tl.load(src + cols, mask=cols < n, other=float("-inf"))
            if top_k_mode:
                above = (_skey(s)[None, :] >= mids[:, None]) & (cols < n)[None, :]
                acc += tl.where(above, 1.0, 0.0)
            else:
                w = tl.where(_skey(s) >= kth, tl.exp(s), 0.0)
                acc += tl.where(w.to(tl.int32, bitcast=True)[None, :] > mids[:, None], w[None, :], 0.0)
        return tl.sum(acc, axis=1)

    @triton.jit
    def _search(src, n, lo, hi, target, kth, top_k_mode: tl.constexpr, TILE: tl.constexpr, WIDE: tl.constexpr):
        """16-way search over int32 keys for a threshold in (lo, hi]. ``src``: n candidate scaled
        logits. top_k_mode: the largest key K with count(skey >= K) >= target (lo satisfies it,
        hi does not; returns lo); else the least key t with mass(w > t) < target over the
        weights w = exp(s) of the candidates with skey >= kth (lo fails it, hi satisfies it;
        returns hi). Steps of TILE candidates, or of WIDE where there are more (every token a
        candidate: the small steps took 4x as long there on the H200)."""
        j = tl.arange(0, 16)
        while hi - lo > 1:
            mids = lo + (hi - lo) * (j + 1).to(tl.int64) // 16  # mids[15] == hi
            if n > WIDE:
                stat = _stats(src, n, mids, kth, top_k_mode, WIDE)
            else:
                stat = _stats(src, n, mids, kth, top_k_mode, TILE)
            if top_k_mode:
                ok = stat >= target
                lo = tl.max(tl.where(ok, mids, lo), axis=0)
                hi = tl.min(tl.where(ok, hi, mids), axis=0)
            else:
                ok = stat < target
                hi = tl.min(tl.where(ok, mids, hi), axis=0)
                lo = tl.max(tl.where(ok, lo, mids), axis=0)
        if top_k_mode:
            return lo
        return hi

    @triton.jit
    def _count(logits, V, best, temp, cut, BLOCK: tl.constexpr):
        """One pass: each lane's number of candidates (tokens with w = exp(s) >= cut among its
        columns lane, lane + BLOCK, ...), their weight and the weight of every token."""
        lanes = tl.arange(0, BLOCK)
        count = tl.zeros([BLOCK], dtype=tl.int32)
        mass = tl.zeros([BLOCK], dtype=tl.float32)
        z = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + lanes
            s, w = _scaled(logits, cols, V, best, temp)
            keep = (w >= cut) & (cols < V)
            count += keep.to(tl.int32)
            z += w
            mass += tl.where(keep, w, 0.0)
        return count, tl.sum(mass, axis=0), tl.sum(z, axis=0)

    @triton.jit
    def _place(logits, scratch, count, V, best, temp, cut, BLOCK: tl.constexpr):
        """The candidates' scaled logits to ``scratch``, lane after lane (each lane's in column
        order, from its slot given by one scan of the lane counts): a fixed order, and one scan
        per row instead of one per block."""
        lanes = tl.arange(0, BLOCK)
        slot = tl.cumsum(count, axis=0) - count
        for start in range(0, V, BLOCK):
            cols = start + lanes
            s, w = _scaled(logits, cols, V, best, temp)
            keep = (w >= cut) & (cols < V)
            tl.store(scratch + slot, s, mask=keep)
            slot += keep.to(tl.int32)

    @triton.jit
    def _token(ids_ptr, cols, V, HAS_IDS: tl.constexpr):
        """The vocabulary ids of columns of a pruned row (HAS_IDS), else the columns (int32 both)."""
        token = cols
        if HAS_IDS:
            token = tl.load(ids_ptr + cols, mask=cols < V, other=0).to(tl.int32)
        return token

    @triton.jit
    def _process_kernel(logits_ptr, out_ptr, greedy_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr,
                        race_ptr, pick_ptr, scratch_ptr, ids_ptr, V, out_row, positions, race_row, race_pos,
                        HAS_RACE: tl.constexpr, HAS_IDS: tl.constexpr, BLOCK: tl.constexpr,
                        TILE: tl.constexpr, WIDE: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0)
        setting = row // positions
        logits = logits_ptr + row.to(tl.int64) * V
        out = out_ptr + row.to(tl.int64) * out_row
        race = race_ptr + setting.to(tl.int64) * race_row + (row % positions) * race_pos
        # pass 1: the most probable token (the first of equal maxima, as torch.argmax)
        best, best_at = _row_argmax(logits, V, BLOCK)
        if tl.load(greedy_ptr + setting) != 0:
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                tl.store(out + _token(ids_ptr, cols, V, HAS_IDS), tl.where(cols == best_at, 1.0, 0.0),
                         mask=cols < V)
            if HAS_RACE:
                tl.store(pick_ptr + row, _token(ids_ptr, best_at, V, HAS_IDS).to(tl.int64))
            return
        temp = tl.load(temp_ptr + setting)
        top_k = tl.load(topk_ptr + setting).to(tl.int32)
        top_p = tl.load(topp_ptr + setting)
        min_p = tl.load(minp_ptr + setting)
        top_k = tl.where(top_k >= V, 0, top_k)
        kth = tl.full([], -2147483648, tl.int64)  # skey threshold of top-k (none: every key passes)
        t0 = tl.full([], -1, tl.int64)            # bit threshold of top-p on w's bits (none)
        if (top_k > 0) | (top_p < 1.0) | (min_p > 0.0):
            # passes 2 and 3: the weights w = exp((x - max) / T) (the top token's is 1) and the
            # candidates, the tokens with w >= CUT, which hold every kept token when they are
            # at least k (top-k), hold top_p of the mass (top-p) or min_p >= CUT (min-p alone),
            # else every token is a candidate; then the candidates copied to the scratch row
            scratch = scratch_ptr + row.to(tl.int64) * V
            cut = tl.full([], 1.52587890625e-05, tl.float32)  # CUT = 2^-16
            count, mass, z = _count(logits, V, best, temp, cut, BLOCK)
            n = tl.sum(count, axis=0)
            holds = tl.where(top_k > 0, n >= top_k, tl.where(top_p < 1.0, mass >= top_p * z, min_p >= cut))
            if holds == 0:  # every token: a lane's count is its number of columns
                cut = tl.full([], -1.0, tl.float32)
                count = (V - tl.arange(0, BLOCK) + BLOCK - 1) // BLOCK
                n = V
            _place(logits, scratch, count, V, best, temp, cut, BLOCK)
            mass = z
            if top_k > 0:
                kth = _search(scratch, n, tl.full([], -2147483648, tl.int64), tl.full([], 1, tl.int64),
                              top_k.to(tl.float32), kth, True, TILE, WIDE)
                kacc = tl.zeros([TILE], dtype=tl.float32)
                for start in range(0, n, TILE):
                    cols = start + tl.arange(0, TILE)
                    s = tl.load(scratch + cols, mask=cols < n, other=float("-inf"))
                    kacc += tl.where(_skey(s) >= kth, tl.exp(s), 0.0)
                mass = tl.sum(kacc, axis=0)
            if top_p < 1.0:
                t0 = _search(scratch, n, tl.full([], -1, tl.int64), tl.full([], 0x3F800000, tl.int64),
                             top_p * mass, kth, False, TILE, WIDE)
            # the kept tokens are candidates: their weight from the scratch row
            facc = tl.zeros([TILE], dtype=tl.float32)
            for start in range(0, n, TILE):
                cols = start + tl.arange(0, TILE)
                s = tl.load(scratch + cols, mask=cols < n, other=float("-inf"))
                w = tl.exp(s)
                kept = (_skey(s) >= kth) & (w.to(tl.int32, bitcast=True) >= t0) & (w >= min_p)
                facc += tl.where(kept, w, 0.0)
            zf = tl.sum(facc, axis=0)
        else:  # pass 2: the total weight
            zacc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                zacc += _scaled(logits, cols, V, best, temp)[1]
            zf = tl.sum(zacc, axis=0)
        # last pass: the distribution, and the race's winner
        win = tl.full([BLOCK], -1.0, tl.float32)
        win_at = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            s, w = _scaled(logits, cols, V, best, temp)
            kept = (_skey(s) >= kth) & (w.to(tl.int32, bitcast=True) >= t0) & (w >= min_p)
            p = tl.where(kept, w / zf, 0.0)
            token = _token(ids_ptr, cols, V, HAS_IDS)
            tl.store(out + token, p, mask=cols < V)
            if HAS_RACE:
                e = tl.load(race + token, mask=cols < V, other=1.0)
                score = tl.where(cols < V, p / e, -1.0)
                better = score > win
                win = tl.where(better, score, win)
                win_at = tl.where(better, cols, win_at)
        if HAS_RACE:
            _, at = _first_max(win, win_at, V)
            tl.store(pick_ptr + row, _token(ids_ptr, at, V, HAS_IDS).to(tl.int64))

    @triton.jit
    def _argmax_kernel(x_ptr, out_ptr, V, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0)
        _, at = _row_argmax(x_ptr + row.to(tl.int64) * V, V, BLOCK)
        tl.store(out_ptr + row, at.to(tl.int64))

    @triton.jit
    def _rejection_kernel(p_ptr, q_ptr, drafts_ptr, depths_ptr, u_ptr, race_ptr, out_ptr, V, k, u_stride,
                          HAS_Q: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0)
        r64 = row.to(tl.int64)
        depth = tl.load(depths_ptr + row).to(tl.int32)
        accepted = 0
        alive = 1
        for i in range(0, k):
            x = tl.load(drafts_ptr + row * k + i)
            tl.store(out_ptr + row * (k + 2) + i, x)
            p_x = tl.load(p_ptr + (r64 * (k + 1) + i) * V + x)
            if HAS_Q:
                q_x = tl.load(q_ptr + (r64 * k + i) * V + x)
                ratio = tl.minimum(p_x / tl.maximum(q_x, 1.1754943508222875e-38), 1.0)
            else:
                ratio = tl.minimum(p_x, 1.0)
            u = tl.load(u_ptr + row * u_stride + i)
            alive = alive & (u < ratio).to(tl.int32) & (i < depth).to(tl.int32)
            accepted += alive
        p_row = p_ptr + (r64 * (k + 1) + accepted) * V
        residual = accepted < depth
        at = tl.minimum(accepted, k - 1)  # the bonus position has no draft
        q_row = q_ptr + (r64 * k + at) * V
        x = tl.load(drafts_ptr + row * k + at, mask=k > 0, other=-1)
        best = tl.full([BLOCK], -1.0, tl.float32)
        best_at = tl.zeros([BLOCK], dtype=tl.int32)
        res_best = tl.full([BLOCK], -1.0, tl.float32)
        res_at = tl.zeros([BLOCK], dtype=tl.int32)
        mass = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            p = tl.load(p_row + cols, mask=inside, other=0.0)
            e = tl.load(race_ptr + r64 * V + cols, mask=inside, other=1.0)
            score = tl.where(inside, p / e, -1.0)
            better = score > best
            best = tl.where(better, score, best)
            best_at = tl.where(better, cols, best_at)
            if residual:
                if HAS_Q:
                    r = tl.maximum(p - tl.load(q_row + cols, mask=inside, other=0.0), 0.0)
                else:
                    r = tl.where(cols == x, 0.0, p)
                mass += r
                score = tl.where(inside, r / e, -1.0)
                better = score > res_best
                res_best = tl.where(better, score, res_best)
                res_at = tl.where(better, cols, res_at)
        _, token = _first_max(best, best_at, V)
        if residual:
            # a rejection leaves residual mass in exact arithmetic; should rounding leave none, p itself
            if tl.sum(mass, axis=0) > 0.0:
                _, token = _first_max(res_best, res_at, V)
        tl.store(out_ptr + row * (k + 2) + k, accepted.to(tl.int64))
        tl.store(out_ptr + row * (k + 2) + k + 1, token.to(tl.int64))


def process(logits: torch.Tensor, greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
            top_p: torch.Tensor, min_p: torch.Tensor, race: torch.Tensor | None = None,
            ids: torch.Tensor | None = None, vocab_size: int | None = None,
            block: int = BLOCK, num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sampling.process_logits`` in one launch: logits [rows, positions, V] (any float dtype)
    and per-row settings [rows, 1] (``SamplerTensors``) -> (float32 probs [rows, positions, V],
    picks [rows, positions] long or None). With ``race`` ([rows, positions, V] exponentials,
    the vocabulary contiguous) each (row, position) also draws its token, argmax(p / race).
    ids [V] ascending, with ``vocab_size``: the logits are a pruned vocabulary's, those tokens'
    ids in the whole one; the probs come back over the whole vocabulary [rows, positions,
    vocab_size] (zero elsewhere), the race is read at the ids (race [..., vocab_size]) and the
    picks are ids: a pruned draft's q and token in one launch, no gather or scatter around it."""
    rows, positions, vocab = logits.shape
    logits = logits.contiguous()
    if race is not None and race.stride(2) != 1:
        race = race.contiguous()
    width = vocab if ids is None else vocab_size
    alloc = torch.empty if ids is None else torch.zeros
    out = alloc(rows, positions, width, dtype=torch.float32, device=logits.device)
    scratch = torch.empty(rows * positions, vocab, dtype=torch.float32, device=logits.device)
    picks = torch.empty(rows, positions, dtype=torch.long, device=logits.device) if race is not None else out
    _process_kernel[(rows * positions,)](
        logits, out, greedy, temperature, top_k, top_p,
        min_p, race if race is not None else out, picks, scratch, ids if ids is not None else picks, vocab, width,
        positions, race.stride(0) if race is not None else 0, race.stride(1) if race is not None else 0,
        HAS_RACE=race is not None, HAS_IDS=ids is not None, BLOCK=block, TILE=TILE, WIDE=WIDE,
        num_warps=num_warps, **fused.launch_options(logits.device))
    return out, (picks if race is not None else None)


def argmax(x: torch.Tensor, block: int = BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """``x.argmax(-1)`` (the first maximum) with one program per row: torch's reduction of one
    row of a vocabulary uses one block and took 12.5 us on the H200, this one pass about 3."""
    lead, vocab = x.shape[:-1], x.shape[-1]
    x = x.contiguous()
    out = torch.empty(lead, dtype=torch.long, device=x.device)
    _argmax_kernel[(max(out.numel(), 1),)](x, out, vocab, BLOCK=block, num_warps=num_warps,
                                           **fused.launch_options(x.device))
    return out


def rejection(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, drafts: torch.Tensor,
              depths: torch.Tensor, uniforms: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """``speculative.rejection_outcome`` in one launch (same arguments; depths [rows, 1])."""
    rows, k1, vocab = target_probs.shape
    k = k1 - 1
    out = torch.empty(rows, k + 2, dtype=torch.long, device=target_probs.device)
    drafts = drafts.contiguous()
    q = draft_probs.contiguous() if draft_probs is not None else target_probs
    _rejection_kernel[(rows,)](
        target_probs.contiguous(), q, drafts if k else out, depths.contiguous(), uniforms, race.contiguous(), out,
        vocab, k, uniforms.stride(0), HAS_Q=draft_probs is not None, BLOCK=BLOCK, num_warps=NUM_WARPS,
        **fused.launch_options(out.device))
    return out
