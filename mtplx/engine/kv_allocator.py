"""The one owner of KV memory: which sequence holds which blocks, and which may be admitted.

Every allocation happens here, before a forward, never while a forward's metadata is built
(``ModelRunner`` only reads block tables). The block accounting itself (tables, refcounts,
the prefix cache) is ``cache/block_manager.py``; the recurrent-state slots of hybrid models
are ``cache/state_cache.py``. Batching modes ask this allocator whether a request fits
(``headroom``, ``blocks_needed``); they never touch block tables.
"""

from __future__ import annotations

from typing import Iterable

from mtplx.cache.block_manager import BlockManager, OutOfBlocks
from mtplx.cache.state_cache import RecurrentStateCache
from mtplx.engine.sequence import Sequence


class KVAllocator:
    def __init__(self, blocks: BlockManager, states: RecurrentStateCache | None, max_context: int):
        self.blocks, self.states, self.max_context = blocks, states, max_context
        self.block_size = blocks.block_size

    # -- a sequence's life -------------------------------------------------------------------
    def admit(self, seq: Sequence, namespace: str | None = None) -> int:
        """Blocks for the whole prompt (cached prefix blocks reused) and, on a hybrid model, a
        zeroed state slot. Returns how many prompt tokens hit the prefix cache. Raises
        OutOfBlocks with nothing taken."""
        cached = self.blocks.allocate(seq.seq_id, seq.prompt_ids, namespace=namespace)
        if self.states is not None and seq.state_slot is None:
            seq.state_slot = self.states.allocate()
        return cached

    def reserve(self, seq: Sequence, length: int) -> int:
        """Make the sequence's table cover ``length`` KV slots (drafts and verifies write past
        the committed length). Returns the blocks added; OutOfBlocks (nothing taken) when the
        pool runs dry."""
        return self.blocks.ensure_capacity(seq.seq_id, length)

    def reserve_rows(self, rows: list[tuple[Sequence, int]]) -> int:
        """``reserve`` for several rows, all or nothing: OutOfBlocks, with nothing taken, when
        the pool cannot cover every row. Returns the blocks added."""
        bs = self.block_size
        need = sum(max(0, -(-length // bs) - len(self.blocks.block_table(seq.seq_id))) for seq, length in rows)
        if need > self.blocks.num_free_blocks:
            raise OutOfBlocks(need, self.blocks.num_free_blocks, self.blocks.num_blocks)
        return sum(self.reserve(seq, length) for seq, length in rows)

    def trim(self, seq: Sequence, length: int) -> None:
        """The valid KV length is ``length``: give back the blocks past it (no copy)."""
        self.blocks.rollback(seq.seq_id, length)

    def commit(self, seq: Sequence, tokens: list[int], length: int | None = None) -> None:
        """The first ``length`` of ``tokens`` (default: all) have KV written: register each newly
        full block in the prefix cache."""
        self.blocks.commit(seq.seq_id, tokens, length)

    def release(self, seq: Sequence) -> None:
        """Give back the sequence's blocks (full committed ones stay cached) and state slot."""
        self.blocks.free(seq.seq_id)
        if self.states is not None and seq.state_slot is not None:
            self.states.free(seq.state_slot)
            seq.state_slot = None

    def table(self, seq: Sequence) -> list[int]:
        return self.blocks.block_table(seq.seq_id)

    # -- admission ------------------------------------------------------------------------------
    def blocks_needed(self, prompt_tokens: int, max_tokens: int, depth: int) -> int:
        """Blocks one request can occupy: prompt + max_tokens + its draft slots, capped by the
        context (``Engine.step`` ends a row before it would pass it)."""
        tokens = min(prompt_tokens + max_tokens + depth + 1, self.max_context)
        return -(-tokens // self.block_size)

    def headroom(self, running: Iterable[tuple[Sequence, int]]) -> int:
        """Free blocks (evictable cached ones included) not promised to ``running``: pairs of
        (sequence, the blocks its whole run may need)."""
        promised = sum(max(0, need - len(self.blocks.block_table(seq.seq_id))) for seq, need in running)
        return self.blocks.num_free_blocks - promised

    def stats(self) -> dict:
        """The block manager's counts, plus ``state_slots_used`` on hybrid models."""
        stats = self.blocks.stats()
        if self.states is not None:
            stats["state_slots_used"] = self.states.num_used_slots
        return stats
