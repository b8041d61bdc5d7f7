"""Qwen3.5 / Qwen3.6, dense and MoE: the Qwen3-Next trunk with separate DeltaNet projections
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). The checkpoint's text model
sits under ``model.language_model.*`` (loading/checkpoint.py strips it); rotary is multimodal
in the checkpoint, which for text (equal positions on every axis) is plain partial rotary."""

from __future__ import annotations

import torch
from torch import nn

from mtplx.models.config import ModelConfig
from mtplx.models.gated_deltanet import GatedDeltaNet
from mtplx.models.hybrid import HybridCausalLM


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    def __init__(self, config: ModelConfig, state_index: int):
        super().__init__(config, state_index)
        h = config.hidden_size
        self.in_proj_qkv = nn.Linear(h, config.linear.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.v_heads * self.v_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.v_heads, bias=False)

    def project(self, x: torch.Tensor):
        rows, q_len, _ = x.shape
        z = self.in_proj_z(x).view(rows, q_len, self.v_heads, self.v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


class Qwen3_5ForCausalLM(HybridCausalLM):
    """Dense or MoE by config (``num_experts``)."""

    linear_attention = Qwen3_5GatedDeltaNet
