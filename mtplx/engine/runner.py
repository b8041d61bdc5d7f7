"""Tensors in, hidden states out: builds attention metadata for rows of sequences and runs
the trunk or the MTP head over them. Owns the KV tensors and the block accounting, and, for
hybrid models, the recurrent state of their linear-attention layers (state_cache.py)."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mtplx import kernels
from mtplx.cache import attention
from mtplx.cache.attention import AttentionMetadata
from mtplx.cache.block_manager import HYBRID_PREFIX_CACHE_REASON, BlockManager
from mtplx.cache.kv_cache import PagedKVCache
from mtplx.engine.sequence import Sequence
from mtplx.engine.sampling import SamplerTensors, SamplingParams, draft_params, process_logits
from mtplx.kernels import cpu as cpu_kernels, cycle as cycle_kernels, noise, sampling as sampling_kernels
from mtplx.engine.speculative import greedy_outcome, rejection_outcome
from mtplx.cache.state_cache import RecurrentStateCache
from mtplx.models.base import CausalLM
from mtplx.models.config import ModelConfig
from mtplx.models.mtp import MTPHead, whole_vocabulary

log = logging.getLogger("mtplx")

# How a verify forward's recurrent state is cut back to the accepted prefix (hybrid models):
# "capture" keeps each verified token's state update and rebuilds the state after the accepted
# prefix (one small matmul per layer); "reforward" snapshots the state before the verify,
# restores it and feeds the accepted tokens again. benchmarks/hybrid_cpu.py measures both:
# capture is the faster (no second forward on a partial acceptance).
STATE_COMMIT_MODES = ("capture", "reforward")
DEFAULT_STATE_COMMIT = "capture"


# the kinds of chained cycle (each its own graph): every row greedy; rows may sample, their
# drafts the head's argmax ("sample") or, for rows of the mirror draft policy, sampled from the
# head's distribution (``sampling.draft_params``: "mirror"); "_filters": some row asks for top-k or
# min-p (the graph sorts the vocabulary for top-k and applies min-p to the verify; the plain
# variants process temperature and top-p alone, what most requests send)
CYCLE_VARIANTS = ("greedy", "sample", "sample_filters", "mirror", "mirror_filters")

# the row counts CUDA graphs are captured for (cuda_graphs.py): a batch runs in the smallest that
# holds it, the rest padding rows
ROW_BUCKETS = (1, 2, 4, 8)


def row_bucket(rows: int) -> int:
    """The rows a batch of ``rows`` computes in a captured graph (past the largest bucket, its own)."""
    return next((b for b in ROW_BUCKETS if b >= rows), rows)


# a greedy cycle's integer inputs (ModelRunner.cycle_layout), in the order a graph's buffer holds them
CYCLE_FIELDS = ("catch_up_ids", "catch_up_pos", "catch_up_slots", "last", "draft_pos", "draft_slots", "primary",
                "verify_pos", "verify_slots", "depths")


@dataclass
class CycleInputs:
    """Device inputs of one greedy MTP cycle (``ModelRunner.greedy_cycle``) over R rows.

    catch_up_ids / catch_up: the head's catch-up pairs [R, W] and their metadata (padded to W);
    last: [R] index of each row's last real catch-up pair (its output is draft 1's state);
    draft_metas: one single-token metadata per further head step (depth - 1 of them);
    primary: [R, 1] the committed token the verify starts from; verify: its metadata
    [R, depth + 1]; depths: [R, 1] each row's own depth (acceptance is capped there)."""

    catch_up_ids: torch.Tensor
    catch_up: AttentionMetadata
    last: torch.Tensor
    draft_metas: list[AttentionMetadata]
    primary: torch.Tensor
    verify: AttentionMetadata
    depths: torch.Tensor

    @classmethod
    def from_fields(cls, f: dict[str, torch.Tensor], tables: torch.Tensor) -> "CycleInputs":
        """From [R, n] long tensors named as ``ModelRunner.cycle_layout``'s fields, and the
        rows' block tables."""
        meta = lambda pos, slots: AttentionMetadata(pos, slots, tables)  # noqa: E731
        return cls(catch_up_ids=f["catch_up_ids"], catch_up=meta(f["catch_up_pos"], f["catch_up_slots"]),
                   last=f["last"][:, 0],
                   draft_metas=[meta(f["draft_pos"][:, j: j + 1], f["draft_slots"][:, j: j + 1])
                                for j in range(f["draft_pos"].shape[1])],
                   primary=f["primary"], verify=meta(f["verify_pos"], f["verify_slots"]), depths=f["depths"])


@dataclass
class _PendingVerify:
    """A verify forward whose recurrent state waits for ``commit_state``."""

    seq_ids: list
    seqs: list[Sequence]
    token_rows: list[list[int]]
    starts: list[int]
    slots: torch.Tensor
    snapshot: list | None = None  # "reforward" only: per layer (conv, ssm) from before the verify


