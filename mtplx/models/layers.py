"""Building blocks shared by every architecture: norm, rotary embedding, attention, MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mtplx.engine.attention import AttentionMetadata, paged_attention, write_kv
from mtplx.models.config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * w, or * (1 + w) for zero-centred weights (Qwen3-Next / Qwen3.5 convention)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight.float() + 1.0 if self.zero_centered else self.weight.float()
        if self.zero_centered:
            return (x * weight).to(dtype)
        return weight.to(dtype) * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] float32, with the config's scaling applied."""
    dim = int(config.head_dim * config.partial_rotary_factor)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = config.rope_scaling or {}
    kind = config.rope_type
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over the first ``rotary_dim`` channels of each head."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.rotary_dim = self.inv_freq.shape[0] * 2

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [rows, q, heads, head_dim]; positions: [rows, q] long."""
        freqs = positions.unsqueeze(-1).float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().unsqueeze(2).to(x.dtype)
        sin = emb.sin().unsqueeze(2).to(x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Grouped-query attention over the paged cache. Families switch on qkv bias and q/k norms."""

    def __init__(self, config: ModelConfig, *, qkv_bias: bool, qk_norm: bool, o_bias: bool = False):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.scale = d ** -0.5

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata,
                k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        rows, q_len, _ = x.shape
        q = self.q_proj(x).view(rows, q_len, self.heads, self.head_dim)
        k = self.k_proj(x).view(rows, q_len, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(rows, q_len, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, meta.positions), rotary(k, meta.positions)
        write_kv(k_pool, v_pool, k, v, meta.slot_mapping)
        out = paged_attention(q, k_pool, v_pool, meta, self.scale)
        return self.o_proj(out.reshape(rows, q_len, -1))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: ModelConfig, attention: Attention, zero_centered_norms: bool = False):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, zero_centered_norms)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zero_centered_norms)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, x, rotary, meta, k_pool, v_pool):
        x = x + self.self_attn(self.input_layernorm(x), rotary, meta, k_pool, v_pool)
        return x + self.mlp(self.post_attention_layernorm(x))
