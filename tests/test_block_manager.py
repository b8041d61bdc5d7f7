"""BlockManager: paged KV accounting and the prefix cache.

The randomized tests drive the manager like the engine does (allocate, prefill, write drafts,
accept some, commit, roll back, free) against an independent model of the KV tensors: each
slot records the token prefix its KV entry was computed from. A prefix hit is correct only if
every reused slot holds exactly the prefix of the new prompt.
"""

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mtplx.cache import block_manager
from mtplx.cache.block_manager import BlockManager, OutOfBlocks


def colliding_hash(parent_key, token_ids):
    """Ignores the parent and folds everything into 3 keys: collisions on almost every lookup."""
    return hash(token_ids) % 3


class Engine:
    """Drives a BlockManager as the engine would, checking each promise against a slot model."""

    def __init__(self, num_blocks: int, block_size: int):
        self.bm = BlockManager(num_blocks, block_size)
        self.slot_prefix: dict[int, tuple[int, ...]] = {}  # slot -> tokens its KV was computed from
        self.committed: dict[int, list[int]] = {}
        self.pending: dict[int, list[int]] = {}  # prompt tokens not yet prefilled
        self.next_id = 0

    def allocate(self, prompt: list[int]) -> int | None:
        seq, bm = self.next_id, self.bm
        self.next_id += 1
        free_before = bm.num_free_blocks
        try:
            cached = bm.allocate(seq, prompt)
        except OutOfBlocks:
            assert bm.num_free_blocks == free_before
            with pytest.raises(KeyError):
                bm.length(seq)
            return None
        assert cached % bm.block_size == 0 and cached < len(prompt)
        assert len(bm.block_table(seq)) * bm.block_size >= len(prompt)
        for pos in range(cached):  # every reused slot holds exactly this prompt's prefix
            assert self.slot_prefix[bm.slot(seq, pos)] == tuple(prompt[:pos + 1])
        self.committed[seq], self.pending[seq] = prompt[:cached], prompt[cached:]
        return seq

    def write(self, seq: int, drafts: list[int], accept: int) -> bool:
        """Write KV for the remaining prompt (all accepted) or for drafts (the first `accept`
        accepted); False if the sequence ran out of blocks and was preempted."""
        bm, done = self.bm, self.committed[seq]
        new = self.pending[seq] or drafts
        accept = len(new) if self.pending[seq] else min(accept, len(new))
        try:
            bm.ensure_capacity(seq, len(done) + len(new))
        except OutOfBlocks:
            self.free(seq)
            return False
        stream = done + new
        for pos in range(len(done), len(stream)):
            slot = bm.slot(seq, pos)
            assert bm.ref_count(slot // bm.block_size) == 1, "wrote into a shared block"
            self.slot_prefix[slot] = tuple(stream[:pos + 1])
        self.committed[seq] = done = stream[:len(done) + accept]
        self.pending[seq] = self.pending[seq][accept:]
        bm.commit(seq, done)
        assert bm.length(seq) == len(done)
        return True

    def rollback(self, seq: int, extra: int) -> None:
        bm, done = self.bm, len(self.committed[seq])
        capacity = len(bm.block_table(seq)) * bm.block_size
        length = min(done + extra, capacity)
        bm.rollback(seq, length)
        assert len(bm.block_table(seq)) == -(-length // bm.block_size)

    def free(self, seq: int) -> None:
        self.bm.free(seq)
        del self.committed[seq], self.pending[seq]

    def check(self) -> None:
        bm = self.bm
        bm.check_invariants()
        held = {b for seq in self.committed for b in bm.block_table(seq)}
        assert bm.num_used_blocks == len(held)
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks

    def finish(self) -> None:
        for seq in list(self.committed):
            self.free(seq)
        self.check()
        assert self.bm.num_free_blocks == self.bm.num_blocks and self.bm.num_used_blocks == 0


def random_prompt(rng: random.Random, documents: list[list[int]]) -> list[int]:
    """A prefix of a shared document plus a short private suffix: many partial prefix hits."""
    doc = rng.choice(documents)
    return doc[:rng.randint(0, len(doc))] + [rng.randrange(4) for _ in range(rng.randint(1, 6))]


@pytest.mark.parametrize("hash_fn", [block_manager.block_hash, colliding_hash], ids=["real", "colliding"])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_never_leaks_or_serves_wrong_kv(monkeypatch, hash_fn, seed):
    monkeypatch.setattr(block_manager, "block_hash", hash_fn)
    rng = random.Random(seed)
    block_size = [1, 2, 4][seed % 3]
    # tight enough that allocations fail and cached blocks get evicted, loose enough to run
    eng = Engine(num_blocks=rng.randint(30, 70) // block_size, block_size=block_size)
    documents = [[rng.randrange(4) for _ in range(24)] for _ in range(3)]  # tiny vocab: repeats
    for _ in range(1500):
        op = rng.random()
        if op < 0.2 or not eng.committed:
            eng.allocate(random_prompt(rng, documents))
        elif op < 0.75:
            seq = rng.choice(list(eng.committed))
            drafts = [rng.randrange(4) for _ in range(rng.randint(1, 5))]
            if eng.write(seq, drafts, rng.randint(0, len(drafts))) and rng.random() < 0.7:
                eng.rollback(seq, rng.randint(0, 3))
        else:
            eng.free(rng.choice(list(eng.committed)))
        eng.check()
    eng.finish()
    assert eng.bm.prefix_hits_tokens > 0


class BlockManagerMachine(RuleBasedStateMachine):
    hash_fn = staticmethod(block_manager.block_hash)

    def __init__(self):
        super().__init__()
        self._saved_hash = block_manager.block_hash
        block_manager.block_hash = self.hash_fn
        self.eng = Engine(num_blocks=12, block_size=2)

    def teardown(self):
        try:
            self.eng.finish()
        finally:
            block_manager.block_hash = self._saved_hash

    @rule(prefix_len=st.integers(0, 12), suffix=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def allocate(self, prefix_len, suffix):
        self.eng.allocate([1, 2, 1, 2, 0, 1, 0, 0, 2, 1, 1, 2][:prefix_len] + suffix)

    @precondition(lambda self: self.eng.committed)
    @rule(data=st.data(), drafts=st.lists(st.integers(0, 2), min_size=1, max_size=4),
          accept=st.integers(0, 4), extra=st.integers(0, 3), roll=st.booleans())
    def write(self, data, drafts, accept, extra, roll):
        seq = data.draw(st.sampled_from(sorted(self.eng.committed)))
        if self.eng.write(seq, drafts, accept) and roll:
            self.eng.rollback(seq, extra)

    @precondition(lambda self: self.eng.committed)
    @rule(data=st.data())
    def free(self, data):
        self.eng.free(data.draw(st.sampled_from(sorted(self.eng.committed))))

    @invariant()
    def consistent(self):
        self.eng.check()


class CollidingBlockManagerMachine(BlockManagerMachine):
    hash_fn = staticmethod(colliding_hash)


_machine_settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = _machine_settings
TestCollidingBlockManagerStateful = CollidingBlockManagerMachine.TestCase
TestCollidingBlockManagerStateful.settings = _machine_settings


# -- specifications -------------------------------------------------------------------------


def finished(bm: BlockManager, seq, tokens: list[int]) -> None:
    """Run a request to completion: prefill + generate tokens, commit, free."""
    bm.allocate(seq, tokens[:5])
    bm.ensure_capacity(seq, len(tokens))
    bm.commit(seq, tokens)
    bm.free(seq)


def test_allocate_on_cold_cache_covers_prompt_and_reuses_nothing():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", list(range(10))) == 0
    assert len(bm.block_table("a")) == 3 and bm.length("a") == 0
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5


def test_prefix_of_finished_request_is_reused_in_whole_blocks_never_the_whole_prompt():
    bm = BlockManager(num_blocks=16, block_size=4)
    finished(bm, "a", list(range(14)))  # blocks [0..3] [4..7] [8..11] registered
    assert bm.num_cached_blocks == 3 and bm.num_used_blocks == 0
    assert bm.allocate("b", list(range(10)) + [99]) == 8  # shares 10 tokens: 2 full blocks
    assert bm.allocate("c", list(range(12))) == 8  # the last prompt token is always recomputed
    assert bm.allocate("d", list(range(13))) == 12
    assert bm.allocate("e", [0, 1, 2, 99, 4, 5, 6, 7, 8]) == 0
    assert bm.allocate("f", [0]) == 0
    assert bm.prefix_hits_tokens == 28
    assert bm.stats()["prefix_lookups"] == 6  # "a" included
    bm.check_invariants()


def test_generated_tokens_are_cached_for_the_next_turn():
    bm = BlockManager(num_blocks=16, block_size=4)
    finished(bm, "turn1", [5, 6, 7, 8, 9] + [1, 2, 3, 4, 5, 6])  # prompt of 5, 6 generated
    assert bm.allocate("turn2", [5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 42]) == 8


def test_request_sharing_a_running_request_shares_its_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    bm.allocate("a", list(range(9)))
    bm.commit("a", list(range(9)))
    assert bm.allocate("b", list(range(8)) + [50, 51]) == 8
    shared = bm.block_table("a")[:2]
    assert bm.block_table("b")[:2] == shared
    assert [bm.ref_count(b) for b in shared] == [2, 2]
    assert bm.num_used_blocks == 3 + 1
    bm.free("a")
    assert [bm.ref_count(b) for b in shared] == [1, 1] and bm.num_cached_blocks == 0
    bm.free("b")
    assert bm.num_cached_blocks == 2
    bm.check_invariants()


def test_concurrent_identical_prompts_keep_the_first_registration():
    bm = BlockManager(num_blocks=16, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    for seq in "ab":
        bm.allocate(seq, prompt)
    for seq in "ab":
        bm.commit(seq, prompt)
    bm.check_invariants()
    first = bm.block_table("a")[:2]
    bm.free("a")
    bm.free("b")  # b's identical blocks were never registered: they go back to the free list
    assert bm.num_cached_blocks == 2
    assert bm.allocate("c", prompt) == 4 and bm.block_table("c")[:2] == first


@pytest.mark.parametrize("hash_fn", [lambda parent, tokens: 0, colliding_hash, lambda p, t: hash(t)],
                         ids=["constant", "mod3", "ignores-parent"])
def test_hash_collision_never_serves_a_block_with_other_tokens(monkeypatch, hash_fn):
    monkeypatch.setattr(block_manager, "block_hash", hash_fn)
    bm = BlockManager(num_blocks=32, block_size=2)
    a = [1, 2, 3, 4, 1, 2, 1, 2, 0]
    bm.allocate("a", a)
    bm.commit("a", a)  # registers blocks until one's key is taken by an earlier block
    assert bm.allocate("wrong first block", [9, 9, 3, 4, 0]) == 0
    assert bm.allocate("a's 2nd block first", [3, 4, 1, 2, 0]) == 0  # same tokens, other prefix
    assert bm.allocate("a's 1st block twice", [1, 2, 1, 2, 1, 2, 0]) == 2
    hit = bm.allocate("same as a", a)
    assert hit >= 2 and bm.block_table("same as a")[:hit // 2] == bm.block_table("a")[:hit // 2]
    bm.check_invariants()


def test_lru_evicts_the_least_recently_used_cached_block_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    for seq, prompt in (("a", [1, 1, 9]), ("b", [2, 2, 9]), ("c", [3, 3, 9])):
        bm.allocate(seq, prompt)
        bm.commit(seq, prompt[:2])
        bm.free(seq)
    assert bm.num_cached_blocks == 3  # LRU order: [1,1], [2,2], [3,3]
    bm.allocate("touch a", [1, 1, 5])  # [1,1] leaves the cache ...
    bm.free("touch a")  # ... and returns as the most recently used: [2,2], [3,3], [1,1]
    bm.allocate("big", [7] * 5)  # needs 3 blocks: 1 free + evicts [2,2] and [3,3]
    assert bm.num_cached_blocks == 1
    bm.free("big")
    assert bm.allocate("a again", [1, 1, 5]) == 2
    assert bm.allocate("b again", [2, 2, 5]) == 0
    bm.check_invariants()


def test_eviction_takes_a_finished_request_tail_before_its_prefix():
    bm = BlockManager(num_blocks=4, block_size=2)
    finished(bm, "a", [1, 2, 3, 4, 5, 6, 0])  # 3 blocks cached, 1 free
    bm.allocate("other", [9, 9, 9])  # 2 blocks: the free one + one eviction
    bm.free("other")
    assert bm.allocate("a again", [1, 2, 3, 4, 5, 6, 7]) == 4  # the tail [5,6] went, not [1,2]


def test_out_of_blocks_when_everything_is_in_use():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", list(range(8)))
    with pytest.raises(OutOfBlocks, match=r"needed 1 KV cache blocks but only 0 of 4 are free"):
        bm.allocate("b", [1])
    with pytest.raises(OutOfBlocks, match="needed 1"):
        bm.ensure_capacity("a", 9)
    with pytest.raises(KeyError):
        bm.length("b")
    assert len(bm.block_table("a")) == 4
    bm.check_invariants()


def test_failed_allocate_does_not_evict_the_blocks_it_would_reuse():
    bm = BlockManager(num_blocks=3, block_size=2)
    finished(bm, "a", [1, 2, 3, 4, 5])
    assert bm.num_cached_blocks == 2
    with pytest.raises(OutOfBlocks, match="needed 2 KV cache blocks but only 1"):
        bm.allocate("b", [1, 2, 3, 4, 5, 6, 7])  # 2 hits + 2 fresh, only 1 block besides the hits
    assert bm.num_cached_blocks == 2 and bm.prefix_hits_tokens == 0
    assert bm.allocate("c", [1, 2, 3, 4, 5]) == 4
    bm.check_invariants()


def test_rollback_releases_blocks_beyond_the_new_length():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", list(range(5)))
    bm.ensure_capacity("a", 13)  # room for drafts: 4 blocks
    assert bm.num_used_blocks == 4
    bm.commit("a", list(range(6)))
    bm.rollback("a", 9)
    assert len(bm.block_table("a")) == 3 and bm.length("a") == 9
    bm.rollback("a", 6)
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 6
    bm.check_invariants()


def test_rollback_into_a_shared_or_cached_block_raises():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", list(range(9)))
    bm.commit("a", list(range(9)))
    bm.allocate("b", list(range(6)))  # shares block [0..3]
    with pytest.raises(ValueError, match="minimum is 4"):
        bm.rollback("b", 3)
    with pytest.raises(ValueError, match="minimum is 8"):
        bm.rollback("a", 7)  # [4..7] is registered in the prefix cache
    bm.rollback("a", 8)
    bm.rollback("b", 4)
    assert len(bm.block_table("a")) == 2 and len(bm.block_table("b")) == 1
    bm.check_invariants()


def test_slot_maps_a_position_to_its_block_and_offset():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("x", [0])  # takes block 0
    bm.allocate("a", list(range(6)))
    table = bm.block_table("a")
    assert [bm.slot("a", p) for p in (0, 3, 4, 5)] == [table[0] * 4, table[0] * 4 + 3, table[1] * 4, table[1] * 4 + 1]
    with pytest.raises(IndexError):
        bm.slot("a", 8)


def test_misuse_is_reported():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate("a", [1])
    with pytest.raises(ValueError, match="at least one token"):
        bm.allocate("b", [])
    with pytest.raises(ValueError, match="ensure_capacity"):
        bm.commit("a", [1, 2, 3, 4, 5])
    with pytest.raises(KeyError, match="unknown sequence 'zz'"):
        bm.free("zz")
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def test_namespaces_keep_prefix_caches_apart():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 14))
    bm.allocate("a", prompt, namespace="trunk_only")
    bm.commit("a", prompt)
    bm.free("a")
    assert bm.allocate("b", prompt) == 0  # default namespace: no hit on trunk_only blocks
    bm.commit("b", prompt)
    bm.free("b")
    assert bm.allocate("c", prompt, namespace="trunk_only") == 12
    assert bm.allocate("d", prompt) == 12
    bm.check_invariants()
