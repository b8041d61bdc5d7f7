"""A model of a given shape with seeded random weights and a random MTP head, no checkpoint:
for benchmarks of real shapes and for tests that must build the same model in several
processes cheaply (no transformers import)."""

from __future__ import annotations

import torch
from torch import nn

from mtplx.loading.checkpoint import LoadedModel
from mtplx.loading.weights import build_model_on_meta
from mtplx.models.config import MTPConfig, ModelConfig
from mtplx.models.layers import rope_inv_freq
from mtplx.models.mtp import MTPHead
from mtplx.models.parallel import Shard, parallelize


def random_loaded(shape: dict, device, dtype: torch.dtype = torch.float32, *, seed: int = 0, head: bool = True,
                  shard: Shard | None = None) -> LoadedModel:
    """A model built from the Hugging Face config dict ``shape``, its weights drawn from a
    generator seeded with ``seed`` (norm weights near their identity, others scaled by
    fan-in^-0.5, so activations stay of order 1 through the layers), with a random MTP head
    (the family's norm convention). With ``shard``, only that tensor-parallel rank's modules
    are built and drawn directly (no whole model in memory: a benchmark's, whose values need
    not match the whole model's; ``checkpoint.shard_loaded`` slices a whole one exactly)."""
    config = ModelConfig.from_hf(shape)
    g = torch.Generator().manual_seed(seed)
    model = build_model_on_meta(config, shard)
    _draw(model, g, device, dtype)
    model.rotary.inv_freq = rope_inv_freq(config).to(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    mtp = None
    if head:
        with torch.device("meta"):
            mtp = MTPHead(model, MTPConfig(layout="sidecar", zero_centered_norms=config.is_hybrid))
        if shard is not None:
            parallelize(mtp, shard, config)
        _draw(mtp, g, device, dtype)
    return LoadedModel(model.requires_grad_(False).eval(), None if mtp is None else mtp.requires_grad_(False).eval(),
                       None, config, source=None)


def _draw(module: nn.Module, g: torch.Generator, device, dtype: torch.dtype) -> None:
    """Move a meta module to ``device`` with random values, parameter by parameter in name order."""
    module.to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rpartition(".")[2]
            if name.endswith("A_log"):  # DeltaNet decays in [0.02, 0.5]: the state carries far
                value = torch.empty(p.shape).uniform_(0.02, 0.5, generator=g).log()
            elif leaf == "dt_bias":
                value = torch.ones(p.shape)
            elif "norm" in name:
                zero_centred = _zero_centred(module, name)
                value = (0.0 if zero_centred else 1.0) + 0.1 * torch.randn(p.shape, generator=g)
            else:
                value = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
            p.copy_(value.to(dtype))


def _zero_centred(module: nn.Module, name: str) -> bool:
    owner = module.get_submodule(name.rpartition(".")[0])
    return bool(getattr(owner, "zero_centered", False))
