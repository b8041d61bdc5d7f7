"""The MTP head: predicts token t+2 from the trunk's hidden state at t and the token at t+1.

    e = norm_e(embed(x[t+1])); h = norm_h(hidden[t])
    x = fc(concat(e, h))            # [hidden, embedding] order for MiMo
    x = DecoderLayer(x)             # its own KV cache (layer index after the trunk's layers)
    out = norm(x); logits = lm_head(out)   # embedding and lm_head shared with the trunk

Module names follow the Qwen3.5 checkpoint layout (``fc``, ``pre_fc_norm_embedding``, ...);
loading/mtp_weights.py maps the other layouts onto them. Deeper drafts apply the same module
recursively to its own output and its own drafted token.
"""

from __future__ import annotations

import torch
from torch import nn

from mtplx.cache.attention import AttentionMetadata
from mtplx.cache.kv_cache import PagedKVCache
from mtplx.models.base import CausalLM
from mtplx.models.config import MTPConfig
from mtplx.models.layers import RMSNorm


class MTPHead(nn.Module):
    def __init__(self, trunk: CausalLM, mtp: MTPConfig):
        super().__init__()
        config = trunk.config
        h, eps, zc = config.hidden_size, config.rms_norm_eps, mtp.zero_centered_norms
        self.mtp = mtp
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zc)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zc)
        self.layers = nn.ModuleList([trunk.make_head_layer(config, zc)])
        self.norm = RMSNorm(h, eps, zc)
        self.cache_layer = config.num_kv_layers  # KV layer index in the shared cache (after the trunk's)

    def forward(self, trunk: CausalLM, hidden: torch.Tensor, next_tokens: torch.Tensor,
                meta: AttentionMetadata, cache: PagedKVCache) -> torch.Tensor:
        """hidden: [rows, q, H] (trunk final-normed, or this head's own output);
        next_tokens: [rows, q] the token after each hidden's position.
        ``meta`` places entry (hidden[t], x[t+1]) at the slot of x[t+1].
        Returns the head's normed output [rows, q, H]; logits via trunk.compute_logits."""
        e = self.pre_fc_norm_embedding(trunk.model.embed_tokens(next_tokens))
        h = self.pre_fc_norm_hidden(hidden)
        pair = (h, e) if self.mtp.hidden_first else (e, h)
        x = self.fc(torch.cat(pair, dim=-1))
        layer = self.cache_layer
        x = self.layers[0](x, trunk.rotary.bind(meta.positions, x.dtype), meta.for_head(), cache.k[layer],
                           cache.v[layer])
        return self.norm(x)
