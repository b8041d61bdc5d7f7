"""Checkpoints quantized by other tools, read from their own integers: AWQ (AutoAWQ's GEMM
layout), GPTQ (AutoGPTQ / GPTQModel, checkpoint formats ``gptq`` and ``gptq_v2``, GPTQModel's
per-module ``dynamic`` bits and groups),
compressed-tensors (llm-compressor's ``pack-quantized``, ``int-quantized`` and
``float-quantized``) and block-scaled fp8 (``quant_method: fp8``, as Qwen3 and DeepSeek-V3 ship).
Each quantized linear map becomes a ``QuantizedWeight`` (models/quant.py) holding the same
integers and scales, with no float weight made on the way, so the CPU and CUDA kernels run it
as they run a GGUF file's blocks.

The layouts (w[n, k]: output n, input k; g(k): k's group; u: a stored unsigned integer):

    AWQ, version gemm       w = (u - z) s      qweight int32 [in, out / 8]: 8 outputs a word, in
                                               the order 0 2 4 6 1 3 5 7; qzeros int32
                                               [groups, out / 8] the same; scales [groups, out]
    GPTQ                    w = (u - z) s      qweight int32 [in * bits / 32, out]: consecutive
                                               inputs in a word; qzeros [groups, out * bits / 32]:
                                               consecutive outputs, stored as z - 1 (``gptq``) or
                                               z (``gptq_v2``); scales [groups, out]; g_idx [in]
    compressed-tensors      w = (q - zp) s     weight_packed int32 [out, in * bits / 32]:
      pack-quantized                           consecutive inputs, q + 2^(bits-1) stored;
                                               weight_scale [out, groups] ([out, 1]: a scale per
                                               row); weight_zero_point (asymmetric only) packed
                                               along the outputs; weight_g_idx (activation order)
      int-quantized         w = (q - zp) s     weight int8 [out, in], weight_scale, weight_zero_point
      float-quantized       w = f s            weight float8_e4m3fn, weight_scale per row or tensor,
                                               or per block of the config's block_structure
    fp8 (weight_block_size) w = f s            weight float8_e4m3fn [out, in]; weight_scale_inv
                                               [out / bn, in / bk] per block of bn x bk
    fp8 (no block size)     w = f s            weight_scale per tensor or row (AutoFP8's layout)

Words are little-endian int32: field j of a word is bits [j * bits, (j + 1) * bits). Bits per
weight: 4 or 8 (fp8: 8). The portable form is w = q' scale + zero with q' = u - 2^(bits-1)
(int4 in [-8, 7]), so scale = s and zero = (2^(bits-1) - z) s, exactly in float32 (on the CPU
kernel the offsets are stored in float16: ``kernels/cpu.pack``). A block-scaled fp8 weight keeps
a scale per row and group of bk inputs (its block's). Where a layer's groups are not runs of
consecutive inputs (GPTQ's activation order, ``desc_act``: g_idx a permutation), the weight is
dequantized exactly to float instead: the kernels take contiguous groups.

Which modules are quantized is read from the tensors (a module with a ``qweight``, a
``weight_packed``, ...), so ``ignore`` / ``modules_to_not_convert`` lists need no parsing;
bits and group size come from the shapes and are checked against ``quantization_config``.
Only the layers the engine runs quantized elsewhere (a GGUF's blocks: the ``*_proj``
projections and the output matrix) stay so; per-expert MoE weights (stacked into float tensors
on load), routers and the rest are dequantized to the model's dtype, which costs their float
size in memory. Stacked (3-D) quantized expert tensors are refused by name.
Activation quantization (compressed-tensors' ``input_activations``, e.g. W8A8) is not
applied: those weights run with float activations. Sources of the layouts: AutoAWQ 0.2.9
(``awq/utils/packing_utils.py``), GPTQModel 7.7 (``nn_modules/qlinear``, ``utils/model.py``'s
v1 -> v2 zero conversion), compressed-tensors 0.20 (``compressors/pack_quantized``), and
transformers' ``FineGrainedFP8Config``; tests/test_prequantized.py checks against
compressed-tensors and transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtplx.errors import ModelLoadError
from mtplx.models.quant import QuantizedWeight

METHODS = ("awq", "gptq", "compressed-tensors", "fp8")
AWQ_UNDO = (0, 4, 1, 5, 2, 6, 3, 7)  # field i of an AWQ word holds output (0 2 4 6 1 3 5 7)[i]
_CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


@dataclass
class Scheme:
    """A checkpoint's ``quantization_config``, as far as reading its tensors needs."""

    method: str  # one of METHODS
    bits: set[int] = field(default_factory=set)  # the bit widths the config names (empty: any)
    group_size: int | None = None  # AWQ / GPTQ: inputs per group (GPTQ -1: the whole row)
    zeros_minus_one: bool = True  # GPTQ: qzeros stored as z - 1 (checkpoint_format "gptq")
    block: tuple[int, int] | None = None  # fp8: weight_block_size; compressed-tensors: block_structure

    def only(self, values: set) -> int | None:
        """The one value of a set the config names, or None where it names none or several."""
        return next(iter(values)) if len(values) == 1 else None


