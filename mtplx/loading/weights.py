"""Build modules from checkpoint tensors, checking every name and shape."""

from __future__ import annotations

import torch
from torch import nn

from mtplx.errors import ModelLoadError
from mtplx.loading.mtp_weights import HeadWeights
from mtplx.loading.sharding import shard_state
from mtplx.models.base import CausalLM
from mtplx.models.config import ModelConfig
from mtplx.models.layers import rope_inv_freq
from mtplx.models.mtp import MTPHead
from mtplx.models.parallel import Shard, local_config, parallelize
from mtplx.models.quant import QuantizedWeight, QuantLinear, fuse_quantized
from mtplx.models.registry import build_model


def build_model_on_meta(config: ModelConfig, shard: Shard | None = None) -> CausalLM:
    """The model's modules on the meta device; with ``shard``, one tensor-parallel rank's
    (its heads and channels, vocabulary-parallel embedding and output; models/parallel.py)."""
    if shard is None:
        with torch.device("meta"):
            return build_model(config)
    with torch.device("meta"):
        return parallelize(build_model(local_config(config, shard)), shard, config)


def attach_head(model: CausalLM, weights: HeadWeights, device, dtype, shard: Shard | None = None,
                config: ModelConfig | None = None) -> MTPHead:
    """The MTP head for ``model``; with ``shard``, the rank's slice of it (``config``: the
    whole model's)."""
    with torch.device("meta"):
        head = MTPHead(model, weights.mtp)
    state = weights.state_dict
    if shard is not None:
        parallelize(head, shard, config)
        state = shard_state(state, config, shard)
    head = materialize(head, state, device, dtype, tied=False, what="MTP head")
    if weights.mtp.draft_vocab and shard is None:  # a rank's output rows are a vocabulary slice:
        try:                                           # it drafts from the whole (sharded) vocabulary
            head.bind_draft_vocab(model)
        except ValueError as exc:
            raise ModelLoadError(f"MTP head {weights.source or ''}: {exc}") from exc
    return head


def materialize(module: nn.Module, state: dict, device, dtype, *, tied: bool,
                what: str = "model") -> nn.Module:
    """Move a meta-device module onto ``device`` with the checkpoint's tensors, checking every
    name and shape. Extra checkpoint tensors are ignored; missing or misshapen ones are errors.
    A ``QuantizedWeight`` in ``state`` turns its Linear into a ``QuantLinear`` (no float copy of
    that weight is ever allocated)."""
    module = module.to(dtype)  # still on meta: only the dtypes change
    quantized = fuse_quantized(module, _take_quantized_linears(module, state, what))
    module = module.to_empty(device=device)
    expected = module.state_dict()
    for name, target in expected.items():
        if name == "lm_head.weight" and tied:
            continue
        tensor = state.get(name)
        if tensor is None:
            raise ModelLoadError(f"{what} checkpoint is missing tensor {name!r} (expected shape {tuple(target.shape)})")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"{what} tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
    for name, (qw, bias) in quantized.items():
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child,
                QuantLinear(qw, None if bias is None else bias.to(dtype), device=device, dtype=dtype))
    if isinstance(module, CausalLM):
        if tied and "lm_head" not in quantized:
            module.lm_head.weight = module.model.embed_tokens.weight
        module.rotary.inv_freq = rope_inv_freq(module.config).to(device)
    module.requires_grad_(False)  # inference weights; forge re-enables the head's
    return module.eval()


def _take_quantized_linears(module: nn.Module, state: dict, what: str) -> dict:
    """For each ``QuantizedWeight`` in ``state``: check it against its (meta) Linear, and put an
    empty placeholder in the Linear's place. Returns {module name: (weight, bias or None)}."""
    out = {}
    for key, qw in state.items():
        if not isinstance(qw, QuantizedWeight):
            continue
        name = key.removesuffix(".weight")
        linear = module.get_submodule(name)
        if tuple(qw.shape) != tuple(linear.weight.shape):
            raise ModelLoadError(f"{what} tensor {key!r} has shape {qw.shape}, expected {tuple(linear.weight.shape)}")
        bias = state.get(name + ".bias")
        if (bias is None) != (linear.bias is None):
            raise ModelLoadError(f"{what} tensor {name + '.bias'!r} is {'missing' if bias is None else 'unexpected'}")
        out[name] = (qw, bias)
        module.set_submodule(name, nn.Identity())
    return out
