"""Chained cycles: the next cycle starts on the device before the host reads the last one.

A cycle whose whole work runs on the device (argmax drafts, verify, and acceptance: greedy, or
for rows that sample exact rejection sampling from their own streams' noise, drawn inside the
cycle from fills the host plans before the launch; depth 0
is an AR step) ends by writing the next cycle's inputs from its own
outcome (``runner.advance_cycle``). So the host can launch cycle n+1 and only then read and
commit cycle n: its commit, detokenizing and streaming overlap the device's next cycle. The
host is one cycle behind the device; ``CycleChain`` owns that cycle in flight:

- ``start``: the first cycle, from the host's state;
- ``advance``: launch the next cycle over the same rows, hand back the one to commit;
- ``joined``: rows new to the batch take the places of rows that left (below), their
  inputs written from the host's state (``ModelRunner.join_cycle``), and the chain goes on;
- ``drain``: no next cycle (the rows changed, or an AR step comes): hand back the one in
  flight, for its rows still live;
- ``forget``: a row released while its cycle is in flight (its outcome is dropped; the
  device's writes land past the row's committed length, in blocks the row gives back).

A row that leaves (it ended, or its client cancelled) does not end the chain while the rows
left need the same graph (``runner.row_bucket``: 8 rows down to 5 keep the 8-row graph): it
stays in the chain's rows as a ghost, a padding row from the next launch on
(``CycleBuffers.freeze``: it writes no KV and reads only the scratch block), and its outcomes
go unread. Restarting the chain from the host's state would leave the device idle while the
host commits, plans and launches. A row that joins (a new request, prefilled while the cycle
was in flight) takes a ghost's place, or a padding row's while the rows need the same graph (a
fourth row joins three in the 4-row graph), so a scheduler that keeps its batch full (a request
ends, the next one arrives) or whose batch grows within a graph's rows does not restart the
chain either.

Rows' block tables must cover three cycles ahead (``runner.lookahead``): the cycle in flight,
the one starting, and the slots its tail computes for the one after. ``reserve`` takes those
blocks through the engine's allocator before any launch.
"""

from __future__ import annotations

import torch

from mtplx.cache.block_manager import OutOfBlocks
from mtplx.engine.kv_allocator import KVAllocator
from mtplx.engine.runner import CycleLaunch, ModelRunner, row_bucket
from mtplx.engine.sequence import Sequence