def scheme_of(cfg: dict, path: Path | None = None) -> Scheme | None:
    """The quantization scheme of a model directory's config.json (``quantization_config``, or
    for older checkpoints the file beside it: AutoGPTQ's ``quantize_config.json``, AutoAWQ's
    ``quant_config.json``), or None for a float checkpoint. Raises ModelLoadError for a scheme
    this module cannot read."""
    qc = cfg.get("quantization_config")
    if qc is None and isinstance(cfg.get("text_config"), dict):
        qc = cfg["text_config"].get("quantization_config")
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        if qc is None and path is not None and (Path(path) / name).is_file():
            qc = {"quant_method": method, **_json_object(Path(path) / name)}
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"quantization_config must be a JSON object, found {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"AWQ version {version!r} is not supported: mtplx reads AutoAWQ's 'gemm' layout "
                                 "(re-export the model with version='gemm')")
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        return Scheme("awq", {bits}, group)
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", (qc.get("meta") or {}).get("checkpoint_format", "gptq"))).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelLoadError(f"GPTQ checkpoint_format {fmt!r} is not supported: mtplx reads 'gptq' and "
                                 "'gptq_v2' (re-export without a kernel-specific layout such as marlin)")
        bits = int(qc.get("bits", 4))
        # GPTQModel's "dynamic": per-module bits and group sizes, read from each module's tensors
        return Scheme("gptq", set() if qc.get("dynamic") else {bits}, int(qc.get("group_size", 128)),
                      zeros_minus_one=fmt == "gptq")
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
            raise ModelLoadError("compressed-tensors config_groups must map names to objects")
        formats = {str(g.get("format") or qc.get("format") or "") for g in groups.values()} or {str(qc.get("format"))}
        bad = sorted(f for f in formats if f not in _CT_FORMATS)
        if bad:
            raise ModelLoadError(f"compressed-tensors format {', '.join(bad)} is not supported: mtplx reads "
                                 f"{', '.join(_CT_FORMATS)}")
        weights = [g.get("weights") or {} for g in groups.values()]
        kinds = {str(w.get("type", "int")) for w in weights}
        if not kinds <= {"int", "float"}:
            raise ModelLoadError(f"compressed-tensors weight type {sorted(kinds)} is not supported (int or float)")
        blocks = {tuple(int(v) for v in w["block_structure"]) for w in weights if w.get("block_structure")}
        if len(blocks) > 1 or any(len(b) != 2 for b in blocks):
            raise ModelLoadError(f"compressed-tensors block structures {sorted(blocks)}: mtplx reads one 2-D block")
        groups_sizes = {int(w["group_size"]) for w in weights if w.get("group_size")}
        return Scheme("compressed-tensors", {int(w["num_bits"]) for w in weights if "num_bits" in w},
                      group_size=next(iter(groups_sizes)) if len(groups_sizes) == 1 else None,
                      block=next(iter(blocks), None))
    if method == "fp8":  # block-scaled (weight_scale_inv per block), or per tensor / row (weight_scale)
        block = qc.get("weight_block_size")
        if block is None:
            return Scheme("fp8", {8})
        if not (isinstance(block, (list, tuple)) and len(block) == 2):
            raise ModelLoadError(f"fp8 weight_block_size must be two numbers, got {block!r}")
        return Scheme("fp8", {8}, block=(int(block[0]), int(block[1])))
    raise ModelLoadError(f"quant_method {method or '(none)'!r} is not supported: mtplx reads the checkpoints of "
                         f"{', '.join(METHODS)}; or load a float (16/32-bit) checkpoint")


