"""What a checkpoint is, read from its metadata alone (no weights are loaded)."""

from __future__ import annotations

import math
from pathlib import Path

from safetensors import safe_open

from mtplx.errors import ModelLoadError, UnsupportedModel
from mtplx.loading import hf_dir
from mtplx.loading.mtp_weights import SIDECAR_PROVENANCE, SIDECAR_WEIGHTS, detect_layout, is_head_key
from mtplx.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from mtplx.cache.block_manager import HYBRID_PREFIX_CACHE_REASON

# support tiers and the exit codes `mtplx inspect` returns for them
TIERS = {"verified": 0, "unverified": 3, "ar_only": 4, "unsupported": 5}


def describe(path: str | Path, head_dir: str | Path | None = None) -> dict:
    """Architecture, parameter counts, MTP layout and support tier of a model path."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    cfg, shapes = _gguf_meta(path) if path.is_file() else _dir_meta(path)
    info = {"path": str(path), "format": "gguf" if path.is_file() else "hf", "model_type": cfg.get("model_type")}
    try:
        config = ModelConfig.from_hf(cfg)
    except UnsupportedModel as exc:
        return {**info, "tier": "unsupported", "reason": str(exc),
                "supported_architectures": sorted(SUPPORTED_MODEL_TYPES)}
    packed = {}  # a quantized checkpoint's linear maps: {weight name: (stored, runs as, [out, in])}
    if path.is_dir():
        from mtplx.loading import prequantized

        try:
            scheme = prequantized.scheme_of(cfg, path)
        except ModelLoadError as exc:
            return {**info, "tier": "unsupported", "reason": str(exc)}
        if scheme is not None:
            packed = prequantized.describe_formats(path, scheme)
            modules = {k.removesuffix(".weight") for k in packed}
            shapes = {k: s for k, s in shapes.items()  # a quantized layer's bias stays
                      if k.rpartition(".")[0] not in modules or k.rpartition(".")[2] == "bias"}
            shapes.update({k: tuple(v[2]) for k, v in packed.items()})
    trunk = {k: s for k, s in shapes.items() if not is_head_key(k, config)}
    info["weights"] = _weight_formats(path, config, packed)
    info["layer_mix"] = config.layer_mix()
    info["prefix_cache"] = ({"enabled": False, "reason": HYBRID_PREFIX_CACHE_REASON} if config.is_hybrid
                            else {"enabled": True})
    per_entry = 2 * config.num_kv_layers * config.num_key_value_heads * config.head_dim  # keys and values
    info["kv_cache"] = {"attention_layers": config.num_kv_layers,  # a head's layers add theirs
                        "bytes_per_token": {"float16": 2 * per_entry, "float32": 4 * per_entry}}
    info.update(
        layers=config.num_hidden_layers, hidden_size=config.hidden_size, vocab_size=config.vocab_size,
        attention_heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        context=config.max_position_embeddings, parameters=sum(math.prod(s) for s in trunk.values()),
    )
    layout = detect_layout(shapes.keys(), config)
    if layout is not None:
        head = {k: s for k, s in shapes.items() if is_head_key(k, config)}
        return {**info, "tier": "verified", "mtp": {"layout": layout, "source": "native",
                "layers": config.mtp.num_layers if config.mtp else 1,
                "zero_centered_norms": bool(config.mtp and config.mtp.zero_centered_norms),
                "parameters": sum(math.prod(s) for s in head.values())}}
    sidecar = Path(head_dir).expanduser() if head_dir else (path if path.is_dir() else path.parent)
    if (sidecar / SIDECAR_WEIGHTS).is_file():
        return {**info, **_sidecar_tier(path, sidecar)}
    if head_dir:  # as loading does: a head asked for and not there is an error, not "no head"
        raise ModelLoadError(f"no {SIDECAR_WEIGHTS} in {sidecar}")
    return {**info, "tier": "ar_only", "mtp": None,
            "reason": "no MTP head: forge one with `mtplx forge build`"}


def _sidecar_tier(trunk: Path, sidecar: Path) -> dict:
    import json

    prov_file = sidecar / SIDECAR_PROVENANCE
    recorded = json.loads(prov_file.read_text()).get("trunk_sha256") if prov_file.is_file() else None
    actual = hf_dir.sha256_of_weights(trunk)
    with safe_open(sidecar / SIDECAR_WEIGHTS, framework="pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    mtp = {"layout": "sidecar", "source": str(sidecar), "layers": 1, "parameters": params,
           "trunk_sha256": actual, "recorded_trunk_sha256": recorded}
    if recorded == actual:
        return {"tier": "verified", "mtp": mtp}
    return {"tier": "unverified", "mtp": mtp,
            "reason": f"head was trained against trunk sha256 {recorded or '(none recorded)'}, this trunk is {actual}"}


def _gguf_meta(path: Path) -> tuple[dict, dict]:
    from mtplx.loading.gguf_file import gguf_config, read_gguf_header

    header = read_gguf_header(path)
    shapes = {t.name: t.shape for t in header.tensors}
    try:
        cfg = gguf_config(header.metadata, shapes)
    except UnsupportedModel:
        return {"model_type": header.metadata.get("general.architecture")}, {}
    return cfg, shapes


def _dir_meta(path: Path) -> tuple[dict, dict]:
    cfg = hf_dir.read_hf_config(path)
    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        if file.name == SIDECAR_WEIGHTS:
            continue
        try:
            with safe_open(file, framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        except Exception as exc:  # safetensors raises several types for corrupt headers
            raise ModelLoadError(f"safetensors file {file} is truncated or corrupt: {exc}") from exc
    return cfg, shapes


def _weight_formats(path: Path, config: ModelConfig, packed: dict) -> list[dict]:
    """Each trunk linear map's stored format and what it runs as (a GGUF file's: with
    ``--quantize gguf``, the default on the CPU; on CUDA every weight is dequantized to float), grouped:
    [{"names": "layers 0-29: q,k,v,o,gate,up,down", "stored": "Q4_1", "runs_as": "int4 g32 (exact)"}].
    packed: a quantized checkpoint's layers (``prequantized.describe_formats``)."""
    per_tensor = _gguf_formats(path) if path.is_file() else _safetensors_formats(path, packed)
    rows: dict[tuple[str, str, str], list[int]] = {}
    for name, (stored, runs) in per_tensor.items():
        if is_head_key(name, config):
            continue
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and name.endswith("_proj.weight"):
            key = (parts[-2].removesuffix("_proj"), stored, runs)
            rows.setdefault(key, []).append(int(parts[2]))
        elif name == "lm_head.weight":
            rows.setdefault(("lm_head", stored, runs), [])
    grouped: dict[tuple, list[str]] = {}
    for (short, stored, runs), layers in rows.items():
        grouped.setdefault((_span(layers), stored, runs), []).append(short)
    return [{"names": f"{span}: {','.join(names)}" if span else ",".join(names), "stored": stored, "runs_as": runs}
            for (span, stored, runs), names in grouped.items()]


