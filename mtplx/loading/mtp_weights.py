"""MTP head weights: the three native checkpoint layouts and the forged sidecar, mapped onto
the head's module names (Qwen3.5 layout: ``fc``, ``pre_fc_norm_embedding``, ...)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mtplx.errors import ModelLoadError
from mtplx.models.config import HEAD_FEATURES, MTPConfig, ModelConfig

SIDECAR_WEIGHTS = "mtp.safetensors"
SIDECAR_PROVENANCE = "mtplx_forge.json"

# families whose RMSNorms compute x * (1 + w); their MTP norms load the same way
ZERO_CENTERED_FAMILIES = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}

_DEEPSEEK_RENAMES = {
    "enorm": "pre_fc_norm_embedding",
    "hnorm": "pre_fc_norm_hidden",
    "eh_proj": "fc",
    "shared_head.norm": "norm",
}
_MIMO_RENAMES = {
    "token_layernorm": "pre_fc_norm_embedding",
    "hidden_layernorm": "pre_fc_norm_hidden",
    "input_proj": "fc",
    "final_layernorm": "norm",
}
# sub-module names kept as they are, under the head's single decoder layer
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_SHARED = ("embed_tokens", "shared_head.head")  # the trunk's embedding and lm_head serve the head


@dataclass
class HeadWeights:
    state_dict: dict[str, torch.Tensor]  # head module names, layer 0 only
    mtp: MTPConfig
    verified: bool = True
    provenance: dict | None = None
    source: str = ""


def detect_layout(keys, config: ModelConfig) -> str | None:
    """Which native layout (if any) a trunk checkpoint's keys carry."""
    layers = config.num_hidden_layers
    for key in keys:
        if key.startswith("mtp.") or key.startswith("model.language_model.mtp."):
            return "qwen3_next"
        if key.startswith("model.mtp_layers."):
            return "mimo"
        if key.startswith(f"model.layers.{layers}."):
            return "deepseek"
    return None


def is_head_key(key: str, config: ModelConfig) -> bool:
    return detect_layout([key], config) is not None


def extract_native_head(state: dict[str, torch.Tensor], config: ModelConfig) -> HeadWeights | None:
    """Pull MTP layer 0 out of a trunk state dict, renamed to the head's module names."""
    layout = detect_layout(state.keys(), config)
    if layout is None:
        return None
    if layout == "qwen3_next":
        prefix, renames = r"(?:model\.language_model\.)?mtp\.", {}
    elif layout == "deepseek":
        prefix, renames = rf"model\.layers\.{config.num_hidden_layers}\.", _DEEPSEEK_RENAMES
    else:
        prefix, renames = r"model\.mtp_layers\.0\.", _MIMO_RENAMES
    out = {}
    for key, tensor in state.items():
        match = re.match(prefix + r"(.*)", key)
        if match:
            name = _rename(match.group(1), renames)
            if name is not None:
                out[name] = tensor
    num_layers = (config.mtp.num_layers if config.mtp else 1)
    zero_centered = config.model_type in ZERO_CENTERED_FAMILIES
    return HeadWeights(out, MTPConfig(layout=layout, num_layers=num_layers, zero_centered_norms=zero_centered),
                       source=f"native {layout} weights")


def _rename(name: str, renames: dict[str, str]) -> str | None:
    if name.startswith("layers."):  # Qwen3.5 names are already the head's
        return name if name.startswith("layers.0.") else None
    for old, new in renames.items():
        if name.startswith(old + "."):
            return new + name[len(old):]
    if name.startswith(_LAYER_PARTS):
        return "layers.0." + name
    if name.startswith(_SHARED):
        return None
    return name


def load_sidecar(head_dir: Path, config: ModelConfig, trunk_sha256: str, *,
                 allow_unverified: bool = False) -> HeadWeights:
    """A forged head: ``mtp.safetensors`` (Qwen3.5 key names) + ``mtplx_forge.json`` provenance.

    Refuses a head trained against different trunk weights unless ``allow_unverified``, in
    which case it loads labelled unverified."""
    from safetensors.torch import load_file

    weights, prov_path = head_dir / SIDECAR_WEIGHTS, head_dir / SIDECAR_PROVENANCE
    if not weights.is_file():
        raise ModelLoadError(f"no MTP head at {weights}")
    provenance = None
    if prov_path.is_file():
        try:
            provenance = json.loads(prov_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{prov_path}: invalid JSON ({exc})") from exc
    recorded = (provenance or {}).get("trunk_sha256")
    verified = recorded == trunk_sha256
    if not verified and not allow_unverified:
        raise ModelLoadError(
            f"MTP head {weights} was trained against trunk sha256 {recorded or '(none recorded)'}, "
            f"but this trunk's sha256 is {trunk_sha256}; refusing to attach it "
            "(pass allow_unverified_head=True / --allow-unverified-head to load it labelled unverified)"
        )
    try:
        raw = load_file(str(weights))
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise ModelLoadError(f"{weights}: not a readable safetensors file ({exc})") from exc
    state = {k[len("mtp."):]: v for k, v in raw.items() if k.startswith("mtp.")}
    return HeadWeights(state, sidecar_config(state, provenance, config, where=str(prov_path)),
                       verified=verified, provenance=provenance, source=str(head_dir))


def sidecar_config(state: dict[str, torch.Tensor], provenance: dict | None, config: ModelConfig,
                   where: str = "the sidecar") -> MTPConfig:
    """A forged head's MTPConfig: features and layer count as ``mtplx_forge.json`` records them
    under ``head`` (a head without them: "final", one layer, as every head before forge v2), the
    draft vocabulary's size and a narrower second layer's MLP width from their tensors."""
    head = (provenance or {}).get("head") or {}
    features, layers = head.get("features", "final"), head.get("num_layers", 1)
    if features not in HEAD_FEATURES:
        raise ModelLoadError(f"{where}: head features {features!r} unknown; this mtplx reads {', '.join(HEAD_FEATURES)}")
    if not isinstance(layers, int) or layers < 1:
        raise ModelLoadError(f"{where}: head num_layers must be a positive integer, got {layers!r}")
    if (features != "final" or layers != 1) and config.is_hybrid:
        raise ModelLoadError(f"{where}: a head of {layers} layers reading {features!r} features needs a dense "
                             f"trunk, not {config.model_type}")
    vocab = state.get("draft_vocab")
    second = state.get("layers.1.mlp.gate_proj.weight")  # a narrower second layer's MLP, by its shape
    second_mlp = 0 if second is None or second.shape[0] == config.intermediate_size else second.shape[0]
    return MTPConfig(layout="sidecar", zero_centered_norms=config.model_type in ZERO_CENTERED_FAMILIES,
                     features=features, head_layers=layers, draft_vocab=0 if vocab is None else vocab.numel(),
                     second_mlp=second_mlp)
