"""Model configuration: the few numbers a decoder needs, read from a Hugging Face config dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtplx.errors import ModelLoadError, UnsupportedModel

# model_type -> architecture family file under mtplx/models/
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "mimo": "qwen2",
    "qwen3": "qwen3",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
}

# text-only model_type names that Qwen3.5 checkpoints use inside ``text_config``
_TEXT_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5")
LAYER_TYPES = ("full_attention", "linear_attention")

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class MTPConfig:
    """Where a checkpoint keeps its MTP head and how many layers it has.

    layout: "qwen3_next" (``mtp.*``, concat [embedding, hidden]), "deepseek"
    (``model.layers.{L+i}.*``, [embedding, hidden]), "mimo" (``model.mtp_layers.*``,
    [hidden, embedding]) or "sidecar" (a forged ``mtp.safetensors`` with Qwen3.5 key names).
    """

    layout: str
    num_layers: int = 1
    zero_centered_norms: bool = False
    # forged heads (recorded in mtplx_forge.json); the defaults are every head before forge v2
    features: str = "final"  # the trunk hidden state the head reads: one of HEAD_FEATURES
    head_layers: int = 1  # decoder layers stacked in the head (each its own KV layer)
    draft_vocab: int = 0  # rows of a pruned draft vocabulary (0: drafts over the whole vocabulary)
    # the MLP width of every head layer after the first (0: the trunk's): a narrower second layer
    # keeps a two-layer head of a small trunk inside the size a shipped head may have
    second_mlp: int = 0

    @property
    def hidden_first(self) -> bool:
        return self.layout == "mimo"


# What a head reads of the trunk at position t (besides the final-normed hidden state every
# verify needs for its logits): "final" nothing more; "prenorm" the last layer's output before
# the final norm; "fuse3" (EAGLE-3) the outputs of a low, a middle and the last layer.
HEAD_FEATURES = ("final", "prenorm", "fuse3")


def feature_layers(features: str, num_layers: int) -> tuple[int, ...]:
    """The trunk layers whose outputs (the residual stream after the layer, before any norm) a
    head with these ``features`` reads: () for "final", (L-1,) for "prenorm", (L/4, L/2, L-1)
    for "fuse3"."""
    if features not in HEAD_FEATURES:
        raise ValueError(f"head features must be one of {', '.join(HEAD_FEATURES)}, got {features!r}")
    last = num_layers - 1
    return {"final": (), "prenorm": (last,), "fuse3": (num_layers // 4, num_layers // 2, last)}[features]


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet sizes: key heads share query heads; each key head serves
    num_value_heads // num_key_heads value heads."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: [q | k | v] concatenated."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts with one always-on shared expert (scaled by a sigmoid gate)."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True
    sparse_step: int = 1  # every sparse_step-th layer is MoE (Qwen3-Next's decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()  # layers kept dense (Qwen3-Next's mlp_only_layers)

    def is_moe_layer(self, index: int) -> bool:
        return index not in self.dense_layers and (index + 1) % self.sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    mtp: MTPConfig | None = None
    extra: dict = field(default_factory=dict, compare=False)
    # hybrid linear-attention models (Qwen3-Next, Qwen3.5): one entry per layer, from LAYER_TYPES;
    # empty means every layer is full attention
    layer_types: tuple[str, ...] = ()
    linear: LinearAttentionConfig | None = None
    moe: MoEConfig | None = None

    @property
    def family(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def is_hybrid(self) -> bool:
        """True when some layers are linear attention with a recurrent state."""
        return "linear_attention" in self.layer_types

    @property
    def num_kv_layers(self) -> int:
        """Trunk layers that keep a KV cache (full attention)."""
        if not self.layer_types:
            return self.num_hidden_layers
        return sum(t == "full_attention" for t in self.layer_types)

    @property
    def num_linear_layers(self) -> int:
        return sum(t == "linear_attention" for t in self.layer_types)

    def layer_mix(self) -> dict:
        """The trunk's layer composition, for ``mtplx inspect`` and stats."""
        kinds = self.layer_types or ("full_attention",) * self.num_hidden_layers
        mix = {"full_attention": self.num_kv_layers, "linear_attention": self.num_linear_layers,
               "pattern": "".join("L" if t == "linear_attention" else "F" for t in kinds)}
        if self.moe is not None:
            mix["moe_layers"] = sum(self.moe.is_moe_layer(i) for i in range(self.num_hidden_layers))
            mix["experts"] = f"{self.moe.experts_per_token} of {self.moe.num_experts} + 1 shared"
        return mix

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x conventions)."""
        cfg = _text_config(cfg)
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(
                f"unsupported architecture {model_type!r}; supported: "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            rope_theta, rope_scaling = _rope_settings(cfg)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            config = cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=_intermediate_size(cfg, model_type),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                partial_rotary_factor=_partial_rotary_factor(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=_attention_bias(cfg, model_type),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                mtp=_native_mtp(cfg, model_type, layers),
                **_hybrid_fields(cfg, model_type, layers),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad value for {exc}") from exc
        if config.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModel(
                f"unsupported rope scaling {config.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        return config


def _text_config(cfg: dict) -> dict:
    """A multimodal config's text model as one flat dict (Qwen3.5 keeps it under ``text_config``).

    The text fields win, except ``tie_word_embeddings``, which the top-level model applies."""
    text = cfg.get("text_config")
    model_type = _TEXT_MODEL_TYPES.get(cfg.get("model_type"), cfg.get("model_type"))
    if not isinstance(text, dict):
        return {**cfg, "model_type": model_type}
    outer = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    merged = {**outer, **text, "model_type": model_type}
    if "tie_word_embeddings" in outer:
        merged["tie_word_embeddings"] = outer["tie_word_embeddings"]
    return merged


def _intermediate_size(cfg: dict, model_type: str) -> int:
    """The dense MLP width; Qwen3.5-MoE has no dense MLP (every layer routes to experts)."""
    if model_type == "qwen3_5_moe" and "intermediate_size" not in cfg:
        return 0
    return int(cfg["intermediate_size"])


def _partial_rotary_factor(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)


def _hybrid_fields(cfg: dict, model_type: str, layers: int) -> dict:
    """layer_types, linear-attention and MoE sizes of the hybrid families ({} for the others)."""
    if SUPPORTED_MODEL_TYPES[model_type] not in HYBRID_FAMILIES:
        return {}
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {cfg['hidden_act']!r} is not supported; supported: 'silu'")
    if cfg.get("attn_output_gate", True) is not True:
        raise UnsupportedModel("attn_output_gate=false is not supported: Qwen3-Next/3.5 attention is gated")
    if cfg.get("mtp_use_dedicated_embeddings"):
        raise UnsupportedModel("mtp_use_dedicated_embeddings=true is not supported: the MTP head shares the "
                               "trunk's embedding")
    kinds = cfg.get("layer_types")
    if kinds is None:
        interval = int(cfg.get("full_attention_interval", 4))
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    kinds = tuple(kinds)
    bad = sorted(set(kinds) - set(LAYER_TYPES))
    if len(kinds) != layers or bad:
        raise ModelLoadError(f"layer_types must list {layers} entries from {', '.join(LAYER_TYPES)}; "
                             f"got {len(kinds)} entries{', unknown: ' + ', '.join(bad) if bad else ''}")
    linear = LinearAttentionConfig(
        num_key_heads=int(cfg["linear_num_key_heads"]), num_value_heads=int(cfg["linear_num_value_heads"]),
        key_head_dim=int(cfg["linear_key_head_dim"]), value_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise ModelLoadError(f"linear_num_value_heads ({linear.num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({linear.num_key_heads})")
    moe = None
    if int(cfg.get("num_experts") or 0) > 0:
        moe = MoEConfig(
            num_experts=int(cfg["num_experts"]), experts_per_token=int(cfg["num_experts_per_tok"]),
            expert_intermediate_size=int(cfg["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            dense_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )
    return {"layer_types": kinds, "linear": linear, "moe": moe}


def _rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from either ``rope_scaling`` (4.x) or ``rope_parameters`` (5.x)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling


def _attention_bias(cfg: dict, model_type: str) -> bool:
    if model_type in ("qwen2", "mimo"):
        return True  # Qwen2 always has q/k/v bias
    return bool(cfg.get("attention_bias", False))


def _native_mtp(cfg: dict, model_type: str, layers: int) -> MTPConfig | None:
    """The MTP head a config declares, if any (weights are checked at load time)."""
    n = int(cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0)
    if n <= 0:
        return None
    if model_type == "mimo":
        return MTPConfig(layout="mimo", num_layers=n)
    if SUPPORTED_MODEL_TYPES[model_type] in HYBRID_FAMILIES:  # ``mtp.*`` keys, x * (1 + w) norms
        return MTPConfig(layout="qwen3_next", num_layers=n, zero_centered_norms=True)
    return MTPConfig(layout="deepseek", num_layers=n)
