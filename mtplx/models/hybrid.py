"""Hybrid linear-attention decoders (Qwen3-Next, Qwen3.5): the pieces both families share.

Layers follow ``config.layer_types``: most are Gated DeltaNet linear attention (recurrent
state, gated_deltanet.py), every few is gated full attention over the paged KV cache (output
multiplied by a sigmoid gate, zero-centred q/k norms, partial rotary). Every RMSNorm outside the
DeltaNet computes x * (1 + w). The MLP is dense SwiGLU or a sparse MoE (moe.py), per layer.

Module names follow transformers' (``model.layers.3.self_attn.q_proj``,
``model.layers.0.linear_attn.A_log``), so a checkpoint's state dict loads as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from mtplx.cache.attention import AttentionMetadata, paged_attention, write_kv
from mtplx.cache.kv_cache import PagedKVCache
from mtplx.cache.state_cache import RecurrentStateCache
from mtplx.models.base import CausalLM
from mtplx.models.config import ModelConfig
from mtplx.models.gated_deltanet import GatedDeltaNet
from mtplx.models.layers import MLP, RMSNorm, RotaryEmbedding
from mtplx.models.moe import SparseMoE


class GatedAttention(nn.Module):
    """GQA whose q_proj also yields a per-channel output gate: o_proj(attn * sigmoid(gate))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.heads * d * 2, bias=bias)  # per head: [query | gate]
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, zero_centered=True)
        self.scale = d ** -0.5

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata,
                k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """x: [rows, q, H] -> [rows, q, H]; writes the new keys/values into the pools."""
        rows, q_len, _ = x.shape
        q, gate = self.q_proj(x).view(rows, q_len, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.k_proj(x).view(rows, q_len, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(rows, q_len, self.kv_heads, self.head_dim)
        q, k = rotary(self.q_norm(q), meta.positions), rotary(self.k_norm(k), meta.positions)
        write_kv(k_pool, v_pool, k, v, meta.slot_mapping)
        out = paged_attention(q, k_pool, v_pool, meta, self.scale) * torch.sigmoid(gate)
        return self.o_proj(out.reshape(rows, q_len, -1))


class HybridDecoderLayer(nn.Module):
    """Pre-norm block whose token mixer is ``linear_attn`` (Gated DeltaNet) or ``self_attn``
    (gated attention); ``cache_index`` is its slot in the state cache or in the KV cache."""

    def __init__(self, config: ModelConfig, mlp: nn.Module, *, cache_index: int,
                 linear_attn: GatedDeltaNet | None = None, self_attn: GatedAttention | None = None):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, zero_centered=True)
        self.linear_attn, self.self_attn = linear_attn, self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zero_centered=True)
        self.mlp = mlp
        self.cache_index = cache_index

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata,
                k_pool: torch.Tensor | None = None, v_pool: torch.Tensor | None = None,
                states: RecurrentStateCache | None = None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            h = self.linear_attn(h, meta, states)
        else:
            h = self.self_attn(h, rotary, meta, k_pool, v_pool)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


def make_mlp(config: ModelConfig, index: int | None) -> nn.Module:
    """Layer ``index``'s MLP (``None``: the MTP head's layer, MoE whenever the trunk has experts)."""
    moe = config.moe
    if moe is not None and (index is None or moe.is_moe_layer(index)):
        return SparseMoE(config.hidden_size, moe)
    return MLP(config.hidden_size, config.intermediate_size)


class HybridStack(nn.Module):
    def __init__(self, config: ModelConfig, linear_attention: type[GatedDeltaNet]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers, kv, linear = [], 0, 0
        for i, kind in enumerate(config.layer_types):
            if kind == "linear_attention":
                layer = HybridDecoderLayer(config, make_mlp(config, i), cache_index=linear,
                                           linear_attn=linear_attention(config, linear))
                linear += 1
            else:
                layer = HybridDecoderLayer(config, make_mlp(config, i), cache_index=kv,
                                           self_attn=GatedAttention(config))
                kv += 1
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True)


class HybridCausalLM(CausalLM):
    """Base of the hybrid families; a family sets ``linear_attention`` (its DeltaNet input
    projections differ). The forward needs ``cache.states`` (a RecurrentStateCache)."""

    linear_attention: type[GatedDeltaNet] = GatedDeltaNet

    @staticmethod
    def make_attention(config: ModelConfig) -> GatedAttention:
        return GatedAttention(config)

    def make_stack(self, config: ModelConfig) -> nn.Module:
        return HybridStack(config, self.linear_attention)

    def make_head_layer(self, config: ModelConfig, zero_centered_norms: bool) -> nn.Module:
        # the family's full-attention block; its norms are zero-centred like every norm here
        return HybridDecoderLayer(config, make_mlp(config, None), cache_index=config.num_kv_layers,
                                  self_attn=GatedAttention(config))

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache) -> torch.Tensor:
        """input_ids: [rows, q] long -> final-normed hidden states [rows, q, hidden]."""
        x = self.model.embed_tokens(input_ids)
        rotary = self.rotary.bind(meta.positions, x.dtype)
        for layer in self.model.layers:
            if layer.linear_attn is not None:
                x = layer(x, rotary, meta, states=cache.states)
            else:
                x = layer(x, rotary, meta, cache.k[layer.cache_index], cache.v[layer.cache_index])
        hidden = self.model.norm(x)
        cache.store_block_ends(hidden, meta.slot_mapping)
        return hidden
