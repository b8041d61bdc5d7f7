"""CUDA graphs for the forwards of decoding (AR steps, MTP drafts and verifies) and of prefill.

A decode step of a small model is a few hundred kernel launches; replaying a captured graph
turns them into one. Each (kind, rows bucket, query length) gets its own graph over static
input buffers; a step copies its metadata into those buffers (pinned host memory, async) and
replays. Attention reads the row's real length from the positions buffer on the device (the
Triton kernel's dynamic bound), so one graph serves every context length.

Any other forward of up to PREFILL_GRAPH_TOKENS tokens per row (a prompt, the rest of one
after a prefix-cache hit, the head's pre-feed of a prompt's pairs) runs row by row, in chunks of
at most PREFILL_BUCKETS[-1] tokens, each through the one-row graph of the smallest bucket that
holds it (padding writes to the scratch slot). Eagerly, a prefill is about 10 kernel launches
per layer and several times as many host ops, and on a small model their host time is the
whole time to first token. Longer prompts, rows beyond the largest bucket and hybrid models
run eagerly through ``ModelRunner``.

A greedy MTP cycle (head catch-up, argmax drafts, verify, greedy acceptance) is one graph per
(rows bucket, depth), its catch-up padded to depth + 1 pairs: one input copy, one replay and
one transfer back per cycle, where the step-by-step path paid a copy, a replay and eager
logits/argmax launches per head step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtplx.cache.attention import AttentionMetadata
from mtplx.engine.runner import (CYCLE_VARIANTS, ROW_BUCKETS, CycleBuffers, CycleLaunch, ModelRunner, copy_in,
                                 flat_tables, pad_row)
from mtplx.engine.sequence import Sequence

MAX_GRAPH_QUERY = 8
PREFILL_BUCKETS = (16, 32, 64, 128, 256)  # one-row graphs for chunks of a prompt
PREFILL_GRAPH_TOKENS = 2048  # longer prompts prefill eagerly, in one forward


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor        # [R, q] long  } views of one device buffer, filled by one copy
    positions: torch.Tensor  # [R, q] long  }
    slots: torch.Tensor      # [R, q] long  }
    tables: torch.Tensor     # [R, W] long
    hidden_in: torch.Tensor | None  # [R, q, H] (head graphs)
    out: torch.Tensor        # [R, q, H]
    rows_in: torch.Tensor    # [3 * R * q] long: ids, positions, slots (the buffer behind the three views)
    staging: torch.Tensor    # pinned host memory for rows_in then the used table columns
    copied: torch.cuda.Event  # recorded after the copies out of ``staging``


@dataclass
class _CycleGraph:
    """A whole greedy cycle (``ModelRunner.cycle_and_advance``) over R rows at one depth."""

    graph: torch.cuda.CUDAGraph
    buffers: CycleBuffers
    out: tuple                # (hidden, logits, packed)
    staging: torch.Tensor     # pinned host memory the inputs are copied through
    copied: torch.cuda.Event  # recorded after the copies out of ``staging``
    outcomes: list            # two pinned [R, depth + 2] host copies of ``packed``, used in turn by
    done: list                # chained cycles (one in flight while the other is read); their events
    turn: int = 0


class GraphCache:
    """CUDA graphs captured at start-up for the forwards of decoding and prefill, which
    ``ModelRunner`` consults before it runs a forward eagerly (``runner.graphs``): forwards of
    <= 8 query tokens over <= 8 rows, one-row prefill chunks, whole greedy cycles (chained or
    not). Only the shapes ``capture_all`` captured are replayed; every method answers None
    (run eagerly) for any other. Hybrid models keep the eager path (``enabled`` False)."""

    def __init__(self, runner: ModelRunner, max_context: int):
        self.runner = runner
        self.max_context = max_context
        self.table_width = -(-max_context // runner.block_size)
        self.graphs: dict[tuple, _Graph | _CycleGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.enabled = runner.states is None
        # where a new row's prompt runs beside the chain's cycles, once asked for (``enable_side``)
        self.side: torch.cuda.Stream | None = None
        self._side_pool = self._side_capture = None

    # -- what ModelRunner consults -----------------------------------------------------------
    def forward(self, kind: str, seqs: list[Sequence], token_rows: list[list[int]], starts: list[int],
                hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """A trunk or head forward (``ModelRunner.trunk`` / ``head_forward``'s contract): the
        graph captured for its shape, else row by row through the prefill graphs where those
        take it, else None (run it eagerly)."""
        q = max(len(r) for r in token_rows)
        if self._on_side():
            if kind not in ("trunk", "head"):  # beside the chain: the one-row side graphs alone
                return None
            kind = "side_" + kind
        g = self._captured(kind, len(seqs), q)
        if g is not None:
            return self._replay(g, seqs, token_rows, starts, hidden)
        if self._prefills(len(seqs), q, kind):
            return self._prefill(kind, seqs, token_rows, starts, hidden)
        return None

    def _on_side(self) -> bool:
        """Whether work is being queued on the side stream (a prompt beside the chain)."""
        return self.side is not None and torch.cuda.current_stream(self.runner.device) == self.side

    def enable_side(self) -> torch.cuda.Stream | None:
        """The stream a new row's prompt runs on beside the chain's cycles (``Generator.beside``),
        captured on first use: its own copies ("side_trunk", "side_head") of the trunk's and the
        head's one-row graphs (the decode graphs' query lengths and the prefill chunks: the
        prompt's forwards and the head's pre-feed), so that it runs the same kernels at the same
        shapes as the current stream would, in a graph pool of their own (graphs of one pool
        share their intermediate buffers, so two of them must never run at once) and captured on
        a stream of their own (cuBLAS keys its workspace by stream: graphs captured on one stream
        share it, whatever their pools). None where graphs are off."""
        one_row = sorted((kind, q) for kind, rows, q in self.graphs if kind in ("trunk", "head") and rows == 1)
        if self.side is None and self.enabled and one_row:
            self._side_pool = torch.cuda.graph_pool_handle()
            self._side_capture = _distinct_stream(self.runner.device)
            for kind, q in one_row:  # every one-row trunk and head graph the current stream replays
                self._graph("side_" + kind, 1, q, side=True)
            self.side = _distinct_stream(self.runner.device, self._side_capture)
        return self.side

    def cycle(self, seqs: list[Sequence], backlog: torch.Tensor, depth: int):
        """``ModelRunner.greedy_cycle`` through its captured graph, or None: over 8 rows, or a
        catch-up longer than the graph's (not pre-fed)."""
        g = self._captured("cycle", len(seqs), depth)
        if g is None or backlog.shape[1] > depth + 1:
            return None
        self._fill_cycle(g, seqs, backlog)
        g.graph.replay()
        return tuple(t[: len(seqs)] for t in g.out)

    def chained(self, rows: int, depth: int, variant: str = "greedy") -> _CycleGraph | None:
        """The cycle graph chained cycles over this many rows at this depth replay (variant: a
        ``runner.CYCLE_VARIANTS``), or None."""
        return self._captured(_cycle_kind(variant), rows, depth)

    def start_cycle(self, seqs: list[Sequence], backlog: torch.Tensor | None, depth: int,
                    variant: str = "greedy") -> CycleLaunch:
        """``ModelRunner.start_cycle`` through the cycle graph (``chained`` must have one)."""
        self._fill_cycle(self.chained(len(seqs), depth, variant), seqs, backlog)
        return self.run_chained(seqs, depth, variant)

    def run_chained(self, seqs: list[Sequence], depth: int, variant: str = "greedy",
                    ghosts: frozenset[int] = frozenset()) -> CycleLaunch:
        """Replay the cycle graph from its device-side inputs (drawing the sampling rows' noise
        first; ``ghosts``: rows that left, padding now); its outcome goes to one of two pinned
        host buffers in turn (one is read while the other is written)."""
        g = self.chained(len(seqs), depth, variant)
        g.buffers.draw_noise(seqs, ghosts)
        g.graph.replay()
        host, done = g.outcomes[g.turn], g.done[g.turn]
        g.turn ^= 1
        host.copy_(g.out[2], non_blocking=True)
        done.record()
        return CycleLaunch(list(seqs), depth, g.out[0][: len(seqs)], host, done, ghosts)

    def upload_tables(self, rows: int, depth: int, tables: list[list[int]], variant: str = "greedy") -> None:
        g = self.chained(rows, depth, variant)
        g.copied.synchronize()  # the staging buffer's last copies are done (they preceded a finished cycle)
        g.buffers.set_tables(tables, g.staging)
        g.copied.record()

    # -- replaying ------------------------------------------------------------------------------
    def _prefills(self, rows: int, q: int, kind: str) -> bool:
        """Whether a forward of q tokens per row with no graph of its own runs row by row, in
        chunks, through the prefill graphs: prompt-length forwards (a prompt, a pre-feed), and
        one row's query length between those of the decode graphs and the smallest prefill
        bucket (the rest of a prompt after a prefix-cache hit). Short forwards over more rows
        than the decode graphs take stay one eager forward."""
        return ((q > MAX_GRAPH_QUERY or rows == 1) and q <= PREFILL_GRAPH_TOKENS
                and self._captured(kind, 1, PREFILL_BUCKETS[-1]) is not None)

    def _prefill(self, kind: str, seqs: list[Sequence], token_rows: list[list[int]], starts: list[int],
                 hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's forward in chunks through the one-row prefill graphs; a new [rows, q, H]
        tensor (the graphs' output buffers are overwritten by the next replay; a shorter row's
        padding positions are zero). Rows are independent, so this equals one batched forward
        up to GEMM shapes' rounding."""
        r_ = self.runner
        q = max(len(r) for r in token_rows)
        width = self.graphs[(kind, 1, PREFILL_BUCKETS[-1])].out.shape[-1]
        out = torch.zeros(len(seqs), q, width, dtype=r_.dtype, device=r_.device)
        for r, (seq, row, start) in enumerate(zip(seqs, token_rows, starts)):
            for done in range(0, len(row), PREFILL_BUCKETS[-1]):
                n = min(len(row) - done, PREFILL_BUCKETS[-1])
                g = self.graphs[(kind, 1, _bucket(n, PREFILL_BUCKETS))]
                part = None if hidden is None else hidden[r: r + 1, done: done + n]
                out[r, done: done + n] = self._replay(g, [seq], [row[done: done + n]], [start + done], part)[0, :n]
        return out

    def _replay(self, g: _Graph, seqs, token_rows, starts, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Fill the graph's inputs for these rows, replay it; its output buffer [rows, q, H]."""
        self._load(g, seqs, token_rows, starts)
        if hidden is not None:
            g.hidden_in[: len(seqs), : hidden.shape[1]].copy_(hidden)
        g.graph.replay()
        return g.out[: len(seqs)]

    def _fill_cycle(self, g: _CycleGraph, seqs: list[Sequence], backlog: torch.Tensor | None) -> None:
        """A cycle graph's inputs from the host's state: the integers through pinned staging,
        then the head's backlog (none at depth 0)."""
        values, width = g.buffers.values(seqs)
        g.buffers.fill(_staged(g, values), width)
        g.copied.record()
        if backlog is not None:
            g.buffers.backlog[: len(seqs), : backlog.shape[1]].copy_(backlog)

    def _captured(self, kind: str, rows: int, q: int):
        """The captured graph for ``kind`` ("trunk", "head": q query tokens; "cycle": depth q)
        over this many rows, or None."""
        if not self.enabled or rows > ROW_BUCKETS[-1]:
            return None
        return self.graphs.get((kind, _bucket(rows), q))

    def _load(self, g: _Graph, seqs, token_rows, starts) -> None:
        """Fill the graph's static inputs for these rows with two host-to-device copies (ids,
        positions and slots; then the block-table columns in use). Padding rows read the
        scratch block; table columns past a row's length may hold stale entries, which the
        attention kernel never reads (it stops at the row's last position)."""
        R, q = g.ids.shape
        cache = self.runner.cache
        ids, pos, slots, tables = [], [], [], []
        for seq, row, start in zip(seqs, token_rows, starts):
            table, positions, row_slots = self.runner.row_layout(seq, start, len(row), q)
            ids += pad_row(row, q)
            pos += positions
            slots += row_slots
            tables.append(table)
        pad = (R - len(seqs)) * q
        flat, width = flat_tables(tables, R, cache.scratch_block)
        values = ids + [0] * pad + pos + [0] * pad + slots + [cache.scratch_slot] * pad + flat
        if self._on_side():
            # beside the chain: pinned memory of its own (PyTorch's host allocator keeps it until
            # the copy is done), where the graph's one staging buffer would wait for the copies
            # of its last replay, queued behind the cycle in flight, and stall the host
            copy_in(torch.tensor(values, dtype=torch.long).pin_memory(), g.rows_in, g.tables, width)
        else:
            copy_in(_staged(g, values), g.rows_in, g.tables, width)
            g.copied.record()
        if g.hidden_in is not None:
            g.hidden_in.zero_()

    # -- capturing ------------------------------------------------------------------------------
    def capture_all(self, depths=(1, 2, 3), rows=ROW_BUCKETS) -> int:
        """Capture the graphs a server will need, at start-up. Only these are ever replayed:
        other shapes (a depth above those captured, a pre-feed of a few pairs) run eagerly
        rather than stall a request on a capture. Returns how many graphs there are."""
        if not self.enabled:
            return 0
        r_ = self.runner
        head = r_.head is not None
        depths = [d for d in depths if d + 1 <= MAX_GRAPH_QUERY]
        for r in rows:
            self._graph("trunk", r, 1)
            self._cycle_graph(r, 0)  # a greedy AR step
            for d in depths:
                self._graph("trunk", r, d + 1)
                if head:
                    self._graph("head", r, d + 1)
            if head:
                self._graph("head", r, 1)
                if r_.head.trunk_width != r_.model.config.hidden_size:  # drafts feed its own output
                    self._graph("head_own", r, 1)
                for d in depths:
                    self._cycle_graph(r, d)
            for variant in CYCLE_VARIANTS[1:]:  # cycles whose rows may sample (mirror ones draft)
                if variant.endswith("_filters") and not r_.filters_apart:
                    continue
                for d in ([] if variant.startswith("mirror") else [0]) + (depths if head else []):
                    self._cycle_graph(r, d, variant)
        for q in PREFILL_BUCKETS:
            self._graph("trunk", 1, q)
            if head:
                self._graph("head", 1, q)
        return len(self.graphs)

    def _graph(self, kind: str, rows: int, q: int, side: bool = False) -> _Graph:
        R = _bucket(rows)
        key = (kind, R, q)
        if key not in self.graphs:
            self.graphs[key] = self._capture(kind, R, q, side)
        return self.graphs[key]

    def _capture(self, kind: str, R: int, q: int, side: bool = False) -> _Graph:
        r_ = self.runner
        dev = r_.device
        base = kind.removeprefix("side_")  # side_*: a copy in the side stream's pool (``enable_side``)
        H = r_.trunk_width if base == "head" else r_.model.config.hidden_size  # "head_own": its own output
        trunk = base == "trunk"
        long = dict(dtype=torch.long, device=dev)
        rows_in = torch.zeros(3, R, q, **long)
        ids, positions, slots = rows_in.unbind(0)
        slots.fill_(r_.cache.scratch_slot)
        tables = torch.full((R, self.table_width), r_.cache.scratch_block, **long)
        hidden_in = torch.zeros(R, q, H, dtype=r_.dtype, device=dev) if not trunk else None
        meta = AttentionMetadata(positions, slots, tables)

        def forward():
            if not trunk:
                return r_.head(r_.model, hidden_in, ids, meta, r_.cache)
            return r_.forward_trunk(ids, meta)

        graph, out = self._capture_forward(forward, side)
        staging = torch.empty(3 * R * q + R * self.table_width, dtype=torch.long, pin_memory=True)
        copied = torch.cuda.Event()
        copied.record()
        return _Graph(graph, ids, positions, slots, tables, hidden_in, out, rows_in.view(-1), staging, copied)

    def _capture_forward(self, forward, side: bool = False) -> tuple[torch.cuda.CUDAGraph, object]:
        """Warm ``forward`` up on a side stream (Triton compiles there), then capture it, both
        outside autograd (where the fused kernels run, not the reference path); side: into the
        side stream's pool, on its capture stream (``enable_side``)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad():
            with torch.cuda.stream(stream):
                for _ in range(2):
                    forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._side_pool if side else self.pool,
                                  stream=self._side_capture if side else None):
                out = forward()
        return graph, out

    def _cycle_graph(self, rows: int, depth: int, variant: str = "greedy") -> _CycleGraph:
        R = _bucket(rows)
        key = (_cycle_kind(variant), R, depth)
        if key not in self.graphs:
            self.graphs[key] = self._capture_cycle(R, depth, variant)
        return self.graphs[key]

    def _capture_cycle(self, R: int, depth: int, variant: str = "greedy") -> _CycleGraph:
        buffers = CycleBuffers(self.runner, R, depth, self.table_width, variant)
        graph, out = self._capture_forward(lambda: self.runner.cycle_and_advance(buffers, depth))
        staging = torch.empty(buffers.ints.numel() + R * self.table_width, dtype=torch.long, pin_memory=True)
        copied = torch.cuda.Event()
        copied.record()
        outcomes = [torch.zeros(R, depth + 2, dtype=torch.long, pin_memory=True) for _ in range(2)]
        return _CycleGraph(graph, buffers, out, staging, copied, outcomes, [torch.cuda.Event() for _ in range(2)])


def _distinct_stream(device, *others: torch.cuda.Stream) -> torch.cuda.Stream:
    """A stream of PyTorch's pool (handed out in turn, 32 a device) that is none of ``others``,
    the current stream or the one every other graph was captured on: cuBLAS keys its
    workspace by stream, so work on this one never shares that of a graph replaying beside it."""
    capture = torch.cuda.graph.default_capture_stream
    taken = {s.cuda_stream for s in others} | {torch.cuda.current_stream(device).cuda_stream}
    if capture is not None:
        taken.add(capture.cuda_stream)
    for _ in range(64):
        stream = torch.cuda.Stream(device=device)
        if stream.cuda_stream not in taken:
            return stream
    raise RuntimeError("no CUDA stream apart from the graphs' capture stream")


def _staged(g, values: list[int]) -> torch.Tensor:
    """``values`` in the graph's pinned staging buffer, once the copies out of it that the last
    replay made are done (record ``g.copied`` after the new ones)."""
    g.copied.synchronize()
    g.staging[: len(values)].copy_(torch.tensor(values, dtype=torch.long))
    return g.staging


def _bucket(n: int, buckets: tuple[int, ...] = ROW_BUCKETS) -> int:
    """The smallest bucket that holds n (rows, or a prompt chunk's tokens)."""
    return next(b for b in buckets if b >= n)


def _cycle_kind(variant: str) -> str:
    """A chained cycle graph's key kind: "cycle" (greedy), else the variant's, e.g. "sample_cycle"."""
    return "cycle" if variant == "greedy" else f"{variant}_cycle"