class ModelRunner:
    def __init__(self, model: CausalLM, head: MTPHead | None, *, num_blocks: int, block_size: int = 16,
                 state_commit: str = DEFAULT_STATE_COMMIT, kv_dtype: torch.dtype | None = None):
        cfg = model.config
        param = model.model.embed_tokens.weight  # lm_head may be quantized
        self.model, self.head = model, head
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        self.prefix_cache_disabled_reason = HYBRID_PREFIX_CACHE_REASON if cfg.is_hybrid else None
        self.blocks = BlockManager(num_blocks, block_size, self.prefix_cache_disabled_reason)
        self.cache = PagedKVCache(
            num_layers=cfg.num_kv_layers + (len(head.layers) if head is not None else 0),
            num_blocks=num_blocks, block_size=block_size, kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, hidden_size=self.trunk_width, dtype=self.dtype, device=self.device,
            kv_dtype=kv_dtype,
        )
        self.states = make_state_cache(cfg, self.dtype, self.device) if cfg.is_hybrid else None
        self._chain_buffers: dict[tuple[int, int], object] = {}  # eager chained cycles' inputs
        # CUDA graphs captured at start-up (cuda_graphs.GraphCache), consulted before a forward
        # runs eagerly; None: every forward is eager
        self.graphs = None
        self.cache.states = self.states
        if state_commit not in STATE_COMMIT_MODES:
            raise ValueError(f"state_commit must be one of {', '.join(STATE_COMMIT_MODES)}, got {state_commit!r}")
        self.state_commit = state_commit
        self._pending: _PendingVerify | None = None
        self._kv_overflow_warned = False

    def warn_on_kv_overflow(self) -> None:
        """Log once where a key or value written to a float16 cache of a wider model went past
        float16's range (65,504) and became inf: attention over it is wrong from there on."""
        if self.cache.kv_dtype != torch.float16 or self.dtype == torch.float16 or self._kv_overflow_warned:
            return
        if attention.took_kv_overflow():
            self._kv_overflow_warned = True
            log.warning("a key or value past float16's range (65,504) was written to the KV cache as inf: "
                        "outputs from here on may be wrong; load with kv_dtype='float32' (--kv-dtype float32)")

    @contextmanager
    def eager(self):
        """Inside, every forward runs eagerly (the captured graphs are not consulted): for
        checks and benchmarks that compare the two."""
        graphs, self.graphs = self.graphs, None
        try:
            yield
        finally:
            self.graphs = graphs

    def compile_kernels(self) -> int:
        """On CUDA, compile at start-up the attention kernel variants forwards can launch, so
        no request waits on a compile (graph captures compile only their own shapes; a pre-feed
        of a few pairs, a long prompt, a hybrid model or an eager runner launch others). Returns
        the launches."""
        if self.device.type != "cuda" or not (kernels.ENABLED and attention.triton_kernel.available()):
            return 0
        cfg = self.model.config
        return attention.triton_kernel.compile_variants(
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, self.block_size, self.dtype,
            self.device, max_query=attention.triton_kernel.SHORT_QUERY)

    # -- recurrent state (hybrid models; no-ops otherwise) ---------------------------------
    @torch.inference_mode()
    def commit_state(self, seqs: list[Sequence], kept: list[int]) -> None:
        """After a ``trunk(..., keep_states=True)`` verify over the same rows: keep each row's
        recurrent state after its first kept[r] fed tokens (accepted drafts + 1)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if [s.seq_id for s in seqs] != pending.seq_ids:
            raise ValueError("commit_state rows differ from the verify forward's rows")
        # rows that kept every fed token already hold the right state (the forward wrote it)
        redo = [r for r, (row, k) in enumerate(zip(pending.token_rows, kept)) if k < len(row)]
        if not redo:
            self.states.discard_captured()
            return
        index = torch.tensor(redo, dtype=torch.long, device=self.device)
        slots = pending.slots.index_select(0, index)
        if self.state_commit == "capture":
            kept_rows = torch.tensor([kept[r] for r in redo], dtype=torch.long, device=self.device)
            self.states.commit_captured(slots, kept_rows, index)
        else:
            self.states.restore(slots, pending.snapshot, index)
            self.trunk([pending.seqs[r] for r in redo], [pending.token_rows[r][:kept[r]] for r in redo],
                       [pending.starts[r] for r in redo])

    # -- metadata -----------------------------------------------------------------------
    def metadata(self, seqs: list[Sequence], starts: list[int], lens: list[int]) -> AttentionMetadata:
        """Row r holds lens[r] new tokens at sequence indices starts[r] .. starts[r]+lens[r]-1,
        padded to max(lens) (padding repeats the last position and writes to scratch)."""
        q = max(lens)
        bs = self.block_size
        positions, slots, tables = [], [], []
        for seq, start, n in zip(seqs, starts, lens):
            table, pos, slot = self.row_layout(seq, start, n, q)
            positions.append(pos)
            slots.append(slot)
            tables.append(table[: (start + n + bs - 1) // bs])
        width = max(len(t) for t in tables)
        tables = [t + [self.cache.scratch_block] * (width - len(t)) for t in tables]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        meta = AttentionMetadata(as_tensor(positions), as_tensor(slots), as_tensor(tables))
        if self.states is not None:
            if any(s.state_slot is None for s in seqs):
                raise ValueError("a sequence has no recurrent-state slot: admit it first (KVAllocator.admit)")
            meta.state_slots = as_tensor([s.state_slot for s in seqs])
            meta.query_lens = as_tensor(lens)
        return meta

    def row_layout(self, seq: Sequence, start: int, n: int, q: int) -> tuple[list[int], list[int], list[int]]:
        """(block table, positions, cache slots) of n new tokens at sequence index ``start``,
        padded to q (padding repeats the last position and writes to the scratch slot; n = 0:
        a placeholder row at position start - 1 that writes nothing)."""
        bs = self.block_size
        table = self.blocks.block_table(seq.seq_id)
        if start + n > len(table) * bs:  # a bug: the engine's allocator reserves before every forward
            raise RuntimeError(f"sequence {seq.seq_id}: KV slots up to {start + n} are not reserved "
                               f"(its table covers {len(table) * bs}); reserve before the forward")
        pos = list(range(start, start + n))
        slots = [table[p // bs] * bs + p % bs for p in pos] + [self.cache.scratch_slot] * (q - n)
        return table, pos + [start + n - 1] * (q - n), slots

    def _pad(self, rows: list[list[int]], q: int) -> torch.Tensor:
        return torch.tensor([pad_row(r, q) for r in rows], dtype=torch.long, device=self.device)

    # -- forwards -----------------------------------------------------------------------
    @torch.inference_mode()
    def trunk(self, seqs: list[Sequence], token_rows: list[list[int]], starts: list[int],
              keep_states: bool = False) -> torch.Tensor:
        """Feed token_rows[r] at sequence indices starts[r]... Returns hidden [rows, q, H].

        keep_states: a verify forward; the recurrent state (hybrid models) is then cut back to
        the accepted tokens by ``commit_state``."""
        if self.graphs is not None and (out := self.graphs.forward("trunk", seqs, token_rows, starts)) is not None:
            return out
        lens = [len(r) for r in token_rows]
        meta = self.metadata(seqs, starts, lens)
        if keep_states and self.states is not None:
            self._pending = _PendingVerify([s.seq_id for s in seqs], list(seqs), token_rows, starts,
                                           meta.state_slots)
            if self.state_commit == "capture":
                meta.capture = True
            else:
                self._pending.snapshot = self.states.snapshot(meta.state_slots)
        return self.forward_trunk(self._pad(token_rows, max(lens)), meta)

    @property
    def trunk_width(self) -> int:
        """Width of the trunk's hidden states here: wider than the model's where the head reads
        more than the final-normed state (``MTPHead.trunk_layers``); logits read the first H."""
        return self.head.trunk_width if self.head is not None else self.model.config.hidden_size

    def forward_trunk(self, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The trunk's forward, returning the feature layers the head reads where it reads some."""
        layers = self.head.trunk_layers if self.head is not None else ()
        return self.model(ids, meta, self.cache, layers) if layers else self.model(ids, meta, self.cache)

    @torch.inference_mode()
    def head_forward(self, seqs: list[Sequence], hidden: torch.Tensor, token_rows: list[list[int]],
                     starts: list[int], outputs: bool = True) -> torch.Tensor | None:
        """MTP head over pairs (hidden[r, i], token_rows[r][i]); the pair's entry goes to the
        token's slot starts[r] + i. hidden: [rows, q, H]. Returns head output [rows, q, H]; with
        ``outputs`` False, only the cache entries (``MTPHead.feed``, where no graph fits) and None."""
        # a head fed its own output (narrower than the trunk's where it reads feature layers)
        # replays graphs of its own
        kind = "head" if hidden.shape[-1] == self.trunk_width else "head_own"
        if self.graphs is not None and (out := self.graphs.forward(kind, seqs, token_rows, starts, hidden)) is not None:
            return out if outputs else None
        lens = [len(r) for r in token_rows]
        meta = self.metadata(seqs, starts, lens)
        if not outputs:
            self.head.feed(self.model, hidden, self._pad(token_rows, max(lens)), meta, self.cache)
            return None
        return self.head(self.model, hidden, self._pad(token_rows, max(lens)), meta, self.cache)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.draft_logits(self.model, hidden)

    @torch.inference_mode()
    def greedy_cycle(self, seqs: list[Sequence], backlog: torch.Tensor,
                     depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One MTP cycle with argmax drafts, all on the device (no host sync): the head catches
        up on each row's committed pairs (tokens[head_len: trunk_len + 1] with the trunk hidden
        ``backlog`` [rows, W, H]), drafts ``depth`` argmax tokens, the trunk verifies
        [tokens[trunk_len]] + drafts, and the greedy outcome is computed. Rows without
        penalties or recurrent state (the generator checks). Returns (verify hidden
        [rows, depth + 1, H], verify logits [rows, depth + 1, V], packed [rows, depth + 2]:
        the drafts, the accepted count capped at the row's own depth, the next token)."""
        if self.graphs is not None and (out := self.graphs.cycle(seqs, backlog, depth)) is not None:
            return out
        return self.cycle_forward(self.cycle_inputs(seqs, backlog.shape[1], depth), backlog, depth)

    def cycle_inputs(self, seqs: list[Sequence], width: int, depth: int) -> CycleInputs:
        fields, tables = self.cycle_layout(seqs, width, depth)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        flat, used = flat_tables(tables, len(tables), self.cache.scratch_block)
        return CycleInputs.from_fields({name: as_tensor(rows) for name, rows in fields.items()},
                                       as_tensor(flat).view(len(tables), used))

    def cycle_layout(self, seqs: list[Sequence], width: int,
                     depth: int) -> tuple[dict[str, list[list[int]]], list[list[int]]]:
        """A greedy cycle's integer inputs, per field a list of rows (the catch-up padded to
        ``width`` pairs, the verify to depth + 1 tokens), and each row's block table (which
        must already cover the cycle's writes)."""
        fields: dict[str, list[list[int]]] = {name: [] for name in CYCLE_FIELDS}
        tables = []
        width = width if depth else 0
        for seq in seqs:
            catch_up = seq.tokens[seq.head_len: seq.trunk_len + 1] if depth else []  # depth 0: an AR step
            _, pos, slots = self.row_layout(seq, seq.head_len, len(catch_up), width) if depth else (None, [], [])
            steps = [self.row_layout(seq, *draft_step(seq, j), 1)[1:] for j in range(depth - 1)]
            own = min(seq.depth, depth)  # an MTP row stepped AR (depth 0) verifies one token
            table, verify_pos, verify_slots = self.row_layout(seq, seq.trunk_len, 1 + own, depth + 1)
            row = {"catch_up_ids": pad_row(catch_up, width), "catch_up_pos": pos, "catch_up_slots": slots,
                   "last": [max(len(catch_up) - 1, 0)], "draft_pos": [p[0] for p, _ in steps],
                   "draft_slots": [sl[0] for _, sl in steps], "primary": [seq.tokens[seq.trunk_len]],
                   "verify_pos": verify_pos, "verify_slots": verify_slots, "depths": [own]}
            for name in CYCLE_FIELDS:
                fields[name].append(row[name])
            tables.append(table)
        return fields, tables

    # -- chained greedy cycles (engine/chain.py) ------------------------------------------------
    # A cycle is started from the host's state (``start_cycle``), then each next one before the
    # last one's outcome is read (``next_cycle``): the cycle's own tail (``advance_cycle``)
    # wrote the next inputs on the device. With CUDA graphs each is one replay; eagerly (CPU
    # tests, shapes without a graph) the same work runs op by op.

    def cycle_buffers(self, rows: int, depth: int, variant: str = "greedy"):
        """The static inputs chained cycles over these rows run from (CycleBuffers): the
        captured cycle graph's, else the eager chain's own. variant: ``CYCLE_VARIANTS`` (rows
        that sample have their settings and noise as inputs too)."""
        if self.graphs is not None and (g := self.graphs.chained(rows, depth, variant)) is not None:
            return g.buffers
        key = (row_bucket(rows), depth, variant)  # a bucket's rows, as a graph's: padding rows run too
        if key not in self._chain_buffers:
            with torch.inference_mode(False):  # written in place outside inference mode too
                width = -(-self.max_row_slots // self.block_size)  # the most blocks a row's table holds
                self._chain_buffers[key] = CycleBuffers(self, key[0], depth, width, variant)
        return self._chain_buffers[key]

    def lookahead(self, seq: Sequence, depth: int) -> int:
        """KV slots a row's table must cover before a chained cycle starts: its committed
        length plus three cycles' worth (one may be in flight, then the one starting, whose
        tail computes the slots of the one after it from the table)."""
        return seq.trunk_len + 3 * (depth + 1)

    @torch.inference_mode()
    def start_cycle(self, seqs: list[Sequence], backlog: torch.Tensor | None, depth: int,
                    variant: str = "greedy") -> CycleLaunch:
        """A cycle from the host's state (``greedy_cycle``'s contract, argmax drafts; the
        catch-up at most depth + 1 pairs), leaving the next cycle's inputs on the device.
        variant "sample" / "sample_filters" (mirror too): rows may sample (exact rejection sampling of their
        drafts, all on the device; their settings are written now, their noise planned before
        each launch and drawn inside the cycle). The rows' tables
        must cover ``lookahead`` (``CycleChain.reserve``)."""
        b = self.cycle_buffers(len(seqs), depth, variant)
        if b.sampling is not None:
            b.sampling.write(seqs)
        if self.graphs is not None and self.graphs.chained(len(seqs), depth, variant) is not None:
            return self.graphs.start_cycle(seqs, backlog, depth, variant)
        values, width = b.values(seqs)
        b.fill(torch.tensor(values, dtype=torch.long), width)
        if backlog is not None:  # none at depth 0
            b.backlog[: len(seqs), : backlog.shape[1]].copy_(backlog)
        return self._run_chained(b, seqs, depth)

    @torch.inference_mode()
    def next_cycle(self, seqs: list[Sequence], depth: int, variant: str = "greedy",
                   ghosts: frozenset[int] = frozenset(), freeze: list[int] = ()) -> CycleLaunch:
        """The cycle after the last one started over these rows, from its device-side inputs.
        As for ``start_cycle``, the rows' tables must cover ``lookahead`` (``CycleChain.reserve``).
        ghosts: indices of rows that left (ended or released) and run on as padding, their
        outcome unread; freeze: those that left since the last launch (``CycleBuffers.freeze``)."""
        g = self.graphs.chained(len(seqs), depth, variant) if self.graphs is not None else None
        b = g.buffers if g is not None else self.cycle_buffers(len(seqs), depth, variant)
        b.freeze(freeze)
        if g is not None:
            return self.graphs.run_chained(seqs, depth, variant, ghosts)
        return self._run_chained(b, seqs, depth, ghosts)

    @torch.inference_mode()
    def join_cycle(self, seqs: list[Sequence], depth: int, variant: str, joining: list[int],
                   backlog: torch.Tensor | None) -> None:
        """Write the rows at ``joining`` (indices into ``seqs``, a chain's rows: places of rows
        that left) into the chained cycles' inputs from the host's state, as ``start_cycle``
        writes every row's (``backlog``: their head catch-up's trunk hidden states, in the
        same order; None at depth 0); the other rows' inputs stay as the last cycle wrote them.
        Queued on the stream after the cycle in flight, which reads the inputs it had. The
        rows' tables must cover ``lookahead`` (``CycleChain.reserve``)."""
        b = self.cycle_buffers(len(seqs), depth, variant)
        b.join([seqs[r] for r in joining], joining, backlog)
        if b.sampling is not None:
            b.sampling.write(seqs)

    def upload_tables(self, rows: int, depth: int, tables: list[list[int]], variant: str = "greedy") -> None:
        """Copy grown block tables into the chained cycles' inputs for these rows (the rest of
        the inputs stay as the last cycle wrote them)."""
        if self.graphs is not None and self.graphs.chained(rows, depth, variant) is not None:
            self.graphs.upload_tables(rows, depth, tables, variant)
        else:
            self.cycle_buffers(rows, depth, variant).set_tables(tables)

    @property
    def filters_apart(self) -> bool:
        """Whether cycles whose rows ask for top-k or min-p need graphs of their own (the
        "_filters" ``CYCLE_VARIANTS``): on the PyTorch sampling path; the sampling kernels
        apply each row's filters in every graph."""
        return not sampling_kernels.available(self.device)

    def can_chain(self, rows: int, depth: int, variant: str = "greedy") -> bool:
        """Whether cycles over this many rows at this depth can chain: with CUDA graphs, where
        their cycle graph was captured; eagerly, always."""
        return self.graphs.chained(rows, depth, variant) is not None if self.graphs is not None else True

    @property
    def max_row_slots(self) -> int:
        """The most KV slots one row may take: the pool, capped by the model's context (and
        by the captured graphs' block tables)."""
        slots = min(self.model.config.max_position_embeddings, self.blocks.num_blocks * self.block_size)
        return min(slots, self.graphs.max_context) if self.graphs is not None else slots

    def _run_chained(self, b, seqs: list[Sequence], depth: int, ghosts: frozenset[int] = frozenset()) -> CycleLaunch:
        b.draw_noise(seqs, ghosts)
        hidden, _, packed = self.cycle_and_advance(b, depth)
        return CycleLaunch(list(seqs), depth, hidden[: len(seqs)], packed.clone(), None, ghosts)

    def cycle_and_advance(self, b, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One cycle from CycleBuffers ``b``, then the next cycle's inputs written into them
        (the work a chained cycle's CUDA graph captures)."""
        hidden, logits, packed = self.cycle_forward(b.inputs, b.backlog, depth, b.sampling)
        advance_cycle(b.fields, b.tables, packed, self.block_size, self.cache.scratch_slot)
        if depth:
            b.backlog.copy_(hidden)
        return hidden, logits, packed

    def cycle_forward(self, c: CycleInputs, backlog: torch.Tensor, depth: int,
                      sampling: CycleSampling | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``greedy_cycle``'s device work from prepared inputs (CUDA graphs capture this).
        Depth 0 is an AR step: no head work, the outcome (0, next token). sampling: for rows
        that may sample, their settings and noise (``CycleSampling``): the verify's logits are
        processed per row and the drafts accepted by exact rejection sampling from that noise
        (greedy rows' one-hot distributions give the greedy outcome); mirror rows draft from the
        head's distribution q (``sampling.draft_params``), kept for their acceptance. None:
        greedy acceptance."""
        tokens, draft_probs = [], []
        if sampling is not None:
            sampling.generate()
        if depth:
            out = self.head(self.model, backlog, c.catch_up_ids, c.catch_up, self.cache)
            h = out[torch.arange(out.shape[0], device=out.device), c.last]
        for j in range(depth):
            picks, q = self._draft(h, j, sampling)
            if q is not None:
                draft_probs.append(q)
            tokens.append(picks)
            if j + 1 < depth:
                h = self.head(self.model, h[:, None], picks[:, None], c.draft_metas[j], self.cache)[:, 0]
        drafts = torch.stack(tokens, dim=1) if tokens else c.primary[:, :0]
        hidden = self.forward_trunk(torch.cat([c.primary, drafts], dim=1), c.verify)
        logits = self.model.compute_logits(hidden)
        if sampling is None:
            return hidden, logits, _greedy_outcome(logits, drafts, c.depths)
        if not depth and sampling_kernels.usable(logits):
            # an AR step: its token is the race's winner over p, which the processing kernel
            # draws in its last pass (what the rejection kernel draws at depth 0, a second pass)
            s = sampling.sampler
            _, picks = sampling_kernels.process(logits, s.greedy, s.temperature, s.top_k, s.top_p, s.min_p,
                                                race=sampling.race[:, None])
            return hidden, logits, greedy_outcome(picks, drafts, c.depths)
        probs = process_logits(logits, sampling.sampler, top_k=sampling.filters, min_p=sampling.filters)
        q = torch.stack(draft_probs, dim=1) if draft_probs else None
        return hidden, logits, rejection_outcome(probs, q, drafts, c.depths, sampling.uniforms, sampling.race)

    def _draft(self, h: torch.Tensor, j: int,
               sampling: CycleSampling | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft j of every row from the head's output h [R, H] -> (tokens [R], q [R, V] in a
        mirror cycle, else None). With a pruned draft vocabulary an argmax draft, and on the
        kernel path a mirror row's distribution too, come from the vocabulary's own logits
        (``MTPHead.draft_subset``: the same drafts, less work)."""
        mirror = sampling is not None and sampling.mirror
        subset = self.head.draft_subset(self.model, h)
        if subset is None:
            logits = self.head.draft_logits(self.model, h)
            return sampling.draft(logits, j) if mirror else (first_max(logits), None)
        kept, ids = subset
        return sampling.draft(kept, j, ids) if mirror else (ids[first_max(kept)], None)


class CycleSampling:
    """What a chained cycle whose rows may sample reads besides its integers (static inputs of
    its graph): the rows' sampler settings (written when the rows change), and the noise of each
    sampling row, from its own stream (``sampling.NoiseStream``). Before every launch the host
    plans each row's fills (``draw``: one copy of [rows, depth + 3] int64: the row's key, its
    draft races' fills (a mirror row's), its acceptance uniforms' fill and its race's fill), the
    fills the host path draws, in its order; the cycle draws them on the device (``generate``,
    inside the captured graph: three launches for all rows). The same numbers, so a seed gives the
    same tokens chained or not."""

    def __init__(self, rows: int, depth: int, vocab: int, variant: str, device: torch.device):
        self.depth, self.filters, self.mirror = depth, variant.endswith("_filters"), variant.startswith("mirror")
        self.sampler = SamplerTensors(rows, device)
        self.draft_sampler = SamplerTensors(rows, device) if self.mirror else None  # mirror drafts' q
        self.uniforms = torch.zeros(rows, max(depth, 1), dtype=torch.float32, device=device)
        self.race = torch.ones(rows, vocab, dtype=torch.float32, device=device)
        self.plan = torch.tensor([_idle_plan(depth)] * rows, dtype=torch.long, device=device)
        if self.mirror:
            self.mirror_rows = torch.zeros(rows, 1, dtype=torch.bool, device=device)
            self.onehot_rows = torch.ones(rows, 1, dtype=torch.bool, device=device)  # drafts an argmax
            self.draft_race = torch.ones(rows, depth, vocab, dtype=torch.float32, device=device)

    def write(self, seqs: list[Sequence]) -> None:
        """These rows' settings (a bucket's padding rows are greedy)."""
        self.write_params([s.params for s in seqs], [_mirrors(s) for s in seqs])

    def write_params(self, params: list[SamplingParams], mirrors: list[bool]) -> None:
        """Rows' sampler settings, and in a mirror cycle which rows draft from the head's
        distribution (the others draft its argmax)."""
        self.sampler.write(params)
        if self.mirror:
            self.draft_sampler.write([draft_params(p) for p in params])
            rows = [[m] for m in mirrors] + [[False]] * (self.mirror_rows.shape[0] - len(mirrors))
            self.mirror_rows.copy_(torch.tensor(rows), non_blocking=True)
            torch.logical_not(self.mirror_rows, out=self.onehot_rows)

    def draw(self, seqs: list[Sequence | None]) -> None:
        """Plan each sampling row's fills for the cycle about to launch (``generate`` draws them):
        a mirror row's draft races, depth by depth, then the acceptance uniforms (none at depth
        0), then the emitted token's race (``speculative.draw_noise``'s order). Greedy and padding
        rows take none (None: a chain's row that left, ``CycleBuffers.freeze``): their noise
        comes from fills no stream uses (finite and above 0, and their one-hot distributions
        decide their tokens whatever it is; a ghost's tokens go unread). Queued on the stream
        after the cycle before it, which read the last plan."""
        plan = []
        for seq in seqs:
            if seq is None or seq.params.greedy:
                plan.append(_idle_plan(self.depth))
                continue
            n, stream = min(seq.depth, self.depth), seq.noise
            mirror = self.mirror and _mirrors(seq)
            drafts = [stream.take() if mirror and j < n else -1 - j for j in range(self.depth)]
            uniforms = stream.take() if n else -1 - self.depth
            plan.append([noise.signed_key(stream.key), *drafts, uniforms, stream.take()])
        plan += [_idle_plan(self.depth)] * (self.plan.shape[0] - len(seqs))
        self.plan.copy_(torch.tensor(plan, dtype=torch.long), non_blocking=True)

    def generate(self) -> None:
        """The planned noise into the buffers the cycle reads (the first work of a cycle)."""
        keys, d = self.plan[:, 0], self.depth
        if self.mirror and d:
            noise.fill(self.draft_race, keys, self.plan[:, 1: d + 1], exponential=True)
        noise.fill(self.uniforms[:, None], keys, self.plan[:, d + 1: d + 2], exponential=False)
        noise.fill(self.race[:, None], keys, self.plan[:, d + 2:], exponential=True)

    def draft(self, head_logits: torch.Tensor, j: int, ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft j for every row from the head's logits [R, V]: a mirror row samples from its
        draft distribution q (``sampling.draft_params``, by an exponential race); every other
        row keeps the argmax, its q a one-hot (exactly what a one-hot draft's acceptance
        computes). Returns (drafts [R], q [R, V]).
        ids [N]: head_logits [R, N] are a pruned draft vocabulary's. The kernel makes q over
        those N tokens (zero elsewhere, as over the whole row) and the race reads the same noise
        entries, so the draft is the one the whole row gives; the PyTorch path reads whole rows."""
        if sampling_kernels.usable(head_logits):  # one launch: q (one-hot where not mirror) and the race
            s = self.draft_sampler  # no filters: the kernel's pass without a threshold search
            q, picks = sampling_kernels.process(head_logits[:, None], self.onehot_rows, s.temperature, s.top_k,
                                                s.top_p, s.min_p, race=self.draft_race[:, j: j + 1], ids=ids,
                                                vocab_size=self.race.shape[1])
            return picks[:, 0], q[:, 0]
        if ids is not None:
            head_logits = whole_vocabulary(head_logits, ids, self.race.shape[1])
        q = process_logits(head_logits[:, None], self.draft_sampler, top_k=False, top_p=False, min_p=False)[:, 0]
        sampled = torch.argmax(q / self.draft_race[:, j], dim=-1)
        picks = torch.where(self.mirror_rows[:, 0], sampled, head_logits.argmax(-1))
        hot = torch.zeros_like(q).scatter_(1, picks[:, None], 1.0)
        return picks, torch.where(self.mirror_rows, q, hot)


def first_max(logits: torch.Tensor) -> torch.Tensor:
    """The first maximum over the vocabulary: one Triton pass on CUDA (``kernels.sampling.argmax``,
    which passes over a NaN), elsewhere ``torch_argmax``."""
    return sampling_kernels.argmax(logits) if sampling_kernels.usable(logits) else torch_argmax(logits)


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) (the first maximum, the first NaN where a row has one): on the CPU
    one C++ pass a row (``kernels.cpu.argmax``)."""
    return cpu_kernels.argmax(logits) if cpu_kernels.argmax_usable(logits) else logits.argmax(-1)


def _greedy_outcome(logits: torch.Tensor, drafts: torch.Tensor, depths: torch.Tensor | None) -> torch.Tensor:
    """``greedy_outcome(first_max(logits), drafts, depths)``: on the CPU one C++ call
    (``kernels.cpu.greedy_verify``), where the PyTorch ops' dispatch cost more than their work."""
    if cpu_kernels.argmax_usable(logits) and logits.dim() == 3 and drafts.dtype == torch.long \
            and (depths is None or depths.dtype == torch.long):
        return cpu_kernels.greedy_verify(logits, drafts, depths)
    return greedy_outcome(first_max(logits), drafts, depths)


def _idle_plan(depth: int) -> list[int]:
    """A row's noise plan that takes no stream's fills (greedy and padding rows): key 0, fills
    below 0, which no stream draws."""
    return [0, *(-1 - j for j in range(depth + 2))]


def _mirrors(seq: Sequence) -> bool:
    """Whether a row drafts from the head's distribution (the mirror policy at temperature > 0)."""
    return not seq.params.greedy and seq.draft_policy == "mirror"


class CycleBuffers:
    """The static inputs of a whole greedy MTP cycle over R rows at one depth (what the cycle
    graph reads), the catch-up padded to depth + 1 pairs, and how to fill them for a batch of
    sequences. Every integer input is a view of ``ints``, so one copy fills them all (plus one
    for the block-table columns in use). Nothing here is CUDA-specific: CPU tests run
    ``cycle_forward`` over these buffers to check the layout against the eager cycle."""

    def __init__(self, runner: ModelRunner, rows: int, depth: int, table_width: int, variant: str = "greedy"):
        dev, W = runner.device, depth + 1
        C = W if depth else 0  # depth 0 (an AR step) has no head catch-up
        self.runner, self.depth = runner, depth
        widths = {"catch_up_ids": C, "catch_up_pos": C, "catch_up_slots": C, "last": 1,
                  "draft_pos": max(depth - 1, 0), "draft_slots": max(depth - 1, 0), "primary": 1,
                  "verify_pos": W, "verify_slots": W, "depths": 1}
        self.ints = torch.zeros(rows * sum(widths.values()), dtype=torch.long, device=dev)
        self.fields, at = {}, 0  # name -> [rows, n] view of ints, in CYCLE_FIELDS order
        for name in CYCLE_FIELDS:
            self.fields[name] = self.ints[at: at + rows * widths[name]].view(rows, widths[name])
            at += rows * widths[name]
        for name in ("catch_up_slots", "draft_slots", "verify_slots"):
            self.fields[name].fill_(runner.cache.scratch_slot)
        self.tables = torch.full((rows, table_width), runner.cache.scratch_block, dtype=torch.long, device=dev)
        self.backlog = torch.zeros(rows, C, runner.trunk_width, dtype=runner.dtype, device=dev)
        self.inputs = CycleInputs.from_fields(self.fields, self.tables)
        self.sampling = None  # rows that may sample: their settings and noise (CycleSampling)
        if variant != "greedy":
            self.sampling = CycleSampling(rows, depth, runner.model.config.vocab_size, variant, dev)

    def draw_noise(self, seqs: list[Sequence], ghosts: frozenset[int] = frozenset()) -> None:
        """The sampling rows' noise for the cycle about to launch (``CycleSampling.draw``);
        ``ghosts``' rows (padding now) take none."""
        if self.sampling is not None:
            self.sampling.draw([None if r in ghosts else s for r, s in enumerate(seqs)])

    def freeze(self, rows: list[int]) -> None:
        """Make these rows padding rows from the next cycle on, as ``values`` writes a bucket's:
        every slot they write becomes the scratch slot, so their cycles keep their inputs
        (``advance_cycle``) and write no KV; their positions go to 0 and their tables to the
        scratch block, so their attention reads one slot, not their old context. For rows that
        left a chain: their blocks may be another row's by then. Device fills, no copy from the
        host (which would wait for the cycle in flight)."""
        cache = self.runner.cache
        for r in rows:
            for name, view in self.fields.items():
                view[r].fill_(_padding_value(name, cache.scratch_slot))
            self.tables[r].fill_(cache.scratch_block)

    def join(self, seqs: list[Sequence], rows: list[int], backlog: torch.Tensor | None) -> None:
        """Rows ``rows`` become ``seqs``' (a chain's joining rows): their fields and whole
        table rows in two scatters from one asynchronous copy to the device, then their backlog."""
        fields, tables = self.runner.cycle_layout(seqs, self.depth + 1, self.depth)
        ints, table_cells, values, table_values = [], [], [], []
        for name, view in self.fields.items():
            at, width = view.storage_offset() - self.ints.storage_offset(), view.shape[1]
            for r, row in zip(rows, fields[name]):
                ints += range(at + r * width, at + (r + 1) * width)
                values += row
        width = self.tables.shape[1]
        for r, table in zip(rows, tables):
            table_cells += range(r * width, (r + 1) * width)
            table_values += table + [self.runner.cache.scratch_block] * (width - len(table))
        staged = torch.tensor(ints + table_cells + values + table_values, dtype=torch.long)
        staged = staged.to(self.ints.device, non_blocking=True)  # (pageable: staged by the copy at once)
        n, m = len(ints), len(table_cells)
        self.ints.index_copy_(0, staged[:n], staged[n + m: 2 * n + m])
        self.tables.view(-1).index_copy_(0, staged[n: n + m], staged[2 * n + m:])
        if backlog is not None:
            for i, r in enumerate(rows):
                self.backlog[r, : backlog.shape[1]].copy_(backlog[i])

    def values(self, seqs: list[Sequence]) -> tuple[list[int], int]:
        """(every field's values for these rows, padding rows included, then the block-table
        columns in use, row by row; that column count)."""
        scratch_slot, scratch_block = self.runner.cache.scratch_slot, self.runner.cache.scratch_block
        fields, tables = self.runner.cycle_layout(seqs, self.depth + 1, self.depth)
        pad = self.tables.shape[0] - len(seqs)
        values = []
        for name, view in self.fields.items():
            for row in fields[name]:
                values += row
            values += [_padding_value(name, scratch_slot)] * (pad * view.shape[1])
        flat, width = flat_tables(tables, self.tables.shape[0], scratch_block)
        return values + flat, width

    def fill(self, source: torch.Tensor, width: int) -> None:
        """Copy ``values``' output (as a long tensor, e.g. pinned staging) into the buffers."""
        copy_in(source, self.ints, self.tables, width)

    def set_tables(self, tables: list[list[int]], staging: torch.Tensor | None = None) -> None:
        """Copy the rows' block tables in (through pinned ``staging`` where given), leaving
        the other inputs as they are (a chained cycle wrote them)."""
        flat, width = flat_tables(tables, self.tables.shape[0], self.runner.cache.scratch_block)
        source = torch.tensor(flat, dtype=torch.long)
        if staging is not None:
            staging[: len(flat)].copy_(source)
            source = staging[: len(flat)]
        self.tables[:, :width].copy_(source.view(-1, width), non_blocking=True)


def _padding_value(field: str, scratch_slot: int) -> int:
    """A padding row's value of a cycle field: its slots the scratch slot (it writes no KV), 0 elsewhere."""
    return scratch_slot if field.endswith("slots") else 0


def flat_tables(tables: list[list[int]], rows: int, scratch_block: int) -> tuple[list[int], int]:
    """Block tables padded with the scratch block to the widest and to ``rows`` rows, flattened
    row by row; that width."""
    width = max(len(t) for t in tables)
    flat = []
    for t in tables:
        flat += t + [scratch_block] * (width - len(t))
    return flat + [scratch_block] * ((rows - len(tables)) * width), width


def copy_in(source: torch.Tensor, ints: torch.Tensor, tables: torch.Tensor, width: int) -> None:
    """The first ints.numel() values into ``ints``, the next rows * width into the first
    ``width`` columns of ``tables`` (two copies, asynchronous from pinned memory)."""
    n, rows = ints.numel(), tables.shape[0]
    ints.copy_(source[:n], non_blocking=True)
    tables[:, :width].copy_(source[n: n + rows * width].view(rows, width), non_blocking=True)


def draft_step(seq: Sequence, j: int) -> tuple[int, int]:
    """(start, tokens) of a row's head step after draft j + 1 (it feeds that draft at
    trunk_len + 1 + j). A step the row's own depth does not need (a batch drafts to its deepest
    row) is a placeholder: no token, no KV written, no block taken past the row's own cycle."""
    if j + 1 < seq.depth:
        return seq.trunk_len + 1 + j, 1
    return seq.trunk_len + 1, 0


def advance_cycle(fields: dict[str, torch.Tensor], tables: torch.Tensor, packed: torch.Tensor,
                  block_size: int, scratch_slot: int) -> None:
    """In place, with device ops only: the next greedy cycle's integer inputs from this one's
    outcome (``packed``: drafts, accepted count a, next token), the values ``cycle_layout``
    gives once the host has committed that outcome: the a accepted drafts and the next token
    are the head's catch-up (a + 1 pairs from this cycle's first verify position + 1), the
    next token the primary, the verify starts a + 1 further on. Rows whose verify writes the
    scratch slot (a bucket's padding rows) keep their inputs. The block tables must already
    cover the next cycle's positions (the caller takes the blocks). On CUDA one launch
    (``kernels/cycle.py``), these ops elsewhere."""
    if cycle_kernels.usable(packed):
        return cycle_kernels.advance_cycle(fields, tables, packed, block_size, scratch_slot)
    depth = packed.shape[1] - 2
    accepted, nxt = packed[:, depth: depth + 1], packed[:, depth + 1:]
    f = fields
    live = f["verify_slots"][:, :1] != scratch_slot
    if depth == 0:  # an AR step: the next token goes in at the next position
        pos = f["verify_pos"] + 1
        new = {"primary": nxt, "verify_pos": pos, "verify_slots": _slot_of(tables, pos, block_size)}
    else:
        def slot_of(pos, real):
            return torch.where(real, _slot_of(tables, pos, block_size), scratch_slot)

        start = f["verify_pos"][:, :1] + 1  # where this cycle's accepted tokens go: the catch-up's first pair
        trunk = start + accepted            # the next verify's first position (the new trunk length)
        i = torch.arange(depth + 1, device=packed.device)[None]
        j = i[:, : depth - 1]
        catch_up_pos = start + torch.minimum(i, accepted)
        real_draft = j + 1 < f["depths"]
        draft_pos = torch.where(real_draft, trunk + 1 + j, trunk)
        verify_pos = trunk + torch.minimum(i, f["depths"])
        new = {"catch_up_ids": torch.where(i < accepted, torch.cat([packed[:, :depth], nxt], dim=1), nxt),
               "catch_up_pos": catch_up_pos, "catch_up_slots": slot_of(catch_up_pos, i <= accepted),
               "last": accepted, "draft_pos": draft_pos, "draft_slots": slot_of(draft_pos, real_draft),
               "primary": nxt, "verify_pos": verify_pos, "verify_slots": slot_of(verify_pos, i <= f["depths"])}
    for name, value in new.items():
        f[name].copy_(torch.where(live, value, f[name]))


def _slot_of(tables: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """KV slots of positions [rows, n] through the rows' block tables (positions past a table
    read its last column: callers mask those)."""
    block = tables.gather(1, (pos // block_size).clamp(max=tables.shape[1] - 1))
    return block * block_size + pos % block_size


@dataclass
class CycleLaunch:
    """A greedy cycle started on the device: its outcome reaches the host by ``rows()``.

    seqs: its rows; hidden: its verify hidden states [rows, depth + 1, H] (valid until the same
    buffers run again); host/done: the packed outcome copied to host memory, and the event
    after that copy; ghosts: the indices of rows that had left the chain when it launched
    (padding rows, their outcome meaningless)."""

    seqs: list[Sequence]
    depth: int
    hidden: torch.Tensor
    host: torch.Tensor
    done: torch.cuda.Event | None
    ghosts: frozenset[int] = frozenset()

    def rows(self) -> list[list[int]]:
        """Per row: the drafts, the accepted count, the next token (waits for the device)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host[: len(self.seqs)].tolist()


def pad_row(row: list[int], q: int) -> list[int]:
    """Token ids padded to q by repeating the last (0 for a placeholder row)."""
    return row + [row[-1] if row else 0] * (q - len(row))


def make_state_cache(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> RecurrentStateCache:
    """The recurrent state pool for a hybrid model's linear-attention layers."""
    lin = config.linear
    return RecurrentStateCache(num_layers=config.num_linear_layers, conv_dim=lin.conv_dim,
                               conv_width=lin.conv_kernel - 1, v_heads=lin.num_value_heads,
                               k_dim=lin.key_head_dim, v_dim=lin.value_head_dim, dtype=dtype, device=device)


def recurrent_state_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of recurrent state one sequence holds (conv in ``dtype``, SSM in float32); 0 for
    models without linear attention."""
    if not config.is_hybrid:
        return 0
    lin = config.linear
    conv = lin.conv_dim * (lin.conv_kernel - 1) * torch.empty(0, dtype=dtype).element_size()
    ssm = lin.num_value_heads * lin.key_head_dim * lin.value_head_dim * 4
    return config.num_linear_layers * (conv + ssm)
