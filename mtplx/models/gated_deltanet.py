"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5 (pure PyTorch).

Per value head the layer keeps a state matrix S [k_dim, v_dim]. For each token t, with decay
g_t <= 0 (log space), write strength beta_t in (0, 1), L2-normalised key k_t and query q_t:

    S_t = exp(g_t) S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
    o_t = S_t^T q_t

``delta_rule_recurrent`` runs this token by token (decode and verify); ``delta_rule_chunked``
computes the same in chunks with a few matmuls (prefill). Both return the updates delta_t, from
which ``state_after_prefix`` rebuilds the state after any prefix of a verify forward's tokens
(``CapturedVerify``): a partial acceptance costs one small matmul per layer, not a re-forward.
Before the delta rule, q, k and v pass through a depthwise causal convolution whose last
kernel-1 inputs are the layer's second piece of state. Both states live in
cache/state_cache.py, one slot per sequence; ``AttentionMetadata.state_slots`` names the slot
of each row.

A token with beta = 0 and g = 0 leaves S unchanged: padding positions are masked that way, so a
row shorter than the batch's query length ends with its own state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtplx.cache.attention import AttentionMetadata
from mtplx.cache.state_cache import RecurrentStateCache
from mtplx.models.config import ModelConfig

CHUNK_SIZE = 64
# Up to this many new tokens per row the token-by-token form is cheaper than chunking.
RECURRENT_MAX_TOKENS = 8


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor):
    """Token-by-token gated delta rule, float32.

    q, k: [rows, T, heads, k_dim] (normalised, q scaled); v: [rows, T, heads, v_dim];
    g, beta: [rows, T, heads]; state: [rows, heads, k_dim, v_dim].
    Returns (out [rows, T, heads, v_dim], final state, deltas [rows, T, heads, v_dim]).
    """
    outs, deltas = [], []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("rhkv,rhk->rhv", state, k[:, t])
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("rhkv,rhk->rhv", state, q[:, t]))
        deltas.append(delta)
    return torch.stack(outs, dim=1), state, torch.stack(deltas, dim=1)


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, chunk_size: int = CHUNK_SIZE):
    """The gated delta rule over chunks of ``chunk_size`` tokens, float32; same shapes and
    results as ``delta_rule_recurrent``.

    Within a chunk, with gamma_i the cumulative log decay from the chunk start and S0 the state
    before it, the updates satisfy (I + A) Delta = beta*V - beta*exp(gamma)*K S0 where
    A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j for j < i (lower triangular); so
    Delta = U - W S0 with U, W from one triangular solve each, and
    O = exp(gamma)*Q S0 + (Q K^T * decay) Delta,  S_end = exp(gamma_end) S0 + (K * exp(gamma_end - gamma))^T Delta.
    """
    rows, length, heads, _ = k.shape
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [rows, heads, T, dim]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [rows, heads, T]
    size = min(chunk_size, length)
    pad = -length % size
    if pad:  # padded tokens have beta = g = 0: they change nothing
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    chunks = (length + pad) // size
    q, k, v = (x.reshape(rows, heads, chunks, size, -1) for x in (q, k, v))
    g, beta = g.reshape(rows, heads, chunks, size), beta.reshape(rows, heads, chunks, size)

    gamma = g.cumsum(-1)
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # the diagonal is ignored (unitriangular)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_from_start = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]

    out, deltas = torch.empty_like(v), torch.empty_like(v)
    for c in range(chunks):
        deltas[:, :, c] = u[:, :, c] - w[:, :, c] @ state
        out[:, :, c] = q_from_start[:, :, c] @ state + scores[:, :, c] @ deltas[:, :, c]
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ deltas[:, :, c]
    unchunk = lambda x: x.reshape(rows, heads, chunks * size, -1)[:, :, :length].transpose(1, 2)  # noqa: E731
    return unchunk(out), state, unchunk(deltas)


def state_after_prefix(before: torch.Tensor, k: torch.Tensor, deltas: torch.Tensor, g: torch.Tensor,
                       kept: torch.Tensor) -> torch.Tensor:
    """The state after each row's first kept[r] tokens, rebuilt from the state before them and
    their updates: S_a = exp(gamma_a) S_0 + sum_{j <= a} exp(gamma_a - gamma_j) k_j delta_j^T,
    a = kept - 1, gamma = cumulative g.

    before: [rows, heads, k_dim, v_dim]; k: [rows, T, heads, k_dim]; deltas: [rows, T, heads, v_dim];
    g: [rows, T, heads]; kept: [rows] long in 1..T. Returns [rows, heads, k_dim, v_dim]."""
    gamma = g.cumsum(1)
    last = gamma.gather(1, (kept - 1)[:, None, None].expand(-1, 1, gamma.shape[2]))  # [rows, 1, heads]
    inside = torch.arange(g.shape[1], device=g.device)[None, :, None] < kept[:, None, None]
    weight = torch.where(inside, (last - gamma).clamp(max=0).exp(), 0.0)
    update = (k * weight[..., None]).permute(0, 2, 3, 1) @ deltas.transpose(1, 2)  # [rows, heads, k_dim, v_dim]
    return before * last[:, 0, :, None, None].exp() + update


