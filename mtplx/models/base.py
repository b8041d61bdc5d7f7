"""The decoder-only causal LM every family file builds on: embed -> layers -> norm -> lm_head.

Module names follow Hugging Face's (``model.layers.0.self_attn.q_proj.weight``), so a
checkpoint's state dict loads as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from mtplx.cache.attention import AttentionMetadata
from mtplx.cache.kv_cache import PagedKVCache
from mtplx.kernels import cpu as cpu_kernels, gemv
from mtplx.models.config import ModelConfig
from mtplx.models.layers import (Attention, DecoderLayer, RMSNorm, RotaryEmbedding, cpu_row_step, dense_linear,
                                 run_cpu_step)


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig, make_attention):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, make_attention(config)) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Base class; a family subclass only says how to build its attention."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = self.make_stack(config)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # a cheaper copy of lm_head that only picks MTP drafts (loading/checkpoint.py sets it)
        self.draft_lm_head: nn.Module | None = None

    @staticmethod
    def make_attention(config: ModelConfig) -> Attention:
        raise NotImplementedError

    def make_stack(self, config: ModelConfig) -> nn.Module:
        """embed_tokens, layers, norm (hybrid families build their own layer mix)."""
        return DecoderStack(config, self.make_attention)

    def make_head_layer(self, config: ModelConfig, zero_centered_norms: bool) -> nn.Module:
        """The MTP head's decoder layer: the family's full-attention block."""
        return DecoderLayer(config, self.make_attention(config), zero_centered_norms)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache,
                features: tuple[int, ...] = ()) -> torch.Tensor:
        """input_ids: [rows, q] long -> final-normed hidden states [rows, q, hidden].

        features: trunk layers whose outputs (the residual stream after the layer, before any
        norm) an MTP head reads besides (``config.feature_layers``); with some, the result is
        [rows, q, hidden * (1 + len(features))]: the final-normed state, then those outputs in
        order. ``compute_logits`` reads the first ``hidden`` columns."""
        x = self.model.embed_tokens(input_ids)
        rotary = self.rotary.bind(meta.positions, x.dtype)
        delta, kept = None, {}
        last = len(self.model.layers) - 1
        # a CPU row's blocks as C++ calls: asked once here, not by each block (about 5 us a block)
        row_steps = cpu_row_step(x, rotary, cache.k[0])
        for i, layer in enumerate(self.model.layers):
            step = layer._cpu_layer() if row_steps and type(layer) is DecoderLayer else None
            if step is not None:
                x, delta = run_cpu_step(step, x, delta, rotary, meta, cache.k[i], cache.v[i])
            else:
                x, delta = layer.forward_chain(x, delta, rotary, meta, cache.k[i], cache.v[i])
            if i in features and i != last:
                kept[i] = x + delta  # the sum the next layer's norm forms again (same rounding)
        x, hidden = self.model.norm.add_forward(x, delta)
        if features:
            kept[last] = x
            hidden = torch.cat([hidden] + [kept[i] for i in features], dim=-1)
        cache.store_block_ends(hidden, meta.slot_mapping)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., hidden] (or a forward's wider output with head features: its first
        ``hidden`` columns) -> logits [..., vocab] float32."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = hidden[..., : self.config.hidden_size]
        if isinstance(self.lm_head, nn.Linear) and gemv.usable(hidden, self.lm_head.weight):
            return gemv.gemv(hidden, self.lm_head.weight).float()
        # a float output matrix on the CPU (a float checkpoint's, or a quantized checkpoint's
        # float16 / bf16 one): decode rows through the C++ kernel (layers.cpu_dense)
        return dense_linear(self.lm_head, hidden, cpu_kernels.SMALL_ROWS).float()

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits an MTP draft is chosen from: through ``draft_lm_head`` where there is one (fewer
        bytes to read per draft), else ``compute_logits``. Only drafts use it and the verify reads
        ``lm_head``, so outputs stay exact (a sampled draft's q is these logits' distribution)."""
        if self.draft_lm_head is None:
            return self.compute_logits(hidden)
        return self.draft_lm_head(hidden).float()
