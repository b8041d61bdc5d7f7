"""Building blocks shared by every architecture: norm, rotary embedding, attention, MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mtplx.cache.attention import ROW_EXACT_QUERIES, AttentionMetadata, paged_attention, write_kv
from mtplx import kernels
from mtplx.kernels import cpu as cpu_kernels, fused, gemv, mma_gemv
from mtplx.models.config import ModelConfig
from mtplx.models.parallel import reduce_partial


class RMSNorm(nn.Module):
    """x / rms(x) * w, or * (1 + w) for zero-centred weights (Qwen3-Next / Qwen3.5 convention)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.usable(x):
            return fused.rms_norm(x, self.weight, self.eps, self.zero_centered)[1]
        if not self.zero_centered and cpu_kernels.usable(x):
            return cpu_kernels.add_rms_norm(x, None, self.weight, self.eps)[1]
        return self._reference(x)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): the residual add and the next norm (one kernel on CUDA);
        delta None: (x, norm(x))."""
        if fused.usable(x):
            return fused.rms_norm(x, self.weight, self.eps, self.zero_centered, delta)
        if not self.zero_centered and cpu_kernels.usable(x):
            return cpu_kernels.add_rms_norm(x, delta, self.weight, self.eps)
        if delta is not None:
            x = x + delta
        return x, self._reference(x)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and not self.zero_centered:  # one op (the same numbers as below)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # one fused op where the backend has it
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

    def bind(self, positions: torch.Tensor, dtype: torch.dtype) -> "BoundRotary":
        """cos/sin for these positions, computed once per forward and shared by every layer
        (one launch on CUDA: ``fused.rope_cos_sin``)."""
        if fused.usable(positions) and positions.numel():
            return BoundRotary(*fused.rope_cos_sin(positions, self.inv_freq, dtype), self.rotary_dim)
        freqs = positions.unsqueeze(-1).float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return BoundRotary(emb.cos().unsqueeze(2).to(dtype), emb.sin().unsqueeze(2).to(dtype), self.rotary_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [rows, q, heads, head_dim]; positions: [rows, q] long."""
        return self.bind(positions, x.dtype)(x, positions)


