"""Fault injection for tests and chaos drills, without changing the decode path.

``hook(point, seq)`` is called on the model thread at each point of ``FAULT_POINTS``; what it
raises is that point's fault. Per-row points (a row's own work: admission, its prompt, its
drafts, their acceptance, its sampled token, its commit, its detokenizing) fail that row
alone. "forward" comes from ``FaultyRunner``, which wraps the runner: a forward over the
row raises before it launches, which no row can be blamed for, so every row of the step
fails. Chained cycles keep running under injection: fault tests run the production path.
"""

from __future__ import annotations

from typing import Callable

from mtplx.engine.sequence import Sequence

FaultHook = Callable[[str, Sequence], None]
FAULT_POINTS = ("admit", "prefill", "forward", "draft", "accept", "sample", "commit", "detokenize")


class FaultyRunner:
    """A runner whose forwards (``FORWARDS``: trunk, head, whole cycles, chained or not) first
    call ``hook("forward", seq)`` for each of their rows (a chained cycle's ghosts aside: rows
    that left, whose requests are over); everything else is the runner's own."""

    FORWARDS = ("trunk", "head_forward", "greedy_cycle", "start_cycle", "next_cycle")

    def __init__(self, runner, hook: FaultHook):
        self.runner, self.hook = runner, hook

    def __getattr__(self, name: str):
        attr = getattr(self.runner, name)
        if name not in self.FORWARDS:
            return attr

        def forward(seqs: list[Sequence], *args, **kwargs):
            ghosts = kwargs.get("ghosts", ())  # (``CycleChain.advance`` passes them by name)
            for r, seq in enumerate(seqs):
                if r not in ghosts:
                    self.hook("forward", seq)
            return attr(seqs, *args, **kwargs)

        return forward
