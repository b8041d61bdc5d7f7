"""The MTP head: predicts token t+2 from the trunk's hidden state at t and the token at t+1.

    e = norm_e(embed(x[t+1])); h = norm_h(features[t])
    x = fc(concat(e, h))            # [hidden, embedding] order for MiMo
    x = DecoderLayer(x) (x head_layers)  # each its own KV layer (after the trunk's layers);
                                         # layers after the first: MLP width ``second_mlp``, if set
    out = norm(x); logits = lm_head(out)   # embedding and lm_head shared with the trunk

features[t] is what the head reads of the trunk (``MTPConfig.features``): the final-normed
hidden state ("final", every native head), the last layer's output before the final norm
("prenorm"), or feature_fc over the outputs of a low, a middle and the last layer ("fuse3",
EAGLE-3). The trunk's forward returns those layers' outputs beside the final-normed state when
the runner asks (``trunk_layers``), in one wider tensor: the same buffers carry it to the head.
Deeper drafts apply the same module recursively to its own output (width hidden: read as is)
and its own drafted token.

A pruned draft vocabulary (FR-Spec; ``MTPConfig.draft_vocab`` rows, the ids in the buffer
``draft_vocab``): drafts are chosen from logits over those rows only (``draft_logits``); the
verify reads the whole vocabulary, so outputs stay exact.

Module names follow the Qwen3.5 checkpoint layout (``fc``, ``pre_fc_norm_embedding``, ...);
loading/mtp_weights.py maps the other layouts onto them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtplx.cache.attention import AttentionMetadata
from mtplx.cache.kv_cache import PagedKVCache
from mtplx.kernels import cpu as cpu_kernels, gemv
from mtplx.models.base import CausalLM
from mtplx.models.config import MTPConfig, feature_layers
from mtplx.models.layers import MLP, RMSNorm, cpu_dense, dense_linear
from mtplx.models.quant import QuantLinear, quantize_rtn

# a pruned draft vocabulary's logit for the rows it leaves out: finite, so a row whose every
# kept token a grammar masks still has a distribution (uniform over the rest), and low enough
# that softmax gives those rows exactly 0 otherwise (exp underflows), at any temperature >= 1e-9
PRUNED_LOGIT = -1e20


class MTPHead(nn.Module):
    def __init__(self, trunk: CausalLM, mtp: MTPConfig):
        super().__init__()
        config = trunk.config
        h, eps, zc = config.hidden_size, config.rms_norm_eps, mtp.zero_centered_norms
        self.mtp = mtp
        self.hidden_size = h
        self.trunk_layers = feature_layers(mtp.features, config.num_hidden_layers)
        if mtp.features == "fuse3":
            self.feature_fc = nn.Linear(len(self.trunk_layers) * h, h, bias=False)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zc)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zc)
        self.layers = nn.ModuleList([trunk.make_head_layer(config, zc) for _ in range(mtp.head_layers)])
        if mtp.second_mlp:
            for layer in list(self.layers)[1:]:
                layer.mlp = MLP(h, mtp.second_mlp, config.mlp_bias)
        self.norm = RMSNorm(h, eps, zc)
        self.cache_layer = config.num_kv_layers  # KV layer index of layers[0] in the shared cache
        if mtp.draft_vocab:
            self.register_buffer("draft_vocab", torch.zeros(mtp.draft_vocab, dtype=torch.long))
            self.register_buffer("draft_rows", None, persistent=False)  # [N, H]: ``bind_draft_vocab``

    @property
    def trunk_width(self) -> int:
        """Width of the trunk hidden states this head reads: hidden * (1 + feature layers)."""
        return self.hidden_size * (1 + len(self.trunk_layers))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's hidden input [..., H] from the trunk's forward output [..., trunk_width]
        (final-normed state, then the feature layers' outputs), or from its own output [..., H]
        (taken as it is)."""
        if hidden.shape[-1] == self.hidden_size:
            return hidden
        extra = hidden[..., self.hidden_size:]
        return dense_linear(self.feature_fc, extra) if self.mtp.features == "fuse3" else extra

    def forward(self, trunk: CausalLM, hidden: torch.Tensor, next_tokens: torch.Tensor,
                meta: AttentionMetadata, cache: PagedKVCache) -> torch.Tensor:
        """hidden: [rows, q, trunk_width] (the trunk's) or [rows, q, H] (this head's own output);
        next_tokens: [rows, q] the token after each hidden's position.
        ``meta`` places entry (hidden[t], x[t+1]) at the slot of x[t+1].
        Returns the head's normed output [rows, q, H]; draft logits via ``draft_logits``."""
        x, rotary, head_meta = self._input(trunk, hidden, next_tokens, meta)
        for i, layer in enumerate(self.layers):
            x = layer(x, rotary, head_meta, cache.k[self.cache_layer + i], cache.v[self.cache_layer + i])
        return self.norm(x)

    def feed(self, trunk: CausalLM, hidden: torch.Tensor, next_tokens: torch.Tensor, meta: AttentionMetadata,
             cache: PagedKVCache) -> None:
        """``forward``'s cache entries for these pairs, without its outputs (a prompt's pairs, fed
        before the first draft): the last layer writes only its keys and values, so its queries,
        attention and MLP, the most of a long prompt's pass, do not run. For a fresh 4,000-token
        prompt on this project's 2-core CPU (two threads), 386 -> 88 ms."""
        x, rotary, head_meta = self._input(trunk, hidden, next_tokens, meta)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            pools = cache.k[self.cache_layer + i], cache.v[self.cache_layer + i]
            if i < last:
                x = layer(x, rotary, head_meta, *pools)
            elif not (hasattr(layer, "write_kv") and layer.write_kv(x, rotary, head_meta, *pools)):
                layer(x, rotary, head_meta, *pools)  # a block of another kind: the whole forward

    def _input(self, trunk: CausalLM, hidden: torch.Tensor, next_tokens: torch.Tensor, meta: AttentionMetadata):
        """The first layer's input x [rows, q, H] (norms, then fc over the embedding and the
        hidden state), the bound rotary embedding and the head's attention metadata."""
        e = self.pre_fc_norm_embedding(trunk.model.embed_tokens(next_tokens))
        h = self.pre_fc_norm_hidden(self.features(hidden))
        pair = (h, e) if self.mtp.hidden_first else (e, h)
        x = dense_linear(self.fc, torch.cat(pair, dim=-1))
        return x, trunk.rotary.bind(meta.positions, x.dtype), meta.for_head()

    # -- drafting -------------------------------------------------------------------------------
    def bind_draft_vocab(self, trunk: CausalLM) -> None:
        """Copy the trunk's output rows of the draft vocabulary (after the ids are loaded)."""
        vocab = trunk.config.vocab_size
        ids = self.draft_vocab
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            raise ValueError(f"a draft-vocabulary id lies outside [0, {vocab})")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):  # forge stores them so
            raise ValueError("the draft-vocabulary ids must be distinct and ascending")
        dtype = trunk.model.embed_tokens.weight.dtype
        self.quantized_draft_rows = ()
        if isinstance(trunk.lm_head, QuantLinear) and trunk.lm_head.backend == "cpu" and dtype == torch.float32:
            # the quantized output matrix's rows, no float copy; held in a tuple, not as a
            # submodule: the head's weights stay its dtype. 8-bit rows are rounded once more to
            # 4 bits (groups of 32): a draft reads half the bytes, and the drafts only propose
            # (the verify reads the whole output matrix, so decoding stays exact). On this
            # project's CPU, depth 1, 3 chat prompts x 2 rounds: greedy 108.1 -> 111.0 tok/s at
            # acceptance length 1.49 -> 1.52, T 0.7 86.6 -> 92.6 at 1.45 -> 1.47 (session 11).
            rows = trunk.lm_head.select_rows(ids)
            if rows.bits > 4:
                rows = QuantLinear(quantize_rtn(rows.dequantize()[: rows.out_features], 4, 32),
                                   device=rows.words.device, backend="cpu")
            self.quantized_draft_rows = (rows,)
            self.draft_rows = None
            return
        weight = trunk.lm_head.weight if isinstance(trunk.lm_head, nn.Linear) else trunk.lm_head.dequantize()
        self.draft_rows = weight.detach().index_select(0, ids.to(weight.device)).to(dtype).contiguous()

    def draft_subset(self, trunk: CausalLM, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """hidden: [..., H] this head's output -> (logits [..., N] float32 of the pruned draft
        vocabulary's rows, their ids [N] ascending), or None without a bound pruned vocabulary.
        A draft chosen here is the one ``draft_logits`` gives, read through the ids (ascending
        ids: the first of equal maxima is the same token), at a third of the work for the
        default head (16,384 of 49,152 rows): no full-width logits are written."""
        quantized = getattr(self, "quantized_draft_rows", ())
        if quantized:
            return quantized[0](hidden), self.draft_vocab
        rows = getattr(self, "draft_rows", None)
        if rows is None:  # no pruned vocabulary, or not bound (a tensor-parallel rank)
            return None
        if gemv.usable(hidden, rows):
            return gemv.gemv(hidden, rows).float(), self.draft_vocab
        kept = cpu_dense(hidden, rows, self, cpu_kernels.SMALL_ROWS)  # a float output matrix's rows on the CPU
        return (F.linear(hidden, rows) if kept is None else kept).float(), self.draft_vocab

    def draft_logits(self, trunk: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] this head's output -> logits [..., vocab] float32 that drafts are
        chosen from: ``trunk.compute_draft_logits``, or with a pruned draft vocabulary the
        logits of its rows, scattered to their ids, ``PRUNED_LOGIT`` elsewhere (an argmax lies
        within the vocabulary; a sampled draft's q is zero outside it)."""
        subset = self.draft_subset(trunk, hidden)
        if subset is None:  # the whole vocabulary (a tensor-parallel rank: the sharded one, still exact)
            return trunk.compute_draft_logits(hidden)
        return whole_vocabulary(*subset, trunk.config.vocab_size)


def whole_vocabulary(kept: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A pruned draft vocabulary's logits kept [..., N] float32 at their ids [N], ``PRUNED_LOGIT``
    elsewhere: [..., vocab_size] float32."""
    lead = kept.shape[:-1]
    out = torch.full((*lead, vocab_size), PRUNED_LOGIT, dtype=torch.float32, device=kept.device)
    return out.scatter_(-1, ids.expand(*lead, -1), kept)
