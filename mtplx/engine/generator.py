"""The decode step every scheduler mode calls: prefill, then one cycle per step.

A cycle, per row (REFERENCE.md section 3; ``Generator._cycle`` reads top to bottom):
  1. draft: the head catches up on committed tokens (its first output is draft 1), then
     drafts recursively from its own hidden state and its own drafted token;
  2. verify: [primary] + drafts in ONE trunk forward;
  3. accept: greedy argmax match, or exact rejection sampling (speculative.py);
  4. commit: append accepted drafts + the correction/bonus token; the KV length is simply the
     number of tokens whose KV is valid, so a partial acceptance costs no copy (hybrid models'
     recurrent state is kept at the accepted position by ``runner.commit_state``).
An AR step is a cycle of depth 0: no drafts, the verify is the one-token forward, the next
token is sampled from it. Every path ends in one commit (``_commit``) of a ``CycleOutcome``.

Three ways a cycle runs, one predicate each (``_cycle``):
- on the host: drafts come to the host depth by depth (sampled drafts, penalties, hybrid
  models' recurrent state), acceptance row by row;
- on the device: argmax drafts, the verify and greedy acceptance in one
  ``runner.greedy_cycle`` (one CUDA graph where captured); sampled rows' rejection sampling
  is queued behind it; one transfer brings every row's outcome;
- chained (where the engine chains; sampled rows accept on the device too): as on the device, but the next cycle is
  launched before the last one is read (``chain.py``).
Functions take lists of sequences (rows) so batching modes reuse them unchanged.

Faults: a row's own work in a step that raises does not stop the other rows: they complete
the step, and ``StepResult.failed`` names the failed rows (the caller fails those requests and
frees their blocks). An exception in a batched forward is not attributable to a row and
propagates as is (the caller fails every row of the step). ``faults.py`` injects both.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from mtplx.engine import constraints, logprobs
from mtplx.engine.adaptive_depth import batch_depth
from mtplx.engine.chain import CycleChain
from mtplx.engine.cuda_graphs import PREFILL_GRAPH_TOKENS
from mtplx.engine.faults import FaultHook, FaultyRunner
from mtplx.engine.kv_allocator import KVAllocator
from mtplx.engine.runner import CycleLaunch, ModelRunner, draft_step, torch_argmax
from mtplx.engine.sampling import SamplerBatch, apply_penalties
from mtplx.engine.sequence import Sequence
from mtplx.engine.speculative import CycleOutcome, greedy_outcome, sampled_outcome
from mtplx.engine.stats import DecodeStats


@dataclass
class StepResult:
    """What one step did. advanced: the rows whose tokens it committed, in commit order (rows
    of a chained cycle still in flight from an earlier step come first: the step committed it
    before its own cycle); failed: seq_id -> the exception of each row whose own work failed
    (the other rows completed the step)."""

    advanced: list[Sequence] = field(default_factory=list)
    failed: dict[int, BaseException] = field(default_factory=dict)


class Generator:
    def __init__(self, runner: ModelRunner, kv: KVAllocator, eos_token_ids: set[int], chain: bool = False):
        self.runner = runner
        self.kv = kv
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = runner.model.config.vocab_size
        self.chain = CycleChain(runner, kv, chain)
        self.fault_hook: FaultHook | None = None  # per-row fault points; None (no cost) unless injecting
        self.live: dict[int, Sequence] = {}  # admitted and not yet released, by seq_id
        self._sampler: tuple[tuple[int, ...], SamplerBatch] | None = None  # the last batch's, by seq_ids
        # observer(event, seq): "commit" after a row's tokens are appended, "chain_start" when a
        # chain starts over a row, "chain_join" when a row joins a running chain; for benchmarks
        # and tests (instrumentation, not a new path)
        self.observers: list[Callable[[str, Sequence], None]] = []
        self._mates: dict[int, list[Sequence]] = {}  # seq_id -> the rows of its last committed cycle
        self._beside = "auto"  # (``beside``; its second stream is captured with the engine's graphs)

    def inject_faults(self, hook: FaultHook | None) -> None:
        """Call ``hook(point, seq)`` at every fault point (faults.py); None stops. Forwards
        fault through a wrapped runner; the decode path is unchanged (chaining included)."""
        base = self.runner.runner if isinstance(self.runner, FaultyRunner) else self.runner
        self.runner = FaultyRunner(base, hook) if hook is not None else base
        self.chain.runner = self.runner
        self.fault_hook = hook

    # -- lifecycle ----------------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        """Take blocks for the prompt, reusing cached prefix blocks. If it raises, the
        sequence holds nothing (OutOfBlocks: nothing was taken; later errors release)."""
        seq.stats = DecodeStats(depth=seq.request_depth, adaptive=seq.depth_plan is not None,
                                prompt_tokens=len(seq.prompt_ids))
        seq.t_start = time.perf_counter()
        # AR sequences on a model with a head leave the head's KV entries unwritten: their
        # blocks go to a separate prefix cache, so an MTP request never drafts from them
        namespace = "trunk_only" if self.runner.head is not None and seq.mode != "mtp" else None
        cached = self.kv.admit(seq, logprobs.cache_namespace(seq, namespace))
        self.live[seq.seq_id] = seq
        try:
            self._set_up(seq, cached)
        except BaseException:
            self.release(seq)
            raise

    def _set_up(self, seq: Sequence, cached: int) -> None:
        """The rest of admission, once the prompt's blocks are taken (``cached`` of its tokens hit)."""
        self._stage("admit", seq)
        seq.trunk_len = seq.cached_prompt_tokens = seq.stats.cached_prompt_tokens = cached
        seq.head_len = max(cached, 1)
        if cached and self.runner.head is not None:
            # the head's first pair needs the trunk hidden at the last cached position
            table = self.kv.table(seq)
            seq.hidden_backlog = self.runner.cache.last_hidden[table[cached // self.runner.block_size - 1]][None]
        if seq.params.presence_penalty or seq.params.frequency_penalty:
            seq.counts = torch.zeros(self.vocab_size, dtype=torch.long, device=self.runner.device)

    def release(self, seq: Sequence) -> None:
        """Return the sequence's blocks (committed full blocks stay in the prefix cache) and its
        state slot; a no-op for a sequence not admitted (or already released). A cycle in flight
        over the row still writes to them, ahead of any later use on its stream; a prompt fed
        beside the chain (``prefill``, wait=False) is waited for first."""
        if self.live.pop(seq.seq_id, None) is None:
            return
        done = seq.pending_prefill[0] if seq.pending_prefill is not None else None
        seq.pending_prefill = None
        try:
            if done is not None:  # its forwards still write its blocks, beside the chain
                done.synchronize()
        finally:
            self.chain.forget(seq)
            self.kv.release(seq)
            self._mates.pop(seq.seq_id, None)

    def release_all(self) -> None:
        """Release every admitted sequence and forget the cycle in flight (after a crash:
        nothing the device still computes is read)."""
        self.chain.clear()
        self._mates.clear()
        for seq in list(self.live.values()):
            self.release(seq)

    def prefill_rows(self, seqs: list[Sequence]) -> None:
        """Each row's whole remaining prompt in one trunk forward (rows padded to the longest),
        then every row's first token in one sampling call: ``prefill`` for many new rows at once
        (forge's corpus decoding admits rows as others finish; one forward each made the GPU's
        host the bottleneck). A row's first token is drawn from its own noise stream, as
        ``prefill`` draws it; on the GPU the padded batch's products may round differently from
        a one-row forward's."""
        if any(s.trunk_len >= len(s.prompt_ids) for s in seqs):
            raise ValueError("prefill_rows takes rows with prompt tokens left to feed")
        if self.runner.states is not None:  # a hybrid's recurrent state: one row at a time
            for seq in seqs:
                self.prefill(seq)
            return
        self._feed_prompts(seqs, [len(s.prompt_ids) for s in seqs])

    def prefill(self, seq: Sequence, chunk: int | None = None, wait: bool = True) -> bool:
        """Feed up to ``chunk`` more prompt tokens; after the last one, sample the first token.
        Returns True when the prompt is done. A feed that crosses the prompt's cache edge
        (``cache_edge``) is two forwards, split there.

        wait=False, where a chained cycle is in flight and the rest of the prompt is fed at once:
        the forwards and the first token's draw run beside the chain (``side_prefill``; on CUDA
        on a second stream, after the cycle in flight), False is returned, and a later call
        takes the token once they are done (with ``wait``, waiting for them). The caller steps
        the other rows meanwhile and the row joins the chain once prefilled, so the chain
        neither stops for the prompt's forwards nor waits on them. The token is drawn as the
        waiting path draws it: the same forwards, kernels and noise."""
        if seq.pending_prefill is not None:
            return self._take_pending(seq, wait)
        end = len(seq.prompt_ids) if chunk is None else min(len(seq.prompt_ids), seq.trunk_len + chunk)
        if not wait and end == len(seq.prompt_ids) and self._beside_chain(seq):
            self._prefill_beside(seq)
            return False
        self._feed_to_edge(seq, end)
        self._feed_prompts([seq], [end])
        return end == len(seq.prompt_ids)

    def _feed_to_edge(self, seq: Sequence, end: int) -> None:
        """Where a feed up to ``end`` crosses the prompt's cache edge, its tokens below the edge
        first, in a forward of their own (``cache_edge``)."""
        edge = self.cache_edge(seq)
        if seq.trunk_len < edge < end:
            self._feed_prompts([seq], [edge])

    def _beside_chain(self, seq: Sequence) -> bool:
        """Whether the prompt's forwards may run beside the chain: a chained cycle is in flight,
        the runner feeds prompts beside it (``side_prefill``: a second CUDA stream, or in order
        where forced), the row can join the chain (``_device_rows``: no penalties, constraints
        or logprobs, whose host work would block on the side stream and which drain the chain
        anyway), it needs nothing of the forwards but their state (no prompt logprobs, no fault
        injection), and its prompt runs through graphs (up to ``PREFILL_GRAPH_TOKENS`` left: a
        longer one's eager forward copies its metadata to the device synchronously)."""
        return (self.chain.flight is not None and self.side_prefill is not None and self.fault_hook is None
                and seq.prompt_logprobs is None and self._device_rows([seq])
                and len(seq.prompt_ids) - seq.trunk_len <= PREFILL_GRAPH_TOKENS)

    @property
    def beside(self) -> str:
        """Where new rows' prompts run while a chain is in flight (``prefill``, wait=False):
        "auto", the default (beside it, on the CUDA graphs' second stream, captured when this is
        set or with the engine's graphs: ``GraphCache.enable_side``; where there are no graphs,
        the CPU included, as "off"), "inline" (in order: tests of the rows' waiting and joining
        on the CPU) or "off" (the caller waits for them). Session 52, H100, 8 closed-loop
        streams at T 0.7: a join step 1,285 us against 3,719 with "off", mtp_batch over ar_batch
        1.163x against 1.084x (docs/performance.md)."""
        return self._beside

    @beside.setter
    def beside(self, where: str) -> None:
        """(Set while the engine is idle: "auto" captures graphs on the calling thread.)"""
        if where not in ("auto", "inline", "off"):
            raise ValueError(f"beside: auto, inline or off, not {where!r}")
        graphs = getattr(self.runner, "graphs", None)
        if where == "auto" and graphs is not None:
            graphs.enable_side()
        self._beside = where

    @property
    def side_prefill(self):
        """Where prompts are fed beside a running chain (``beside``): the CUDA graphs' second
        stream ("auto"), "inline", or None: they are not ("off", or "auto" without CUDA graphs)."""
        if self._beside == "auto":
            return getattr(getattr(self.runner, "graphs", None), "side", None)
        return "inline" if self._beside == "inline" else None

    def _prefill_beside(self, seq: Sequence) -> None:
        """The rest of the prompt's forwards, then its first token's draw, queued on the side
        stream after the work queued on the current one (the cycle in flight, whose rows that
        left may still write blocks now this row's); for an MTP row beside an MTP chain, the
        head's pre-feed of the prompt's pairs too (all but the chain's catch-up, as
        ``_join_chain`` feeds them at the chain's depth: the same forwards where the row joins at
        that depth; otherwise what is left is fed at the join or start, and the head, being
        causal, drafts the same up to rounding). The token is copied to pinned memory and
        an event marks the end (``pending_prefill``). The last hidden state and the head's
        backlog are taken out of the graphs' output buffers there, which the next prompt's
        replay overwrites. Inline (the CPU), the same in order. If queuing fails, the side
        stream is waited for before the error goes on, so the row's blocks can be freed."""
        side = self.side_prefill
        inline = isinstance(side, str)
        if not inline:
            side.wait_stream(torch.cuda.current_stream(side.device))
        try:
            with contextlib.nullcontext() if inline else torch.cuda.stream(side):
                end = len(seq.prompt_ids)
                self._feed_to_edge(seq, end)
                rows, hidden = self._forward_prompts([seq], [end])  # (the backlog is its own copy: ``_cat``)
                saved = self._sampler  # (the steps' sampler stays theirs)
                try:
                    token = self._sample_rows([seq], self.runner.logits(hidden[0, len(rows[0]) - 1][None]),
                                              to_host=False)
                finally:
                    self._sampler = saved
                flight = self.chain.flight
                if flight.depth and seq.mode == "mtp":  # an MTP row beside an MTP chain: the head's
                    self._head_pre_feed([seq], flight.depth + 1)  # pre-feed here, not in the join's step
                # (an AR row keeps no backlog of its own: a prefix hit's one state is not its pairs)
                if inline:
                    seq.pending_prefill = (None, token)
                    return
                host = torch.empty_like(token, device="cpu", pin_memory=True)
                host.copy_(token, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
        except BaseException:
            if not inline:
                with contextlib.suppress(Exception):  # (the error raised is the first one)
                    side.synchronize()
            raise
        seq.pending_prefill = (done, host)

    def _take_pending(self, seq: Sequence, wait: bool) -> bool:
        """A prompt fed beside the chain: its first token once its forwards and draw are done
        (with ``wait``, waiting for that event alone); False while they are not."""
        done, token = seq.pending_prefill
        if done is not None:
            if not wait and not done.query():
                return False
            done.synchronize()
            if seq.hidden_backlog is not None:  # (made on the side stream: the steps read it on theirs)
                seq.hidden_backlog.record_stream(torch.cuda.current_stream(seq.hidden_backlog.device))
        seq.pending_prefill = None
        self._take_first_tokens([seq], token.tolist())
        return True

    def cache_edge(self, seq: Sequence) -> int:
        """The end of the prompt's full blocks: what the prefix cache serves the same prompt
        again. A prompt's tokens past it are computed after it in both cases: its forward and
        the head's catch-up split there when the prompt is new, as they start there on a hit. A
        product's rounding can depend on how many rows it multiplies, so without the split the
        tail's KV entries, the first token's logits and so a seeded sampled request's tokens
        differed between a new prompt and a repeated one (session 42: the same seeded T 0.7
        requests, every one of 12 on an H100 in bf16, one of 6 on the CPU). 0 where nothing is
        cached (hybrid models)."""
        return self.runner.blocks.longest_hit(len(seq.prompt_ids))

    def _feed_prompts(self, seqs: list[Sequence], ends: list[int]) -> None:
        """Row r's prompt tokens from its trunk_len to ends[r] in one trunk forward (rows padded
        to the longest); the rows whose prompt is then done sample their first token, in one call."""
        rows, hidden = self._forward_prompts(seqs, ends)
        done = [r for r, seq in enumerate(seqs) if seq.trunk_len == len(seq.prompt_ids)]
        if done:
            last = torch.stack([hidden[r, len(rows[r]) - 1] for r in done])
            self._take_first_tokens([seqs[r] for r in done], self._sample_rows([seqs[r] for r in done],
                                                                               self.runner.logits(last)))

    def _forward_prompts(self, seqs: list[Sequence], ends: list[int]) -> tuple[list[list[int]], torch.Tensor]:
        """``_feed_prompts``' forward: (each row's tokens fed, the hidden states [rows, q, H])."""
        rows = [s.prompt_ids[s.trunk_len:end] for s, end in zip(seqs, ends)]
        for seq in seqs:
            self._stage("prefill", seq)
        hidden = self.runner.trunk(seqs, rows, [s.trunk_len for s in seqs])
        self.runner.warn_on_kv_overflow()
        for r, (seq, end) in enumerate(zip(seqs, ends)):
            own = hidden[r, : len(rows[r])]
            logprobs.record_prompt(seq, self.runner.logits, own, seq.trunk_len)
            seq.trunk_len = end
            if self.runner.head is not None and seq.mode == "mtp":
                seq.hidden_backlog = _cat(seq.hidden_backlog, own)
        return rows, hidden

    def _take_first_tokens(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """Each row's first token (drawn from its prompt's last hidden state), its time to first token."""
        now = time.perf_counter()
        for seq, token in zip(seqs, tokens):
            seq.stats.ttft_s = now - seq.t_start
            seq.t_first = now
            self._append(seq, [token])

    # -- the step ---------------------------------------------------------------------------
    def step(self, seqs: list[Sequence]) -> StepResult:
        """One cycle for each row (all of one mode: MTP rows at their depths, or AR rows).
        A chained cycle in flight over these rows goes on (with its ghosts: rows that left,
        while the graph bucket holds; new rows take ghosts' places, ``chain.py``); over other
        rows it is committed first (its rows are in ``advanced`` too)."""
        result = self._step(seqs)
        self.runner.warn_on_kv_overflow()
        return result

    def _step(self, seqs: list[Sequence]) -> StepResult:
        mtp = seqs[0].mode == "mtp"
        result = StepResult()
        depths = self.next_depths(seqs)
        if self.chain.continues(seqs, depths):
            self._chain_step(seqs, result, depths)
            return result
        if self._join_chain(seqs, depths, result):
            return result
        self.drain(result)
        for s in seqs:  # the drained cycle may have reached the context's end
            if len(s.tokens) >= self.kv.max_context and not s.finished:
                s.finish_reason = "length"
        seqs = [s for s in seqs if not s.finished and s.seq_id not in result.failed]
        if seqs:
            if mtp:
                for s, d in zip(seqs, self.next_depths(seqs)):
                    s.depth = d
            self._cycle(seqs, max(s.depth for s in seqs) if mtp else 0, result)
        return result

    def next_depths(self, seqs: list[Sequence]) -> list[int]:
        """Each row's depth in the cycle launched next (rows of one mode; AR: 0): its own, or for
        depth="auto" rows the batch's (``adaptive_depth.batch_depth``), weighed over these rows
        and the rows of each one's last cycle that are not here: ended or released since. A
        chained cycle launched before the host saw a row end carries it once more, so the
        unchained path counts it once too (adaptive_depth.py); for the cycle after, the chain
        counts the rows of the one in flight still live (a row that ended there is a ghost,
        ``chain.py``), as the unchained path counts the rows of the cycle it just committed."""
        if seqs[0].mode != "mtp":  # AR steps
            return [0] * len(seqs)
        return [min(d, self._room(s)) for s, d in zip(seqs, self._mtp_depths(seqs))]

    def _room(self, seq: Sequence) -> int:
        """The deepest cycle that keeps the row within the context: it commits up to depth + 1
        tokens, so a row 1 token short of the end drafts none (an AR step) and ends where AR does."""
        return max(0, self.kv.max_context - len(seq.tokens) - 1)

    def _mtp_depths(self, seqs: list[Sequence]) -> list[int]:
        if all(s.depth_plan is None for s in seqs):
            return [s.depth for s in seqs]
        flying = self.chain.in_flight()
        flight_mates = self.chain.live_rows() if flying else ()
        here = {s.seq_id for s in seqs}
        gone: dict[int, Sequence] = {}
        if not here.isdisjoint(flying):  # the rows in flight share their mates: weighed once
            gone.update((m.seq_id, m) for m in flight_mates if m.seq_id not in here)
        for s in seqs:
            if s.seq_id not in flying:
                gone.update((m.seq_id, m) for m in self._mates.get(s.seq_id, ()) if m.seq_id not in here)
        rows = seqs + list(gone.values())
        auto = [s for s in rows if s.depth_plan is not None]
        floor = max((s.depth for s in rows if s.depth_plan is None), default=0)
        depth = batch_depth([s.depth_plan for s in auto], [s.depth_plan.expected_at(s.seq_id in flying) for s in auto],
                            max(s.depth for s in seqs if s.depth_plan is not None), floor, width=len(rows))
        return [min(depth, s.depth_plan.max_depth) if s.depth_plan is not None else s.depth for s in seqs]

    def _cycle(self, seqs: list[Sequence], depth: int, result: StepResult) -> None:
        """Draft -> verify -> accept -> commit, for rows of one mode (depth 0: an AR step)."""
        faults = result.failed
        # argmax drafts stay on the device (``_device_rows``): the cycle syncs with the host once;
        # sampled rows too, their acceptance chained on the device.
        # MTP rows' AR steps (depth="auto", adaptive_depth.batch_depth) do not chain: the head's
        # backlog grows by each step's hidden state on the host.
        device = self._device_rows(seqs)
        chains = depth > 0 or seqs[0].mode != "mtp"
        if device and chains and self.chain.takes(seqs, depth) and self._start_chain(seqs, depth, result):
            return
        on_device = device and depth > 0 and all(s.params.greedy or s.draft_policy == "greedy" for s in seqs)
        for seq in seqs:  # this cycle's writes: the verify's depth + 1 slots past the committed length
            self.kv.reserve(seq, seq.trunk_len + min(seq.depth, depth) + 1)
        t0 = time.perf_counter()
        if depth == 0:
            hidden = self.runner.trunk(seqs, [[s.tokens[s.trunk_len]] for s in seqs], [s.trunk_len for s in seqs])
            t1 = t2 = time.perf_counter()
            tokens = self._sample_rows(seqs, self.runner.logits(hidden[:, 0]), faults)
            outcome = CycleOutcome([[] for _ in seqs], [0] * len(seqs), tokens)
        elif on_device:
            t1 = t0  # one fused draft + verify: its time (launch and wait) counts as verify_s
            hidden, logits, packed = self._device_cycle(seqs, depth, faults)
            t2 = time.perf_counter()
            outcome = self._read_device_outcome(seqs, logits, packed, faults)
        else:
            drafts, draft_probs = constraints.cut_drafts(seqs, *self._draft(seqs, depth, faults))
            t1 = time.perf_counter()
            rows = [[s.tokens[s.trunk_len]] + d for s, d in zip(seqs, drafts)]
            hidden = self.runner.trunk(seqs, rows, [s.trunk_len for s in seqs], keep_states=True)
            logits = self.runner.logits(hidden)
            t2 = time.perf_counter()
            outcome = self._accept(seqs, logits, drafts, draft_probs, faults)
        t3 = time.perf_counter()
        if depth:
            self.runner.commit_state(seqs, [a + 1 for a in outcome.accepted])
        self._commit(seqs, outcome, hidden, False, result, drafted=depth > 0)
        if depth:
            _add_times(seqs, draft_s=t1 - t0, verify_s=t2 - t1, accept_s=t3 - t2, commit_s=time.perf_counter() - t3)

    def _commit(self, seqs: list[Sequence], outcome: CycleOutcome, hidden: torch.Tensor | None, continued: bool,
                result: StepResult, drafted: bool = True) -> None:
        """Commit each row's accepted drafts and next token: every path's one commit.
        continued: a chained cycle already runs on from this outcome on the device (it holds
        the head's backlog and the blocks past the row's length); else the rows keep their
        verify hidden states as the head's backlog and give back the blocks past their length.
        drafted: False for MTP rows' AR steps, whose head did not run: the step's hidden state
        joins the backlog the head catches up on when the row drafts again."""
        mates = list(seqs)
        for seq in seqs:
            if seq.seq_id in self.live:
                self._mates[seq.seq_id] = mates
        for r, seq in enumerate(seqs):
            drafts, accepted, token = outcome.row(r)
            if seq.seq_id in result.failed or token is None:
                continue
            try:
                if seq.mode == "mtp" and not drafted:
                    seq.stats.ar_steps += 1
                    seq.hidden_backlog = _cat(seq.hidden_backlog, hidden[r, :1])
                elif seq.mode == "mtp":
                    if drafts:
                        seq.stats.record_cycle(len(drafts), accepted, full=accepted == len(drafts))
                        if seq.depth_plan is not None:
                            seq.depth_plan.observe(len(drafts), accepted)
                    else:  # a row at depth 0 in a drafting cycle (the context's end): an AR step
                        seq.stats.ar_steps += 1
                    seq.hidden_backlog = None if continued else hidden[r, : accepted + 1]
                seq.trunk_len += accepted + 1
                if not continued:
                    self.kv.trim(seq, seq.trunk_len)
                self._append(seq, drafts[:accepted] + [token])
                result.advanced.append(seq)
            except Exception as exc:
                result.failed[seq.seq_id] = exc

    # -- chained cycles (chain.py) -----------------------------------------------------------
    def _start_chain(self, seqs: list[Sequence], depth: int, result: StepResult) -> bool:
        """The first cycle from the host's state, then the chain's step. False (nothing done)
        where the rows cannot take the chain's blocks: the context's end or a full pool (an
        unchained cycle needs fewer)."""
        if not self.chain.reserve(seqs, depth):
            return False
        backlog = None
        if depth:
            self._head_pre_feed(seqs, depth + 1)
            backlog = stack_padded([s.hidden_backlog for s in seqs])
        self.chain.start(seqs, backlog, depth)
        self._notify("chain_start", seqs)
        if depth:
            for s in seqs:
                s.head_len, s.hidden_backlog = s.trunk_len + 1, None
        self._chain_step(seqs, result)
        return True

    def _device_rows(self, seqs: list[Sequence]) -> bool:
        """Whether these rows' cycles can run wholly on the device (so chain): not with
        penalties, constraints or logprobs (host work per position), nor on hybrid models
        (re-feeding accepted tokens to their recurrent state needs them on the host)."""
        return self.runner.states is None and all(s.counts is None and not s.host_path for s in seqs)

    def _join_chain(self, seqs: list[Sequence], depths: list[int], result: StepResult) -> bool:
        """Rows new to the batch (prefilled while the chain's cycle was in flight) join the
        chain in places of rows that left (``CycleChain.joined``), and the chain's step runs:
        the device does not wait for the host to commit and restart it. False (nothing done)
        where they cannot."""
        flight = self.chain.flight
        if flight is None:
            return False
        in_chain = {s.seq_id for s in flight.seqs}
        new = [(s, d) for s, d in zip(seqs, depths) if s.seq_id not in in_chain]
        mode = flight.seqs[0].mode
        if not new or not self._device_rows([s for s, _ in new]) or any(s.mode != mode for s, _ in new):
            return False
        join = self.chain.joined(seqs, depths)
        if join is None:
            return False
        if mode == "mtp":  # the new rows' depths (a chain fixes each row's)
            for s, d in new:
                s.depth = d
        joining = [join[0][r] for r in join[1]]
        backlog = None
        if flight.depth:
            self._head_pre_feed(joining, flight.depth + 1)
            backlog = stack_padded([s.hidden_backlog for s in joining])
        if self._chain_step(seqs, result, depths, join, backlog):
            self._notify("chain_join", joining)
            if flight.depth:  # the chain's cycle catches their head up
                for s in joining:
                    s.head_len, s.hidden_backlog = s.trunk_len + 1, None
        return True

    def _chain_step(self, seqs: list[Sequence], result: StepResult, depths: list[int] | None = None,
                    join: tuple[list[Sequence], list[int]] | None = None, backlog: torch.Tensor | None = None) -> bool:
        """Launch the next cycle on the device, then commit the one in flight; True when the
        chain goes on. Where the rows cannot take the next cycle's blocks, nothing new starts and
        this commit is the chain's last.
        depths: the rows' next depths where the caller has them (``next_depths``); join, backlog:
        rows joining the chain (``_join_chain``)."""
        t0 = time.perf_counter()
        launch, continued = self.chain.advance(seqs, self.next_depths(seqs) if depths is None else depths, join,
                                               backlog)
        here = {s.seq_id for s in seqs}
        keep = [r for r, s in enumerate(launch.seqs) if s.seq_id in here]  # the chain's ghosts aside
        committed = [launch.seqs[r] for r in keep]  # in the launch's order
        outcome = self._read_launch(launch, keep, result.failed)
        t1 = time.perf_counter()
        self._commit_launch(launch, committed, outcome, None if continued else launch.hidden[keep], continued,
                            result)
        if launch.depth:  # MTP stats: the launch and wait, then the commit
            _add_times(committed, verify_s=t1 - t0, commit_s=time.perf_counter() - t1)
        return continued

    def drain(self, result: StepResult | None = None) -> StepResult:
        """Commit the cycle in flight (rows released or ended since it started are skipped),
        so the host's state is the device's again."""
        result = result if result is not None else StepResult()
        drained = self.chain.drain()
        if drained is not None and drained[1]:
            launch, keep = drained
            seqs = [launch.seqs[r] for r in keep]
            outcome = self._read_launch(launch, keep, result.failed)
            self._commit_launch(launch, seqs, outcome, launch.hidden[keep], False, result)
        return result

    def _read_launch(self, launch: CycleLaunch, keep: list[int], faults: dict[int, BaseException]) -> CycleOutcome:
        """The outcome of a chained cycle's rows at ``keep`` (waits for the device: the
        cycle's one transfer); a row whose own handling of it fails is left uncommitted."""
        rows = launch.rows()
        seqs = [launch.seqs[r] for r in keep]
        outcome = CycleOutcome.unpack([rows[r] for r in keep], [s.depth if launch.depth else 0 for s in seqs])
        points = ("draft", "accept") if launch.depth else ("sample",)  # the device did this row work
        for r, seq in enumerate(seqs):
            if any(self._row_work(seq, point, lambda: True, faults) is None for point in points):
                outcome.next_tokens[r] = None
        return outcome

    def _commit_launch(self, launch: CycleLaunch, seqs: list[Sequence], outcome: CycleOutcome,
                       hidden: torch.Tensor | None, continued: bool, result: StepResult) -> None:
        if launch.depth:  # the cycle caught the head up to its verify's first position
            for s in seqs:
                s.head_len = s.trunk_len + 1
        self._commit(seqs, outcome, hidden, continued, result)

    # -- drafting -----------------------------------------------------------------------------
    def _head_catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed the head the pairs committed since its last step (first those below the
        prompt's cache edge, ``_head_to_edge``); its last output per row (the first draft's
        hidden state) -> [rows, H]."""
        self._head_to_edge(seqs)
        catch_up = [s.tokens[s.head_len: s.trunk_len + 1] for s in seqs]
        width = max(len(t) for t in catch_up)
        out = self.runner.head_forward(seqs, stack_padded([s.hidden_backlog for s in seqs]), catch_up,
                                       [s.head_len for s in seqs])
        for s in seqs:
            s.head_len, s.hidden_backlog = s.trunk_len + 1, None
        if all(len(t) == width for t in catch_up):
            return out[:, width - 1]  # a slice: no index tensor to copy to the device (a host sync)
        return out[torch.arange(len(seqs)), torch.tensor([len(t) - 1 for t in catch_up])]

    def _head_pre_feed(self, seqs: list[Sequence], keep: int) -> None:
        """Feed the head all but the last ``keep`` of each row's pending pairs (the first cycle
        after a prompt has a prompt's worth), so the cycle's own catch-up fits its CUDA graph
        instead of sending the whole cycle down the eager path. The head is causal, so the
        cycle's drafts are the same as from one long catch-up. The pairs below the prompt's
        cache edge go first, alone (``_head_to_edge``)."""
        self._head_to_edge(seqs)
        self._head_feed([(s, s.trunk_len + 1 - keep - s.head_len) for s in seqs])

    def _head_to_edge(self, seqs: list[Sequence]) -> None:
        """Feed the head each row's pending pairs below its prompt's cache edge, where they run
        past it: a hit on the prompt's full blocks starts the head there (``cache_edge``)."""
        edges = [(s, self.cache_edge(s)) for s in seqs]
        self._head_feed([(s, edge - s.head_len) for s, edge in edges if s.head_len < edge <= s.trunk_len])

    def _head_feed(self, counts: list[tuple[Sequence, int]]) -> None:
        """Feed the head the first ``n`` pending pairs of each (row, n) with n > 0."""
        rows = [(s, s.tokens[s.head_len: s.head_len + n]) for s, n in counts if n > 0]
        if not rows:
            return
        hidden = stack_padded([s.hidden_backlog[: len(r)] for s, r in rows])
        self.runner.head_forward([s for s, _ in rows], hidden, [r for _, r in rows], [s.head_len for s, _ in rows],
                                 outputs=False)
        for s, r in rows:
            s.head_len += len(r)
            s.hidden_backlog = s.hidden_backlog[len(r):]

    def _device_cycle(self, seqs: list[Sequence], depth: int, faults: dict[int, BaseException]):
        """Argmax drafts, each fed to the next head step on the device, the verify and greedy
        acceptance, in one ``runner.greedy_cycle`` (one CUDA graph where captured). The same
        drafts as ``_draft`` picks. Returns (verify hidden, verify logits, packed outcome on the
        device: ``speculative.greedy_outcome``'s layout)."""
        for j in range(depth):  # a failed row keeps the argmax placeholder, as in _draft
            for seq in seqs:
                if j < seq.depth:
                    self._row_work(seq, "draft", lambda: None, faults)
        self._head_pre_feed(seqs, depth + 1)
        backlog = stack_padded([s.hidden_backlog for s in seqs])
        hidden, logits, packed = self.runner.greedy_cycle(seqs, backlog, depth)
        for s in seqs:
            s.head_len, s.hidden_backlog = s.trunk_len + 1, None
        return hidden, logits, packed

    def _draft(self, seqs: list[Sequence], depth: int, faults: dict[int, BaseException]
               ) -> tuple[list[list[int]], list[list[torch.Tensor | None]]]:
        """Catch the head up on committed tokens, then draft ``depth`` tokens per row: argmax
        (one-hot q) or, under the mirror policy, a sample from the head's distribution
        (``sampling.draft_params``; q kept for acceptance). A row whose draft choice raises is
        recorded in ``faults`` and drafts the argmax from then on. One host sync per depth, for
        all rows."""
        h = self._head_catch_up(seqs)
        sampler = self._sampler_for(seqs)
        mirror = [not s.params.greedy and s.draft_policy != "greedy" for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        for j in range(depth):
            logits = self._penalised_rows(seqs, self.runner.draft_logits(h), drafts)
            if any(s.constraint is not None for s in seqs):  # each position drafted under its grammar mask
                logits = torch.cat([constraints.mask_draft(s, logits[r:r + 1], drafts[r]) for r, s in enumerate(seqs)])
            q = sampler.draft_probs(logits) if any(mirror) else None
            picks = []
            for r, seq in enumerate(seqs):
                pick = None
                if j < seq.depth:  # past it, a placeholder: no sample, so the row's RNG runs as alone
                    row_q = q[r:r + 1] if mirror[r] else None
                    pick = self._row_work(seq, "draft", lambda: self._draft_token(
                        seq, logits[r:r + 1], drafts[r], row_q, lambda: sampler.sample(row_q, [r])), faults)
                picks.append(pick if pick is not None else (logits[r:r + 1].argmax(-1), None))
            # host sync, once per depth for all rows: the drafts feed the next head step
            for r, token in enumerate(torch.cat([t for t, _ in picks]).tolist()):
                drafts[r].append(token)
                probs[r].append(picks[r][1])
            if j + 1 < depth:
                starts, counts = zip(*(draft_step(s, j) for s in seqs))
                out = self.runner.head_forward(seqs, h[:, None], [d[-1:] * n for d, n in zip(drafts, counts)],
                                               list(starts))
                h = out[:, 0]
        return [d[: s.depth] for d, s in zip(drafts, seqs)], [p[: s.depth] for p, s in zip(probs, seqs)]

    def _draft_token(self, seq: Sequence, logits: torch.Tensor, previous: list[int], q: torch.Tensor | None, draw):
        """One row's draft from the head's logits [1, V] (penalties applied, counting
        ``previous`` drafts) as a [1] device tensor and its q: the argmax (one-hot q: None), or
        under the mirror policy ``draw()``, a sample from q [1, V] with the row's noise stream."""
        if q is None:
            return logits.argmax(-1), None
        return draw(), q[0]

    # -- acceptance -------------------------------------------------------------------------
    def _accept(self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[list[int]], draft_probs: list,
                faults: dict[int, BaseException]) -> CycleOutcome:
        """Each row's acceptance of its host-side drafts against the verify's logits
        [rows, depth + 1, V]: greedy rows by argmax match, sampled rows by exact rejection
        sampling (its own noise stream), queued on the device; one transfer brings them all."""
        sampler = self._sampler_for(seqs)
        k = logits.shape[1] - 1
        if any(s.counts is not None for s in seqs):  # position i's penalties count the drafts before it
            logits = torch.stack([self._penalised_rows(seqs, logits[:, i], [d[:i] for d in drafts])
                                  for i in range(k + 1)], dim=1)
        logits = self._host_work(seqs, logits, lambda seq, rows, r: constraints.mask_verify(seq, rows, drafts[r]),
                                 [len(d) + 1 for d in drafts])
        probs = sampler.probs(logits) if not sampler.all_greedy else None

        def accept(r: int, seq: Sequence) -> torch.Tensor:
            n = len(drafts[r])
            tokens = torch.tensor(drafts[r], dtype=torch.long, device=logits.device)
            if seq.params.greedy:
                return greedy_outcome(logits[r, : n + 1].argmax(-1)[None], tokens[None])[0, n:]
            q = None if not draft_probs[r] or draft_probs[r][0] is None else torch.stack(draft_probs[r])
            return torch.stack(sampled_outcome(probs[r, : n + 1], q, tokens, seq.noise))

        return self._gather_outcomes(seqs, drafts, [self._row_work(seq, "accept", lambda: accept(r, seq), faults)
                                                    for r, seq in enumerate(seqs)])

    def _read_device_outcome(self, seqs: list[Sequence], logits: torch.Tensor, packed: torch.Tensor,
                             faults: dict[int, BaseException]) -> CycleOutcome:
        """Outcomes of a ``_device_cycle``: greedy rows take the device's verdict; sampled rows
        (greedy drafts under the default draft policy) go through exact rejection sampling of
        their one-hot drafts, queued on the device behind the cycle; then the cycle's one
        transfer brings every row's drafts and outcome to the host."""
        k = packed.shape[1] - 2
        sampler = self._sampler_for(seqs)
        # every row's distributions in one pass (a greedy row's are one-hots, unused): indexing
        # the sampled rows out would copy an index to the device, a host sync behind the cycle
        probs = sampler.probs(logits) if not sampler.all_greedy else None

        def accept(r: int, seq: Sequence) -> torch.Tensor:
            if seq.params.greedy:
                return packed[r, k:]
            n = seq.depth
            return torch.stack(sampled_outcome(probs[r, : n + 1], None, packed[r, :n], seq.noise))

        work = [self._row_work(seq, "accept", lambda: accept(r, seq), faults) for r, seq in enumerate(seqs)]
        return self._gather_outcomes(seqs, None, work, packed)

    def _gather_outcomes(self, seqs: list[Sequence], drafts: list[list[int]] | None,
                         work: list[torch.Tensor | None], packed: torch.Tensor | None = None) -> CycleOutcome:
        """Bring every row's (accepted, next token) pair, and ``packed``'s drafts when the
        device drafted, to the host in one transfer (the cycle's host sync). A failed row
        (None) "accepts" all its drafts and is not committed."""
        parts = ([packed[:, :-2].flatten()] if packed is not None else []) + [w for w in work if w is not None]
        flat = torch.cat(parts).tolist() if parts else []
        if packed is not None:
            k = packed.shape[1] - 2
            drafts = [flat[r * k: r * k + s.depth] for r, s in enumerate(seqs)]
            flat = flat[len(seqs) * k:]
        pairs = iter(flat)
        accepted, tokens = [], []
        for r, w in enumerate(work):
            a, t = (next(pairs), next(pairs)) if w is not None else (len(drafts[r]), None)
            accepted.append(a)
            tokens.append(t)
        return CycleOutcome(drafts, accepted, tokens)

    def _host_work(self, seqs: list[Sequence], logits: torch.Tensor, mask, lengths: list[int]) -> torch.Tensor:
        """The per-position host work of constrained and logprob rows (``Sequence.host_path``)
        on logits [rows, positions, V]: row r's first lengths[r] positions through
        ``mask(seq, rows, r)`` (its grammar masks), then recorded for logprobs; other rows as is."""
        if not any(s.host_path for s in seqs):
            return logits
        logits = logits.clone()
        for r, seq in enumerate(seqs):
            if seq.host_path:
                n = lengths[r]
                logits[r, :n] = mask(seq, logits[r, :n], r)
                logprobs.record(seq, logits[r, :n])
        return logits

    # -- sampling ----------------------------------------------------------------------------
    def _sampler_for(self, seqs: list[Sequence]) -> SamplerBatch:
        """The rows' sampler settings as tensors, rebuilt only when the rows change."""
        key = tuple(s.seq_id for s in seqs)
        if self._sampler is None or self._sampler[0] != key:
            self._sampler = key, SamplerBatch([s.params for s in seqs], [s.noise for s in seqs],
                                              self.runner.device)
        return self._sampler[1]

    def _penalised_rows(self, seqs: list[Sequence], logits: torch.Tensor, previous: list[list[int]]) -> torch.Tensor:
        """logits [rows, V] with each row's presence/frequency penalties, counting its generated
        tokens plus ``previous[r]`` (drafts before this position); rows without penalties as is."""
        if all(s.counts is None for s in seqs):
            return logits
        return torch.cat([self._penalised(s, logits[r:r + 1], previous[r]) for r, s in enumerate(seqs)])

    def _penalised(self, seq: Sequence, logits: torch.Tensor, previous: list[int]) -> torch.Tensor:
        if seq.counts is None:
            return logits
        counts = seq.counts.clone()
        if previous:
            index = torch.tensor(previous, device=counts.device)
            counts.index_add_(0, index, torch.ones(len(previous), dtype=counts.dtype, device=counts.device))
        return apply_penalties(logits, counts[None], seq.params.presence_penalty, seq.params.frequency_penalty)

    def _sample_rows(self, seqs: list[Sequence], logits: torch.Tensor,
                     faults: dict[int, BaseException] | None = None, to_host: bool = True):
        """One token per row from logits [rows, V], each with its own sampler and noise stream;
        the host syncs once for all rows. With ``faults``, a row whose sampling raises is
        recorded there (its token is None); without, the exception propagates. to_host=False
        (no faults): the tokens as a tensor where they were drawn, unread (no sync)."""
        if self.fault_hook is None and all(s.params.greedy and s.counts is None and not s.host_path for s in seqs):
            tokens = torch_argmax(logits)
            return tokens.tolist() if to_host else tokens  # (the read: the step's one host sync)
        sampler = self._sampler_for(seqs)
        logits = self._penalised_rows(seqs, logits, [[] for _ in seqs])
        logits = self._host_work(seqs, logits[:, None], lambda seq, rows, r: constraints.mask_next(seq, rows),
                                 [1] * len(seqs))[:, 0]
        probs = sampler.probs(logits)
        failed = set()
        for r, s in enumerate(seqs):
            try:
                self._stage("sample", s)
            except Exception as exc:
                if faults is None:
                    raise
                faults[s.seq_id] = exc
                failed.add(r)
        rows = [r for r in range(len(seqs)) if r not in failed]  # each its own stream's noise, one launch
        if not rows:
            return [None] * len(seqs)
        if failed:
            probs = probs[rows]
        if not to_host:
            return sampler.draw(probs, rows)
        tokens = iter(sampler.draw(probs, rows).tolist())  # one sync
        return [None if r in failed else next(tokens) for r in range(len(seqs))]

    # -- commit --------------------------------------------------------------------------
    def _append(self, seq: Sequence, new_tokens: list[int]) -> None:
        """Append tokens up to the first stop (EOS or max_tokens); register full blocks."""
        self._stage("commit", seq)
        tokens = seq.tokens
        committed, limit = len(tokens), len(seq.prompt_ids) + seq.max_tokens  # the length max_tokens ends at
        eos = () if seq.ignore_eos else self.eos_token_ids
        for token in new_tokens:
            if token in eos:
                seq.finish_reason = "stop"
                break
            tokens.append(token)
            if seq.counts is not None:
                seq.counts[token] += 1
            if len(tokens) >= limit:
                seq.finish_reason = "length"
                break
        if seq.host_path:
            constraints.advance(seq, tokens[committed:])
            logprobs.commit(seq, tokens[committed:])
        seq.stats.generated_tokens = len(tokens) - len(seq.prompt_ids)
        seq.stats.decode_s = time.perf_counter() - seq.t_first
        valid = min(seq.trunk_len, seq.head_len) if seq.mode == "mtp" else seq.trunk_len
        self.kv.commit(seq, tokens, valid)  # no copy of the whole sequence per row and step
        if self.observers:
            self._notify("commit", [seq])

    def _notify(self, event: str, seqs: list[Sequence]) -> None:
        for observer in self.observers:
            for seq in seqs:
                observer(event, seq)

    # -- fault points ----------------------------------------------------------------------
    def _stage(self, point: str, seq: Sequence) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point, seq)

    def _row_work(self, seq: Sequence, point: str, work, faults: dict[int, BaseException]):
        """One row's own work at a fault point: the hook, then ``work()``. What either raises is
        that row's fault (recorded in ``faults``; the result is None); a row already failed
        does nothing."""
        if seq.seq_id in faults:
            return None
        try:
            self._stage(point, seq)
            return work()
        except Exception as exc:
            faults[seq.seq_id] = exc
            return None


def _add_times(seqs: list[Sequence], **seconds: float) -> None:
    """Add a cycle's phase times (draft_s, verify_s, accept_s, commit_s) to each row's stats."""
    for seq in seqs:
        for name, value in seconds.items():
            setattr(seq.stats, name, getattr(seq.stats, name) + value)


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """The head's backlog ``a`` with ``b`` after it, in memory of its own: ``b`` may be a view of
    a CUDA graph's output buffer, which the graph's next replay overwrites (a prompt's second
    forward at its cache edge, another row's prompt)."""
    return b.clone() if a is None else torch.cat([a, b])


def stack_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """[n_r, H] per row -> [rows, max n_r, H], each row padded by repeating its last entry."""
    width = max(x.shape[0] for x in rows)
    return torch.stack([x if x.shape[0] == width else torch.cat([x, x[-1:].expand(width - x.shape[0], -1)])
                        for x in rows])