def _json_object(file: Path) -> dict:
    import json

    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file} is not readable JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{file} must hold a JSON object, found {type(value).__name__}")
    return value


def unpack_state(state: dict, scheme: Scheme, dtype: torch.dtype) -> dict:
    """``state`` (tensors as stored) with each quantized module's tensors replaced by one
    ``<module>.weight``: a ``QuantizedWeight``, or a float tensor in ``dtype`` where the layout
    cannot be kept (``desc_act``). Every other floating tensor is cast to ``dtype``."""
    readers = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors, "fp8": _fp8_blocks}
    by_module: dict[str, list[str]] = {}
    for k in state:
        module, _, suffix = k.rpartition(".")
        if suffix in _QUANT_SUFFIXES:
            by_module.setdefault(module, []).append(k)
    out, used = {}, set()
    for name, weight in readers[scheme.method](state, scheme):
        module = name.removesuffix(".weight")
        used.update(by_module.get(module, ()))
        if isinstance(weight, QuantizedWeight):
            if scheme.bits and not weight.fp8 and weight.bits not in scheme.bits:
                raise ModelLoadError(f"{module}: {weight.bits}-bit weights, but quantization_config says "
                                     f"{sorted(scheme.bits)}")
            # quantized layers where the engine has them (as for a GGUF's blocks): the
            # projections and the output matrix; experts (stacked as float tensors on load),
            # routers and the rest run dequantized
            kept = (name.endswith("_proj.weight") and ".experts." not in name) or name == "lm_head.weight"
            out[name] = weight if kept else weight.dequantize().to(dtype)
        else:
            out[name] = weight.to(dtype)
    for name, tensor in state.items():
        if name in used or name in out:
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            raise ModelLoadError(f"{name}: an fp8 tensor without a scale beside it ({scheme.method} checkpoint)")
        out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out


