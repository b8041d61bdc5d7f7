"""Forged heads of every kind (issue 16) decode exactly: a head reading the trunk's pre-norm
state or three fused layers, a head of two layers, a head with a pruned draft vocabulary.
Greedy MTP equals AR greedy through the step-by-step and the chained cycle, after a prefix-cache
hit too; a pruned head's draft logits are the trunk's output rows of its vocabulary."""

import pytest
import torch

from mtplx.models.config import MTPConfig, feature_layers
from mtplx.models.mtp import PRUNED_LOGIT
from tests.test_mtp_greedy import PROMPTS
from tests.tiny_models import tiny_engine

VOCAB_IDS = list(range(0, 96, 3))  # a third of the tiny vocabulary

# (features, head layers, draft vocabulary, chained): each kind step by step, two also chained
KINDS = [("prenorm", 1, None, False), ("fuse3", 1, None, False), ("final", 2, None, False),
         ("final", 1, VOCAB_IDS, False), ("fuse3", 2, VOCAB_IDS, False), ("prenorm", 1, None, True),
         ("fuse3", 2, VOCAB_IDS, True)]


@pytest.mark.parametrize("features,layers,vocab,chained", KINDS,
                         ids=lambda x: str(x if not isinstance(x, list) else "vocab"))
def test_mtp_greedy_equals_ar_greedy_for_every_head_kind(features, layers, vocab, chained):
    engine, _ = tiny_engine("qwen3", num_hidden_layers=4, draft_vocab=vocab,
                            mtp=MTPConfig(layout="sidecar", features=features, head_layers=layers))
    head = engine.runner.head
    assert head.trunk_width == 64 * (1 + len(feature_layers(features, 4)))
    assert len(engine.runner.cache.k) == 4 + layers and engine.runner.cache.last_hidden.shape[1] == head.trunk_width
    engine.generator.chain.enabled = chained
    starts = []
    engine.generator.observers.append(lambda event, seq: starts.append(event == "chain_start"))
    for prompt in PROMPTS:
        ar = engine.generate(prompt, mode="ar", max_tokens=30).token_ids
        for depth in (1, 3):
            assert engine.generate(prompt, mode="mtp", depth=depth, max_tokens=30).token_ids == ar, (prompt, depth)
    assert any(starts) == chained
    prompt = list(range(3, 30))  # a prefix-cache hit: the head resumes from a stored wide hidden state
    first = engine.generate(prompt, mode="mtp", depth=2, max_tokens=16)
    again = engine.generate(prompt, mode="mtp", depth=2, max_tokens=16)
    assert again.stats["cached_prompt_tokens"] == 24 and again.token_ids == first.token_ids
    assert first.token_ids == engine.generate(prompt, mode="ar", max_tokens=16).token_ids


def test_a_head_with_a_narrower_second_mlp_decodes_exactly():
    """--second-mlp: the second layer's MLP is that wide (the first keeps the trunk's), and
    greedy MTP still equals AR greedy."""
    engine, _ = tiny_engine("qwen3", num_hidden_layers=4,
                            mtp=MTPConfig(layout="sidecar", features="fuse3", head_layers=2, second_mlp=40))
    first, second = engine.runner.head.layers
    assert (first.mlp.gate_proj.out_features, second.mlp.gate_proj.out_features, second.mlp.down_proj.in_features) \
        == (128, 40, 40)
    for prompt in PROMPTS[:2]:
        ar = engine.generate(prompt, mode="ar", max_tokens=20).token_ids
        assert engine.generate(prompt, mode="mtp", depth=3, max_tokens=20).token_ids == ar, prompt


def test_pruned_draft_logits_are_the_trunks_rows_of_the_draft_vocabulary():
    engine, _ = tiny_engine("llama", draft_vocab=VOCAB_IDS)
    model, head = engine.loaded.model, engine.runner.head
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    got = head.draft_logits(model, h)
    full = model.compute_logits(h)  # independent: the whole lm_head
    assert torch.allclose(got[:, VOCAB_IDS], full[:, VOCAB_IDS], atol=1e-5)
    outside = [t for t in range(96) if t not in VOCAB_IDS]
    assert bool((got[:, outside] == PRUNED_LOGIT).all())
    picks = got.argmax(-1).tolist()
    assert all(p in VOCAB_IDS for p in picks)
    assert picks == [VOCAB_IDS[i] for i in full[:, VOCAB_IDS].argmax(-1).tolist()]
    assert torch.softmax(got, -1)[:, outside].sum() == 0  # a sampled draft's q is zero outside it


@pytest.mark.parametrize("arch,layers,fused", [("qwen3", 1, False), ("llama", 2, False), ("llama", 1, True)])
def test_feeding_pairs_writes_the_cache_entries_forward_writes_without_the_last_layers_attention(
        monkeypatch, arch, layers, fused):
    """``MTPHead.feed`` (a prompt's pairs before the first draft) leaves the head's cache as its
    ``forward`` over the same pairs does, entry for entry: q/k norms (qwen3), a first layer run
    whole (two layers), a fused q/k/v weight. The last layer writes only its keys and values:
    a one-layer head's feed attends nothing."""
    from mtplx.cache.attention import AttentionMetadata
    from mtplx.models import layers as layer_module

    engine, _ = tiny_engine(arch, num_hidden_layers=4,
                            mtp=MTPConfig(layout="sidecar", features="fuse3", head_layers=layers))
    model, head, cache = engine.loaded.model, engine.runner.head, engine.runner.cache
    if fused:
        for layer in head.layers:
            layer.self_attn.fuse()
    g = torch.Generator().manual_seed(3)
    q = 21
    hidden = torch.randn(1, q, head.trunk_width, generator=g)
    tokens = torch.randint(0, 96, (1, q), generator=g)
    positions = torch.arange(1, q + 1)[None]
    table = torch.arange(cache.k[0].shape[0])[None]
    meta = AttentionMetadata(positions=positions, slot_mapping=positions.clone(), block_tables=table)
    pools = [pool[head.cache_layer + i] for pool in (cache.k, cache.v) for i in range(layers)]
    with torch.inference_mode():
        for p in pools:
            p.zero_()
        head(model, hidden, tokens, meta, cache)
        written = [p.clone() for p in pools]
        for p in pools:
            p.fill_(7.0)
        if layers == 1:
            def attends(*args, **kwargs):
                raise AssertionError("the last layer's attention ran")
            monkeypatch.setattr(layer_module, "paged_attention", attends)
        assert head.feed(model, hidden, tokens, meta, cache) is None
    for got, want in zip(pools, written):
        flat_got, flat_want = got.flatten(0, 1)[1: q + 1], want.flatten(0, 1)[1: q + 1]
        assert torch.equal(flat_got, flat_want), float((flat_got - flat_want).abs().max())
        assert bool((got.flatten(0, 1)[q + 1:] == 7.0).all()) and bool((got.flatten(0, 1)[0] == 7.0).all())
