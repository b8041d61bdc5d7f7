"""Tiny random hybrid models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) for tests: a transformers
reference and ours with the same weights, plus MTP heads in the zero-centred convention."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from mtplx.loading.mtp_weights import HeadWeights
from mtplx.loading.weights import attach_head
from mtplx.models.config import MTPConfig
from tests.tiny_models import ours_from_hf

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# layers L L L F: the full-attention layer every fourth, as in the real models
TINY_HYBRID = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                   linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6,
                   tie_word_embeddings=False)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
HF_CLASSES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", True),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", False),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", True),
}
HEAD = MTPConfig(layout="qwen3_next", zero_centered_norms=True)


@contextmanager
def one_thread():
    """Run with one intra-op thread: tiny models gain nothing from more, and on a busy 2-core
    machine two spinning threads make each small op tens of times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def hf_hybrid(arch: str, seed: int = 0, **overrides):
    """A random transformers hybrid model (float32, eval) and its config dict.

    Zero-centred norm weights get small random values (a wrong norm convention shows), and the
    DeltaNet decays are kept mild (A in [0.02, 0.5]) so the recurrent state carries far."""
    import transformers

    cfg_name, model_name, moe = HF_CLASSES[arch]
    fields = {**TINY_HYBRID, **(TINY_MOE if moe else {}), **overrides}
    if arch == "qwen3_5_moe":
        fields.pop("intermediate_size")
    cfg = getattr(transformers, cfg_name)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.5).log())
            elif "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model, cfg.to_dict()


def hybrid_pair(arch: str, seed: int = 0, **overrides):
    """(transformers model, our model with the same weights)."""
    hf, cfg = hf_hybrid(arch, seed, **overrides)
    return hf, ours_from_hf(hf, cfg)


def hybrid_head(model, seed: int = 1):
    """A random MTP head (``mtp.*`` names, zero-centred norms) for a hybrid ``model``."""
    from mtplx.models.mtp import MTPHead

    with torch.device("meta"):
        shapes = MTPHead(model, HEAD).state_dict()
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in shapes.items():
        if "norm" in name:  # zero-centred: small weights around 0
            state[name] = 0.1 * torch.randn(t.shape, generator=g)
        else:
            state[name] = torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5
    return attach_head(model, HeadWeights(state, HEAD), "cpu", model.lm_head.weight.dtype)


def script_drafts(engine, choose) -> None:
    """Replace the engine's draft choice by ``choose(generated + earlier drafts) -> token``
    (a one-hot draft). The head still runs, so its cache stays as in real decoding; the test
    controls which drafts are right, to exercise partial and full acceptance."""
    engine.generator._draft_token = lambda seq, logits, previous, *_: (
        torch.tensor([int(choose(seq.generated + previous))], device=logits.device), None)


def hybrid_engine(arch: str = "qwen3_5", *, head: bool = True, seed: int = 0,
                  kv_cache_tokens: int = 4096, block_size: int = 4, **overrides):
    """An Engine over a tiny random hybrid model with a random MTP head (token-id prompts) and
    its transformers twin."""
    from mtplx.engine.llm_engine import Engine
    from mtplx.loading.checkpoint import LoadedModel

    hf, model = hybrid_pair(arch, seed, **overrides)
    mtp = hybrid_head(model) if head else None
    loaded = LoadedModel(model, mtp, None, model.config, source=None)
    return Engine(loaded, kv_cache_tokens=kv_cache_tokens, block_size=block_size), hf