def causal_conv_tail(window: torch.Tensor, ends: torch.Tensor, width: int) -> torch.Tensor:
    """The conv state after a row's first ends[r] new inputs.

    window: [rows, channels, width + q] (previous state, then the q new inputs); ends: [rows]
    long in 1..q. Returns [rows, channels, width]: the ``width`` inputs ending at that token."""
    index = ends[:, None] + torch.arange(width, device=window.device)
    return window.gather(2, index[:, None, :].expand(-1, window.shape[1], -1))


@dataclass
class CapturedVerify:
    """What a verify forward keeps of one layer so that the state after any accepted prefix is
    cheap to rebuild: no per-token copies of the state matrices, only the per-token updates.

    window: [rows, conv_dim, width + q]; before: [rows, heads, k_dim, v_dim] (the state before
    the verify); k: [rows, q, heads, k_dim]; deltas: [rows, q, heads, v_dim]; g: [rows, q, heads]."""

    window: torch.Tensor
    before: torch.Tensor
    k: torch.Tensor
    deltas: torch.Tensor
    g: torch.Tensor

    def state_after(self, kept: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kept, rows: [n] long -> (conv state [n, conv_dim, width], SSM state [n, heads, k_dim, v_dim])
        of rows ``rows`` after their first kept (1..q) tokens."""
        window, before, k, deltas, g = (t.index_select(0, rows) for t in (self.window, self.before, self.k,
                                                                           self.deltas, self.g))
        width = window.shape[2] - k.shape[1]
        return causal_conv_tail(window, kept, width), state_after_prefix(before, k, deltas, g, kept)


class RMSNormGated(nn.Module):
    """w * x / rms(x) * silu(gate), per head (plain weights, not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """The layer, minus its input projections, which differ by family (``project``)."""

    def __init__(self, config: ModelConfig, state_index: int):
        super().__init__()
        lin = config.linear
        self.state_index = state_index  # which slot of RecurrentStateCache's per-layer lists
        self.k_heads, self.v_heads = lin.num_key_heads, lin.num_value_heads
        self.k_dim, self.v_dim = lin.key_head_dim, lin.value_head_dim
        self.conv_width = lin.conv_kernel - 1
        channels = lin.conv_dim
        self.conv1d = nn.Conv1d(channels, channels, lin.conv_kernel, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = RMSNormGated(self.v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.v_heads * self.v_dim, config.hidden_size, bias=False)

    def project(self, x: torch.Tensor):
        """x: [rows, q, H] -> (qkv [rows, q, conv_dim] as [q | k | v], z [rows, q, v_heads, v_dim],
        b [rows, q, v_heads], a [rows, q, v_heads])."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, states: RecurrentStateCache) -> torch.Tensor:
        """x: [rows, q, H] -> [rows, q, H]; reads and updates the rows' states in ``states``."""
        rows, q_len, _ = x.shape
        qkv, z, b, a = self.project(x)
        conv_state, before = states.read(self.state_index, meta.state_slots)
        window = torch.cat([conv_state, qkv.transpose(1, 2).to(conv_state.dtype)], dim=-1)
        qkv = F.silu(F.conv1d(window, self.conv1d.weight, groups=window.shape[1])).transpose(1, 2)
        query, key, value = self._heads(qkv)

        valid = meta.valid_tokens(rows, q_len)  # [rows, q] False on padding
        beta = b.float().sigmoid() * valid[..., None]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float()) * valid[..., None]
        rule = delta_rule_recurrent if q_len <= RECURRENT_MAX_TOKENS else delta_rule_chunked
        core, after, deltas = rule(query, key, value, g, beta, before)
        ends = meta.query_lens if meta.query_lens is not None else torch.full((rows,), q_len, device=x.device)
        states.write(self.state_index, meta.state_slots, causal_conv_tail(window, ends, self.conv_width), after)
        if meta.capture:
            states.keep_captured(self.state_index, CapturedVerify(window, before, key, deltas, g))

        out = self.norm(core.to(x.dtype), z)
        return self.out_proj(out.reshape(rows, q_len, -1))

    def _heads(self, qkv: torch.Tensor):
        """[rows, q, conv_dim] -> float32 query, key [rows, q, v_heads, k_dim] (L2-normalised, the
        query scaled by k_dim^-0.5, each key head repeated for its value heads), value
        [rows, q, v_heads, v_dim]."""
        rows, q_len, _ = qkv.shape
        key_width = self.k_heads * self.k_dim
        query, key, value = qkv.float().split([key_width, key_width, self.v_heads * self.v_dim], dim=-1)
        query = l2_normalize(query.reshape(rows, q_len, self.k_heads, self.k_dim))
        key = l2_normalize(key.reshape(rows, q_len, self.k_heads, self.k_dim))
        repeat = self.v_heads // self.k_heads
        if repeat > 1:
            query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        return query * self.k_dim ** -0.5, key, value.reshape(rows, q_len, self.v_heads, self.v_dim)
