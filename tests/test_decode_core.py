"""The decode core's parts, each against an independent reference: the chain object that owns
the cycle in flight, the KV allocator (the one place blocks are taken), the batched sampler
(the per-row reference sampler), and the package layering."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch

from mtplx.engine.sampling import (DRAFT_SHARPENING, SamplerBatch, SamplingParams, draft_params, logits_to_probs,
                                   NoiseStream, sample)
from tests.test_mtp_chained import PROMPTS, start
from tests.test_mtp_chained import chained_engine as repeat_head_engine
from tests.tiny_models import tiny_engine



def chained_engine():
    engine = repeat_head_engine()
    engine.generator.chain.enabled = True
    return engine


# -- the chain object ------------------------------------------------------------------------
def test_the_chain_goes_on_only_over_the_same_live_rows_at_the_same_depth():
    engine = chained_engine()
    gen, chain = engine.generator, engine.generator.chain
    seqs = [start(engine, p, mode="mtp", depth=2, max_tokens=40) for p in PROMPTS]
    with torch.inference_mode():
        result = gen.step(seqs)
        assert chain.flight is not None and chain.flight.seqs == seqs
        assert [s.seq_id for s in result.advanced] == [s.seq_id for s in seqs] and not result.failed
        assert chain.continues(seqs, [2, 2, 2])
        assert not chain.continues(seqs, [2, 1, 2])       # another depth
        assert not chain.continues(seqs[:2], [2, 2])      # other rows
        assert chain.continues(seqs[::-1], [2, 2, 2])  # the same rows in another order (a joined row's place)
        gen.release(seqs[1])  # cancelled with its cycle in flight
        assert not chain.continues(seqs, [2, 2, 2])
        flight, keep = chain.drain()
        assert keep == [0, 2] and chain.flight is None
        assert chain.drain() is None
    for s in (seqs[0], seqs[2]):
        gen.release(s)
    assert engine.runner.blocks.num_used_blocks == 0


def test_forgetting_every_row_of_the_cycle_in_flight_drops_it():
    engine = chained_engine()
    gen = engine.generator
    seqs = [start(engine, p, mode="ar", max_tokens=40) for p in PROMPTS[:2]]
    with torch.inference_mode():
        gen.step(seqs)
    assert gen.chain.flight is not None
    gen.release(seqs[0])
    assert gen.chain.flight is not None
    gen.release(seqs[1])
    assert gen.chain.flight is None and gen.live == {}
    assert engine.runner.blocks.num_used_blocks == 0
    engine.runner.blocks.check_invariants()


def test_a_step_over_other_rows_reports_the_rows_of_the_cycle_it_committed_first():
    """No hidden cross-row commits: a step for group B commits A's chained cycle in flight,
    and says so in its result (A's rows first, then B's)."""
    engine = chained_engine()
    gen = engine.generator
    a = [start(engine, p, mode="mtp", depth=1, max_tokens=40) for p in PROMPTS[:2]]
    b = [start(engine, PROMPTS[2], mode="ar", max_tokens=40)]
    with torch.inference_mode():
        gen.step(a)
        before = [s.num_generated for s in a]
        result = gen.step(b)
    assert [s.seq_id for s in result.advanced] == [s.seq_id for s in a + b]
    assert all(s.num_generated > n for s, n in zip(a, before))
    for s in a + b:
        gen.release(s)
    assert engine.runner.blocks.num_used_blocks == 0


def test_the_chain_does_not_start_where_a_row_would_pass_the_context():
    engine = chained_engine()
    seq = start(engine, [3 + i % 80 for i in range(engine.max_context - 6)], mode="mtp", depth=3, max_tokens=4)
    free = engine.runner.blocks.num_free_blocks
    assert not engine.generator.chain.reserve([seq], 3)  # lookahead: 12 more slots than the context has
    assert engine.runner.blocks.num_free_blocks == free  # nothing taken
    engine.generator.release(seq)


# -- the KV allocator ----------------------------------------------------------------------------
def test_forwards_never_take_blocks_they_read_tables_the_allocator_filled():
    engine, _ = tiny_engine("qwen3")
    seq = engine.new_sequence(engine.make_request(PROMPTS[1], mode="ar", max_tokens=8))
    engine.generator.admit(seq)
    runner = engine.runner
    with torch.inference_mode():
        runner.trunk([seq], [seq.prompt_ids], [0])
        used = runner.blocks.num_used_blocks
        with pytest.raises(RuntimeError, match="not reserved"):
            runner.trunk([seq], [[5] * 16], [len(seq.prompt_ids)])  # past the prompt's blocks
        assert runner.blocks.num_used_blocks == used
        engine.kv.reserve(seq, len(seq.prompt_ids) + 16)
        runner.trunk([seq], [[5] * 16], [len(seq.prompt_ids)])
    engine.generator.release(seq)
    assert runner.blocks.num_used_blocks == 0


def test_the_allocator_promises_each_running_row_its_whole_run():
    engine, _ = tiny_engine("qwen3")
    kv = engine.kv
    need = kv.blocks_needed(prompt_tokens=10, max_tokens=20, depth=3)
    assert need == -(-(10 + 20 + 3 + 1) // kv.block_size)
    assert kv.blocks_needed(prompt_tokens=10, max_tokens=10**6, depth=3) == -(-engine.max_context // kv.block_size)
    seq = engine.new_sequence(engine.make_request(list(range(3, 13)), mode="mtp", depth=3, max_tokens=20))
    free = kv.headroom([])
    engine.generator.admit(seq)
    held = len(kv.table(seq))
    assert kv.headroom([(seq, need)]) == free - held - (need - held)
    engine.generator.release(seq)
    assert kv.stats()["used_blocks"] == 0


# -- the batched sampler ---------------------------------------------------------------------------
ROW_PARAMS = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.3, min_p=0.1),
              SamplingParams(temperature=0.5, top_k=20, top_p=0.8, min_p=0.02), SamplingParams(temperature=1.0)]


def test_the_batched_sampler_processes_each_row_as_the_per_row_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(ROW_PARAMS), 3, 64, generator=g) * 3
    batch = SamplerBatch(ROW_PARAMS, [NoiseStream(i) for i in range(len(ROW_PARAMS))], torch.device("cpu"))
    got = batch.probs(logits)
    for r, params in enumerate(ROW_PARAMS):
        ref = logits_to_probs(logits[r], params)
        assert torch.equal(got[r] > 0, ref > 0), r  # the same support: filters cut the same tokens
        assert torch.allclose(got[r], ref, atol=1e-6), r
    assert torch.allclose(batch.probs(logits[:, 0]), got[:, 0])


def test_mirror_drafts_come_from_the_sharpened_head_distribution_without_filters_on_both_paths():
    """A mirror row's q: softmax(z / (T * DRAFT_SHARPENING)), no top-k / top-p / min-p (exact
    for any q; sampling.draft_params), the same on the host path (``SamplerBatch.draft_probs``)
    and in the chained cycle (``CycleSampling.draft``, its PyTorch path here)."""
    from mtplx.engine.runner import CycleSampling
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(len(ROW_PARAMS), 64, generator=g) * 3
    for params in ROW_PARAMS:
        assert draft_params(params) == (params if params.greedy else
                                         SamplingParams(temperature=params.temperature * DRAFT_SHARPENING))
    host = SamplerBatch(ROW_PARAMS, [NoiseStream(i) for i in range(len(ROW_PARAMS))],
                        torch.device("cpu")).draft_probs(logits)
    cycle = CycleSampling(len(ROW_PARAMS), 1, 64, "mirror_filters", torch.device("cpu"))
    cycle.write_params(ROW_PARAMS, [not p.greedy for p in ROW_PARAMS])
    cycle.draft_race.exponential_(generator=g)
    picks, q = cycle.draft(logits, 0)
    for r, params in enumerate(ROW_PARAMS):
        want = torch.softmax(logits[r] / (params.temperature * DRAFT_SHARPENING), dim=-1) if not params.greedy \
            else logits_to_probs(logits[r:r + 1], params)[0]
        assert bool((want > 0).all()) or params.greedy, r  # no filter cut a token
        torch.testing.assert_close(host[r], want, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(q[r], want, rtol=1e-5, atol=1e-7)
        race_pick = int(torch.argmax(want / cycle.draft_race[r, 0])) if not params.greedy else int(logits[r].argmax())
        assert int(picks[r]) == race_pick, r


def test_the_batched_sampler_draws_what_each_row_draws_alone():
    """Each row's noise comes from its own stream, so a seed fixes a row's tokens whatever rows
    run beside it."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(ROW_PARAMS), 64, generator=g) * 2
    batch = SamplerBatch(ROW_PARAMS, [NoiseStream(100 + i) for i in range(len(ROW_PARAMS))],
                         torch.device("cpu"))
    probs = batch.probs(logits)
    drawn = [batch.sample(probs).tolist() for _ in range(20)]
    for r, params in enumerate(ROW_PARAMS):
        alone = NoiseStream(100 + r)
        ref = [int(sample(logits_to_probs(logits[r:r + 1], params), alone)) if not params.greedy
               else int(logits[r].argmax()) for _ in range(20)]
        assert [d[r] for d in drawn] == ref, r


