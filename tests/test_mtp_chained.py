"""Chained greedy cycles: each cycle's tail writes the next cycle's inputs on the device, and
the generator starts the next cycle before it reads the last one's outcome (one cycle behind).
Greedy AR steps chain the same way, as cycles of depth 0. On the CPU the runner runs the same
chain eagerly (``Engine(chain=True)``, ``generator.chain.enabled``); decoding must not change."""

import pytest
import torch

from mtplx.engine.adaptive_depth import AutoDepth, DepthCosts
from mtplx.engine.generator import StepResult
from mtplx.engine.runner import CYCLE_FIELDS, CycleLaunch, advance_cycle
from mtplx.engine.speculative import CycleOutcome
from tests.test_adaptive_depth import switching_engine
from tests.tiny_models import repeat_head, tiny_engine

PROMPTS = [[1, 2, 3], [5, 17, 33, 2, 8, 9, 10, 11, 40], list(range(20, 39))]


def chained_engine(head: str = "repeat"):
    engine, _ = tiny_engine("qwen3")
    if head == "repeat":  # drafts often accepted: partial and full acceptance both occur
        engine.runner.head.load_state_dict(repeat_head(engine.loaded.model).state_dict())
    return engine


def start(engine, prompt, **kw):
    seq = engine.new_sequence(engine.make_request(prompt, **kw))
    engine.generator.admit(seq)
    engine.generator.prefill(seq)
    return seq


