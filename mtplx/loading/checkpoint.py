"""Turn a path (Hugging Face directory or GGUF file) into a ready model, head and tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from mtplx.errors import InvalidParameter, ModelLoadError
from mtplx.loading import hf_dir, prequantized
from mtplx.loading.sharding import shard_state
from mtplx.loading.mtp_weights import HeadWeights, extract_native_head, is_head_key, load_sidecar, SIDECAR_WEIGHTS
from mtplx.loading.text_weights import text_model_state
from mtplx.loading.tokenizer import Tokenizer
from mtplx.models.base import CausalLM
from mtplx.models.config import ModelConfig
from mtplx.loading.weights import attach_head, build_model_on_meta, materialize
from mtplx.models.mtp import MTPHead
from mtplx.models.parallel import Shard
from mtplx.models.quant import FORMATS, QuantizedWeight, QuantLinear, quantize, quantize_linears, quantize_rtn

QUANTIZE_CHOICES = (None, "none", "gguf", *FORMATS)
HEAD_QUANTIZE_CHOICES = (None, "none", *FORMATS)
QUANTIZE_GROUP = 32  # inputs per scale for --quantize (GGUF's block size)

log = logging.getLogger("mtplx")


@dataclass
class LoadedModel:
    model: CausalLM
    head: MTPHead | None
    tokenizer: Tokenizer | None
    config: ModelConfig
    source: Path
    generation_defaults: dict = field(default_factory=dict)
    head_info: dict = field(default_factory=dict)  # layout, verified, source, provenance
    quantize: str | None = None  # the trunk's weights as loaded: None float, else the format (gguf, int4, ...)
    head_quantize: str | None = None  # the MTP head's linear weights: None its dtype, else int8, int4 or fp8


def check_options(world: int, quantize: str | None, head_quantize: str | None, path: str | Path | None = None) -> None:
    """The weight options a load takes: ``quantize`` and ``head_quantize`` among their choices,
    and with tensor parallelism (``world`` ranks, more than one) float weights only: a quantized
    trunk or head refused by name, and (given the model's ``path``) a directory quantized by
    another tool unless ``quantize`` is "none". ``mtplx.load`` asks before it starts the other
    ranks, and every rank's ``load_checkpoint`` again."""
    if quantize not in QUANTIZE_CHOICES:
        raise InvalidParameter("quantize", f"{quantize!r} is not one of {', '.join(map(str, QUANTIZE_CHOICES))}")
    if head_quantize not in HEAD_QUANTIZE_CHOICES:
        raise InvalidParameter("head_quantize", f"{head_quantize!r} is not one of "
                                                f"{', '.join(map(str, HEAD_QUANTIZE_CHOICES))}")
    if world <= 1:
        return
    if head_quantize not in (None, "none"):
        raise InvalidParameter("tensor_parallel", f"head_quantize={head_quantize!r} cannot be sharded yet: "
                                                  "tensor parallelism needs a float head (head_quantize none)")
    if quantize not in (None, "none"):
        raise InvalidParameter("tensor_parallel", f"quantize={quantize!r} cannot be sharded yet: tensor "
                                                  "parallelism needs float weights (quantize none)")
    path = Path(path).expanduser() if path is not None else None
    if quantize is None and path is not None and (path / "config.json").is_file():
        scheme = prequantized.scheme_of(hf_dir.read_hf_config(path), path)
        if scheme is not None:
            raise _prequantized_refused(path, scheme)


def _prequantized_refused(path: Path, scheme) -> InvalidParameter:
    return InvalidParameter("tensor_parallel", f"{path} is a {scheme.method} checkpoint: tensor "
                                               "parallelism needs float weights (quantize none)")


def load_checkpoint(path: str | Path, *, device: torch.device, dtype: torch.dtype,
                    head_dir: str | Path | None = None, allow_unverified_head: bool = False,
                    quantize: str | None = None, shard: Shard | None = None,
                    head_quantize: str | None = None) -> LoadedModel:
    """Load trunk weights, tokenizer and any MTP head (native weights or a sidecar).

    A sidecar is looked for in ``head_dir`` if given, else beside the trunk (``mtp.safetensors``).
    quantize: the trunk's linear weights (the MTP head's stay in ``dtype``): None (auto): a GGUF
    file's own blocks where they run fastest and as exactly as the float model (float32 on a CPU
    with kernels/cpu.py's kernels), or where the float weights would not fit on the GPU
    (``resolve_quantize``), else float; "none": float; "gguf": a
    GGUF file's own quantized blocks (models/quant.py; fast on the CPU only);
    "int4" / "int8": round-to-nearest with groups of 32 inputs; "fp8": float8 e4m3 with one
    scale per output row (fast on CUDA; on the CPU dequantized per forward, for quality checks).
    shard: load one tensor-parallel rank's slice of the trunk and head (float weights only;
    ``LoadedModel.config`` stays the whole model's, ``model.config`` is the rank's).
    head_quantize: the MTP head's linear weights (its fc, feature fusion and layers; the draft
    rows of the output matrix are the trunk's): None or "none" in ``dtype``; "int8" / "int4"
    round-to-nearest with groups of 32 inputs, "fp8" as for the trunk. Drafts only propose and
    the verify reads the trunk, so outputs stay exact; a coarser head may accept less
    (docs/performance.md measures it)."""
    path = Path(path).expanduser()
    check_options(shard.world if shard is not None else 1, quantize, head_quantize)
    head_quantize = None if head_quantize == "none" else head_quantize
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist (give a Hugging Face directory or a .gguf file)")
    quantize = resolve_quantize(quantize, path, device, dtype) if shard is None or shard.world == 1 else quantize
    if path.is_file() and path.suffix == ".gguf":
        from mtplx.loading.gguf_file import load_gguf

        cfg_dict, state, metadata = load_gguf(path, dtype=dtype, quantized=quantize == "gguf")
        config = ModelConfig.from_hf(cfg_dict)
        tokenizer = Tokenizer.from_gguf(path, metadata)
        gen_defaults = {}
    elif path.is_dir():
        cfg_dict = hf_dir.read_hf_config(path)
        config = ModelConfig.from_hf(cfg_dict)
        scheme = prequantized.scheme_of(cfg_dict, path)
        if scheme is None:
            state = hf_dir.load_safetensors_state_dict(path, dtype=dtype)
        else:
            if quantize == "gguf":
                raise InvalidParameter("quantize", f"'gguf' reads a GGUF file's own blocks; {path} is a "
                                                   f"{scheme.method} checkpoint: leave quantize unset (auto) to run "
                                                   "its own integers, or give none, int4, int8 or fp8")
            if shard is not None and shard.world > 1 and quantize is None:
                raise _prequantized_refused(path, scheme)
            state = prequantized.unpack_state(hf_dir.load_safetensors_state_dict(path), scheme, dtype)
            quantize = prequantized.resolve(quantize, scheme, state, device)
            if quantize == "none":
                state = prequantized.dequantized(state, dtype)
        tokenizer = Tokenizer.from_hf_dir(path)
        gen_defaults = hf_dir.read_generation_config(path)
    else:
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    if config.is_hybrid:
        state = text_model_state(state)
    if tokenizer is not None:
        tokenizer.add_eos_ids(set(config.eos_token_ids) | set(_as_list(gen_defaults.get("eos_token_id"))))

    if any(isinstance(v, QuantizedWeight) for v in state.values()):  # an MTP head stays float
        state = {k: v.dequantize().to(dtype) if isinstance(v, QuantizedWeight) and is_head_key(k, config) else v
                 for k, v in state.items()}
    native = extract_native_head(state, config)
    trunk_state = {k: v for k, v in state.items() if not is_head_key(k, config)}
    if quantize in FORMATS:
        trunk_state = quantize_state(trunk_state, config, quantize)
    if shard is not None:
        trunk_state = shard_state(trunk_state, config, shard)
    model = materialize(build_model_on_meta(config, shard), trunk_state, device, dtype,
                        tied=config.tie_word_embeddings)
    output = trunk_state.get("lm_head.weight")

    head_weights = native
    sidecar_dir = Path(head_dir).expanduser() if head_dir else (path if path.is_dir() else path.parent)
    if native is None and (sidecar_dir / SIDECAR_WEIGHTS).is_file():
        head_weights = load_sidecar(sidecar_dir, config, hf_dir.sha256_of_weights(path),
                                    allow_unverified=allow_unverified_head)
    elif head_dir and native is None:
        raise ModelLoadError(f"no {SIDECAR_WEIGHTS} in {sidecar_dir}")
    head, head_info = None, {}
    if head_weights is None and head_quantize is not None:
        log.warning("head_quantize=%s has no effect: %s has no MTP head (requests decode AR)", head_quantize, path)
    if head_weights is not None:
        head = attach_head(model, head_weights, device, dtype, shard, config)
        if head_quantize is not None:
            quantize_linears(head, head_quantize, QUANTIZE_GROUP)
        if isinstance(output, QuantizedWeight) and output.bits == 8:
            # drafts read the output matrix once more per drafted token: half the bytes in int4
            model.draft_lm_head = QuantLinear(quantize_rtn(output.dequantize(), 4, QUANTIZE_GROUP), device=device,
                                              dtype=dtype)
        head_info = {"layout": head_weights.mtp.layout, "verified": head_weights.verified,
                     "source": head_weights.source, "provenance": head_weights.provenance}
    return LoadedModel(model, head, tokenizer, config, path, gen_defaults, head_info,
                       None if quantize in (None, "none") else quantize, head_quantize if head is not None else None)


def shard_loaded(loaded: LoadedModel, shard: Shard, device) -> LoadedModel:
    """One tensor-parallel rank's slice, on ``device``, of a whole model already in memory
    (tests and benchmarks build their models so; ``load_checkpoint(shard=...)`` slices a
    checkpoint as it loads)."""
    config, dtype = loaded.config, loaded.model.model.embed_tokens.weight.dtype
    state = shard_state(dict(loaded.model.state_dict()), config, shard)
    model = materialize(build_model_on_meta(config, shard), state, device, dtype, tied=config.tie_word_embeddings)
    head = None
    if loaded.head is not None:
        weights = HeadWeights(dict(loaded.head.state_dict()), loaded.head.mtp)
        head = attach_head(model, weights, device, dtype, shard, config)
    return replace(loaded, model=model, head=head)


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


GPU_FLOAT_SHARE = 0.8  # of a GPU's free memory the float weights may take; the rest: KV cache, activations


def resolve_quantize(quantize: str | None, path: Path, device: torch.device, dtype: torch.dtype) -> str | None:
    """``quantize`` as asked, or for None (auto) "gguf" for a GGUF file loaded as float32 on a CPU
    where kernels/cpu.py's kernels run (float32 activations: greedy output equal to the float
    model's on 8 of 8 prompts for 64 tokens, several times its decode speed: docs/performance.md),
    or on a GPU whose free memory the file's weights in ``dtype`` would fill past
    GPU_FLOAT_SHARE (its own blocks then run on the quantized kernels: a 4-bit model in about a
    quarter of bf16's bytes); else None (float: on CUDA the bf16 path is the tuned one, and for a
    model as small as the default one faster than its 4-bit blocks: docs/performance.md, session 12)."""
    if quantize is not None:
        return quantize
    from mtplx.kernels import cpu as cpu_kernels

    device = torch.device(device)
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    if device.type == "cpu" and dtype == torch.float32 and cpu_kernels.available():
        return "gguf"
    if device.type == "cuda" and gguf_float_bytes(path, dtype) > GPU_FLOAT_SHARE * torch.cuda.mem_get_info(device)[0]:
        return "gguf"
    return None


def gguf_float_bytes(path: Path, dtype: torch.dtype) -> int:
    """The bytes a GGUF file's tensors take dequantized to ``dtype``."""
    from math import prod

    from mtplx.loading.gguf_file import read_gguf_header

    return sum(prod(t.shape) for t in read_gguf_header(path).tensors) * dtype.itemsize


def quantize_state(state: dict, config: ModelConfig, fmt: str) -> dict:
    """The trunk's projection and output weights (a tied embedding: as the output matrix) as
    ``QuantizedWeight``s in ``fmt`` (one of FORMATS); embeddings, norms and biases are left as
    they are.
    A weight whose inputs are not a whole number of groups stays float."""
    out = dict(state)
    for name, tensor in state.items():
        if isinstance(tensor, QuantizedWeight):
            tensor = tensor.dequantize()  # a GGUF block weight re-quantized to the asked format
        elif not (name.endswith("_proj.weight") or name == "lm_head.weight") or tensor.dim() != 2:
            continue
        if tensor.shape[1] % QUANTIZE_GROUP == 0:
            out[name] = quantize(tensor, fmt, QUANTIZE_GROUP)
    embed = state.get("model.embed_tokens.weight")
    if config.tie_word_embeddings and embed is not None and embed.shape[1] % QUANTIZE_GROUP == 0:
        out["lm_head.weight"] = quantize(embed, fmt, QUANTIZE_GROUP)
    return out