# -- layering ---------------------------------------------------------------------------------------
PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mtplx"


def imported_modules(folder: str) -> dict[str, set[str]]:
    out = {}
    for path in (PACKAGE / folder).glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        out[path.name] = names
    return out


@pytest.mark.parametrize("folder, forbidden", [
    ("models", ("mtplx.engine", "mtplx.batching", "mtplx.server")),
    ("kernels", ("mtplx.engine", "mtplx.cache", "mtplx.models", "mtplx.batching", "mtplx.server")),
    ("cache", ("mtplx.engine", "mtplx.models", "mtplx.batching", "mtplx.server")),
    ("loading", ("mtplx.engine", "mtplx.batching", "mtplx.server")),
    ("engine", ("mtplx.batching", "mtplx.server")),
    ("batching", ("mtplx.server",)),
])
def test_lower_layers_never_import_higher_ones(folder, forbidden):
    bad = {f: sorted(m for m in names if m.startswith(forbidden)) for f, names in imported_modules(folder).items()}
    assert not {f: m for f, m in bad.items() if m}


def test_batching_never_touches_block_tables():
    for path in (PACKAGE / "batching").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"\.blocks\b|block_table", text), path.name


def test_the_batched_sampler_keeps_the_top_token_for_a_top_p_below_float32s_range():
    """top_p = 1e-165 (valid: in (0, 1]) is 0.0 as a float32 tensor; the top token stays."""
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.0, top_p=1e-165), SamplingParams(temperature=0.5, top_p=0.5)]
    batch = SamplerBatch(params, [NoiseStream(0), NoiseStream(1)], torch.device("cpu"))
    probs = batch.probs(logits)
    assert torch.equal(probs[0], logits_to_probs(logits[:1], params[0])[0])
    assert probs[0].max() == 1.0 and int(probs[0].argmax()) == int(logits[0].argmax())