@pytest.mark.parametrize("head", ["random", "repeat"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_chained_decoding_equals_unchained_and_ar(head, depth):
    engine = chained_engine(head)
    for prompt in PROMPTS:
        ar = engine.generate(prompt, mode="ar", max_tokens=37)
        engine.generator.chain.enabled = True
        chained = engine.generate(prompt, mode="mtp", depth=depth, max_tokens=37)
        engine.generator.chain.enabled = False
        assert chained.token_ids == ar.token_ids, (prompt, depth)
        assert chained.stats["verify_calls"] > 0
        assert engine.runner.blocks.num_used_blocks == 0
        engine.runner.blocks.check_invariants()


@pytest.mark.parametrize("rows", [1, 3])
def test_chained_ar_steps_equal_unchained_ones(rows):
    """Greedy AR as chained depth-0 cycles: the same tokens as unchained steps (which equal
    transformers' greedy decoding, tests/test_mtp_greedy.py), rows ending apart included."""
    engine = chained_engine()
    alone = [engine.generate(p, mode="ar", max_tokens=30 - 7 * i).token_ids for i, p in enumerate(PROMPTS[:rows])]
    engine.generator.chain.enabled = True
    seqs = [start(engine, p, mode="ar", max_tokens=30 - 7 * i) for i, p in enumerate(PROMPTS[:rows])]
    chained_steps = 0
    with torch.inference_mode():
        while not all(s.finished for s in seqs):
            engine.step([s for s in seqs if not s.finished])
            chained_steps += engine.generator.chain.flight is not None
    assert [s.generated for s in seqs] == alone
    assert chained_steps > 10
    for s in seqs:
        engine.generator.release(s)
    assert engine.runner.blocks.num_used_blocks == 0
    engine.runner.blocks.check_invariants()


def test_the_device_written_ar_inputs_are_what_the_host_would_build():
    engine = chained_engine()
    runner, gen = engine.runner, engine.generator
    seqs = [start(engine, p, mode="ar", max_tokens=400) for p in PROMPTS]
    b = runner.cycle_buffers(len(seqs), 0)  # a bucket's rows: 4, the last a padding row
    n = len(seqs)
    for step in range(6):
        assert gen.chain.reserve(seqs, 0)
        values, width = b.values(seqs)
        b.fill(torch.tensor(values), width)
        padding = {name: view[n:].tolist() for name, view in b.fields.items()}
        packed = torch.tensor([[0, 11 + step + r] for r in range(b.tables.shape[0])])
        advance_cycle(b.fields, b.tables, packed, runner.block_size, runner.cache.scratch_slot)
        gen._commit_launch(CycleLaunch(seqs, 0, torch.zeros(n, 1, 64), packed[:n], None), seqs,
                           CycleOutcome.unpack(packed[:n].tolist(), [0] * n), None, True, StepResult())
        fields, tables = runner.cycle_layout(seqs, 1, 0)
        for name in CYCLE_FIELDS:
            assert b.fields[name][:n].tolist() == fields[name], name
            assert b.fields[name][n:].tolist() == padding[name], name  # a padding row keeps its inputs
    for s in seqs:
        gen.release(s)


def test_the_device_written_inputs_are_what_the_host_would_build():
    """A cycle's tail (``advance_cycle``) writes the next cycle's inputs from its outcome: they
    equal ``cycle_layout`` from the host's state once it has committed that outcome, for every
    field and every accepted count (rows of depths 3, 1, 2 in a depth-3 batch; outcomes set
    by hand, so rejection, partial and full acceptance all occur)."""
    engine = chained_engine()
    runner, gen = engine.runner, engine.generator
    seqs = [start(engine, p, mode="mtp", depth=d, max_tokens=400) for p, d in zip(PROMPTS, (3, 1, 2))]
    depth = 3
    b = runner.cycle_buffers(len(seqs), depth)  # a bucket's rows: 4, the last a padding row
    n, R = len(seqs), b.tables.shape[0]
    g = torch.Generator().manual_seed(0)
    for accepted in [(0, 0, 0), (3, 1, 2), (1, 0, 1), (2, 1, 0), (3, 0, 2), (0, 1, 1)]:
        for s in seqs:  # the host's state as a cycle starts: the head caught up to the primary
            s.head_len, s.hidden_backlog = s.trunk_len, torch.zeros(1, 64)
        assert gen.chain.reserve(seqs, depth)
        values, width = b.values(seqs)
        b.fill(torch.tensor(values), width)
        padding = {name: view[n:].tolist() for name, view in b.fields.items()}
        drafts = torch.randint(1, 90, (R, depth), generator=g)
        packed = torch.cat([drafts, torch.tensor(accepted + (2,) * (R - n))[:, None],
                            torch.randint(1, 90, (R, 1), generator=g)], dim=1)
        advance_cycle(b.fields, b.tables, packed, runner.block_size, runner.cache.scratch_slot)
        launch = CycleLaunch(seqs, depth, torch.zeros(n, depth + 1, 64), packed[:n], None)
        gen._commit_launch(launch, seqs, CycleOutcome.unpack(packed[:n].tolist(), [s.depth for s in seqs]), None,
                           True, StepResult())
        fields, tables = runner.cycle_layout(seqs, depth + 1, depth)
        for name in CYCLE_FIELDS:
            assert b.fields[name][:n].tolist() == fields[name], (name, accepted)
            assert b.fields[name][n:].tolist() == padding[name], name  # a padding row keeps its inputs
        for r, table in enumerate(tables):
            assert b.tables[r, : len(table)].tolist() == table
    for s in seqs:
        gen.release(s)
    runner.blocks.check_invariants()


def test_rows_that_end_or_leave_mid_chain_do_not_change_the_others():
    """A batch decoding chained: rows of different depths and lengths end at different cycles,
    one is released (cancelled) with a cycle in flight, and an AR step drains the chain; every
    row that finishes decodes exactly as it does alone, and no block is left taken."""
    engine = chained_engine()
    alone = {i: engine.generate(p, mode="ar", max_tokens=n).token_ids
             for i, (p, n) in enumerate(zip(PROMPTS, (9, 30, 17)))}
    engine.generator.chain.enabled = True
    seqs = [start(engine, p, mode="mtp", depth=d, max_tokens=n)
            for p, d, n in zip(PROMPTS, (1, 3, 2), (9, 30, 17))]
    extra = start(engine, [7, 7, 8], mode="mtp", depth=2, max_tokens=50)
    with torch.inference_mode():
        live = seqs + [extra]
        steps = 0
        while live:
            engine.step(live)
            steps += 1
            if steps == 3:  # cancel one row while its next cycle is in flight
                assert engine.generator.chain.flight is not None
                engine.generator.release(extra)
                extra.finish_reason = "cancelled"
            for s in live:
                if s.finished and s is not extra:
                    engine.generator.release(s)
            live = [s for s in live if not s.finished]
    for i, s in enumerate(seqs):
        assert s.generated == alone[i], i
    assert engine.generator.chain.flight is None or all(s.finished for s in engine.generator.chain.flight.seqs)
    assert engine.runner.blocks.num_used_blocks == 0
    engine.runner.blocks.check_invariants()


GHOST_PROMPTS = PROMPTS + [[4, 9, 16, 25], [60, 61, 62, 63, 64, 65], [88] * 7, [3, 1, 4, 1, 5, 9, 2, 6], [70, 71]]


@pytest.mark.parametrize("depth", [0, 2])
def test_rows_that_leave_a_chain_run_on_as_ghosts(depth):
    """Eight rows (greedy and sampled, seeded) end one by one, as a scheduler retires them
    (released at once; one is cancelled mid-decoding): the chain goes on with each leaver as a
    ghost row, frozen so it writes no KV, while the rows left need the 8-row graph (8 down to
    5), and restarts at 4, 2 and 1. The pool is small, so the live rows' new blocks include
    blocks the ghosts gave back: every row decodes exactly what it decodes alone, unchained."""
    engine, _ = tiny_engine("qwen3", kv_cache_tokens=240)
    engine.runner.head.load_state_dict(repeat_head(engine.loaded.model).state_dict())
    mode = dict(mode="mtp", depth=depth) if depth else dict(mode="ar")
    kwargs = [dict(max_tokens=12 + 4 * i, **mode, **SAMPLED[i % len(SAMPLED)]) for i in range(8)]
    alone = [engine.generate(p, **kw).token_ids for p, kw in zip(GHOST_PROMPTS, kwargs)]
    engine.generator.chain.enabled = True
    starts = []
    engine.generator.observers.append(lambda event, s: starts.append(s) if event == "chain_start" else None)
    seqs = [start(engine, p, **kw) for p, kw in zip(GHOST_PROMPTS, kwargs)]
    cache = engine.runner.cache
    given_back, reused, steps, watched, kept = set(), False, 0, {}, 0

    def kv(block: int) -> list[torch.Tensor]:
        return [t[block].clone() for t in cache.k + cache.v]

    with torch.inference_mode():
        while live := [s for s in seqs if not s.finished]:
            engine.step(live)  # (eagerly, the cycle it launches has run when it returns)
            steps += 1
            taken = {b for s in live for b in engine.kv.table(s)}
            for b, before in watched.items():  # a ghost's cycles write no KV: its blocks are as it left them
                if b not in taken:
                    kept += 1
                    assert all(torch.equal(x, y) for x, y in zip(kv(b), before)), b
            watched = {}
            if steps == 4:  # a client cancels a row with its next cycle in flight
                seqs[7].finish_reason = "cancelled"
            for s in live:
                if s.finished:
                    given_back |= set(engine.kv.table(s))
                    watched.update((b, kv(b)) for b in engine.kv.table(s))
                    engine.generator.release(s)
            reused |= any(given_back & set(engine.kv.table(s)) for s in seqs if not s.finished)
    assert [s.generated for s in seqs[:7]] == alone[:7]
    assert seqs[7].generated == alone[7][: len(seqs[7].generated)]
    assert reused and kept  # a ghost's blocks went to a live row while the chain still ran it
    assert len({s.seq_id for s in starts}) == 8 and len(starts) == 8 + 4 + 2 + 1  # chains of 8, 4, 2 and 1 rows
    assert engine.runner.blocks.num_used_blocks == 0
    engine.runner.blocks.check_invariants()


def record_drafts(engine) -> dict[int, list[tuple[int, ...]]]:
    """Every committed cycle's drafts, by seq_id, in order (what the generator's one commit sees)."""
    drafts, inner = {}, engine.generator._commit

    def commit(seqs, outcome, *args, **kwargs):
        for r, s in enumerate(seqs):
            drafts.setdefault(s.seq_id, []).append(tuple(outcome.row(r)[0]))
        return inner(seqs, outcome, *args, **kwargs)

    engine.generator._commit = commit
    return drafts


JOIN_PROMPTS = [[2 + i, 40 - i, 7, 11 + 2 * i] + [i] * (i % 3) for i in range(14)]


@pytest.mark.parametrize("depth, draft_policy, head", [(0, "greedy", "repeat"), (2, "greedy", "repeat"),
                                                       (3, "mirror", "repeat"), (2, "greedy", "random")])
def test_rows_that_join_a_chain_take_the_places_of_rows_that_left(depth, draft_policy, head):
    """A scheduler that keeps its batch full: as each row ends it is released and a new request
    is admitted and prefilled with the chain's cycle in flight, then stepped with the others
    (last in the scheduler's order, not in the chain's). The new rows (greedy and seeded
    sampled, of the chain's kind of cycle) take the leavers' places without a restart, and
    every row decodes exactly what it decodes alone, unchained, with the same drafts accepted
    (the random head's drafts depend on every input of its catch-up, which the repeat head's
    do not)."""
    engine, _ = tiny_engine("qwen3", kv_cache_tokens=400)
    if head == "repeat":
        engine.runner.head.load_state_dict(repeat_head(engine.loaded.model).state_dict())
    mode = dict(mode="mtp", depth=depth, draft_policy=draft_policy) if depth else dict(mode="ar")
    kwargs = [dict(max_tokens=8 + 3 * (i % 5), **mode, **SAMPLED[i % len(SAMPLED)]) for i in range(len(JOIN_PROMPTS))]
    drafts = record_drafts(engine)
    results = [engine.generate(p, **kw) for p, kw in zip(JOIN_PROMPTS, kwargs)]
    alone, alone_drafts = [r.token_ids for r in results], [drafts[i] for i in sorted(drafts)]
    drafts.clear()
    engine.generator.chain.enabled = True
    events = []
    steps = [0]
    engine.generator.observers.append(lambda event, s: events.append((event, s.seq_id, steps[0])))
    waiting = list(zip(JOIN_PROMPTS, kwargs))
    seqs = [start(engine, p, **kw) for p, kw in waiting[:4]]
    waiting = waiting[4:]
    live = list(seqs)
    with torch.inference_mode():
        while live:
            engine.step(live)
            steps[0] += 1
            for s in [s for s in live if s.finished]:
                engine.generator.release(s)
                live.remove(s)
                if waiting:  # its successor arrives with the chain's cycle in flight
                    seqs.append(start(engine, *waiting[0][:1], **waiting[0][1]))
                    live.append(seqs[-1])
                    waiting = waiting[1:]
    assert [s.generated for s in seqs] == alone
    assert [drafts[s.seq_id] for s in seqs] == alone_drafts
    assert depth == 0 or sum(s.stats.accepted_tokens for s in seqs) > 0
    joins = {i for e, i, _ in events if e == "chain_join"}
    assert len(joins) == len(JOIN_PROMPTS) - 4, events  # every new row joined a running chain
    # chains of 4 rows, then (no request left) 2 and 1: a join never restarted one
    assert len({step for e, _, step in events if e == "chain_start"}) == 3, events
    assert engine.runner.blocks.num_used_blocks == 0
    engine.runner.blocks.check_invariants()


@pytest.mark.parametrize("depth, draft_policy", [(0, "greedy"), (2, "greedy"), (3, "mirror")])
def test_a_row_joins_a_chain_in_its_graphs_padding_row(depth, draft_policy):
    """Three rows run in the 4-row graph, its fourth row padding: a request that arrives with
    the chain's cycle in flight takes that row and the chain goes on without a restart; a
    fifth needs the 8-row graph, and the chain restarts. Every row (greedy and seeded sampled)
    decodes exactly what it decodes alone, with the same drafts."""
    engine, _ = tiny_engine("qwen3", kv_cache_tokens=400)
    engine.runner.head.load_state_dict(repeat_head(engine.loaded.model).state_dict())
    mode = dict(mode="mtp", depth=depth, draft_policy=draft_policy) if depth else dict(mode="ar")
    kwargs = [dict(max_tokens=60 - 2 * i, **mode, **SAMPLED[i % len(SAMPLED)]) for i in range(5)]  # none ends early
    drafts = record_drafts(engine)
    alone = [engine.generate(p, **kw).token_ids for p, kw in zip(JOIN_PROMPTS, kwargs)]
    alone_drafts = [drafts[i] for i in sorted(drafts)]
    drafts.clear()
    engine.generator.chain.enabled = True
    events = []
    engine.generator.observers.append(lambda event, s: events.append((event, s.seq_id)))
    seqs = [start(engine, p, **kw) for p, kw in zip(JOIN_PROMPTS[:3], kwargs)]
    with torch.inference_mode():
        for arriving in (3, 4, None):
            for _ in range(3):
                engine.step([s for s in seqs if not s.finished])
            if arriving is not None:  # it arrives with the chain's cycle in flight
                events.clear()
                seqs.append(start(engine, JOIN_PROMPTS[arriving], **kwargs[arriving]))
                engine.step([s for s in seqs if not s.finished])
                kinds = {e for e, _ in events}
                assert ("chain_join" in kinds) == (arriving == 3) and ("chain_start" in kinds) == (arriving == 4)
        while live := [s for s in seqs if not s.finished]:
            engine.step(live)
    for s in seqs:
        engine.generator.release(s)
    assert [s.generated for s in seqs] == alone
    assert [drafts[s.seq_id] for s in seqs] == alone_drafts
    assert depth == 0 or sum(s.stats.accepted_tokens for s in seqs) > 0
    assert engine.runner.blocks.num_used_blocks == 0
    engine.runner.blocks.check_invariants()


def test_a_fault_hook_sees_no_forward_of_a_ghost():
    """A chain's ghost is a request that is over: fault drills' "forward" point is called for
    the live rows of a chained cycle only (a hook on a finished request failed the others)."""
    engine = chained_engine()
    engine.generator.chain.enabled = True
    seqs = [start(engine, [5 + i, 7, 9], mode="mtp", depth=2, max_tokens=6 if i == 0 else 30) for i in range(8)]
    late, ghosts = [], 0
    engine.fault_hook = lambda point, seq: late.append(seq.seq_id) if (
        point == "forward" and seq.seq_id not in engine.generator.live) else None
    with torch.inference_mode():
        for _ in range(8):
            live = [s for s in seqs if not s.finished]
            engine.step(live)
            flight = engine.generator.chain.flight
            ghosts += bool(flight and flight.ghosts)
            for s in live:
                if s.finished:
                    engine.generator.release(s)
    assert ghosts and late == []
    for s in seqs:
        engine.generator.release(s)


def test_a_joining_row_whose_forward_fails_leaves_the_chain_as_it_was():
    """A fault in the launch a row joins: the step raises, the scheduler drops its rows, and the
    chain forgets its cycle in flight, and the released row whose place the join took stays
    released (a chain that forgot its id before the launch kept the cycle and committed into
    that row at the next step)."""
    engine = chained_engine()
    gen = engine.generator
    gen.chain.enabled = True
    seqs = [start(engine, [2 + i, 40, 7, 11], mode="ar", max_tokens=40) for i in range(4)]
    with torch.inference_mode():
        for _ in range(3):
            engine.step(seqs)
        gen.release(seqs[0])  # cancelled: a ghost from the next launch
        live = seqs[1:]
        engine.step(live)
        joining = start(engine, [6, 36, 7, 19], mode="ar", max_tokens=40)
        gen.inject_faults(lambda point, s: (_ for _ in ()).throw(RuntimeError("boom"))
                          if point == "forward" and s is joining else None)
        with pytest.raises(RuntimeError, match="boom"):
            engine.step(live + [joining])
        gen.inject_faults(None)
        for s in live + [joining]:
            gen.release(s)
        assert gen.chain.flight is None
        later = start(engine, [7, 35, 7, 21], mode="ar", max_tokens=40)
        before = len(seqs[0].tokens)
        result = engine.step([later])
        assert [s.seq_id for s in result.advanced] == [later.seq_id] and not result.failed
        assert len(seqs[0].tokens) == before
        gen.release(later)
    assert engine.runner.blocks.num_used_blocks == 0
    engine.runner.blocks.check_invariants()


def test_an_ar_step_commits_the_cycle_in_flight_first():
    engine = chained_engine()
    reference = engine.generate(PROMPTS[1], mode="ar", max_tokens=24).token_ids
    engine.generator.chain.enabled = True
    seq = start(engine, PROMPTS[1], mode="mtp", depth=2, max_tokens=24)
    with torch.inference_mode():
        engine.step([seq])
        assert engine.generator.chain.flight is not None
        committed = seq.num_generated
        seq.mode = "ar"  # the same row decoded AR from here on
        engine.step([seq])
        flight = engine.generator.chain.flight
        assert (flight is None or flight.depth == 0) and seq.num_generated > committed + 1
        while not seq.finished:
            engine.step([seq])
    assert seq.generated == reference
    engine.generator.release(seq)
    assert engine.runner.blocks.num_used_blocks == 0


SAMPLED = [dict(temperature=0.7, top_p=0.9, seed=1), dict(temperature=1.0, top_k=20, seed=2),
           dict(temperature=0.0), dict(temperature=1.3, min_p=0.05, seed=3)]


@pytest.mark.parametrize("depth, mirror", [(0, False), (1, False), (3, False), (1, True), (3, True),
                                          ("auto", False), ("auto", True)])
def test_sampled_rows_chain_and_decode_what_unchained_cycles_decode(depth, mirror):
    """Rows at temperature > 0 chain too: exact rejection sampling of their drafts (or, AR,
    their token's sample) runs on the device from noise of each row's own stream, the fills the
    host path draws, in its order; mirror rows (drafts sampled from the
    head's distribution) draft there too. A seed gives the same tokens chained or not, for rows
    of different settings (a greedy one among them) in one batch; with depth="auto", rows
    whose depths change cycle by cycle."""
    engine = switching_engine() if depth == "auto" else chained_engine()
    mode = dict(mode="mtp", depth=depth) if depth else dict(mode="ar")
    if mirror:
        mode["draft_policy"] = "mirror"
    prompts = PROMPTS + [PROMPTS[0]]

    def decode(chain: bool):
        engine.generator.chain.enabled = chain
        seqs = [start(engine, p, max_tokens=30 - 4 * i, **mode, **kw) for i, (p, kw) in enumerate(zip(prompts, SAMPLED))]
        chained = 0
        with torch.inference_mode():
            while live := [s for s in seqs if not s.finished]:
                engine.step(live)
                chained += engine.generator.chain.flight is not None
        for s in seqs:
            engine.generator.release(s)
        engine.generator.chain.enabled = False
        return [s.generated for s in seqs], chained

    unchained, none = decode(False)
    chained, steps = decode(True)
    assert none == 0 and steps > 5
    assert chained == unchained
    assert engine.runner.blocks.num_used_blocks == 0


@pytest.mark.parametrize("chain", [False, True])
def test_a_batchs_auto_rows_draft_at_one_depth(chain):
    """Rows of one batch (of different sampling settings, so of different acceptance) share
    each cycle's depth, which still moves with their acceptance; the greedy row among them
    decodes what AR does."""
    engine = switching_engine()
    prompts = PROMPTS + [PROMPTS[0]]
    ar = engine.generate(prompts[2], mode="ar", max_tokens=40).token_ids
    engine.generator.chain.enabled = chain
    seqs = [start(engine, p, mode="mtp", depth="auto", max_tokens=40, **kw) for p, kw in zip(prompts, SAMPLED)]
    used = set()
    with torch.inference_mode():
        while live := [s for s in seqs if not s.finished]:
            engine.step(live)
            depths = {s.depth for s in live if not s.finished}
            assert len(depths) <= 1, depths
            used |= depths
    assert SAMPLED[2]["temperature"] == 0 and seqs[2].generated == ar
    assert len(used) >= 2, used
    for s in seqs:
        engine.generator.release(s)
    assert engine.runner.blocks.num_used_blocks == 0


def auto_engine(costs=(1.0, 1.1, 1.15)):
    """switching_engine whose greedy rows' prior favours depth 3 and sampled rows' depth 1."""
    engine = switching_engine()
    engine.auto_depth = AutoDepth(3, DepthCosts(costs, 0.05), greedy_prior=(0.95,) * 3, sampled_prior=(0.05,) * 3)
    return engine


def decode_groups(specs, chain: bool, groups=None, costs=(1.0, 1.1, 1.15)):
    """A fresh ``auto_engine`` decodes (prompt, request kwargs) rows to the end, stepping the
    row groups ``groups`` (index lists; default: one batch) in turn; -> (tokens, depths) per row."""
    engine = auto_engine(costs)
    engine.generator.chain.enabled = chain
    seqs = [start(engine, p, **kw) for p, kw in specs]
    depths = {s.seq_id: [] for s in seqs}
    engine.generator.observers.append(lambda event, s: depths[s.seq_id].append(s.depth) if event == "commit" else None)
    with torch.inference_mode():
        while any(not s.finished for s in seqs):
            for group in groups or [range(len(seqs))]:
                if live := [seqs[i] for i in group if not seqs[i].finished]:
                    engine.step(live)
        engine.generator.drain()
    for s in seqs:
        engine.generator.release(s)
    assert engine.runner.blocks.num_used_blocks == 0 and not engine.generator._mates
    return [s.generated for s in seqs], [depths[s.seq_id] for s in seqs]


HOT = dict(mode="mtp", depth="auto", temperature=1.0, seed=5)


@pytest.mark.parametrize("specs, groups", [
    # a row that ends at its first cycle beside another
    ([(PROMPTS[0], dict(mode="mtp", depth="auto", max_tokens=2)), (PROMPTS[1], dict(HOT, max_tokens=30))], None),
    # two groups stepped in turn (ar_batch steps its lone MTP row and its AR rows apart)
    ([(PROMPTS[1], dict(HOT, max_tokens=40)), (PROMPTS[2], dict(mode="ar", max_tokens=40))], [[0], [1]]),
    # a fixed-depth row (which makes cycles deep) ending mid-decoding
    ([(PROMPTS[0], dict(mode="mtp", depth=3, max_tokens=12)), (PROMPTS[1], dict(HOT, max_tokens=40))], None),
    # rows of several lengths and settings ending one by one
    ([(PROMPTS[i % 3], dict(mode="mtp", depth="auto" if i != 2 else 2, max_tokens=n, temperature=t, seed=i))
      for i, (n, t) in enumerate([(5, 0.0), (17, 1.3), (9, 0.7), (40, 1.0), (3, 1.0)])], None),
])
def test_auto_rows_ending_or_stepped_apart_decode_alike_chained_or_not(specs, groups):
    """A chained cycle launched before the host saw a row end still carries it: the unchained
    path counts the ended row once too, so the depths, and a seed's tokens, are the same."""
    for costs in ((1.0, 1.1, 1.15), (1.0, 1.5, 2.0)):  # the second: depth 3 pays only beside a fixed depth-3 row
        assert decode_groups(specs, True, groups, costs) == decode_groups(specs, False, groups, costs)


def test_a_lone_seeded_auto_request_decodes_alike_whatever_ran_before_it():
    def after(earlier: dict) -> list[int]:
        engine = auto_engine()
        engine.generate(PROMPTS[2], mode="mtp", depth="auto", max_tokens=40, **earlier)
        return engine.generate(PROMPTS[1], max_tokens=40, **HOT).token_ids

    assert after(dict(temperature=0.0)) == after(dict(temperature=1.0, seed=9))


def test_an_auto_request_ar_batch_steps_ar_keeps_no_plan_and_chains():
    """ar_batch decodes a request AR beside others (mode, depth and adaptive set on the request
    before its sequence is made): no depth plan, and its AR steps chain."""
    engine = auto_engine()
    engine.generator.chain.enabled = True
    seqs = []
    for p in PROMPTS[:2]:
        req = engine.make_request(p, mode="mtp", depth="auto", max_tokens=30)
        req.mode, req.depth, req.adaptive = "ar", 0, False
        seqs.append(engine.new_sequence(req))
        engine.generator.admit(seqs[-1])
        engine.generator.prefill(seqs[-1])
    assert all(s.depth_plan is None and s.depth == 0 for s in seqs)
    chained = steps = 0
    with torch.inference_mode():
        while live := [s for s in seqs if not s.finished]:
            engine.step(live)
            steps += 1
            chained += engine.generator.chain.flight is not None
    for s in seqs:
        engine.generator.release(s)
    assert chained > steps // 2, (chained, steps)


@pytest.mark.parametrize(("depth", "chain"), [(1, False), (3, False), (3, True), ("auto", True)])
def test_mtp_decodes_to_the_context_end_as_ar_does(depth, chain):
    """A cycle commits up to depth + 1 tokens: near the context's end a row drafts fewer (the
    last token an AR step), so MTP output ends at the context's last token as AR's does, alone
    and in a batch of rows at other depths; no block is asked past the context."""
    engine = chained_engine()
    engine.generator.chain.enabled = chain
    prompts = [[11], [1, 2, 3], [40, 41, 42, 43]]  # [11] ends in a loop its drafts all match
    ar = [engine.generate(p, mode="ar", max_tokens=10**6, ignore_eos=True) for p in prompts]
    assert all(len(p) + len(r.token_ids) == engine.max_context and r.finish_reason == "length"
               for p, r in zip(prompts, ar))
    alone = engine.generate(prompts[0], mode="mtp", depth=depth, max_tokens=10**6, ignore_eos=True)
    assert alone.token_ids == ar[0].token_ids and alone.finish_reason == "length"
    assert alone.stats["accepted_tokens"] > 0
    seqs = [start(engine, p, mode="mtp", depth=d, max_tokens=10**6, ignore_eos=True)
            for p, d in zip(prompts, (depth, 2, 1))]
    with torch.inference_mode():
        while not all(s.finished for s in seqs):
            engine.step([s for s in seqs if not s.finished])
    for s in seqs:
        engine.generator.release(s)
    assert [s.generated for s in seqs] == [r.token_ids for r in ar]
    assert all(s.finish_reason == "length" for s in seqs)
    assert engine.runner.blocks.num_used_blocks == 0


@pytest.mark.parametrize("depth, draft_policy", [(0, "greedy"), (2, "greedy"), (3, "mirror")])
def test_rows_whose_prompts_run_beside_the_chain_join_once_their_first_token_is_drawn(depth, draft_policy):
    """A scheduler that does not wait for a new row's prompt (``prefill(wait=False)``): the
    prompt's forwards run beside the chain (on the CPU, ``Generator.beside`` "inline": in order), the
    call answers False and the chain steps on without the row (beside an MTP chain, the head
    is pre-fed the prompt's pairs there too); a later call draws its first token and the row
    joins the running chain. Every row decodes what it decodes alone,
    greedy and seeded sampled, with the same drafts; no join restarts the chain."""
    engine, _ = tiny_engine("qwen3", kv_cache_tokens=400)
    engine.runner.head.load_state_dict(repeat_head(engine.loaded.model).state_dict())
    mode = dict(mode="mtp", depth=depth, draft_policy=draft_policy) if depth else dict(mode="ar")
    kwargs = [dict(max_tokens=8 + 3 * (i % 5), **mode, **SAMPLED[i % len(SAMPLED)]) for i in range(len(JOIN_PROMPTS))]
    drafts = record_drafts(engine)
    alone = [engine.generate(p, **kw).token_ids for p, kw in zip(JOIN_PROMPTS, kwargs)]
    alone_drafts = [drafts[i] for i in sorted(drafts)]
    drafts.clear()
    gen = engine.generator
    gen.chain.enabled, gen.beside = True, "inline"
    events = []
    gen.observers.append(lambda event, s: events.append((event, s.seq_id)))
    waiting = list(zip(JOIN_PROMPTS, kwargs))
    seqs = [start(engine, p, **kw) for p, kw in waiting[:4]]
    waiting = waiting[4:]
    live, pending, deferred = list(seqs), [], 0
    with torch.inference_mode():
        while live or pending:
            for s in list(pending):
                if gen.prefill(s, wait=not live):
                    pending.remove(s)
                    live.append(s)
            if live:
                engine.step(live)
            for s in [s for s in live if s.finished]:
                gen.release(s)
                live.remove(s)
                if waiting:  # its successor arrives with the chain's cycle in flight
                    seq = engine.new_sequence(engine.make_request(waiting[0][0], **waiting[0][1]))
                    gen.admit(seq)
                    assert not gen.prefill(seq, wait=False) and seq.pending_prefill is not None
                    if depth:  # the head was pre-fed beside it too: the join leaves it the chain's catch-up alone
                        assert seq.trunk_len + 1 - seq.head_len <= gen.chain.flight.depth + 1
                    deferred += 1
                    seqs.append(seq)
                    pending.append(seq)
                    waiting = waiting[1:]
    assert deferred == len(JOIN_PROMPTS) - 4
    assert [s.generated for s in seqs] == alone
    assert [drafts[s.seq_id] for s in seqs] == alone_drafts
    assert depth == 0 or sum(s.stats.accepted_tokens for s in seqs) > 0
    assert len({i for e, i in events if e == "chain_join"}) == len(JOIN_PROMPTS) - 4, events  # each joined
    assert engine.runner.blocks.num_used_blocks == 0
    engine.runner.blocks.check_invariants()


def test_an_ar_row_beside_an_mtp_chain_feeds_no_head():
    """An AR request (ar_batch demotes rows that join a lone MTP request) whose prompt hits the
    prefix cache and runs beside an MTP chain: the head's pre-feed is for MTP rows alone (a hit
    gives every row one cached state, which is not a backlog of pairs); it decodes what it
    decodes alone."""
    engine = chained_engine()
    gen = engine.generator
    shared = list(range(3, 43))  # ten full blocks of 4, cached by an AR request first
    engine.generate(shared + [50, 51], mode="ar", max_tokens=3)
    prompt = shared + list(range(60, 85))
    gen.chain.enabled, gen.beside = True, "inline"
    with torch.inference_mode():
        a = start(engine, PROMPTS[0], max_tokens=30, mode="mtp", depth=2)
        engine.step([a])  # an MTP chain's cycle in flight
        b = engine.new_sequence(engine.make_request(prompt, max_tokens=6, mode="ar"))
        gen.admit(b)
        assert b.cached_prompt_tokens > 0 and b.hidden_backlog is not None
        head_len = b.head_len
        assert not gen.prefill(b, wait=False) and b.head_len == head_len  # the head was not fed
        gen.release(a)
        assert gen.prefill(b, wait=True)
        while not b.finished:
            engine.step([b])
        gen.release(b)
    gen.chain.enabled = False
    assert b.generated == engine.generate(prompt, mode="ar", max_tokens=6).token_ids
    assert engine.runner.blocks.num_used_blocks == 0


def test_a_row_released_before_its_first_token_frees_its_blocks():
    """A request cancelled while its prompt runs beside the chain: release drops the pending
    prompt (after its forwards, on a GPU) and returns its blocks; the other rows go on."""
    engine = chained_engine()
    gen = engine.generator
    gen.chain.enabled, gen.beside = True, "inline"
    with torch.inference_mode():
        a = start(engine, PROMPTS[0], max_tokens=12, mode="mtp", depth=2)
        engine.step([a])  # a chained cycle in flight
        b = engine.new_sequence(engine.make_request(PROMPTS[2], max_tokens=12, mode="mtp", depth=2))
        gen.admit(b)
        assert not gen.prefill(b, wait=False) and b.pending_prefill is not None
        gen.release(b)
        while not a.finished:
            engine.step([a])
        gen.release(a)
    assert a.generated == engine.generate(PROMPTS[0], max_tokens=12, mode="mtp", depth=2).token_ids
    assert engine.runner.blocks.num_used_blocks == 0


def test_a_prompts_head_backlog_is_its_own_memory():
    """The head's backlog of a new prompt is a copy, not a view of a forward's output: on the
    GPU that output is a CUDA graph's buffer, which the next replay (the prompt's second
    forward at its cache edge, another row's prompt) overwrites before the head reads it."""
    engine = chained_engine()
    gen = engine.generator
    outputs, held = [], []  # each trunk forward's output; the backlog's memory when the next one starts
    inner = engine.runner.trunk

    def trunk(seqs, *args, **kwargs):
        backlog = seqs[0].hidden_backlog
        held.append(None if backlog is None else backlog.untyped_storage().data_ptr())
        outputs.append(inner(seqs, *args, **kwargs))
        return outputs[-1]
    engine.runner.trunk = trunk
    try:
        with torch.inference_mode():
            for prompt in (list(range(3, 27)), [5]):  # split at the cache edge; one forward
                seq = engine.new_sequence(engine.make_request(prompt, max_tokens=4, mode="mtp", depth=1))
                gen.admit(seq)
                gen.prefill(seq)
                held.append(seq.hidden_backlog.untyped_storage().data_ptr())
                gen.release(seq)
    finally:
        del engine.runner.trunk
    assert len(outputs) == 3 and held[0] is None and held[3] is None
    assert held[1] != outputs[0].untyped_storage().data_ptr()  # before the prompt's second forward
    assert held[2] not in (outputs[0].untyped_storage().data_ptr(), outputs[1].untyped_storage().data_ptr())
    assert held[4] != outputs[2].untyped_storage().data_ptr()
