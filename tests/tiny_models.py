"""Tiny random models for tests: a Hugging Face reference and ours with the same weights."""

from __future__ import annotations

import dataclasses

import torch

from mtplx.loading.weights import attach_head, build_model_on_meta, materialize
from mtplx.loading.mtp_weights import HeadWeights
from mtplx.models.config import MTPConfig, ModelConfig

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False)

HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def hf_reference(model_type: str, seed: int = 0, **overrides):
    """A random transformers model (float32, eval) and its config dict."""
    import transformers

    cfg_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[model_type])
    cfg = cfg_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # make norms non-trivial so a wrong norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
    d = cfg.to_dict()
    d["model_type"] = model_type
    return model, d


def ours_from_hf(hf_model, cfg_dict, dtype=torch.float32):
    config = ModelConfig.from_hf(cfg_dict)
    state = dict(hf_model.state_dict())
    return materialize(build_model_on_meta(config), state, "cpu", dtype, tied=config.tie_word_embeddings)


def random_head(model, seed: int = 1, scale: float = 0.05, mtp: MTPConfig | None = None,
                draft_vocab: list[int] | None = None) -> "torch.nn.Module":
    """A random MTP head for ``model`` (Qwen3.5 layout names); ``mtp``: its features, layers,
    and with ``draft_vocab`` (token ids) a pruned draft vocabulary."""
    from mtplx.models.mtp import MTPHead

    mtp = mtp or MTPConfig(layout="sidecar")
    if draft_vocab is not None:
        mtp = dataclasses.replace(mtp, draft_vocab=len(draft_vocab))
    with torch.device("meta"):
        shape_src = MTPHead(model, mtp)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in shape_src.state_dict().items():
        if name == "draft_vocab":
            state[name] = torch.tensor(draft_vocab, dtype=torch.int32)
        elif "norm" in name:
            state[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        else:
            state[name] = scale * torch.randn(t.shape, generator=g) * (t.shape[-1] ** -0.5) / scale
    return attach_head(model, HeadWeights(state, mtp), "cpu", model.lm_head.weight.dtype)


def tiny_engine(arch: str = "llama", *, head: bool = True, seed: int = 0, head_seed: int = 1,
                kv_cache_tokens: int = 4096, block_size: int = 4, mtp: MTPConfig | None = None,
                draft_vocab: list[int] | None = None, kv_dtype=None, **overrides):
    """An Engine over a tiny random model (no tokenizer: token-id prompts) and its HF twin;
    ``mtp``, ``draft_vocab``: the random head's (``random_head``); ``kv_dtype``: the engine's
    (default float16 on the CPU: tests that compare numbers with a reference to 1e-4 or closer
    ask for float32)."""
    from mtplx.engine.llm_engine import Engine
    from mtplx.loading.checkpoint import LoadedModel

    hf, cfg = hf_reference(arch, seed=seed, **overrides)
    model = ours_from_hf(hf, cfg)
    mtp_head = random_head(model, seed=head_seed, mtp=mtp, draft_vocab=draft_vocab) if head else None
    loaded = LoadedModel(model, mtp_head, None, model.config, source=None)
    return Engine(loaded, kv_cache_tokens=kv_cache_tokens, block_size=block_size, kv_dtype=kv_dtype), hf


def repeat_head(model, **kwargs) -> "torch.nn.Module":
    """A head that drafts the token the trunk just predicted (identity layer, fc passes the
    hidden state through). Tiny random models fall into loops, so its drafts are often right:
    it exercises partial and full acceptance, which a random head rarely reaches. ``kwargs``:
    ``random_head``'s (a draft vocabulary; the features must stay "final")."""
    head = random_head(model, **kwargs)
    h = model.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.eye(h)
        # the hidden state comes in final-normed: unit norms keep it the trunk's own up to a
        # scale, so the head's logits are the trunk's and its draft repeats the token fed
        for p in (head.pre_fc_norm_hidden.weight, head.norm.weight):
            p.fill_(1.0)
        for layer in head.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return head
