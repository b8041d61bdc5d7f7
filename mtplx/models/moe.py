"""Sparse mixture of experts with a shared expert (Qwen3-Next, Qwen3.5-MoE).

    weights, experts = top_k(softmax(router(x)))        # renormalised over the k when norm_topk_prob
    y = sum_k weights_k * expert_k(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

Module names follow transformers 5 (``gate``, ``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I], ``shared_expert``, ``shared_expert_gate``); checkpoints that
store one tensor per expert are stacked at load time (loading/checkpoint.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtplx.models.config import MoEConfig
from mtplx.models.layers import MLP


class Experts(nn.Module):
    """E SwiGLU experts stored as stacked weights."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [tokens, H]; experts, weights: [tokens, k] -> [tokens, H].

        Loops over the experts that some token chose (reference path; a grouped GEMM kernel
        can replace it behind the same signature)."""
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():  # host sync: the loop needs the chosen experts
            token, rank = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * weights[token, rank, None])
        return out


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.experts_per_token, moe.norm_topk_prob
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, hidden, moe.expert_intermediate_size)
        self.shared_expert = MLP(hidden, moe.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] -> [..., H]."""
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        routed = self.experts(flat, experts, weights.to(x.dtype))
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).view_as(x)
