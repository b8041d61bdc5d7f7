"""GGUF checkpoints: header, HF-style config, and dequantised tensors under Hugging Face names.

The header (metadata and tensor table) is parsed here with ``struct``: ``gguf.GGUFReader`` builds
numpy views for every vocabulary string and takes ~2 s on a 49k-token vocabulary, versus ~0.1 s
here. Tensor data is a read-only memory map; ``gguf.quants.dequantize`` turns each tensor's blocks
into float32, which is then cast to the requested dtype.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from mtplx.errors import ModelLoadError, UnsupportedModel

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format of one scalar (8 = string, 9 = array handled apart).
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY_TYPES = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8",
}
_STRING, _ARRAY = 8, 9

# GGUF tensor names -> Hugging Face names (shared by llama, qwen2, qwen3).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Tensors llama.cpp derives from the config; they have no HF counterpart and go to metadata.
_DERIVED_TENSORS = {"rope_freqs.weight": "rope_freqs"}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. ``shape`` is in torch order (GGUF stores it reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # bytes from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """Everything in a GGUF file except the tensor bytes."""

    path: Path
    metadata: dict  # raw key -> value (str, int, float, bool, or list of those)
    tensors: list[TensorInfo]
    data_start: int  # file offset of the (aligned) data section
    file_size: int


def load_gguf(path: Path, *, dtype: torch.dtype, quantized: bool = False) -> tuple[dict, dict, dict]:
    """Load a llama/qwen2/qwen3 GGUF file.

    Returns ``(config, state_dict, metadata)``:
    - ``config``: HF-style config dict (``model_type``, ``hidden_size``, ...).
    - ``state_dict``: HF tensor names (``model.layers.0.self_attn.q_proj.weight``), every tensor
      dequantised to ``dtype``; Linear weights are ``[out_features, in_features]``. With
      ``quantized``, the projection and output weights stored in a format loading/gguf_quant.py
      reads are ``QuantizedWeight``s instead (their blocks repacked, no float weight made); a
      tied embedding is then both a float ``model.embed_tokens.weight`` (for the lookup) and a
      quantized ``lm_head.weight``.
    - ``metadata``: the raw GGUF key/value fields (tokenizer vocabulary included, so a tokenizer
      can be built without re-reading the file), plus ``rope_freqs`` (float32 ``[head_dim // 2]``)
      when the file carries llama.cpp's rope-frequency factors.
    """
    path = Path(path)
    header = read_gguf_header(path)
    _require_supported(header)
    config = gguf_config(header.metadata, {t.name: t.shape for t in header.tensors})
    # Validate names first (the header's reader checked the extents): fail before spending seconds dequantising.
    hf_names = {t.name: hf_tensor_name(t.name, path) for t in header.tensors if t.name not in _DERIVED_TENSORS}
    data = np.memmap(path, dtype=np.uint8, mode="r")  # freed with its last view
    state_dict: dict[str, torch.Tensor] = {}
    metadata = dict(header.metadata)
    for info in header.tensors:
        name = hf_names.get(info.name)
        if quantized and _keeps_quantized(info, name, config):
            qw = _read_quantized(data, header, info)
            qw.q, qw.scale, qw.zero = (_to_hf_layout(t, name, config) for t in (qw.q, qw.scale, qw.zero))
            state_dict["lm_head.weight" if info.name == "token_embd.weight" else name] = qw
            if info.name != "token_embd.weight":
                continue
        tensor = _read_tensor(data, header, info)
        if name is not None:
            state_dict[name] = _to_hf_layout(tensor, name, config).to(dtype)
        else:
            metadata[_DERIVED_TENSORS[info.name]] = tensor
    return config, state_dict, metadata


def _keeps_quantized(info: TensorInfo, hf_name: str | None, config: dict) -> bool:
    """Projection weights (and the output matrix, or a tied embedding as the output matrix) in a
    block format with whole groups of 32 inputs."""
    from mtplx.loading.gguf_quant import SUPPORTED

    if hf_name is None or len(info.shape) != 2 or info.shape[1] % 32 or info.ggml_type not in SUPPORTED:
        return False
    tied_embedding = info.name == "token_embd.weight" and config["tie_word_embeddings"]
    return hf_name.endswith("_proj.weight") or hf_name == "lm_head.weight" or tied_embedding


def _read_quantized(data: np.ndarray, header: GGUFHeader, info: TensorInfo):
    from mtplx.loading.gguf_quant import quantized_weight

    start = header.data_start + info.offset
    return quantized_weight(data[start : start + info.nbytes], info.ggml_type, info.shape)


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse the metadata and tensor table of a GGUF file (v2 or v3, little-endian); a file
    whose tensors' bytes do not all lie inside it (truncated) is refused here, for every reader."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist or is not a file")
    try:
        # A memoryview slices without creating numpy objects (that is what makes GGUFReader slow).
        header = _parse_header(path, memoryview(np.memmap(path, dtype=np.uint8, mode="r")))
    except (struct.error, ValueError, UnicodeDecodeError, IndexError, OverflowError) as exc:
        raise ModelLoadError(f"GGUF file {path} is truncated or corrupt (while reading its header: {exc})") from exc
    _check_extents(header)
    return header


def gguf_config(metadata: dict, tensor_shapes: dict[str, tuple[int, ...]]) -> dict:
    """Map GGUF metadata to a Hugging Face style config dict (llama, qwen2, qwen3)."""
    arch = metadata["general.architecture"]

    def field(key, default=None):
        return metadata.get(f"{arch}.{key}", default)

    hidden = field("embedding_length")
    heads = field("attention.head_count")
    embed_shape = tensor_shapes.get("token_embd.weight")
    vocab_size = field("vocab_size") or (embed_shape[0] if embed_shape else len(metadata["tokenizer.ggml.tokens"]))
    config = {
        "model_type": arch,
        "architectures": [_HF_CLASS[arch]],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": field("feed_forward_length"),
        "num_hidden_layers": field("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field("attention.head_count_kv", heads),
        "head_dim": field("attention.key_length") or hidden // heads,
        "rms_norm_eps": field("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": field("rope.freq_base", 10000.0),
        "max_position_embeddings": field("context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if config[k] is None]
    if missing:
        raise ModelLoadError(f"GGUF metadata lacks the {arch}.* fields needed for {missing}")
    rope_scaling = _rope_scaling(metadata, arch)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    return config


def hf_tensor_name(gguf_name: str, path: Path | str = "") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    raise UnsupportedModel(
        f"GGUF file {path} has tensor {gguf_name!r}, which mtplx does not know; known per-layer tensors "
        f"are blk.N.{{{', '.join(_LAYER_NAMES)}}}.weight/bias and {', '.join(_GLOBAL_NAMES)}"
    )


def unpermute_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation for llama-architecture files.

    ``w``: ``[n_heads * head_dim, ...]`` (a weight or a bias). llama.cpp stores, within each head,
    the rows as interleaved (even, odd) rotary pairs; HF keeps the two rotary halves apart. Row
    ``2*i + j`` of a GGUF head is row ``j*half + i`` of the HF head (``half = head_dim // 2``).
    """
    rows, rest = w.shape[0], w.shape[1:]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(w.shape)


# --- private helpers --------------------------------------------------------------------------

_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _require_supported(header: GGUFHeader) -> None:
    arch = header.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"GGUF file {header.path} has general.architecture={arch!r}; mtplx supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _to_hf_layout(tensor: torch.Tensor, hf_name: str, config: dict) -> torch.Tensor:
    """Only llama files have permuted Q/K rows; qwen2/qwen3 are stored in HF order."""
    if config["model_type"] != "llama":
        return tensor
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_rotary_rows(tensor, config["num_attention_heads"])
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_rotary_rows(tensor, config["num_key_value_heads"])
    return tensor


def _rope_scaling(metadata: dict, arch: str) -> dict | None:
    """HF ``rope_scaling`` from ``{arch}.rope.scaling.*`` (absent or ``none`` -> None)."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": metadata.get(f"{arch}.rope.scaling.factor", 1.0)}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


class _Cursor:
    """Sequential little-endian reads from a buffer; running past its end raises ``struct.error``."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise struct.error(f"string of {n} bytes at offset {self.pos} runs past the end of the file")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        if kind not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {kind} at offset {self.pos}")
        return self.scalar(_SCALAR_FORMATS[kind])

    def array(self) -> list:
        kind, count = self.scalar("<I"), self.scalar("<Q")
        if kind in _NUMPY_TYPES:  # numeric arrays in one read: 49k token types cost microseconds
            items = np.frombuffer(self.buf, dtype=_NUMPY_TYPES[kind], count=count, offset=self.pos)
            self.pos += items.nbytes
            return items.tolist()
        return [self.value(kind) for _ in range(count)]


def _parse_header(path: Path, buf) -> GGUFHeader:
    cur = _Cursor(buf)
    if bytes(buf[:4]) != _MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (its first bytes are {bytes(buf[:4])!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"GGUF file {path} has version {version}; mtplx reads versions 2 and 3 (little-endian)")
    n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
    metadata = {}
    for _ in range(n_fields):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    tensors = [_read_tensor_info(cur) for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = -(-cur.pos // alignment) * alignment
    return GGUFHeader(path, metadata, tensors, data_start, len(buf))


def _read_tensor_info(cur: _Cursor) -> TensorInfo:
    name = cur.string()
    dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
    ggml_type, offset = cur.scalar("<I"), cur.scalar("<Q")
    shape = tuple(reversed(dims))  # GGUF lists the fastest-varying dimension first
    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise UnsupportedModel(
            f"tensor {name!r} has ggml type {ggml_type}, unknown to the installed gguf package"
        ) from None
    n_elements = int(np.prod(shape, dtype=np.int64))
    return TensorInfo(name, shape, ggml_type, offset, n_elements // block * block_bytes)


def _check_extents(header: GGUFHeader) -> None:
    """Every tensor's bytes must lie inside the file."""
    for info in header.tensors:
        end = header.data_start + info.offset + info.nbytes
        if end > header.file_size:
            raise ModelLoadError(
                f"GGUF file {header.path} is truncated: tensor {info.name!r} ends at byte {end} "
                f"but the file has {header.file_size} bytes"
            )


def _read_tensor(data: np.ndarray, header: GGUFHeader, info: TensorInfo) -> torch.Tensor:
    """Dequantise one tensor to float32 ``info.shape``. ``data``: the whole file as uint8."""
    start = header.data_start + info.offset
    rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    raw = data[start : start + info.nbytes].reshape(rows, -1)
    qtype = GGMLQuantizationType(info.ggml_type)
    try:
        values = dequantize(raw, qtype)
    except NotImplementedError as exc:
        raise UnsupportedModel(f"GGUF file {header.path}: tensor {info.name!r} uses {qtype.name}: {exc}") from None
    # F32/F16 come back as read-only views of the memory map: copy those (only those) out.
    values = np.require(values, dtype=np.float32, requirements=["C", "W"])
    return torch.from_numpy(values).reshape(info.shape)
