"""Qwen3-Next: hybrid Gated DeltaNet / gated attention, sparse MoE with a shared expert.

Its DeltaNet projections are fused and grouped by key head: ``in_proj_qkvz`` yields, per key
head, [q | k | v of its value heads | z of its value heads], and ``in_proj_ba`` [b | a]."""

from __future__ import annotations

import torch
from torch import nn

from mtplx.models.config import ModelConfig
from mtplx.models.gated_deltanet import GatedDeltaNet
from mtplx.models.hybrid import HybridCausalLM


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    def __init__(self, config: ModelConfig, state_index: int):
        super().__init__(config, state_index)
        h, per_k = config.hidden_size, self.v_heads // self.k_heads
        self.in_proj_qkvz = nn.Linear(h, self.k_heads * (2 * self.k_dim + 2 * per_k * self.v_dim), bias=False)
        self.in_proj_ba = nn.Linear(h, self.k_heads * 2 * per_k, bias=False)

    def project(self, x: torch.Tensor):
        rows, q_len, _ = x.shape
        per_k = self.v_heads // self.k_heads
        grouped = self.in_proj_qkvz(x).view(rows, q_len, self.k_heads, -1)
        q, k, v, z = grouped.split([self.k_dim, self.k_dim, per_k * self.v_dim, per_k * self.v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(rows, q_len, self.k_heads, 2 * per_k).split([per_k, per_k], dim=-1)
        flat = lambda t: t.reshape(rows, q_len, -1)  # noqa: E731
        qkv = torch.cat([flat(q), flat(k), flat(v)], dim=-1)
        z = z.reshape(rows, q_len, self.v_heads, self.v_dim)
        return qkv, z, b.reshape(rows, q_len, self.v_heads), a.reshape(rows, q_len, self.v_heads)


class Qwen3NextForCausalLM(HybridCausalLM):
    linear_attention = Qwen3NextGatedDeltaNet