_QUANT_SUFFIXES = {"qweight", "qzeros", "scales", "g_idx", "weight", "weight_packed", "weight_scale",
                   "weight_zero_point", "weight_shape", "weight_g_idx", "weight_scale_inv", "input_scale",
                   "input_zero_point", "input_global_scale", "weight_global_scale"}


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The unsigned ``bits``-bit fields of int32 words along the last axis, lowest first:
    [..., W] -> [..., W * 32 / bits] int32."""
    if words.dtype != torch.int32:
        raise ModelLoadError(f"packed weights must be int32, found {words.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def _modules(state: dict, suffix: str) -> list[str]:
    """The modules holding a tensor named ``suffix``; refuses stacked (3-D) quantized tensors."""
    names = sorted(k.removesuffix("." + suffix) for k in state if k.endswith("." + suffix))
    for m in names:
        if state[f"{m}.{suffix}"].dim() > 2 or (suffix == "weight_scale" and f"{m}.weight_shape" in state
                                                and state[f"{m}.weight_shape"].numel() != 2):
            raise ModelLoadError(f"{m}: quantized tensors stacked over experts (3-D) are not supported; "
                                 "mtplx reads one 2-D weight per linear map")
    return names


def _need(state: dict, key: str) -> torch.Tensor:
    if key not in state:
        raise ModelLoadError(f"quantized checkpoint is missing tensor {key!r}")
    return state[key]


def _from_unsigned(u: torch.Tensor, z: torch.Tensor, s: torch.Tensor, bits: int, group: int, source: str,
                   g_idx: torch.Tensor | None = None):
    """w = (u - z) s with u [out, in], z and s [out, groups] -> a QuantizedWeight, or where the
    groups are not runs of ``group`` consecutive inputs (g_idx), the float32 weight."""
    out_f, in_f = u.shape
    s = s.float()
    natural = g_idx is None or torch.equal(g_idx.long(), torch.arange(in_f) // group)
    if not natural or in_f % group:
        g = g_idx.long() if g_idx is not None else torch.arange(in_f) // group
        if g.numel() != in_f or int(g.max()) >= s.shape[1]:
            raise ModelLoadError(f"{source}: g_idx does not match the weight's {in_f} inputs and {s.shape[1]} groups")
        return (u.float() - z.float()[:, g]) * s[:, g]
    if s.shape[1] != in_f // group:
        raise ModelLoadError(f"{source}: {s.shape[1]} scale groups for {in_f} inputs in groups of {group}")
    half = 1 << (bits - 1)
    return QuantizedWeight((u - half).to(torch.int8), s, (half - z.float()) * s, bits, group, source)


def _awq(state: dict, scheme: Scheme):
    for m in _modules(state, "qweight"):
        qweight, qzeros, scales = (_need(state, f"{m}.{k}") for k in ("qweight", "qzeros", "scales"))
        bits = 32 * qweight.shape[1] // scales.shape[1] if scales.shape[1] else 0
        if bits != 4:
            raise ModelLoadError(f"{m}: AWQ {bits}-bit weights are not supported (4-bit only)")
        in_f, out_f = qweight.shape[0], scales.shape[1]

        def undo(words):
            u = _fields(words, 4)
            return u.view(u.shape[0], -1, 8)[..., list(AWQ_UNDO)].reshape(u.shape[0], -1)

        u, z = undo(qweight).T, undo(qzeros)[:, :out_f].T
        group = in_f // scales.shape[0]
        if scheme.group_size not in (None, -1) and scheme.group_size != group:
            raise ModelLoadError(f"{m}: groups of {group} inputs, but quantization_config says {scheme.group_size}")
        yield f"{m}.weight", _from_unsigned(u.contiguous(), z.contiguous(), scales.T.contiguous(), 4, group, "awq")


def _gptq(state: dict, scheme: Scheme):
    for m in _modules(state, "qweight"):
        qweight, qzeros, scales = (_need(state, f"{m}.{k}") for k in ("qweight", "qzeros", "scales"))
        out_f = scales.shape[1]
        bits = next((b for b in (4, 8) if -(-out_f * b // 32) == qzeros.shape[1]), None)
        if bits is None:
            raise ModelLoadError(f"{m}: GPTQ zeros of {qzeros.shape[1]} words for {out_f} outputs: only 4- and 8-bit "
                                 f"weights are supported (quantization_config: {sorted(scheme.bits)} bits)")
        u = _fields(qweight.T.contiguous(), bits)  # [out, in]
        in_f = u.shape[1]
        z = _fields(qzeros, bits)[:, :out_f]
        if scheme.zeros_minus_one:
            z = z + 1
        group = _gptq_group(in_f, scales.shape[0], scheme)
        if -(-in_f // group) != scales.shape[0]:
            raise ModelLoadError(f"{m}: {scales.shape[0]} GPTQ scale groups for {in_f} inputs")
        g_idx = state.get(f"{m}.g_idx")
        yield f"{m}.weight", _from_unsigned(u, z.T.contiguous(), scales.T.contiguous(), bits, group, "gptq", g_idx)


def _gptq_group(in_f: int, groups: int, scheme: Scheme) -> int:
    """Inputs per group of a GPTQ layer with ``groups`` rows of scales: the config's group size
    (-1: the whole row), unless the scales count other, whole groups (GPTQModel's per-module
    "dynamic" sizes): those."""
    group = in_f if scheme.group_size in (None, -1) else scheme.group_size
    if group and -(-in_f // group) != groups and groups and in_f % groups == 0:
        return in_f // groups
    return group


def _ct_group(in_f: int, groups: int, scheme: Scheme) -> int:
    """Inputs per group of a compressed-tensors layer with ``groups`` scales a row: the whole
    row for one, else the config's group size, else what the scales imply."""
    return in_f if groups == 1 else (scheme.group_size or in_f // groups)


def _compressed_tensors(state: dict, scheme: Scheme):
    for m in _modules(state, "weight_scale"):
        scale = state[f"{m}.weight_scale"]
        weight = state.get(f"{m}.weight")
        packed = state.get(f"{m}.weight_packed")
        zp = state.get(f"{m}.weight_zero_point")
        g_idx = state.get(f"{m}.weight_g_idx")
        source = "compressed-tensors"
        if packed is not None:
            shape = state.get(f"{m}.weight_shape")
            if shape is None:
                raise ModelLoadError(f"quantized checkpoint is missing tensor {m + '.weight_shape'!r}")
            out_f, in_f = (int(v) for v in shape.tolist())
            bits = packed.shape[1] * 32 // in_f if in_f else 0
            if bits not in (4, 8) or packed.shape[1] * 32 != in_f * bits:
                raise ModelLoadError(f"{m}: pack-quantized weights of {in_f} inputs in {packed.shape[1]} words: "
                                     "only 4- and 8-bit fields of whole words are supported")
            u = _fields(packed, bits)[:, :in_f]
            if zp is not None and zp.dtype == torch.int32 and zp.shape[0] != out_f:  # packed along the outputs
                zp = _fields(zp.T.contiguous(), bits)[:, :out_f].T - (1 << (bits - 1))
        elif weight is not None and weight.dtype == torch.int8:  # int-quantized: values of the config's bits
            out_f, in_f = weight.shape
            bits = scheme.only(scheme.bits & {4, 8}) or 8
            u = weight.to(torch.int32) + (1 << (bits - 1))
        elif weight is not None and weight.dtype == torch.float8_e4m3fn:
            out_f, in_f = weight.shape
            block = scheme.block if scale.dim() == 2 and scale.numel() > 1 and scale.shape != (out_f, 1) else None
            qw = _fp8(weight, scale, block, source)
            yield f"{m}.weight", qw if qw is not None else _fp8_float(weight, scale, block)
            continue
        else:
            continue  # a scale beside a float weight (e.g. an unquantized layer's leftovers): float
        scale = _per_group(scale, out_f, m)
        half = 1 << (bits - 1)
        z = torch.full(scale.shape, half, dtype=torch.int32) if zp is None else _per_group(zp, out_f, m).round().int() + half
        group = _ct_group(in_f, scale.shape[1], scheme)
        if -(-in_f // group) != scale.shape[1]:
            raise ModelLoadError(f"{m}: {scale.shape[1]} scale groups for {in_f} inputs in groups of {group}")
        yield f"{m}.weight", _from_unsigned(u, z, scale, bits, group, source, g_idx)


def _per_group(t: torch.Tensor, out_f: int, m: str) -> torch.Tensor:
    """A per-tensor, per-row or per-group parameter as [out, groups]."""
    t = t.float()
    if t.numel() == 1:
        return t.reshape(1, 1).expand(out_f, 1).contiguous()
    if t.dim() == 1:
        t = t[:, None]
    if t.shape[0] != out_f:
        raise ModelLoadError(f"{m}: a parameter of shape {tuple(t.shape)} for {out_f} outputs")
    return t


def _fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
         source: str) -> QuantizedWeight | None:
    """An e4m3 weight with a per-tensor, per-row or (block) per-block scale; None for blocks
    whose inputs end in a partial block (``_fp8_float``)."""
    out_f, in_f = weight.shape
    if block is not None:
        bn, bk = block
        rows, cols = -(-out_f // bn), -(-in_f // bk)
        if tuple(scale.shape) != (rows, cols):
            raise ModelLoadError(f"{source}: scales of shape {tuple(scale.shape)} for a {out_f} x {in_f} weight "
                                 f"in blocks of {bn} x {bk}")
        if in_f % bk:
            return None
        s = scale.float().repeat_interleave(bn, dim=0)[:out_f]
        return QuantizedWeight(weight, s, torch.zeros_like(s), 8, bk, source)
    s = _per_group(scale, out_f, source)
    if in_f % s.shape[1]:
        raise ModelLoadError(f"{source}: {s.shape[1]} fp8 scale groups for {in_f} inputs")
    return QuantizedWeight(weight, s, torch.zeros_like(s), 8, in_f // s.shape[1], source)


def _fp8_blocks(state: dict, scheme: Scheme):
    for m in _modules(state, "weight_scale_inv" if scheme.block else "weight_scale"):
        weight = _need(state, f"{m}.weight")
        scale = state[f"{m}.weight_scale_inv" if scheme.block else f"{m}.weight_scale"]
        if weight.dtype != torch.float8_e4m3fn:
            raise ModelLoadError(f"{m}.weight: fp8 checkpoint weights must be float8_e4m3fn, found {weight.dtype}")
        qw = _fp8(weight, scale, scheme.block, "fp8")
        yield f"{m}.weight", qw if qw is not None else _fp8_float(weight, scale, scheme.block)


def _fp8_float(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-scaled fp8 weight whose inputs end in a partial block, dequantized (float32):
    the kernels' groups are whole."""
    bn, bk = block
    s = scale.float().repeat_interleave(bn, 0)[: weight.shape[0]].repeat_interleave(bk, 1)[:, : weight.shape[1]]
    return weight.float() * s


def dequantized(state: dict, dtype: torch.dtype) -> dict:
    """Every ``QuantizedWeight`` of ``state`` as a float tensor in ``dtype`` (quantize="none")."""
    return {k: v.dequantize().to(dtype) if isinstance(v, QuantizedWeight) else v for k, v in state.items()}


def resolve(quantize: str | None, scheme: Scheme, state: dict, device) -> str:
    """``quantize`` as asked, or for None (auto) the checkpoint's own weights, named
    "<method> checkpoint" (``LoadedModel.quantize``); "none" on the CPU for a checkpoint of fp8
    weights only, which the CPU has no kernel for (dequantized once at load, not every forward)."""
    if quantize is not None:
        return quantize
    weights = [v for v in state.values() if isinstance(v, QuantizedWeight)]
    if torch.device(device).type == "cpu" and weights and all(w.fp8 for w in weights):
        return "none"
    return f"{scheme.method} checkpoint"


def describe_formats(path: Path, scheme: Scheme) -> dict[str, tuple[str, str]]:
    """{``<module>.weight``: (stored, runs as, [out, in])} of a quantized checkpoint's linear
    maps, from the tensors' shapes (and the small g_idx / weight_shape tensors) without
    unpacking any weight: what ``mtplx inspect`` shows."""
    from safetensors import safe_open

    meta, small = {}, {}
    for file in sorted(Path(path).glob("*.safetensors")):
        if file.name == "mtp.safetensors":
            continue
        with safe_open(file, framework="pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                meta[k] = (tuple(s.get_shape()), str(s.get_dtype()).lower())
                if k.endswith((".g_idx", ".weight_g_idx", ".weight_shape")):
                    small[k] = f.get_tensor(k)
    out = {}
    cpu_fp8 = "float (no fp8 kernel on the CPU: dequantized at load); fp8 kernels on CUDA"

    def runs(bits, group, g_idx, in_f):
        if in_f % group or (g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_f) // group)):
            return "float (activation-order or partial groups: dequantized at load)"
        return f"int{bits} g{group} (its own integers)"

    for k, (shape, _) in meta.items():
        m, _, suffix = k.rpartition(".")
        if scheme.method in ("awq", "gptq") and suffix == "qweight":
            if f"{m}.scales" not in meta or f"{m}.qzeros" not in meta:
                continue  # loading names the missing tensor
            scales, qzeros = meta[f"{m}.scales"][0], meta[f"{m}.qzeros"][0]
            out_f = scales[1]
            if scheme.method == "awq":
                bits, in_f, group = 4, shape[0], shape[0] // max(scales[0], 1)
            else:
                bits = next((b for b in (4, 8) if -(-out_f * b // 32) == qzeros[1]), 0)
                in_f = shape[0] * 32 // bits if bits else 0
                group = _gptq_group(in_f, scales[0], scheme)
            out[f"{m}.weight"] = (f"{scheme.method} int{bits} g{group}", runs(bits, group, small.get(f"{m}.g_idx"), in_f),
                                  (out_f, in_f))
        elif scheme.method == "compressed-tensors" and suffix == "weight_scale":
            scale = shape
            if f"{m}.weight_packed" in meta and f"{m}.weight_shape" in small:
                out_f, in_f = (int(v) for v in small[f"{m}.weight_shape"].tolist())
                bits = meta[f"{m}.weight_packed"][0][1] * 32 // max(in_f, 1)
            elif f"{m}.weight" in meta and meta[f"{m}.weight"][1] in ("int8", "i8"):
                (out_f, in_f), bits = meta[f"{m}.weight"][0], scheme.only(scheme.bits & {4, 8}) or 8
            elif f"{m}.weight" in meta and "f8" in meta[f"{m}.weight"][1]:
                out[f"{m}.weight"] = ("compressed-tensors fp8 e4m3", cpu_fp8, meta[f"{m}.weight"][0])
                continue
            else:
                continue
            group = _ct_group(in_f, scale[1] if len(scale) == 2 else 1, scheme)
            out[f"{m}.weight"] = (f"compressed-tensors int{bits} g{group}",
                                  runs(bits, group, small.get(f"{m}.weight_g_idx"), in_f), (out_f, in_f))
        elif scheme.method == "fp8" and suffix == ("weight_scale_inv" if scheme.block else "weight_scale") \
                and f"{m}.weight" in meta:
            stored = f"fp8 e4m3, {scheme.block[0]} x {scheme.block[1]} blocks" if scheme.block else "fp8 e4m3"
            out[f"{m}.weight"] = (stored, cpu_fp8, meta[f"{m}.weight"][0])
    return out
