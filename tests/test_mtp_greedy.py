"""MTP greedy decoding is token-identical to AR greedy decoding."""

import pytest
import torch

from mtplx.cache import attention
from tests.tiny_models import repeat_head, tiny_engine

PROMPTS = [[1, 2, 3], [5, 17, 33, 2, 8, 9, 10, 11, 40], list(range(20, 39))]


@pytest.mark.parametrize("head", ["random", "repeat"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mtp_greedy_equals_ar_greedy(arch, head):
    engine, hf = tiny_engine(arch)
    if head == "repeat":  # a head whose drafts are often accepted: partial and full acceptance
        engine.runner.head.load_state_dict(repeat_head(engine.loaded.model).state_dict())
    for prompt in PROMPTS:
        ar = engine.generate(prompt, mode="ar", max_tokens=40)
        with torch.no_grad():  # AR itself equals transformers' greedy decoding
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert ar.token_ids == ref
        for depth in (1, 2, 3):
            mtp = engine.generate(prompt, mode="mtp", depth=depth, max_tokens=40)
            assert mtp.token_ids == ar.token_ids, (prompt, depth)
            assert mtp.stats["verify_calls"] > 0
            assert len(mtp.stats["drafted_by_depth"]) == depth


def test_mtp_greedy_equals_ar_after_prefix_cache_hit():
    engine, _ = tiny_engine("qwen3")
    prompt = list(range(3, 30))
    first = engine.generate(prompt, mode="mtp", depth=2, max_tokens=24)
    again = engine.generate(prompt, mode="mtp", depth=2, max_tokens=24)
    assert again.stats["cached_prompt_tokens"] == 24
    ar = engine.generate(prompt + [1], mode="ar", max_tokens=10)
    extended = engine.generate(prompt + [1], mode="mtp", depth=3, max_tokens=10)
    assert first.token_ids == again.token_ids
    assert extended.token_ids == ar.token_ids


def test_stats_have_the_documented_fields():
    engine, _ = tiny_engine("llama")
    stats = engine.generate([1, 2, 3], mode="mtp", depth=2, max_tokens=20).stats
    for key in ("drafted_tokens", "accepted_tokens", "verify_calls", "drafted_by_depth", "accepted_by_depth",
                "correction_tokens", "bonus_tokens", "mean_acceptance_length", "acceptance_rate_by_position",
                "ttft_s", "decode_tok_s", "draft_s", "verify_s", "accept_s", "commit_s"):
        assert key in stats
    assert stats["mean_acceptance_length"] == 1 + stats["accepted_tokens"] / stats["verify_calls"]
    assert stats["correction_tokens"] + stats["bonus_tokens"] == stats["verify_calls"]
    assert engine.runner.blocks.num_used_blocks == 0


def test_ar_blocks_never_serve_an_mtp_request_stale_head_entries():
    """AR requests on a head model write no head KV, so their cached blocks are kept apart."""
    engine, _ = tiny_engine("llama")
    prompt = list(range(3, 30))
    engine.generate(prompt, mode="ar", max_tokens=4)
    assert engine.generate(prompt, mode="ar", max_tokens=4).stats["cached_prompt_tokens"] == 24
    assert engine.generate(prompt, mode="mtp", max_tokens=4).stats["cached_prompt_tokens"] == 0
    assert engine.generate(prompt, mode="mtp", max_tokens=4).stats["cached_prompt_tokens"] == 24
    assert engine.runner.blocks.num_used_blocks == 0
    engine.runner.blocks.check_invariants()


@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_greedy_mtp_cycle_brings_values_to_the_host_once(rows, chained, monkeypatch):
    """Argmax drafts stay on the device and greedy verification runs there: one transfer per
    cycle (drafts, accepted counts, next tokens), however deep and however many rows, chained
    cycles (tests/test_mtp_chained.py) included. On a GPU each transfer is a host sync that
    drains the queue of launched work."""
    engine, _ = tiny_engine("qwen3")
    engine.runner.head.load_state_dict(repeat_head(engine.loaded.model).state_dict())
    engine.generator.chain.enabled = chained
    # the CPU-only one-row attention reads its query positions on the host, where there is no
    # device to wait for; what is counted here is the generator's transfers
    monkeypatch.setattr(attention, "ROW_EXACT_QUERIES", 0)
    seqs = []
    for i in range(rows):
        seq = engine.new_sequence(engine.make_request([3 + i, 4, 5, 6], mode="mtp", depth=3, max_tokens=30))
        engine.generator.admit(seq)
        engine.generator.prefill(seq)
        seqs.append(seq)
    transfers = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _f=original, _n=name: transfers.append(_n) or _f(self))
    with torch.inference_mode():
        for _ in range(4):
            transfers.clear()
            before = [s.num_generated for s in seqs]
            engine.step(seqs)
            assert transfers == ["tolist"]
            assert all(s.num_generated > b for s, b in zip(seqs, before))


def test_every_greedy_cycle_fits_the_cycle_graph(monkeypatch):
    """The CUDA-graph runner captures a greedy cycle with a catch-up of at most depth + 1 pairs;
    the first cycle after a prompt feeds the head the rest beforehand, so no cycle (the first
    included, several rows of different prompt lengths included) needs the eager path."""
    engine, _ = tiny_engine("qwen3")
    engine.runner.head.load_state_dict(repeat_head(engine.loaded.model).state_dict())
    widths = []

    def recording(forward):  # unchained (greedy_cycle) and chained (start_cycle) cycles alike
        def run(seqs, backlog, depth):
            if depth:  # depth 0 is a chained AR step: no catch-up
                widths.append((backlog.shape[1], depth))
            return forward(seqs, backlog, depth)
        return run

    for name in ("greedy_cycle", "start_cycle"):
        monkeypatch.setattr(engine.runner, name, recording(getattr(engine.runner, name)))
    for prompt in PROMPTS:
        ar = engine.generate(prompt, mode="ar", max_tokens=30)
        assert engine.generate(prompt, mode="mtp", depth=3, max_tokens=30).token_ids == ar.token_ids
    seqs = []
    for prompt in PROMPTS:
        seq = engine.new_sequence(engine.make_request(prompt, mode="mtp", depth=2, max_tokens=20))
        engine.generator.admit(seq)
        engine.generator.prefill(seq)
        seqs.append(seq)
    with torch.inference_mode():
        engine.step(seqs)
    assert widths and all(width <= depth + 1 for width, depth in widths)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_cycle_graphs_input_layout_matches_the_eager_cycle(rows, depth):
    """What the CUDA cycle graph replays, run eagerly on the CPU: ``cycle_forward`` over the
    graph's static buffers (rows padded to the graph's bucket, catch-up padded to depth + 1),
    filled by ``CycleBuffers.values``, computes what ``ModelRunner.greedy_cycle`` computes, and
    drafts what the step-by-step draft path drafts."""
    from mtplx.engine.cuda_graphs import ROW_BUCKETS
    from mtplx.engine.runner import CycleBuffers

    engine, _ = tiny_engine("qwen3")
    engine.runner.head.load_state_dict(repeat_head(engine.loaded.model).state_dict())
    gen, runner = engine.generator, engine.runner
    seqs = []
    for prompt in PROMPTS[:rows]:
        seq = engine.new_sequence(engine.make_request(prompt, mode="mtp", depth=depth, max_tokens=40))
        gen.admit(seq)
        gen.prefill(seq)
        seqs.append(seq)
    g = torch.Generator().manual_seed(depth * 10 + rows)
    with torch.inference_mode():
        gen.step(seqs)  # past the first cycle
        # catch-ups of different widths up to depth + 1, as after partial and full acceptance:
        # step each row's head back (its entries are rewritten) with hidden states to feed
        widths = [depth + 1, 1, min(2, depth + 1)][:rows]
        for s, w in zip(seqs, widths):
            s.head_len = s.trunk_len + 1 - w
        width = max(widths)
        backlog = torch.randn(rows, width, engine.config.hidden_size, generator=g)
        bucket = next(b for b in ROW_BUCKETS if b >= rows)
        buffers = CycleBuffers(runner, bucket, depth, table_width=engine.max_context // runner.block_size)
        for s in seqs:  # the blocks the cycle writes (the generator reserves them before a cycle)
            engine.kv.reserve(s, s.trunk_len + depth + 1)
        values, used = buffers.values(seqs)
        buffers.fill(torch.tensor(values), used)
        buffers.backlog[:rows, :width] = backlog
        got = runner.cycle_forward(buffers.inputs, buffers.backlog, depth)
        ref = runner.greedy_cycle(seqs, backlog, depth)
        for s in seqs:  # the step-by-step draft path, written separately, drafts from the same pairs
            s.hidden_backlog = backlog[seqs.index(s), : s.trunk_len + 1 - s.head_len]
        step_by_step, _ = gen._draft(seqs, depth, {})
    assert got[2][:rows].tolist() == ref[2].tolist()
    assert got[2][:rows, :depth].tolist() == step_by_step
    for a, b in zip(got[:2], ref[:2]):
        assert (a[:rows] - b).abs().max() <= 1e-4


@pytest.mark.parametrize("policy", ["greedy", "mirror"])
def test_rows_of_different_depths_never_write_past_their_own_depth(policy, monkeypatch):
    """In a batch of MTP rows of different depths, the head steps past a row's own depth are
    placeholders: they must not write KV (or take blocks) beyond that row's own cycle, or a
    shallow row near the end of the context would ask for blocks past it (on the GPU, past its
    graph's block table). Outputs stay those of each row alone."""
    engine, _ = tiny_engine("qwen3")
    gen = engine.generator
    asked = []
    ensure = engine.runner.blocks.ensure_capacity
    monkeypatch.setattr(engine.runner.blocks, "ensure_capacity",
                        lambda seq_id, n: asked.append(n) or ensure(seq_id, n))
    temperature = 0.0 if policy == "greedy" else 1.0
    rows = [(1, [3 + i % 80 for i in range(240)]), (8, [5 + i % 70 for i in range(100)])]
    alone = [engine.generate(p, mode="mtp", depth=d, max_tokens=engine.max_context - len(p) - 1, seed=7,
                             temperature=temperature, draft_policy=policy).token_ids for d, p in rows]
    asked.clear()
    seqs = []
    for depth, prompt in rows:
        seq = engine.new_sequence(engine.make_request(prompt, mode="mtp", depth=depth, seed=7,
                                                      temperature=temperature, draft_policy=policy,
                                                      max_tokens=engine.max_context - len(prompt) - 1))
        gen.admit(seq)
        gen.prefill(seq)
        seqs.append(seq)
    with torch.inference_mode():
        while not all(s.finished for s in seqs):
            engine.step([s for s in seqs if not s.finished])
    assert max(asked) <= engine.max_context
    assert [s.generated for s in seqs] == alone
