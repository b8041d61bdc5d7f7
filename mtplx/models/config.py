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
}

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

    @property
    def hidden_first(self) -> bool:
        return self.layout == "mimo"


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

    @property
    def family(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x conventions)."""
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
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                partial_rotary_factor=float(cfg.get("partial_rotary_factor", 1.0)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=_attention_bias(cfg, model_type),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                mtp=_native_mtp(cfg, model_type, layers),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad value for {exc}") from exc
        if config.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModel(
                f"unsupported rope scaling {config.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        return config


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
    return MTPConfig(layout="deepseek", num_layers=n)
