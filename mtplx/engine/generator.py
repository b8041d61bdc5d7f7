"""The decode step every scheduler mode calls: prefill, AR step, MTP cycle.

MTP cycle, per row (REFERENCE.md section 3):
  1. draft: the head catches up on committed tokens (its first output is draft 1), then
     drafts recursively from its own hidden state and its own drafted token;
  2. verify: [primary] + drafts in ONE trunk forward;
  3. accept: greedy argmax match, or exact rejection sampling (speculative.py);
  4. commit: append accepted drafts + the correction/bonus token; the KV length is simply the
     number of tokens whose KV is valid, so a partial acceptance costs no copy (hybrid models'
     recurrent state is kept at the accepted position by ``runner.commit_state``).
Functions take lists of sequences (rows) so batching modes reuse them unchanged.

Faults: a row's own work in a step (drafting, acceptance, sampling, commit) that raises does
not stop the other rows: they complete the step, then ``SequenceFault`` names the failed rows
(the caller fails those requests and frees their blocks). An exception in a batched forward
is not attributable to a row and propagates as is (the caller fails every row of the step).
``Generator.fault_hook`` injects such faults on purpose (tests, chaos drills).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from mtplx.engine import constraints, logprobs
from mtplx.engine.block_manager import OutOfBlocks
from mtplx.engine.runner import CycleLaunch, ModelRunner, draft_step
from mtplx.engine.sampling import apply_penalties, logits_to_probs, sample
from mtplx.engine.sequence import Sequence
from mtplx.engine.speculative import sampled_outcome, verify_greedy, verify_sampled
from mtplx.engine.stats import DecodeStats


# fault_hook(point, seq) is called on the model thread before each per-row stage (here, and
# "detokenize" in llm_engine.TextTracker); what it raises is that row's fault, except at
# "forward" (before a trunk forward that includes the row), which fails the whole step the
# way a failing forward does.
FaultHook = Callable[[str, Sequence], None]
FAULT_POINTS = ("admit", "prefill", "forward", "draft", "accept", "sample", "commit", "detokenize")


class SequenceFault(Exception):
    """Some rows' own work in a step failed; every other row completed the step.

    errors: seq_id -> the exception raised for that row."""

    def __init__(self, errors: dict[int, BaseException]):
        self.errors = errors
        super().__init__("; ".join(f"sequence {i}: {type(e).__name__}: {e}" for i, e in errors.items()))


class Generator:
    def __init__(self, runner: ModelRunner, eos_token_ids: set[int]):
        self.runner = runner
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = runner.model.config.vocab_size
        self.fault_hook: FaultHook | None = None  # FAULT_POINTS; None (no cost) unless injecting
        # a chained greedy cycle still on the device (``_chained_cycle``), and rows released
        # since it started (their outcome is dropped)
        self._flight: CycleLaunch | None = None
        self._released: set[int] = set()
        self._drained: list[Sequence] = []  # rows a drain committed, for callers that step groups apart

    # -- lifecycle ----------------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        """Take blocks for the prompt, reusing cached prefix blocks. If it raises, the
        sequence holds nothing (OutOfBlocks: nothing was taken; later errors release)."""
        seq.stats = DecodeStats(depth=seq.depth, prompt_tokens=len(seq.prompt_ids))
        seq.t_start = time.perf_counter()
        # AR sequences on a model with a head leave the head's KV entries unwritten: their
        # blocks go to a separate prefix cache, so an MTP request never drafts from them
        namespace = "trunk_only" if self.runner.head is not None and seq.mode != "mtp" else None
        cached = self.runner.blocks.allocate(seq.seq_id, seq.prompt_ids,
                                             namespace=logprobs.cache_namespace(seq, namespace))
        try:
            self._set_up(seq, cached)
        except BaseException:
            self.release(seq)
            raise

    def _set_up(self, seq: Sequence, cached: int) -> None:
        """The rest of admission, once the prompt's blocks are taken (``cached`` of its tokens hit)."""
        self.runner.allocate_state(seq)
        if self.fault_hook is not None:
            self.fault_hook("admit", seq)
        seq.trunk_len = seq.cached_prompt_tokens = seq.stats.cached_prompt_tokens = cached
        seq.head_len = max(cached, 1)
        if cached and self.runner.head is not None:
            # the head's first pair needs the trunk hidden at the last cached position
            table = self.runner.blocks.block_table(seq.seq_id)
            seq.hidden_backlog = self.runner.cache.last_hidden[table[cached // self.runner.block_size - 1]][None]
        if seq.params.presence_penalty or seq.params.frequency_penalty:
            seq.counts = torch.zeros(self.vocab_size, dtype=torch.long, device=self.runner.device)

    def release(self, seq: Sequence) -> None:
        """Return the sequence's blocks (committed full blocks stay in the prefix cache). A
        cycle in flight over the row still writes to them, ahead of any later use (one stream)."""
        if self._flight is not None and any(s is seq for s in self._flight.seqs):
            self._released.add(seq.seq_id)
            if all(s.seq_id in self._released for s in self._flight.seqs):
                self._flight, self._released = None, set()
        self.runner.blocks.free(seq.seq_id)
        self.runner.free_state(seq)

    def prefill(self, seq: Sequence, chunk: int | None = None) -> bool:
        """Feed up to ``chunk`` more prompt tokens; after the last one, sample the first token.
        Returns True when the prompt is done."""
        prompt = seq.prompt_ids
        end = len(prompt) if chunk is None else min(len(prompt), seq.trunk_len + chunk)
        if self.fault_hook is not None:
            self.fault_hook("prefill", seq)
            self.fault_hook("forward", seq)
        hidden = self.runner.trunk([seq], [prompt[seq.trunk_len:end]], [seq.trunk_len])[0]
        logprobs.record_prompt(seq, self.runner.logits, hidden, seq.trunk_len)
        seq.trunk_len = end
        if self.runner.head is not None and seq.mode == "mtp":
            seq.hidden_backlog = _cat(seq.hidden_backlog, hidden)
        if end < len(prompt):
            return False
        logits = self.runner.logits(hidden[-1:])
        token = self._sample_one(seq, logits)
        seq.stats.ttft_s = time.perf_counter() - seq.t_start
        seq.t_first = time.perf_counter()
        self._commit(seq, [token])
        return True

    # -- AR ----------------------------------------------------------------------------
    def ar_step(self, seqs: list[Sequence]) -> None:
        """One autoregressive token for each row. Raises SequenceFault after the step if some
        rows' own work failed."""
        seqs = self._resume(seqs, 0)
        if not seqs or (self._chainable(seqs, 0) and self._start_chain(seqs, 0)):
            return
        self._before_forward(seqs)
        hidden = self.runner.trunk(seqs, [[s.tokens[s.trunk_len]] for s in seqs], [s.trunk_len for s in seqs])
        faults: dict[int, BaseException] = {}
        tokens = self._sample_rows(seqs, self.runner.logits(hidden[:, 0]), faults)
        self._commit_steps(seqs, tokens, faults)
        if faults:
            raise SequenceFault(faults)

    def _commit_steps(self, seqs: list[Sequence], tokens: list[int], faults: dict[int, BaseException],
                      rollback: bool = False) -> None:
        """Commit one AR token per row (rollback: give back the blocks past the row's length)."""
        for seq, token in zip(seqs, tokens):
            if seq.seq_id in faults:
                continue
            try:
                seq.trunk_len += 1
                if rollback:
                    self.runner.blocks.rollback(seq.seq_id, seq.trunk_len)
                self._commit(seq, [token])
            except Exception as exc:
                faults[seq.seq_id] = exc

    def _resume(self, seqs: list[Sequence], depth: int) -> list[Sequence]:
        """Before a step at ``depth``: with a chained cycle in flight over exactly these rows,
        run the chain's next step and return no rows (the step is done); otherwise commit the
        cycle in flight and return the rows still live."""
        self._drained = []
        if self._flight is None:
            return seqs
        if self._continues(seqs, depth):
            self._chained_cycle(seqs)
            return []
        self.drain()  # the rows changed: the cycle in flight is committed first
        return [s for s in seqs if not s.finished]

    # -- MTP ---------------------------------------------------------------------------
    def mtp_cycle(self, seqs: list[Sequence]) -> None:
        """Draft, verify, accept and commit one cycle for each row. Raises SequenceFault after
        the cycle if some rows' own work failed (a failed row keeps its place in the batched
        forwards, with a placeholder draft, so the other rows' cycle is unchanged)."""
        seqs = self._resume(seqs, max(s.depth for s in seqs))
        if not seqs:
            return
        faults: dict[int, BaseException] = {}
        t0 = time.perf_counter()
        # argmax drafts stay on the device: the cycle syncs with the host once (not for hybrid
        # models: re-feeding accepted tokens to their recurrent state needs them on the host)
        on_device = self.runner.states is None and all(s.counts is None and not s.host_path and (
            s.params.greedy or s.draft_policy == "greedy") for s in seqs)
        depth = max(s.depth for s in seqs)
        if on_device and self._chainable(seqs, depth) and self._start_chain(seqs, depth):
            return
        if on_device:
            t1 = t0  # one fused draft + verify: its time (launch and wait) counts as verify_s
            hidden, logits, packed = self._greedy_cycle(seqs, faults)
            t2 = time.perf_counter()
            drafts, outcomes = self._accept_device_drafts(seqs, logits, packed, faults)
        else:
            drafts, draft_probs = constraints.cut_drafts(seqs, *self._draft(seqs, faults))
            t1 = time.perf_counter()
            rows = [[s.tokens[s.trunk_len]] + d for s, d in zip(seqs, drafts)]
            self._before_forward(seqs)
            hidden = self.runner.trunk(seqs, rows, [s.trunk_len for s in seqs], keep_states=True)
            logits = self.runner.logits(hidden)
            t2 = time.perf_counter()
            outcomes = self._accept_rows(seqs, lambda r, seq: self._accept(
                seq, logits[r, : len(drafts[r]) + 1], drafts[r], draft_probs[r]), drafts, faults)
        t3 = time.perf_counter()
        self.runner.commit_state(seqs, [accepted + 1 for accepted, _ in outcomes])
        self._commit_cycle(seqs, drafts, outcomes, hidden, faults)
        t4 = time.perf_counter()
        for seq in seqs:
            st = seq.stats
            st.draft_s += t1 - t0
            st.verify_s += t2 - t1
            st.accept_s += t3 - t2
            st.commit_s += t4 - t3
        if faults:
            raise SequenceFault(faults)

    def _commit_cycle(self, seqs: list[Sequence], drafts: list[list[int]], outcomes: list,
                      hidden: torch.Tensor | None, faults: dict[int, BaseException]) -> None:
        """Commit each row's accepted drafts and next token. hidden None: a chained cycle is
        already running from this outcome on the device (it holds the head's backlog and the
        blocks past the row's length)."""
        for r, (seq, (accepted, token)) in enumerate(zip(seqs, outcomes)):
            if seq.seq_id in faults:
                continue
            try:
                seq.stats.record_cycle(len(drafts[r]), accepted, full=accepted == len(drafts[r]))
                seq.hidden_backlog = hidden[r, : accepted + 1] if hidden is not None else None
                seq.trunk_len += accepted + 1
                if hidden is not None:
                    self.runner.blocks.rollback(seq.seq_id, seq.trunk_len)
                self._commit(seq, drafts[r][:accepted] + [token])
            except Exception as exc:
                faults[seq.seq_id] = exc

    # -- chained greedy cycles ------------------------------------------------------------
    # Greedy rows whose whole cycle (or AR step: depth 0) runs on the device: each call starts
    # the next cycle (its inputs written on the device by the last one) before it reads the
    # last one's outcome, so the host's work on a cycle (commit, detokenizing, streaming, the
    # caller's own) overlaps the device's work on the next. The host is one cycle behind the
    # device: a row that ends leaves one cycle in flight, dropped (its writes land past the
    # row's committed length).
    def _chainable(self, seqs: list[Sequence], depth: int) -> bool:
        return (self.fault_hook is None and self.runner.states is None  # not hybrid models' recurrent state
                and all(s.params.greedy and s.counts is None and not s.host_path for s in seqs)
                and self.runner.can_chain(len(seqs), depth))

    def _continues(self, seqs: list[Sequence], depth: int) -> bool:
        """Whether ``seqs`` are the rows of the cycle in flight, all still live, at its depth."""
        flight = self._flight
        return (flight.depth == depth and len(seqs) == len(flight.seqs)
                and all(a is b for a, b in zip(seqs, flight.seqs))
                and not self._released and not any(s.finished for s in seqs) and self.fault_hook is None)

    def _start_chain(self, seqs: list[Sequence], depth: int) -> bool:
        """The first cycle from the host's state, then the chain (``_chained_cycle``). False
        (nothing done) where the rows cannot take the chain's blocks: the context's end or a
        full pool (an unchained cycle needs fewer)."""
        try:
            if not self.runner.extend_tables(seqs, depth):
                return False
        except OutOfBlocks:
            return False
        if depth == 0:
            self._flight = self.runner.start_cycle(seqs, None, 0)
        else:
            self._head_pre_feed(seqs, depth + 1)
            self._flight = self.runner.start_cycle(seqs, stack_padded([s.hidden_backlog for s in seqs]), depth)
            for s in seqs:
                s.head_len, s.hidden_backlog = s.trunk_len + 1, None
        self._chained_cycle(seqs)
        return True

    def _chained_cycle(self, seqs: list[Sequence]) -> None:
        """Start the next cycle on the device, then commit the one in flight. Where the rows
        cannot take the next cycle's blocks (the context's end, a full pool), nothing new
        starts and the commit is the chain's last."""
        flight, depth = self._flight, self._flight.depth
        t0 = time.perf_counter()
        try:
            following = self.runner.next_cycle(seqs, depth) if self.runner.extend_tables(seqs, depth) else None
        except OutOfBlocks:
            following = None
        rows = flight.rows()
        t1 = time.perf_counter()
        self._flight = following
        self._commit_launch(flight, seqs, rows, last=following is None)
        t2 = time.perf_counter()
        for seq in seqs if depth else ():  # MTP stats: the launch and wait, then the commit
            seq.stats.verify_s += t1 - t0
            seq.stats.commit_s += t2 - t1

    def drain(self) -> None:
        """Commit the cycle in flight (rows released or ended since it started are skipped),
        so the host's state is the device's again."""
        flight, released, self._flight, self._released = self._flight, self._released, None, set()
        if flight is None:
            return
        rows = flight.rows()
        keep = [r for r, s in enumerate(flight.seqs) if s.seq_id not in released and not s.finished]
        self._drained = [flight.seqs[r] for r in keep]
        self._commit_launch(flight, [flight.seqs[r] for r in keep], [rows[r] for r in keep], last=True,
                            index=keep)

    def take_drained(self) -> list[Sequence]:
        """Rows the last step's drain committed (each step forgets the step before's), and
        forget them. A step for some rows commits the cycle still in flight for others (the
        rows of the step before): a caller that steps groups of rows apart publishes those
        rows' new tokens too."""
        drained, self._drained = self._drained, []
        return drained

    def _commit_launch(self, flight: CycleLaunch, seqs: list[Sequence], rows: list[list[int]], last: bool,
                       index: list[int] | None = None) -> None:
        """Commit a chained cycle's outcome for ``seqs`` (rows of ``flight`` at ``index``).
        last: no cycle follows it on the device, so the rows keep its verify hidden states as
        the head's backlog, and give back the blocks past their length."""
        k = flight.depth
        faults: dict[int, BaseException] = {}
        if k == 0:  # AR steps
            self._commit_steps(seqs, [row[1] for row in rows], faults, rollback=last)
        else:
            drafts = [row[: s.depth] for row, s in zip(rows, seqs)]
            outcomes = [(row[k], row[k + 1]) for row in rows]
            hidden = flight.hidden[index if index is not None else slice(None)] if last else None
            for s in seqs:  # the cycle caught the head up to its verify's first position
                s.head_len = s.trunk_len + 1
            self._commit_cycle(seqs, drafts, outcomes, hidden, faults)
        if faults:
            raise SequenceFault(faults)

    def _before_forward(self, seqs: list[Sequence]) -> None:
        """The fault hook's "forward" point (not attributable: it fails the whole step)."""
        if self.fault_hook is not None:
            for seq in seqs:
                self.fault_hook("forward", seq)

    def _accept_rows(self, seqs: list[Sequence], accept, drafts: list[list[int]],
                     faults: dict[int, BaseException]) -> list[tuple[int, int | None]]:
        """(accepted, next token) per row from ``accept(r, seq)``; a failed row is recorded in
        ``faults`` and "accepts" everything (its recurrent state is kept as fed, no redo)."""
        outcomes = []
        for r, seq in enumerate(seqs):
            outcome = self._row_work(seq, "accept", lambda: accept(r, seq), faults)
            outcomes.append(outcome if outcome is not None else (len(drafts[r]), None))
        return outcomes

    def _row_work(self, seq: Sequence, point: str, work, faults: dict[int, BaseException]):
        """One row's own work at a fault point: the hook, then ``work()``. What either raises is
        that row's fault (recorded in ``faults``; the result is None); a row already failed
        does nothing."""
        if seq.seq_id in faults:
            return None
        try:
            if self.fault_hook is not None:
                self.fault_hook(point, seq)
            return work()
        except Exception as exc:
            faults[seq.seq_id] = exc
            return None

    def _head_catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed the head the pairs committed since its last step; its last output per row
        (the first draft's hidden state) -> [rows, H]."""
        catch_up = [s.tokens[s.head_len: s.trunk_len + 1] for s in seqs]
        width = max(len(t) for t in catch_up)
        out = self.runner.head_forward(seqs, stack_padded([s.hidden_backlog for s in seqs]), catch_up,
                                       [s.head_len for s in seqs])
        for s in seqs:
            s.head_len, s.hidden_backlog = s.trunk_len + 1, None
        if all(len(t) == width for t in catch_up):
            return out[:, width - 1]  # a slice: no index tensor to copy to the device (a host sync)
        return out[torch.arange(len(seqs)), torch.tensor([len(t) - 1 for t in catch_up])]

    def _greedy_cycle(self, seqs: list[Sequence], faults: dict[int, BaseException]):
        """Argmax drafts (greedy targets, or the default greedy draft policy, no penalties),
        each fed to the next head step on the device, the verify and greedy acceptance, in one
        ``runner.greedy_cycle`` (one CUDA graph where captured). The same drafts as ``_draft``
        picks. Returns (verify hidden, verify logits, packed [rows, depth + 2] on the device:
        drafts, accepted count, next token)."""
        depth = max(s.depth for s in seqs)
        if self.fault_hook is not None:  # a failed row keeps the argmax placeholder, as in _draft
            for j in range(depth):
                for seq in seqs:
                    if j < seq.depth:
                        self._row_work(seq, "draft", lambda: None, faults)
        self._before_forward(seqs)
        self._head_pre_feed(seqs, depth + 1)
        backlog = stack_padded([s.hidden_backlog for s in seqs])
        hidden, logits, packed = self.runner.greedy_cycle(seqs, backlog, depth)
        for s in seqs:
            s.head_len, s.hidden_backlog = s.trunk_len + 1, None
        return hidden, logits, packed

    def _head_pre_feed(self, seqs: list[Sequence], keep: int) -> None:
        """Feed the head all but the last ``keep`` of each row's pending pairs (the first cycle
        after a prompt has a prompt's worth), so the cycle's own catch-up fits its CUDA graph
        instead of sending the whole cycle down the eager path. The head is causal, so the
        cycle's drafts are the same as from one long catch-up."""
        rows = [(s, s.tokens[s.head_len: s.trunk_len + 1 - keep]) for s in seqs if s.trunk_len + 1 - s.head_len > keep]
        if not rows:
            return
        hidden = stack_padded([s.hidden_backlog[: len(r)] for s, r in rows])
        self.runner.head_forward([s for s, _ in rows], hidden, [r for _, r in rows], [s.head_len for s, _ in rows])
        for s, r in rows:
            s.head_len += len(r)
            s.hidden_backlog = s.hidden_backlog[len(r):]

    def _accept_device_drafts(self, seqs: list[Sequence], logits: torch.Tensor, packed: torch.Tensor,
                              faults: dict[int, BaseException]) -> tuple[list[list[int]], list]:
        """Outcomes of a ``_greedy_cycle``: greedy rows take the device's verdict; sampled rows
        (greedy drafts under the default draft policy) go through exact rejection sampling of
        their one-hot drafts, queued on the device behind the cycle; then the cycle's one
        transfer brings every row's drafts and outcome to the host. Returns the drafts (each
        cut to its row's depth) and the outcomes (a failed row "accepts" everything, as in
        ``_accept_rows``)."""
        k = packed.shape[1] - 2

        def accept(r: int, seq: Sequence):
            if seq.params.greedy:
                return "greedy"
            probs = logits_to_probs(logits[r, : seq.depth + 1], seq.params)
            return sampled_outcome(probs, None, packed[r, : seq.depth], seq.generator)

        work = [self._row_work(seq, "accept", lambda: accept(r, seq), faults) for r, seq in enumerate(seqs)]
        sampled = [t for w in work if isinstance(w, tuple) for t in w]
        flat = torch.cat([packed.flatten(), torch.stack(sampled)]) if sampled else packed.flatten()
        flat = flat.tolist()  # the cycle's host sync
        host = [flat[r * (k + 2): (r + 1) * (k + 2)] for r in range(len(seqs))]
        drafts = [row[: s.depth] for row, s in zip(host, seqs)]
        extra = iter(flat[len(seqs) * (k + 2):])
        outcomes = []
        for r, w in enumerate(work):
            if w is None:
                outcomes.append((len(drafts[r]), None))
            elif isinstance(w, tuple):
                outcomes.append((next(extra), next(extra)))
            else:
                outcomes.append((host[r][k], host[r][k + 1]))
        return drafts, outcomes

    def _draft(self, seqs: list[Sequence], faults: dict[int, BaseException]
               ) -> tuple[list[list[int]], list[list[torch.Tensor | None]]]:
        """Catch the head up on committed tokens, then draft ``depth`` tokens per row. A row
        whose draft choice raises is recorded in ``faults`` and drafts the argmax from then on."""
        h = self._head_catch_up(seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        depth = max(s.depth for s in seqs)
        for j in range(depth):
            logits = self.runner.logits(h)
            picks = []
            for r, seq in enumerate(seqs):
                pick = None
                if j < seq.depth:  # past it, a placeholder: no sample, so the row's RNG runs as alone
                    pick = self._row_work(seq, "draft", lambda: self._draft_token(seq, logits[r:r + 1], drafts[r]),
                                          faults)
                # a failed row drafts a placeholder (the argmax): the batch keeps its shape
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

    def _draft_token(self, seq: Sequence, logits: torch.Tensor, previous: list[int]):
        """A draft from head logits [1, V] as a [1] device tensor: argmax (one-hot q) or a
        sample from the head's distribution under the request's sampler (mirror)."""
        logits = constraints.mask_draft(seq, self._penalised(seq, logits, previous), previous)
        if seq.params.greedy or seq.draft_policy == "greedy":
            return logits.argmax(-1), None
        q = logits_to_probs(logits, seq.params)
        return sample(q, seq.generator), q[0]

    def _accept(self, seq: Sequence, logits: torch.Tensor, drafts: list[int], q: list):
        """logits: [k+1, V] target logits at the draft positions and the bonus position."""
        draft_t = torch.tensor(drafts, dtype=torch.long, device=logits.device)
        if seq.counts is not None:  # position i's penalties count the drafts before it
            logits = torch.cat([self._penalised(seq, logits[i:i + 1], drafts[:i]) for i in range(len(drafts) + 1)])
        logits = constraints.mask_verify(seq, logits, drafts)
        logprobs.record(seq, logits)
        if seq.params.greedy:
            return verify_greedy(logits, draft_t)
        draft_q = None if q[0] is None else torch.stack(q)
        return verify_sampled(logits_to_probs(logits, seq.params), draft_q, draft_t, seq.generator)

    # -- sampling helpers ----------------------------------------------------------------
    def _penalised(self, seq: Sequence, logits: torch.Tensor, previous: list[int]) -> torch.Tensor:
        """Apply presence/frequency penalties counting generated tokens plus ``previous`` drafts."""
        if seq.counts is None:
            return logits
        counts = seq.counts.clone()
        if previous:
            index = torch.tensor(previous, device=counts.device)
            counts.index_add_(0, index, torch.ones(len(previous), dtype=counts.dtype, device=counts.device))
        return apply_penalties(logits, counts[None], seq.params.presence_penalty, seq.params.frequency_penalty)

    def _sample_one(self, seq: Sequence, logits: torch.Tensor) -> int:
        return self._sample_rows([seq], logits)[0]

    def _sample_rows(self, seqs: list[Sequence], logits: torch.Tensor,
                     faults: dict[int, BaseException] | None = None) -> list[int]:
        """One token per row from logits [rows, V], each with its own sampler and generator;
        the host syncs once for all rows. With ``faults``, a row whose sampling raises is
        recorded there (its token is a placeholder); without, the exception propagates."""
        tokens = logits.argmax(-1)  # plain greedy rows need nothing more
        hook = self.fault_hook
        if hook is None and all(s.params.greedy and s.counts is None and not s.host_path for s in seqs):
            return tokens.tolist()  # the step's one host sync
        picks = []
        for r, s in enumerate(seqs):
            try:
                if hook is not None:
                    hook("sample", s)
                plain = s.params.greedy and s.counts is None and not s.host_path
                picks.append(tokens[r:r + 1] if plain else self._sample_tensor(s, logits[r:r + 1]))
            except Exception as exc:
                if faults is None:
                    raise
                faults[s.seq_id] = exc
                picks.append(tokens[r:r + 1])
        return torch.cat(picks).tolist()  # the step's one host sync

    def _sample_tensor(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V] -> [1] token on the device."""
        logits = constraints.mask_next(seq, self._penalised(seq, logits, []))
        logprobs.record(seq, logits)
        if seq.params.greedy:
            return logits.argmax(-1)
        return sample(logits_to_probs(logits, seq.params), seq.generator)

    # -- commit --------------------------------------------------------------------------
    def _commit(self, seq: Sequence, new_tokens: list[int]) -> None:
        """Append tokens up to the first stop (EOS or max_tokens); register full blocks."""
        if self.fault_hook is not None:
            self.fault_hook("commit", seq)
        committed = len(seq.tokens)
        for token in new_tokens:
            if token in self.eos_token_ids and not seq.ignore_eos:
                seq.finish_reason = "stop"
                break
            seq.tokens.append(token)
            if seq.counts is not None:
                seq.counts[token] += 1
            if seq.num_generated >= seq.max_tokens:
                seq.finish_reason = "length"
                break
        constraints.advance(seq, seq.tokens[committed:])
        logprobs.commit(seq, seq.tokens[committed:])
        seq.stats.generated_tokens = seq.num_generated
        seq.stats.decode_s = time.perf_counter() - seq.t_first
        valid = min(seq.trunk_len, seq.head_len) if seq.mode == "mtp" else seq.trunk_len
        self.runner.blocks.commit(seq.seq_id, seq.tokens[:valid])


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b])


def stack_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """[n_r, H] per row -> [rows, max n_r, H], each row padded by repeating its last entry."""
    width = max(x.shape[0] for x in rows)
    return torch.stack([x if x.shape[0] == width else torch.cat([x, x[-1:].expand(width - x.shape[0], -1)])
                        for x in rows])
