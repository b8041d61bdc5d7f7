"""Paged KV cache accounting: block tables, refcounts, prefix cache. No tensors.

The tensors (kv_cache.py) are indexed by the block ids handed out here. Every block is in
exactly one state: free, cached (refcount 0 but registered in the prefix cache, evictable
in LRU order), or used (refcount = number of sequences whose table holds it).

Prefix cache: a full block of committed tokens is registered under a hash chain key,
block_hash(parent key, its tokens). A lookup also checks the stored tokens and the parent's
registration serial (unique, never reused), so by induction a hit means the whole prefix
matches: a hash collision can cost a miss, never a wrong cache.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from mtplx.errors import MtplxError

SeqId = str | int
_ROOT = 0  # parent serial of a sequence's first block; registration serials start at 1

# why a hybrid model's blocks never enter the prefix cache
HYBRID_PREFIX_CACHE_REASON = (
    "hybrid linear-attention model: a cached KV prefix cannot restore the recurrent state at its end")



def block_hash(parent_key: int | None, token_ids: tuple[int, ...]) -> int:
    """Chain key of a full block: its tokens and, through parent_key, every token before it."""
    return hash((parent_key, token_ids))


class OutOfBlocks(MtplxError):
    """A request needs more KV blocks than are free, even after evicting every cached block."""

    def __init__(self, needed: int, free: int, total: int):
        super().__init__(
            f"needed {needed} KV cache blocks but only {free} of {total} are free (the rest "
            "hold running sequences); wait for requests to finish or enlarge the KV cache")
        self.needed, self.free = needed, free


@dataclass(slots=True)
class _Block:
    ref_count: int = 0
    key: int | None = None  # set while registered in the prefix cache
    parent_key: int | None = None
    serial: int = -1
    parent_serial: int = -1
    token_ids: tuple[int, ...] = ()
    namespace: str | None = None


@dataclass(slots=True)
class _Seq:
    table: list[int]
    length: int  # tokens with valid KV
    num_hashed: int  # leading blocks that are registered (prefix hits or own commits)
    namespace: str | None = None


class BlockManager:
    """Block tables, lengths and refcounts of running sequences over num_blocks KV blocks of
    block_size token slots each, plus the prefix cache of full committed blocks."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache_disabled_reason: str | None = None):
        """prefix_cache_disabled_reason: when set, no block is ever registered, so no lookup
        hits (models whose cached KV alone cannot resume a sequence); stats() reports why."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._key_to_block: dict[int, int] = {}
        self._seqs: dict[SeqId, _Seq] = {}
        self._next_serial = _ROOT + 1
        self.prefix_hits_tokens = 0
        self.prefix_lookup_tokens = 0
        self.prefix_lookups = 0
        self.prefix_cache_disabled_reason = prefix_cache_disabled_reason

    def allocate(self, seq_id: SeqId, prompt_ids: list[int], namespace: str | None = None) -> int:
        """Register a sequence and give it blocks covering the whole prompt.

        ``namespace`` separates prefix caches whose blocks hold different things for the same
        tokens (e.g. blocks written without the MTP head's entries): hits and registrations
        stay within the sequence's namespace.

        Returns how many leading prompt tokens already have KV (a multiple of block_size,
        always < len(prompt_ids)); length(seq_id) is that count until the next commit.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        hits = self._match_prefix(prompt_ids, namespace)
        need = self._blocks_for(len(prompt_ids)) - len(hits)
        reviving = sum(self._blocks[b].ref_count == 0 for b in hits)
        if need > self.num_free_blocks - reviving:  # checked first: a failure changes nothing
            raise OutOfBlocks(need, self.num_free_blocks - reviving, self.num_blocks)
        for b in hits:
            if self._blocks[b].ref_count == 0:
                del self._cached[b]
            self._blocks[b].ref_count += 1
        cached = len(hits) * self.block_size
        self._seqs[seq_id] = _Seq(hits + [self._take_block() for _ in range(need)], cached, len(hits), namespace)
        self.prefix_lookups += 1
        self.prefix_lookup_tokens += len(prompt_ids)
        self.prefix_hits_tokens += cached
        return cached

    def ensure_capacity(self, seq_id: SeqId, num_tokens: int) -> int:
        """Grow the block table to cover num_tokens slots (e.g. drafts written before commit).
        Returns the number of blocks added."""
        seq = self._seq(seq_id)
        need = self._blocks_for(num_tokens) - len(seq.table)
        if need > self.num_free_blocks:
            raise OutOfBlocks(need, self.num_free_blocks, self.num_blocks)
        seq.table.extend(self._take_block() for _ in range(need))
        return max(0, need)

    def commit(self, seq_id: SeqId, token_ids: list[int], length: int | None = None) -> None:
        """token_ids: the sequence's tokens (prompt + generated); the first ``length`` of them
        (default: all) have their KV written.

        Sets length and registers each newly full block in the prefix cache.
        """
        seq, bs = self._seq(seq_id), self.block_size
        n = len(token_ids) if length is None else length
        if not 0 <= n <= len(token_ids):
            raise ValueError(f"cannot commit {n} of {len(token_ids)} tokens to {seq_id!r}")
        if n > len(seq.table) * bs:
            raise ValueError(f"cannot commit {n} tokens to {seq_id!r}: only "
                             f"{len(seq.table) * bs} slots are allocated (call ensure_capacity first)")
        if n < seq.num_hashed * bs:
            raise ValueError(f"cannot commit {n} tokens to {seq_id!r}: its first "
                             f"{seq.num_hashed * bs} tokens are in the prefix cache")
        seq.length = n
        while seq.num_hashed < n // bs and self._register(seq, token_ids):
            seq.num_hashed += 1

    def rollback(self, seq_id: SeqId, length: int) -> None:
        """Set the valid KV length to `length` tokens and release the blocks beyond it. No copying."""
        seq, bs = self._seq(seq_id), self.block_size
        if not 0 <= length <= len(seq.table) * bs:
            raise ValueError(f"rollback length must be in [0, {len(seq.table) * bs}], got {length}")
        for i in reversed(range(length // bs, len(seq.table))):  # blocks cut into or dropped
            block = self._blocks[seq.table[i]]
            if block.key is not None or block.ref_count > 1:
                raise ValueError(f"cannot roll {seq_id!r} back to {length} tokens: block {i} is "
                                 f"shared or in the prefix cache; the minimum is {(i + 1) * bs}")
        keep = self._blocks_for(length)
        for b in seq.table[keep:]:
            self._blocks[b].ref_count = 0
            self._free.append(b)
        del seq.table[keep:]
        seq.length = length

    def free(self, seq_id: SeqId) -> None:
        """Drop a sequence; its registered blocks stay cached until evicted."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        for b in reversed(seq.table):  # tail first into the LRU, so it is evicted before its prefix
            block = self._blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.key is not None:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def block_table(self, seq_id: SeqId) -> list[int]:
        return list(self._seq(seq_id).table)

    def length(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).length

    def slot(self, seq_id: SeqId, pos: int) -> int:
        """Flat KV slot of token position pos: block_id * block_size + offset."""
        table, bs = self._seq(seq_id).table, self.block_size
        if not 0 <= pos < len(table) * bs:
            raise IndexError(f"position {pos} is outside the {len(table) * bs} allocated slots")
        return table[pos // bs] * bs + pos % bs

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def stats(self) -> dict:
        out = {"total_blocks": self.num_blocks, "free_blocks": self.num_free_blocks,
               "cached_blocks": self.num_cached_blocks, "used_blocks": self.num_used_blocks,
               "prefix_hit_tokens": self.prefix_hits_tokens,
               "prefix_lookup_tokens": self.prefix_lookup_tokens, "prefix_lookups": self.prefix_lookups}
        if self.prefix_cache_disabled_reason:
            out["prefix_cache_disabled_reason"] = self.prefix_cache_disabled_reason
        return out

    def check_invariants(self) -> None:
        """Assert the accounting is consistent (for tests; O(num_blocks + table sizes))."""
        holders = [0] * self.num_blocks
        for seq in self._seqs.values():
            assert len(set(seq.table)) == len(seq.table), "a table holds a block twice"
            assert self._blocks_for(seq.length) <= len(seq.table), "length exceeds the table"
            for b in seq.table:
                holders[b] += 1
            for b in seq.table[:seq.num_hashed]:
                assert self._blocks[b].key is not None, "a hashed prefix block is unregistered"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & self._cached.keys(), "a block is both free and cached"
        for b, block in enumerate(self._blocks):
            if b in free or b in self._cached:
                assert block.ref_count == holders[b] == 0, f"free block {b} is referenced"
                assert (block.key is not None) == (b in self._cached), f"block {b} cache state"
            else:
                assert block.ref_count == holders[b] > 0, f"block {b} refcount != holders (or leaked)"
            if block.key is not None:
                assert self._key_to_block.get(block.key) == b, f"registered block {b} not in the map"
        for key, b in self._key_to_block.items():
            block = self._blocks[b]
            assert block.key == key and len(block.token_ids) == self.block_size
            assert block_hash(block.parent_key, block.token_ids) == key, f"block {b} tokens != key"

    def _seq(self, seq_id: SeqId) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def longest_hit(self, num_prompt_tokens: int) -> int:
        """The most tokens of a prompt this long that a prefix-cache hit can serve: its full
        blocks ending before its last token (whose logits the prompt's forward must give); 0
        with the prefix cache off."""
        if self.prefix_cache_disabled_reason:
            return 0
        return (num_prompt_tokens - 1) // self.block_size * self.block_size

    def _match_prefix(self, prompt_ids: list[int], namespace: str | None) -> list[int]:
        """Cached blocks for the longest prefix that ends before the last prompt token."""
        bs, hits, parent_key, parent_serial = self.block_size, [], namespace, _ROOT
        for i in range(self.longest_hit(len(prompt_ids)) // bs):
            tokens = tuple(prompt_ids[i * bs:(i + 1) * bs])
            key = block_hash(parent_key, tokens)
            b = self._key_to_block.get(key)
            if b is None:
                break
            block = self._blocks[b]
            if block.token_ids != tokens or block.parent_serial != parent_serial or block.namespace != namespace:
                break
            hits.append(b)
            parent_key, parent_serial = key, block.serial
        return hits

    def _register(self, seq: _Seq, token_ids: list[int]) -> bool:
        """Put the sequence's first unregistered block (full, committed) in the prefix cache.

        False if its key already maps to another block (same content registered by another
        sequence, or a collision): that mapping is kept and this block stays unregistered.
        """
        if self.prefix_cache_disabled_reason:
            return False
        i, bs, table = seq.num_hashed, self.block_size, seq.table
        parent = self._blocks[table[i - 1]] if i else _Block(key=seq.namespace, serial=_ROOT)
        tokens = tuple(token_ids[i * bs:(i + 1) * bs])
        key = block_hash(parent.key, tokens)
        if key in self._key_to_block:
            return False
        block = self._blocks[table[i]]
        block.key, block.parent_key, block.token_ids = key, parent.key, tokens
        block.serial, block.parent_serial, block.namespace = self._next_serial, parent.serial, seq.namespace
        self._next_serial += 1
        self._key_to_block[key] = table[i]
        return True

    def _take_block(self) -> int:
        """A block with refcount 1: from the free list, else evict the least recently used cached one."""
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._cached.popitem(last=False)
            del self._key_to_block[self._blocks[b].key]
        self._blocks[b] = _Block(ref_count=1)
        return b
