"""One tensor-parallel rank's slice of a checkpoint (models/parallel.py says who owns what).

Tensors are matched by their name's ending, so the trunk and the MTP head (whose layer has the
same names under ``layers.0``) slice alike. Anything not named here (norms, the head's fc, a
router) is replicated.
"""

from __future__ import annotations

import torch

from mtplx.models.config import ModelConfig
from mtplx.models.parallel import Shard


def shard_state(state: dict, config: ModelConfig, shard: Shard) -> dict:
    """This rank's slice of every tensor of ``state`` (a trunk's or an MTP head's, float
    tensors; names as the modules'), for a model built from ``local_config(config, shard)``."""
    if shard.world == 1:
        return state
    return {name: _slice(name, t, config, shard) for name, t in state.items()}


def _slice(name: str, t: torch.Tensor, config: ModelConfig, shard: Shard) -> torch.Tensor:
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    parts = name.split(".")
    module, leaf = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _take(t, 0, shard.part(config.vocab_size), config.vocab_size)
    if module in ("o_proj", "down_proj", "out_proj"):  # row-parallel: input columns; the bias on rank 0
        if leaf == "bias":
            return t
        units = {"o_proj": heads, "down_proj": config.intermediate_size}.get(module)
        units = units or config.linear.num_value_heads
        return _take(t, 1, shard.part(units), units)
    if module == "q_proj":
        return _take(t, 0, shard.part(heads), heads)
    if module in ("k_proj", "v_proj"):
        return _take(t, 0, shard.kv_part(heads, kv), kv)
    if module in ("gate_proj", "up_proj"):
        return _take(t, 0, shard.part(config.intermediate_size), config.intermediate_size)
    lin = config.linear
    if lin is None or parts[-3:-2] != ["linear_attn"] and leaf not in ("dt_bias", "A_log"):
        return t
    if module in ("in_proj_qkv", "conv1d"):  # [q | k | v] channels, each by its own heads
        key_width, value_width = lin.num_key_heads * lin.key_head_dim, lin.num_value_heads * lin.value_head_dim
        q, k, v = t.split([key_width, key_width, value_width])
        return torch.cat([_take(q, 0, shard.part(lin.num_key_heads), lin.num_key_heads),
                          _take(k, 0, shard.part(lin.num_key_heads), lin.num_key_heads),
                          _take(v, 0, shard.part(lin.num_value_heads), lin.num_value_heads)])
    if module in ("in_proj_qkvz", "in_proj_ba"):  # Qwen3-Next: grouped by key head
        return _take(t, 0, shard.part(lin.num_key_heads), lin.num_key_heads)
    if module in ("in_proj_z", "in_proj_b", "in_proj_a") or leaf in ("dt_bias", "A_log"):
        return _take(t, 0, shard.part(lin.num_value_heads), lin.num_value_heads)
    return t


def _take(t: torch.Tensor, dim: int, units: range, total: int) -> torch.Tensor:
    """Units ``units`` of ``total`` equal units along ``dim`` (a copy: the whole tensor can go)."""
    size = t.shape[dim] // total
    return t.narrow(dim, units.start * size, len(units) * size).clone()