class CycleChain:
    def __init__(self, runner: ModelRunner, kv: KVAllocator, enabled: bool):
        self.runner, self.kv, self.enabled = runner, kv, enabled
        self.flight: CycleLaunch | None = None
        self._released: set[int] = set()

    def takes(self, seqs: list[Sequence], depth: int) -> bool:
        """Whether chaining is on and the runner can chain these rows at this depth."""
        return self.enabled and self.runner.can_chain(len(seqs), depth, self._variant(seqs, depth))

    def continues(self, seqs: list[Sequence], depths: list[int]) -> bool:
        """Whether ``seqs`` are the live rows of the cycle in flight, in any order (the others
        its ghosts, while the rows left need its graph's rows) and ``depths`` (each row's next
        depth) are their depths in it."""
        flight = self.flight
        if flight is None or not seqs or flight.depth != max(depths):
            return False
        live = self.live_rows()
        return (len(seqs) == len(live) and {s.seq_id for s in seqs} == {s.seq_id for s in live}
                and _same_depths(seqs, depths) and row_bucket(len(live)) == row_bucket(len(flight.seqs)))

    def joined(self, seqs: list[Sequence], depths: list[int]) -> tuple[list[Sequence], list[int]] | None:
        """Where rows new to the chain can join it without a restart: (the chain's rows with
        them in the places of rows that left, then in its graph's padding rows, those places),
        or None. They can where ``seqs`` are the chain's live rows at their depths and new rows
        at its depth (``depths``, each row's next: the new rows' own, which the caller sets),
        no more new rows than such places, the rows then need the chain's graph
        (``row_bucket``: 3 rows and a fourth share the 4-row graph) and make the same kind of
        cycle (``cycle_variant``).
        The caller checks that the new rows can chain at all (the device path)."""
        flight = self.flight
        if flight is None or not seqs or flight.depth != max(depths):
            return None
        depth_of = {s.seq_id: d for s, d in zip(seqs, depths)}
        live = self.live_rows()
        if any(depth_of.get(s.seq_id) != s.depth for s in live):
            return None
        live_ids, in_chain = {s.seq_id for s in live}, {s.seq_id for s in flight.seqs}
        new = [s for s in seqs if s.seq_id not in in_chain]
        places = [r for r, s in enumerate(flight.seqs) if s.seq_id not in live_ids]
        places += range(len(flight.seqs), row_bucket(len(flight.seqs)))  # the graph's padding rows, in order
        if (not new or len(new) > len(places) or len(live) + len(new) != len(seqs)
                or row_bucket(len(seqs)) != row_bucket(len(flight.seqs))):
            return None
        rows = list(flight.seqs)
        for r, s in zip(places, new):
            if r < len(rows):
                rows[r] = s
            else:  # a padding row becomes the new one's (its inputs and table written as a leaver's place's)
                rows.append(s)
        if self._variant(rows, flight.depth) != self._variant(flight.seqs, flight.depth):
            return None
        return rows, places[: len(new)]

    def live_rows(self) -> list[Sequence]:
        """The rows of the cycle in flight neither released nor finished, in its order."""
        return [s for s in self.flight.seqs if s.seq_id not in self._released and not s.finished]

    def reserve(self, seqs: list[Sequence], depth: int, rows: list[Sequence] | None = None) -> bool:
        """Take the blocks a chained cycle over these rows may write and copy the grown tables
        to the device (``rows``: the chain's rows, ``seqs`` and its ghosts, whose tables are
        the scratch block's). False (nothing taken) where a row's lookahead passes the slots one row
        may hold or the pool runs dry: the chain cannot go on."""
        if any(self.runner.lookahead(s, depth) > self.runner.max_row_slots for s in seqs):
            return False
        try:
            grown = self.kv.reserve_rows([(s, self.runner.lookahead(s, depth)) for s in seqs])
        except OutOfBlocks:
            return False
        if grown:
            rows = seqs if rows is None else rows
            live = {s.seq_id for s in seqs}
            tables = [self.kv.table(s) if s.seq_id in live else [] for s in rows]
            self.runner.upload_tables(len(rows), depth, tables, self._variant(rows, depth))
        return True

    def start(self, seqs: list[Sequence], backlog: torch.Tensor | None, depth: int) -> None:
        """Launch the first cycle from the host's state (``reserve`` first)."""
        self.flight = self.runner.start_cycle(seqs, backlog, depth, self._variant(seqs, depth))

    def advance(self, seqs: list[Sequence], depths: list[int], join: tuple[list[Sequence], list[int]] | None = None,
                backlog: torch.Tensor | None = None) -> tuple[CycleLaunch, bool]:
        """Launch the cycle after the one in flight where the rows keep their depths
        (``depths``, each row's next) and ``reserve`` succeeds, and hand back the one in flight,
        to commit; True when another cycle now runs on from its outcome. join: ``joined``'s
        answer, rows new to the chain written into places of rows that left first, from the
        host's state (``backlog``: their head catch-up's trunk hidden states)."""
        last, following = self.flight, None
        rows, joining = join if join is not None else (last.seqs, [])  # the chain's rows: ``seqs``, and its ghosts
        if _same_depths(seqs, depths) and self.reserve(seqs, last.depth, rows):
            live = {s.seq_id for s in seqs}
            ghosts = frozenset(r for r, s in enumerate(rows) if s.seq_id not in live)
            variant = self._variant(rows, last.depth)
            if joining:
                self.runner.join_cycle(rows, last.depth, variant, joining, backlog)
            following = self.runner.next_cycle(rows, last.depth, variant, ghosts=ghosts,
                                               freeze=sorted(ghosts - last.ghosts))
            # (once launched: a fault keeps the old rows)
            self._released -= {last.seqs[r].seq_id for r in joining if r < len(last.seqs)}
        self.flight = following
        return last, following is not None

    def in_flight(self) -> set[int]:
        """The seq_ids of the rows of the cycle in flight, released ones aside (a ghost that
        finished is still here until the scheduler releases it)."""
        return {s.seq_id for s in self.flight.seqs} - self._released if self.flight is not None else set()

    def _variant(self, seqs: list[Sequence], depth: int) -> str:
        return cycle_variant(seqs, depth, self.runner.filters_apart)

    def drain(self) -> tuple[CycleLaunch, list[int]] | None:
        """Hand back the cycle in flight and the indices of its rows still live (neither
        released nor finished), leaving nothing in flight; None when nothing was."""
        flight, released = self.flight, self._released
        self.flight, self._released = None, set()
        if flight is None:
            return None
        return flight, [r for r, s in enumerate(flight.seqs) if s.seq_id not in released and not s.finished]

    def forget(self, seq: Sequence) -> None:
        """``seq`` is released: drop its outcome from the cycle in flight."""
        if self.flight is not None and any(s is seq for s in self.flight.seqs):
            self._released.add(seq.seq_id)
            if all(s.seq_id in self._released for s in self.flight.seqs):
                self.flight, self._released = None, set()

    def clear(self) -> None:
        """Forget the cycle in flight without reading it (after a crash)."""
        self.flight, self._released = None, set()


def _same_depths(seqs: list[Sequence], depths: list[int]) -> bool:
    """Whether every row's next cycle has its current depth: a change (depth="auto") ends the
    chain, whose graph fixes each row's depth."""
    return all(d == s.depth for s, d in zip(seqs, depths))


def cycle_variant(seqs: list[Sequence], depth: int, filters_apart: bool = True) -> str:
    """The rows' kind of chained cycle (``runner.CYCLE_VARIANTS``): "greedy" when every row is;
    else "sample" (rejection sampling and the rows' noise on the device), "mirror" when a row
    drafts from the head's distribution (a cycle with drafts), each "_filters" when a sampling
    row asks for top-k or min-p and ``filters_apart`` (the PyTorch path: its graph applies them;
    the plain one does temperature and top-p alone; the sampling kernels apply each row's own)."""
    sampling = [s for s in seqs if not s.params.greedy]
    if not sampling:
        return "greedy"
    mirror = depth > 0 and any(s.draft_policy == "mirror" for s in sampling)
    filters = filters_apart and any(s.params.top_k or s.params.min_p for s in sampling)
    return ("mirror" if mirror else "sample") + ("_filters" if filters else "")
