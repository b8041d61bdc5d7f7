"""CUDA graphs for the short forwards of decoding: AR steps, MTP drafts and verifies.

A decode step of a small model is a few hundred kernel launches; replaying a captured graph
turns them into one. Each (kind, rows bucket, query length) gets its own graph over static
input buffers; a step copies its metadata into those buffers (pinned host memory, async) and
replays. Attention reads the row's real length from the positions buffer on the device (the
Triton kernel's dynamic bound), so one graph serves every context length. Long forwards
(prefill) and hybrid models run eagerly through ``ModelRunner``.

A greedy MTP cycle (head catch-up, argmax drafts, verify, greedy acceptance) is one graph per
(rows bucket, depth), its catch-up padded to depth + 1 pairs: one input copy, one replay and
one transfer back per cycle, where the step-by-step path paid a copy, a replay and eager
logits/argmax launches per head step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtplx.engine.attention import AttentionMetadata
from mtplx.engine.runner import CycleInputs, ModelRunner
from mtplx.engine.sequence import Sequence

ROW_BUCKETS = (1, 2, 4, 8)
MAX_GRAPH_QUERY = 8


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
    """A whole greedy MTP cycle (``ModelRunner.cycle_forward``) over R rows at one depth, its
    catch-up padded to depth + 1 pairs. Every integer input lives in ``ints`` (one copy in)."""

    graph: torch.cuda.CUDAGraph
    fields: dict              # name -> [R, n] view of ints, in the order they are filled
    ints: torch.Tensor        # the flat long buffer behind the fields
    tables: torch.Tensor      # [R, W] long
    backlog: torch.Tensor     # [R, depth + 1, H]
    out: tuple                # (hidden, logits, packed)
    staging: torch.Tensor
    copied: torch.cuda.Event


class CudaGraphRunner(ModelRunner):
    """A ModelRunner that replays CUDA graphs for the shapes ``capture_all`` captured (forwards
    of <= 8 query tokens over <= 8 rows, whole greedy cycles); other forwards run eagerly."""

    def __init__(self, *args, max_context: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.table_width = -(-max_context // self.block_size)
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.enabled = self.states is None  # hybrid models keep the eager path

    # -- public forwards (same contract as ModelRunner) -----------------------------------------
    @torch.inference_mode()
    def trunk(self, seqs: list[Sequence], token_rows: list[list[int]], starts: list[int],
              keep_states: bool = False) -> torch.Tensor:
        g = self._captured("trunk", len(seqs), max(len(r) for r in token_rows))
        if g is None:
            return super().trunk(seqs, token_rows, starts, keep_states)
        return self._replay(g, seqs, token_rows, starts)

    @torch.inference_mode()
    def head_forward(self, seqs: list[Sequence], hidden: torch.Tensor, token_rows: list[list[int]],
                     starts: list[int]) -> torch.Tensor:
        g = self._captured("head", len(seqs), max(len(r) for r in token_rows))
        if g is None:
            return super().head_forward(seqs, hidden, token_rows, starts)
        return self._replay(g, seqs, token_rows, starts, hidden)

    def _replay(self, g: _Graph, seqs, token_rows, starts, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Fill the graph's inputs for these rows, replay it; its output buffer [rows, q, H]."""
        self._load(g, seqs, token_rows, starts)
        if hidden is not None:
            g.hidden_in[: len(seqs), : hidden.shape[1]].copy_(hidden)
        g.graph.replay()
        return g.out[: len(seqs)]

    @torch.inference_mode()
    def greedy_cycle(self, seqs: list[Sequence], backlog: torch.Tensor,
                     depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = self._captured("cycle", len(seqs), depth)
        if g is None or backlog.shape[1] > depth + 1:
            return super().greedy_cycle(seqs, backlog, depth)  # over 8 rows, or a catch-up not pre-fed
        self._load_cycle(g, seqs, depth)
        g.backlog[: len(seqs), : backlog.shape[1]].copy_(backlog)
        g.graph.replay()
        return tuple(t[: len(seqs)] for t in g.out)

    def capture_all(self, depths=(1, 2, 3), rows=ROW_BUCKETS) -> int:
        """Capture the graphs a server will need, at start-up. Only these are ever replayed:
        other shapes (a depth above those captured, a pre-feed of a few pairs) run eagerly
        rather than stall a request on a capture."""
        depths = [d for d in depths if d + 1 <= MAX_GRAPH_QUERY]
        for r in rows:
            self._graph("trunk", r, 1)
            for d in depths:
                self._graph("trunk", r, d + 1)
                if self.head is not None:
                    self._graph("head", r, d + 1)
            if self.head is not None:
                self._graph("head", r, 1)
                for d in depths:
                    self._cycle_graph(r, d)
        return len(self.graphs)

    # -- internals -------------------------------------------------------------------------
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
        ids, pos, slots, tables = [], [], [], []
        for seq, row, start in zip(seqs, token_rows, starts):
            table, positions, row_slots = self.row_layout(seq, start, len(row), q)
            ids += row + [row[-1]] * (q - len(row))
            pos += positions
            slots += row_slots
            tables.append(table)
        pad = (R - len(seqs)) * q
        width = max(len(t) for t in tables)
        flat_tables = []
        for t in tables:
            flat_tables += t + [self.cache.scratch_block] * (width - len(t))
        flat_tables += [self.cache.scratch_block] * ((R - len(seqs)) * width)
        values = ids + [0] * pad + pos + [0] * pad + slots + [self.cache.scratch_slot] * pad + flat_tables
        n = 3 * R * q
        g.copied.synchronize()  # the previous step's copies out of the staging buffer are done
        g.staging[: len(values)].copy_(torch.tensor(values, dtype=torch.long))
        g.rows_in.copy_(g.staging[:n], non_blocking=True)
        g.tables[:, :width].copy_(g.staging[n: n + R * width].view(R, width), non_blocking=True)
        g.copied.record()
        if g.hidden_in is not None:
            g.hidden_in.zero_()

    def _graph(self, kind: str, rows: int, q: int) -> _Graph:
        R = _bucket(rows)
        key = (kind, R, q)
        if key not in self.graphs:
            self.graphs[key] = self._capture(kind, R, q)
        return self.graphs[key]

    def _capture(self, kind: str, R: int, q: int) -> _Graph:
        dev, H = self.device, self.model.config.hidden_size
        long = dict(dtype=torch.long, device=dev)
        rows_in = torch.zeros(3, R, q, **long)
        ids, positions, slots = rows_in.unbind(0)
        slots.fill_(self.cache.scratch_slot)
        tables = torch.full((R, self.table_width), self.cache.scratch_block, **long)
        hidden_in = torch.zeros(R, q, H, dtype=self.dtype, device=dev) if kind == "head" else None
        meta = AttentionMetadata(positions, slots, tables)

        def forward():
            if kind == "head":
                return self.head(self.model, hidden_in, ids, meta, self.cache)
            return self.model(ids, meta, self.cache)

        graph, out = self._capture_forward(forward)
        staging = torch.empty(3 * R * q + R * self.table_width, dtype=torch.long, pin_memory=True)
        copied = torch.cuda.Event()
        copied.record()
        return _Graph(graph, ids, positions, slots, tables, hidden_in, out, rows_in.view(-1), staging, copied)

    def _capture_forward(self, forward) -> tuple[torch.cuda.CUDAGraph, object]:
        """Warm ``forward`` up on a side stream (Triton compiles there), then capture it."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        return graph, out

    # -- whole greedy MTP cycles -----------------------------------------------------------
    def _cycle_graph(self, rows: int, depth: int) -> _CycleGraph:
        R = _bucket(rows)
        key = ("cycle", R, depth)
        if key not in self.graphs:
            self.graphs[key] = self._capture_cycle(R, depth)
        return self.graphs[key]

    def _capture_cycle(self, R: int, depth: int) -> _CycleGraph:
        dev, H, W = self.device, self.model.config.hidden_size, depth + 1
        widths = {"catch_up_ids": W, "catch_up_pos": W, "catch_up_slots": W, "last": 1,
                  "draft_pos": depth - 1, "draft_slots": depth - 1, "primary": 1,
                  "verify_pos": W, "verify_slots": W, "depths": 1}
        ints = torch.zeros(R * sum(widths.values()), dtype=torch.long, device=dev)
        fields, at = {}, 0
        for name, n in widths.items():
            fields[name] = ints[at: at + R * n].view(R, n)
            at += R * n
        for name in ("catch_up_slots", "draft_slots", "verify_slots"):
            fields[name].fill_(self.cache.scratch_slot)
        tables = torch.full((R, self.table_width), self.cache.scratch_block, dtype=torch.long, device=dev)
        meta = lambda pos, slots: AttentionMetadata(pos, slots, tables)  # noqa: E731
        inputs = CycleInputs(
            catch_up_ids=fields["catch_up_ids"], catch_up=meta(fields["catch_up_pos"], fields["catch_up_slots"]),
            last=fields["last"][:, 0],
            draft_metas=[meta(fields["draft_pos"][:, j: j + 1], fields["draft_slots"][:, j: j + 1])
                         for j in range(depth - 1)],
            primary=fields["primary"], verify=meta(fields["verify_pos"], fields["verify_slots"]),
            depths=fields["depths"])
        backlog = torch.zeros(R, W, H, dtype=self.dtype, device=dev)
        graph, out = self._capture_forward(lambda: self.cycle_forward(inputs, backlog, depth))
        staging = torch.empty(ints.numel() + R * self.table_width, dtype=torch.long, pin_memory=True)
        copied = torch.cuda.Event()
        copied.record()
        return _CycleGraph(graph, fields, ints, tables, backlog, out, staging, copied)

    def _load_cycle(self, g: _CycleGraph, seqs: list[Sequence], depth: int) -> None:
        """Fill a cycle graph's integer inputs (two host-to-device copies, as ``_load``)."""
        R, W = g.tables.shape[0], depth + 1
        cols: dict[str, list[int]] = {name: [] for name in g.fields}
        tables = []
        for seq in seqs:
            catch_up = seq.tokens[seq.head_len: seq.trunk_len + 1]
            _, pos, slots = self.row_layout(seq, seq.head_len, len(catch_up), W)
            cols["catch_up_ids"] += catch_up + [catch_up[-1]] * (W - len(catch_up))
            cols["catch_up_pos"] += pos
            cols["catch_up_slots"] += slots
            cols["last"].append(len(catch_up) - 1)
            for j in range(depth - 1):
                _, pos, slots = self.row_layout(seq, seq.trunk_len + 1 + j, 1, 1)
                cols["draft_pos"] += pos
                cols["draft_slots"] += slots
            cols["primary"].append(seq.tokens[seq.trunk_len])
            table, pos, slots = self.row_layout(seq, seq.trunk_len, 1 + seq.depth, W)
            cols["verify_pos"] += pos
            cols["verify_slots"] += slots
            cols["depths"].append(seq.depth)
            tables.append(table)
        pad = R - len(seqs)
        values = []
        for name, view in g.fields.items():
            filler = self.cache.scratch_slot if name.endswith("slots") else 0
            values += cols[name] + [filler] * (pad * view.shape[1])
        width = max(len(t) for t in tables)
        for t in tables:
            values += t + [self.cache.scratch_block] * (width - len(t))
        values += [self.cache.scratch_block] * (pad * width)
        n = g.ints.numel()
        g.copied.synchronize()
        g.staging[: len(values)].copy_(torch.tensor(values, dtype=torch.long))
        g.ints.copy_(g.staging[:n], non_blocking=True)
        g.tables[:, :width].copy_(g.staging[n: n + R * width].view(R, width), non_blocking=True)
        g.copied.record()


def _bucket(rows: int) -> int:
    return next(b for b in ROW_BUCKETS if b >= rows)