def _span(layers: list[int]) -> str:
    if not layers:
        return ""
    layers = sorted(set(layers))
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
    return "layers " + ",".join(map(str, layers))


def _gguf_formats(path: Path) -> dict[str, tuple[str, str]]:
    from gguf import GGMLQuantizationType

    from mtplx.loading.gguf_file import hf_tensor_name, read_gguf_header
    from mtplx.loading.gguf_quant import runs_as

    header = read_gguf_header(path)
    names = {t.name for t in header.tensors}
    out = {}
    for t in header.tensors:
        if t.name == "token_embd.weight" and "output.weight" not in names:
            name = "lm_head.weight"  # a tied embedding is also the output matrix
        else:
            try:
                name = hf_tensor_name(t.name, path)
            except UnsupportedModel:
                continue
        if len(t.shape) == 2:
            runs = runs_as(t.ggml_type) if t.shape[1] % 32 == 0 else "float (dequantized)"
            out[name] = (GGMLQuantizationType(t.ggml_type).name, runs)
    return out


def _safetensors_formats(path: Path, packed: dict) -> dict[str, tuple[str, str]]:
    out = {k: v[:2] for k, v in packed.items()}
    quantized = {k.removesuffix(".weight") for k in out}
    for file in sorted(path.glob("*.safetensors")):
        if file.name == SIDECAR_WEIGHTS:
            continue
        with safe_open(file, framework="pt") as f:
            for k in f.keys():
                if k.rpartition(".")[0] in quantized:
                    continue
                dtype = str(f.get_slice(k).get_dtype()).lower()
                out[k] = (dtype, "float (--quantize int4|int8|fp8 to quantize on load)")
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