class BoundRotary:
    """RoPE with precomputed cos/sin [rows, q, 1, rotary_dim]; called like RotaryEmbedding."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int):
        self.cos, self.sin, self.rotary_dim = cos, sin, rotary_dim
        self._flat = None

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin as [tokens, rotary_dim] (the CPU kernels' layout), made once per bind: a
        forward's every layer asks (about 0.8 us a view)."""
        if self._flat is None:
            self._flat = (self.cos.reshape(-1, self.rotary_dim), self.sin.reshape(-1, self.rotary_dim))
        return self._flat

    def __call__(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * self.cos + rotated * self.sin
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        # quantized gate and up as one matrix, a QuantLinear (models/quant.py, loading/weights.py)
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:  # SiLU * up in the quantized product's epilogue
            return self.down_proj(self.gate_up_proj.silu_mul_forward(x))
        if self.is_fused:
            return self.down_proj(silu_mul(F.linear(x, self.gate_up_weight, self.gate_up_bias)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    @property
    def is_fused(self) -> bool:
        return hasattr(self, "gate_up_weight")

    def fuse(self) -> None:
        """One matmul for gate and up (fewer launches per step); the originals become views."""
        self.gate_up_weight, self.gate_up_bias = _fuse_linears(self.gate_proj, self.up_proj)


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
        self.qkv_proj: nn.Module | None = None  # quantized q, k and v as one matrix (loading/weights.py)
        if qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.scale = d ** -0.5

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata,
                k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        rows, q_len, _ = x.shape
        q = self.write_kv(x, rotary, meta, k_pool, v_pool)
        return self.o_proj(paged_attention(q, k_pool, v_pool, meta, self.scale).reshape(rows, q_len, -1))

    def write_kv(self, x: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata, k_pool: torch.Tensor,
                 v_pool: torch.Tensor) -> torch.Tensor:
        """x's [rows, q_len, H] keys and values written to the pools at ``meta.slot_mapping``
        (q/k norms and RoPE applied); returns its queries [rows, q_len, heads, head_dim], which
        ``forward`` then attends with. Called alone where nothing reads the layer's output (a
        prompt's pairs fed to the MTP head): the same entries, no attention."""
        rows, q_len, _ = x.shape
        if self.qkv_proj is not None or self.is_fused:
            qkv = self.qkv_proj(x) if self.qkv_proj is not None else F.linear(x, self.qkv_weight, self.qkv_bias)
            if cpu_kernels.usable(qkv) and isinstance(rotary, BoundRotary) and cpu_kernels.pools_usable(k_pool):
                # q/k norms, RoPE and the KV write in one call (kernels/cpu.py)
                q = cpu_kernels.rope_write(
                    qkv, *rotary.flat(), meta.slot_mapping, k_pool, v_pool, self.heads, self.kv_heads,
                    self.head_dim, self.q_norm.weight if self.qk_norm else None,
                    self.k_norm.weight if self.qk_norm else None, self.q_norm.eps if self.qk_norm else 1e-6)
                return q.view(rows, q_len, self.heads, self.head_dim)
            q, k, v = self.split_qkv(qkv)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if fused.usable(x) and isinstance(rotary, BoundRotary):
            return self.rope_write_fused(q, k, v, rotary, meta, k_pool, v_pool)
        q = q.reshape(rows, q_len, self.heads, self.head_dim)
        k = k.reshape(rows, q_len, self.kv_heads, self.head_dim)
        v = v.reshape(rows, q_len, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, meta.positions), rotary(k, meta.positions)
        write_kv(k_pool, v_pool, k, v, meta.slot_mapping)
        return q

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused q/k/v projection's output [..., (heads + 2 kv_heads) * head_dim] -> q, k, v views."""
        return qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim],
                         dim=-1)

    def rope_write_fused(self, q, k, v, rotary: "BoundRotary", meta: AttentionMetadata, k_pool: torch.Tensor,
                         v_pool: torch.Tensor) -> torch.Tensor:
        """Projected q, k, v [rows, q_len, n * head_dim] -> the queries [rows, q_len, heads,
        head_dim] after q/k norms and RoPE, k and v written to the pools, in one kernel."""
        return fused.qkv_rope_write(
            q, k, v, rotary.cos, rotary.sin, meta.slot_mapping, k_pool, v_pool, self.heads, self.kv_heads,
            self.head_dim, self.q_norm.weight if self.qk_norm else None,
            self.k_norm.weight if self.qk_norm else None, self.q_norm.eps if self.qk_norm else 1e-6)

    def attend_fused(self, q, k, v, rotary: "BoundRotary", meta: AttentionMetadata, k_pool: torch.Tensor,
                     v_pool: torch.Tensor) -> torch.Tensor:
        """Projected q, k, v [rows, q_len, n * head_dim] -> attention output [rows, q_len, heads * head_dim]
        (q/k norms, RoPE and the KV write in one kernel, then the paged attention kernel)."""
        rows, q_len = q.shape[:2]
        q = self.rope_write_fused(q, k, v, rotary, meta, k_pool, v_pool)
        return paged_attention(q, k_pool, v_pool, meta, self.scale).reshape(rows, q_len, -1)

    @property
    def is_fused(self) -> bool:
        return hasattr(self, "qkv_weight")

    def fuse(self) -> None:
        """One matmul for q, k and v (fewer launches per step); the originals become views."""
        self.qkv_weight, self.qkv_bias = _fuse_linears(self.q_proj, self.k_proj, self.v_proj)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up output [..., 2 I] (gate first) -> [..., I]: one kernel
    where the fused kernels run, else PyTorch."""
    if fused.usable(gate_up):
        return fused.silu_mul(gate_up)
    if cpu_kernels.usable(gate_up) and gate_up.numel() <= cpu_kernels.SMALL_ROWS * gate_up.shape[-1]:
        return cpu_kernels.silu_mul(gate_up)  # (a prompt's many rows: PyTorch's vectorized ops)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _cpu_projection(modules: tuple[nn.Module, ...]):
    """One projection for kernels/cpu.layer from a block's modules (q/k/v or gate/up stacked in
    that order): a QuantLinear's own (``cpu_projection``), or the float32 weights of bias-free
    Linears as one bfloat16 matrix where bf16 holds every weight exactly; else None."""
    if len(modules) == 1 and hasattr(modules[0], "cpu_projection"):
        return modules[0].cpu_projection()
    if not all(type(m) is nn.Linear and m.bias is None for m in modules):
        return None
    weight = torch.cat([m.weight.detach() for m in modules])
    if weight.dtype != torch.float32 or weight.shape[1] % 16:  # dense_matmul's step
        return None
    half = _narrowest(weight, (torch.bfloat16,))
    if half.dtype != torch.bfloat16:
        return None
    return cpu_kernels.projection(half, half.new_empty(0), half.new_empty(0), 0, 16, half.shape[0])


def dense_linear(linear: nn.Module, x: torch.Tensor, max_rows: int = ROW_EXACT_QUERIES) -> torch.Tensor:
    """``linear(x)``; for up to ``max_rows`` float32 CPU rows (a draft, a verify, an output
    matrix's decode rows) of a bias-free ``nn.Linear``, through ``cpu_dense``."""
    if type(linear) is not nn.Linear or linear.bias is not None:  # a quantized layer runs its own kernel
        return linear(x)
    out = cpu_dense(x, linear.weight, linear, max_rows)
    return linear(x) if out is None else out


def cpu_dense(x: torch.Tensor, weight: torch.Tensor, owner: object, max_rows: int) -> torch.Tensor | None:
    """x [..., in] @ weight [out, in]^T through kernels/cpu.dense_matmul for up to ``max_rows``
    float32 CPU rows of a float32 weight, or None where that does not apply. The weight is read
    at the narrowest width that holds it exactly (bfloat16: an MTP head shipped in bf16; float16:
    a checkpoint's float16 output matrix; else float32 as is), from a copy kept on ``owner``
    until the weight changes: the same numbers as the float32 weight up to summation order, each
    row on its own, bound by reading the weight (on this project's CPU 2.6x ``F.linear``'s speed
    at one row of a float32 output matrix, 5.1x at two: benchmarks/cpu_dense.py)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or rows > max_rows or not cpu_kernels.usable(x) or weight.device.type != "cpu" \
            or weight.dtype != torch.float32 or weight.requires_grad or weight.dim() != 2 or weight.shape[1] % 16:
        return None
    # the weight's identity, storage and (where tracked) version: a replaced or edited weight is re-read
    key = (id(weight), weight.data_ptr(), tuple(weight.shape), kernels.version(weight))
    store = getattr(owner, "__dict__", None)
    cached = store.get("_dense_copy") if store is not None else None  # (key, the copy)
    if cached is None or cached[0] != key:
        cached = (key, _narrowest(weight))
        if store is not None:
            store["_dense_copy"] = cached
    return cpu_kernels.dense_matmul(x.reshape(rows, -1), cached[1]).reshape(*x.shape[:-1], -1)


def _narrowest(weight: torch.Tensor, dtypes: tuple = (torch.bfloat16, torch.float16),
               chunk_rows: int = 4096) -> torch.Tensor:
    """weight [out, in] float32 as a contiguous copy in the first of ``dtypes`` that holds every
    value exactly, else itself (contiguous). Checked a chunk of rows at a time (no float32 copy
    of the whole weight). A narrow copy (half the float32 weight's bytes) is kept beside the
    float32 weight, which the model still holds (a tied embedding's lookup reads it)."""
    w = weight.detach()
    for dtype in dtypes:
        if all(torch.equal(c.to(dtype).float(), c) for c in w.split(chunk_rows)):
            return w.to(dtype).contiguous()
    return w.contiguous()


def _fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate Linear weights (and biases) along the output dimension and re-point each
    Linear at its slice, so the fused copy costs no extra memory."""
    weight = torch.cat([l.weight.detach() for l in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([l.bias.detach() for l in linears]) if has_bias else None
    start = 0
    for l in linears:
        n = l.weight.shape[0]
        l.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if has_bias:
            l.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
    return weight, bias


def fuse_projections(module: nn.Module) -> int:
    """Fuse q/k/v and gate/up matmuls in every Attention and MLP below ``module`` (inference).
    Idempotent: a module fused before keeps its fused weights, whose addresses CUDA graphs that
    an earlier engine captured over the same model still read."""
    fused = 0
    for sub in module.modules():
        if (isinstance(sub, (Attention, MLP)) and not sub.training and not sub.is_fused
                and all(isinstance(m, (nn.Linear, RMSNorm)) for m in sub.children())):  # not quantized ones
            sub.fuse()
            fused += 1
    return fused


def cpu_row_step(x: torch.Tensor, rotary, k_pool: torch.Tensor) -> bool:
    """Whether a block's forward on x can be one C++ call (``DecoderLayer._cpu_layer``): one row
    of at most ROW_EXACT_QUERIES tokens (a decode step, draft or verify) in float32 on the CPU,
    RoPE bound for the forward, KV pools the kernel reads. A whole forward asks once
    (``CausalLM.forward``): its layers share x's kind, the rotary and the pools' layout."""
    return (x.shape[0] == 1 and x.shape[1] <= ROW_EXACT_QUERIES and cpu_kernels.usable(x)
            and isinstance(rotary, BoundRotary) and cpu_kernels.pools_usable(k_pool))


def run_cpu_step(step, x, delta, rotary, meta, k_pool, v_pool):
    """A block as its C++ call (``cpu_row_step`` said it may): (residual, mlp output)."""
    table, positions = meta.first_row()
    return step.step(x, delta, *rotary.flat(), meta.slot_mapping, k_pool, v_pool, table, positions, meta.key_start)


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
        x, delta = self.forward_chain(x, None, rotary, meta, k_pool, v_pool)
        return x + delta

    def write_kv(self, x, rotary, meta, k_pool, v_pool) -> bool:
        """Only this block's keys and values for input x [rows, q, H] (``Attention.write_kv``:
        the entries ``forward`` writes, without its attention and MLP); False, nothing written,
        where its attention is of another kind or the tokens are few (up to ``ROW_EXACT_QUERIES``:
        ``forward`` then takes the fused decode paths, the one-call CPU layer or the GPU's GEMVs,
        whose entries this would not reproduce bit for bit, at a cost too small to skip)."""
        if type(self.self_attn) is not Attention or x.shape[0] * x.shape[1] <= ROW_EXACT_QUERIES:
            return False
        self.self_attn.write_kv(self.input_layernorm.add_forward(x, None)[1], rotary, meta, k_pool, v_pool)
        return True

    def forward_chain(self, x, delta, rotary, meta, k_pool, v_pool):
        """The block on input x + delta (delta None: on x), returned as (residual, mlp output)
        with their sum left to the caller, so each residual add shares a kernel with the
        norm after it. Same operations, in the same order, as ``forward``."""
        if self._decode_fusable(x, rotary):
            return self._forward_decode(x, delta, rotary, meta, k_pool, v_pool)
        if self._mma_fusable(x, rotary):
            return self._forward_mma(x, delta, rotary, meta, k_pool, v_pool)
        if cpu_row_step(x, rotary, k_pool) and (step := self._cpu_layer()) is not None:
            return run_cpu_step(step, x, delta, rotary, meta, k_pool, v_pool)
        x, h = self.input_layernorm.add_forward(x, delta)
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, rotary, meta, k_pool, v_pool))
        return x, self.mlp(h)

    def _cpu_layer(self):
        """The layer as one C++ call (kernels/cpu.layer), or None where the calls run one by one.
        Its projections are quantized ones on the C++ kernel, or float32 weights that bfloat16
        holds exactly (an MTP head trained and shipped in bf16), read as bf16; no biases, plain
        norms. Built once, and again when a projection is replaced or its weight changes (an
        optimizer step bumps the tensor's version)."""
        cached = self.__dict__.get("_cpu_layer_cache")  # (what it was built from, built)
        if cached is not None and self._cpu_layer_unchanged(cached[0]):
            return cached[1]
        attn, mlp = self.self_attn, self.mlp
        if type(attn) is not Attention or type(mlp) is not MLP or self.input_layernorm.zero_centered:
            self.__dict__.pop("_cpu_layer_cache", None)  # (holds the modules it was built from)
            return None
        parts = ((attn.qkv_proj,) if attn.qkv_proj is not None else (attn.q_proj, attn.k_proj, attn.v_proj),
                 (attn.o_proj,),
                 (mlp.gate_up_proj,) if mlp.gate_up_proj is not None else (mlp.gate_proj, mlp.up_proj),
                 (mlp.down_proj,))
        subs = (*attn._modules.values(), *mlp._modules.values())
        linears = tuple((m, m.weight, kernels.version(m.weight)) for m in subs if type(m) is nn.Linear)
        source = (attn, mlp, subs, linears)
        projections = [_cpu_projection(ms) for ms in parts]
        built = None
        if all(p is not None for p in projections):
            built = cpu_kernels.layer(
                self.input_layernorm.weight.detach(), self.post_attention_layernorm.weight.detach(),
                self.input_layernorm.eps, *projections, attn.heads, attn.kv_heads, attn.head_dim,
                attn.q_norm.weight.detach() if attn.qk_norm else None,
                attn.k_norm.weight.detach() if attn.qk_norm else None,
                attn.q_norm.eps if attn.qk_norm else 1e-6, attn.scale)
        self.__dict__["_cpu_layer_cache"] = (source, built)
        return built

    def _cpu_layer_unchanged(self, source) -> bool:
        """Whether the layer still has the attention and MLP, their submodules, and each plain
        Linear's weight at the version ``_cpu_layer`` built from (a module or weight replaced, or
        an optimizer step, builds it again). Plain dict reads: a decode step asks at every layer,
        and ``Module.__getattr__`` for each projection cost about 4 us a layer."""
        attn, mlp, subs, linears = source
        modules = self._modules
        return (modules["self_attn"] is attn and modules["mlp"] is mlp
                and subs == (*attn._modules.values(), *mlp._modules.values())
                and all(m._parameters["weight"] is w and kernels.version(w) == v for m, w, v in linears))

    def _decode_fusable(self, x: torch.Tensor, rotary) -> bool:
        """Fused projections on the GPU, and few enough token rows (rows x q_len) that the GEMV
        takes every one of them (one row; up to ``gemv.MAX_ROWS`` for small weights): the block
        below applies."""
        if not fused.usable(x):  # (the CPU's decode steps ask this at every layer: the cheap answer first)
            return False
        attn, mlp = self.self_attn, self.mlp
        return (self._fused_block(rotary)
                and all(gemv.usable(x, w) for w in (attn.qkv_weight, attn.o_proj.weight, mlp.gate_up_weight,
                                                    mlp.down_proj.weight)))

    def _mma_fusable(self, x: torch.Tensor, rotary) -> bool:
        """Fused projections on the GPU and 5-16 token rows (a 4-stream batch's verifies, AR steps
        of 5-16 sequences) of small bf16 weights: the block below applies."""
        if not x.is_cuda or not mma_gemv.MIN_ROWS <= x.numel() // x.shape[-1] <= mma_gemv.MAX_ROWS:
            return False  # (the CPU's decode steps ask this at every layer: the cheap answer first)
        attn, mlp = self.self_attn, self.mlp
        return (self._fused_block(rotary)
                and all(mma_gemv.usable(x, w) for w in (attn.qkv_weight, attn.o_proj.weight, mlp.down_proj.weight))
                and mma_gemv.usable(x, mlp.gate_up_weight, silu=True))

    def _fused_block(self, rotary) -> bool:
        """The shape both GPU blocks below take: a plain Attention and MLP with fused projections,
        plain norms, RoPE bound for the forward."""
        attn, mlp = self.self_attn, self.mlp
        return (type(attn) is Attention and type(mlp) is MLP and attn.is_fused and mlp.is_fused
                and not self.input_layernorm.zero_centered and isinstance(rotary, BoundRotary))

    def _forward_mma(self, x, delta, rotary, meta, k_pool, v_pool):
        """``forward_chain`` for 5-16 token rows: each product on the tensor-core GEMV
        (kernels/mma_gemv.py), SiLU * up the gate/up product's epilogue, the norms (with the
        residual adds) one kernel each."""
        attn, mlp = self.self_attn, self.mlp
        x, h = self.input_layernorm.add_forward(x, delta)
        q, k, v = attn.split_qkv(mma_gemv.matmul(h, attn.qkv_weight, attn.qkv_bias, attn, "qkv"))
        o = attn.attend_fused(q, k, v, rotary, meta, k_pool, v_pool)
        o = reduce_partial(attn.o_proj, mma_gemv.matmul(o, attn.o_proj.weight, attn.o_proj.bias, attn, "o"))
        x, h = self.post_attention_layernorm.add_forward(x, o)
        act = mma_gemv.matmul(h, mlp.gate_up_weight, mlp.gate_up_bias, mlp, "gate_up", silu=True)
        down = mma_gemv.matmul(act, mlp.down_proj.weight, mlp.down_proj.bias, mlp, "down")
        return x, reduce_partial(mlp.down_proj, down)

    def _forward_decode(self, x, delta, rotary, meta, k_pool, v_pool):
        """``forward_chain`` for forwards of a few token rows (AR steps of a few sequences,
        verifies of 1 + D tokens, drafts): the o and down projections through the GEMV (SiLU *
        up as the down projection's prologue), each norm the prologue of the matmul after it
        where that pays (kernels/gemv.py)."""
        attn, mlp = self.self_attn, self.mlp
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if gemv.prologue_pays(attn.qkv_weight):
            x, qkv = gemv.norm_gemv(x, delta, ln1.weight, ln1.eps, attn.qkv_weight, attn.qkv_bias)
        else:
            x, h = ln1.add_forward(x, delta)
            qkv = F.linear(h, attn.qkv_weight, attn.qkv_bias)
        q, k, v = attn.split_qkv(qkv)
        o = gemv.gemv(attn.attend_fused(q, k, v, rotary, meta, k_pool, v_pool), attn.o_proj.weight, attn.o_proj.bias)
        o = reduce_partial(attn.o_proj, o)  # tensor parallelism: sum the ranks' partial outputs
        if gemv.prologue_pays(mlp.gate_up_weight):
            x, gate_up = gemv.norm_gemv(x, o, ln2.weight, ln2.eps, mlp.gate_up_weight, mlp.gate_up_bias)
        else:
            x, h = ln2.add_forward(x, o)
            gate_up = F.linear(h, mlp.gate_up_weight, mlp.gate_up_bias)
        return x, reduce_partial(mlp.down_proj, gemv.silu_gemv(gate_up, mlp.down_proj.weight, mlp.down_proj.bias))
