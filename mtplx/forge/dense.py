"""Training forwards: the frozen trunk over whole sequences, and the MTP head at every depth at once.

The engine runs the head one cycle at a time over a paged cache (models/mtp.py,
engine/generator.py ``_draft``). Training needs every position and every depth in one
differentiable pass, with exactly the inputs, positions and attention the engine uses:

* depth 1, pair t (t = 0 .. T-2): input (h[t], x[t+1]) at position t+1; it attends to the
  depth-1 pairs 0..t (the engine's slots 1..t+1; slot 0 never holds a head entry).
* depth d > 1, pair t: input (out_{d-1}[t], x[t+d]) at position t+d: the head's own output and
  the token that follows, as the engine feeds its own output and its own draft. It attends to the
  depth-1 pairs 0..t (committed entries) and to the entries of depths 2..d for the same t (the
  drafts of the same cycle), never to other cycles' drafts.
* depth d at pair t predicts token t+d+1, the trunk's prediction at position t+d.
* a head of several layers runs each depth through every layer; layer i attends to layer i's
  keys with the same tree mask (the engine keeps one KV layer per head layer).

This is training-time test (EAGLE-3's term): every depth is trained on the head's own earlier
output, as it drafts at inference. The token fed at depth d > 1 is the data's x[t+d]; the
engine feeds its own draft. Under greedy verification a depth-d draft counts only when the
drafts before it were the trunk's tokens, and in greedy data those are exactly the data's; in
sampled data the data's token is one the trunk drew, what an accepted sampled draft is.

The trunk pass reuses the engine's own model code over a throw-away paged cache of the engine's
default KV type on that device (float16 on the CPU for a float32 trunk), so the hidden states
the head trains on are the ones it sees at inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtplx.cache.attention import AttentionMetadata
from mtplx.cache.kv_cache import PagedKVCache
from mtplx.models.base import CausalLM
from mtplx.models.mtp import MTPHead
from mtplx.runtime import resolve_kv_dtype

_BLOCK = 16  # block size of the throw-away cache of ``trunk_hidden``


@torch.no_grad()
def trunk_hidden(model: CausalLM, ids: torch.Tensor, layers: tuple[int, ...] = (),
                 kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Final-normed trunk hidden states of whole sequences, with the outputs of ``layers``
    after them (what a head with those feature layers reads: ``CausalLM.forward``).

    ids: [rows, T] long (padding after a row's end is harmless: attention is causal).
    Returns [rows, T, H * (1 + len(layers))] in the model's dtype, computed by the engine's own
    forward over a cache of ``kv_dtype`` (None: the engine's default on ids' device,
    ``runtime.resolve_kv_dtype``)."""
    rows, length = ids.shape
    cfg = model.config
    blocks_per_row = -(-length // _BLOCK)
    dtype = model.model.embed_tokens.weight.dtype
    cache = PagedKVCache(num_layers=cfg.num_hidden_layers, num_blocks=rows * blocks_per_row, block_size=_BLOCK,
                         kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                         hidden_size=cfg.hidden_size * (1 + len(layers)), dtype=dtype, device=ids.device,
                         kv_dtype=resolve_kv_dtype(kv_dtype, ids.device, dtype))
    tables = torch.arange(rows * blocks_per_row, device=ids.device).view(rows, blocks_per_row)
    positions = torch.arange(length, device=ids.device).expand(rows, length)
    slots = tables.gather(1, positions // _BLOCK) * _BLOCK + positions % _BLOCK
    meta = AttentionMetadata(positions, slots, tables)
    return model(ids, meta, cache, layers) if layers else model(ids, meta, cache)


def select_features(hidden: torch.Tensor, have: tuple[int, ...], want: tuple[int, ...]) -> torch.Tensor:
    """From ``trunk_hidden(..., have)``'s output, the columns ``trunk_hidden(..., want)`` returns
    (the final-normed state, then the outputs of ``want``; each must be in ``have``)."""
    if want == have:
        return hidden
    h = hidden.shape[-1] // (1 + len(have))
    parts = [hidden[..., :h]] + [hidden[..., (1 + have.index(i)) * h:(2 + have.index(i)) * h] for i in want]
    return torch.cat(parts, dim=-1)


def head_outputs(head: MTPHead, trunk: CausalLM, hidden: torch.Tensor, ids: torch.Tensor,
                 depth: int) -> list[torch.Tensor]:
    """The head's normed outputs at depths 1..depth for every pair.

    hidden: [rows, T, head.trunk_width] trunk hidden states; ids: [rows, T] the tokens.
    Returns ``depth`` tensors [rows, T-1, H]; entry t of depth d predicts token t+d+1 and is
    meaningful for t <= T-1-d (later entries use a clamped input token and must be masked)."""
    rows, length = ids.shape
    pairs = length - 1
    t = torch.arange(pairs, device=ids.device)
    past = [([], []) for _ in head.layers]  # per head layer: keys and values of the depths so far
    outs: list[torch.Tensor] = []
    h = hidden[:, :pairs]
    for d in range(1, depth + 1):
        tokens = ids[:, (t + d).clamp(max=length - 1)]
        positions = (t + d).expand(rows, pairs)
        x = _fuse(head, trunk, h, tokens)
        mask = _tree_mask(pairs, d, ids.device)
        for layer, (past_k, past_v) in zip(head.layers, past):
            x, k, v = _layer(layer, x, trunk.rotary, positions, past_k, past_v, mask)
            past_k.append(k)
            past_v.append(v)
        h = head.norm(x)
        outs.append(h)
    return outs


def _fuse(head: MTPHead, trunk: CausalLM, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """fc over the normed [embedding, hidden] pair (hidden first for MiMo), as MTPHead.forward."""
    e = head.pre_fc_norm_embedding(trunk.model.embed_tokens(tokens))
    h = head.pre_fc_norm_hidden(head.features(hidden))
    pair = (h, e) if head.mtp.hidden_first else (e, h)
    return head.fc(torch.cat(pair, dim=-1))


def _layer(layer, x, rotary, positions, past_k, past_v, mask):
    """One pre-norm decoder layer whose attention also sees the keys of shallower depths.
    Returns (output, this depth's keys, values), keys rotated, [rows, T-1, kv_heads, head_dim]."""
    attn = layer.self_attn
    rows, n, _ = x.shape
    y = layer.input_layernorm(x)
    q = attn.q_proj(y).view(rows, n, attn.heads, attn.head_dim)
    k = attn.k_proj(y).view(rows, n, attn.kv_heads, attn.head_dim)
    v = attn.v_proj(y).view(rows, n, attn.kv_heads, attn.head_dim)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rotary(q, positions), rotary(k, positions)
    keys, values = torch.cat(past_k + [k], dim=1), torch.cat(past_v + [v], dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask, scale=attn.scale, enable_gqa=attn.kv_heads != attn.heads)
    x = x + attn.o_proj(out.transpose(1, 2).reshape(rows, n, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x)), k, v


def _tree_mask(pairs: int, depth: int, device) -> torch.Tensor:
    """[pairs, depth * pairs] bool: a depth-``depth`` query at pair t sees depth-1 keys 0..t and
    the key of every deeper level at t itself."""
    causal = torch.ones(pairs, pairs, dtype=torch.bool, device=device).tril()
    same = torch.eye(pairs, dtype=torch.bool, device=device)
    return torch.cat([causal] + [same] * (depth - 1), dim=1)
