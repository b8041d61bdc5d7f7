"""Checkpoints quantized by other tools (loading/prequantized.py).

compressed-tensors checkpoints are written by compressed-tensors itself (its quantization
parameters, its packing, its config) and decompressed by it for the reference weights; the
logits reference is transformers over those weights. AWQ and GPTQ checkpoints are packed here
after the published layouts (AutoAWQ's GEMM writer ``WQLinear_GEMM.from_linear``, AutoGPTQ /
GPTQModel's ``pack``): each stored word is built field by field with Python integers, so a
wrong order of outputs or inputs in a word, a wrong zero convention or a transposed tensor shows
as a wrong weight. Block-scaled fp8 (``quant_method: fp8``) is checked against transformers'
own dequantization of the same file.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mtplx
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.sequence import Sequence
from mtplx.errors import InvalidParameter, ModelLoadError
from mtplx.loading import hf_dir, prequantized
from mtplx.loading.checkpoint import load_checkpoint
from mtplx.models.quant import QuantizedWeight, weight_formats
from tests.tiny_models import hf_reference

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _logits(engine, ids: list[int]) -> torch.Tensor:
    runner = engine.runner
    seq = Sequence(prompt_ids=ids, params=SamplingParams(), max_tokens=1)
    runner.blocks.allocate(seq.seq_id, seq.prompt_ids)
    with torch.inference_mode():
        return runner.logits(runner.trunk([seq], [ids], [0]))[0]


def _reference_logits(hf, dense: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """transformers' logits with these (dequantized) weights in place of the float ones."""
    with torch.no_grad():
        for name, w in dense.items():
            hf.get_submodule(name.removesuffix(".weight")).weight.copy_(w)
        return hf(torch.tensor([ids])).logits[0]


def _check_model(tmp_path, hf, dense: dict[str, torch.Tensor], source: str, vocab: int):
    """Load the checkpoint at tmp_path through mtplx.load: every trunk projection is a quantized
    layer from the checkpoint's integers whose weight is ``dense``'s (within the CPU kernel's
    float16 scales and offsets), and the logits are transformers' over ``dense``."""
    ids = torch.randint(0, vocab, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        float_logits = hf(torch.tensor([ids])).logits[0]
    ref = _reference_logits(hf, dense, ids)
    engine = mtplx.load(tmp_path, device="cpu")
    model = engine.loaded.model
    assert engine.loaded.quantize.endswith("checkpoint")
    formats = weight_formats(model)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        assert source in formats[p + "self_attn.qkv_proj"] and source in formats[p + "mlp.down_proj"]
        pairs = ((layer.self_attn.qkv_proj, torch.cat([dense[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])),
                 (layer.self_attn.o_proj, dense[p + "self_attn.o_proj.weight"]),
                 (layer.mlp.gate_up_proj, torch.cat([dense[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")])),
                 (layer.mlp.down_proj, dense[p + "mlp.down_proj.weight"]))
        for module, w in pairs:
            # the kernel's float16 offsets: within half a float16 step of the largest one
            torch.testing.assert_close(module.dequantize(), w, rtol=0, atol=2e-3 * float(w.abs().max()))
    ours = _logits(engine, ids)
    # the quantized model's logits, far closer to them than the float model's are
    assert (ours - ref).abs().max() < 0.05 * (float_logits - ref).abs().max()
    return engine


# --- compressed-tensors, written and decompressed by the library -----------------------------

CT_CASES = [
    # (format, bits, type, symmetric, strategy, group_size)
    ("pack-quantized", 4, "int", False, "group", 32),
    ("pack-quantized", 4, "int", True, "group", 64),
    ("pack-quantized", 8, "int", True, "channel", None),
    ("pack-quantized", 8, "int", False, "group", 32),
    ("int-quantized", 8, "int", True, "channel", None),
    ("int-quantized", 4, "int", True, "group", 32),  # int8 storage of 4-bit values (what W4A8 writes)
    ("float-quantized", 8, "float", True, "channel", None),
]


def compress_with_compressed_tensors(hf, out, fmt: str, bits: int, kind: str, symmetric: bool, strategy: str,
                                     group: int | None):
    """Quantize transformers model ``hf``'s linear maps (not lm_head) with compressed-tensors,
    round-to-nearest from each group's (row's) min / max by its ``calculate_qparams``, scales
    held at float16 precision, and save it compressed in ``fmt`` to ``out``. Returns the scheme.
    (benchmarks/prequantized_cpu.py writes its checkpoints with this too.)"""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=bits, type=kind, symmetric=symmetric, strategy=strategy, group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                     quantization_status=QuantizationStatus.FROZEN))
    for module in hf.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.detach()
            g = w.reshape(w.shape[0], -1, group) if group else w.unsqueeze(1)
            scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
            module.weight_scale.data = scale.half().float().reshape(module.weight_scale.shape)  # float16 scales
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                    module.weight_zero_point.shape)
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format=fmt)
    compressor.compress_model(hf)
    hf.save_pretrained(out)
    compressor.update_config(out)
    return scheme


def _compressed_tensors_dir(tmp_path, fmt, bits, kind, symmetric, strategy, group):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor

    hf, cfg = hf_reference("llama")
    float_state = {k: v.clone() for k, v in hf.state_dict().items()}
    scheme = compress_with_compressed_tensors(hf, tmp_path, fmt, bits, kind, symmetric, strategy, group)
    # the reference weights: the library's own decompression of the stored tensors
    stored = load_file(str(tmp_path / "model.safetensors"))
    qc = BaseCompressor.get_value_from_registry(fmt)
    dense = {}
    for i in range(cfg["num_hidden_layers"]):
        for name in LINEARS:
            prefix = f"model.layers.{i}.{name}."
            local = {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)}
            dense[prefix + "weight"] = qc.decompress(local, scheme)["weight"].float()
    reference, _ = hf_reference("llama")
    reference.load_state_dict(float_state)
    return reference, cfg, dense


@pytest.mark.parametrize("fmt,bits,kind,symmetric,strategy,group", CT_CASES)
def test_compressed_tensors_checkpoint_runs_its_own_integers(tmp_path, fmt, bits, kind, symmetric, strategy, group):
    hf, cfg, dense = _compressed_tensors_dir(tmp_path, fmt, bits, kind, symmetric, strategy, group)
    # the portable form holds exactly the library's weights (float32 rounding apart)
    scheme = prequantized.scheme_of(hf_dir.read_hf_config(tmp_path), tmp_path)
    state = prequantized.unpack_state(hf_dir.load_safetensors_state_dict(tmp_path), scheme, torch.float32)
    for name, w in dense.items():
        qw = state[name]
        assert isinstance(qw, QuantizedWeight) and qw.kind == ("fp8" if kind == "float" else f"int{bits}")
        assert qw.group_size == (group or w.shape[1])
        torch.testing.assert_close(qw.dequantize(), w, rtol=1e-6, atol=1e-7)
    if kind == "float":  # no fp8 kernel on the CPU: dequantized once at load, the same weights
        engine = mtplx.load(tmp_path, device="cpu")
        assert engine.loaded.quantize is None
        layer = engine.loaded.model.model.layers[0]
        torch.testing.assert_close(layer.self_attn.o_proj.weight, dense["model.layers.0.self_attn.o_proj.weight"])
        return
    _check_model(tmp_path, hf, dense, "compressed-tensors", cfg["vocab_size"])


# --- AWQ and GPTQ, packed after their published layouts --------------------------------------

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: field i of a word holds output 8 c + AWQ_ORDER[i]


def _word(fields: list[int], bits: int) -> int:
    """One int32 from unsigned fields, the first in the lowest bits."""
    v = sum(f << (bits * i) for i, f in enumerate(fields))
    return v - (1 << 32) if v >= 1 << 31 else v


def _asymmetric(w: torch.Tensor, bits: int, group: int):
    """(u [out, in], z [out, groups], s [out, groups] float16-held) by min/max rounding."""
    g = w.reshape(w.shape[0], -1, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    maxq = (1 << bits) - 1
    s = ((hi - lo) / maxq).half().float()
    z = torch.round(-lo / s).clamp(0, maxq)
    u = torch.clamp(torch.round(g / s[..., None]) + z[..., None], 0, maxq).reshape(w.shape)
    return u.int(), z.int(), s


def _awq_tensors(w: torch.Tensor, group: int):
    u, z, s = _asymmetric(w, 4, group)
    out_f, in_f = w.shape

    def pack(x):  # x [rows, out] -> [rows, out / 8]
        return torch.tensor([[_word([int(x[r, 8 * c + AWQ_ORDER[i]]) for i in range(8)], 4)
                              for c in range(out_f // 8)] for r in range(x.shape[0])], dtype=torch.int32)

    tensors = {"qweight": pack(u.T), "qzeros": pack(z.T), "scales": s.T.half().contiguous()}
    dense = ((u - z.repeat_interleave(group, 1)) * s.repeat_interleave(group, 1)).float()
    return tensors, dense


def _gptq_tensors(w: torch.Tensor, bits: int, group: int, symmetric: bool, v1: bool, perm: torch.Tensor | None):
    out_f, in_f = w.shape
    per = 32 // bits
    g_idx = torch.arange(in_f) // group
    if perm is not None:  # activation order: groups of the inputs taken in perm's order
        g_idx = torch.empty(in_f, dtype=torch.long)
        g_idx[perm] = torch.arange(in_f) // group
    grouped = torch.stack([w[:, g_idx == j] for j in range(in_f // group)], dim=1)  # [out, groups, group]
    if symmetric:
        s = (grouped.abs().amax(-1) / ((1 << (bits - 1)) - 0.5)).half().float()
        z = torch.full_like(s, 1 << (bits - 1)).int()
    else:
        _, z, s = _asymmetric(grouped.reshape(out_f, -1), bits, group)
    sk, zk = s[:, g_idx], z[:, g_idx]  # [out, in]
    u = torch.clamp(torch.round(w / sk) + zk, 0, (1 << bits) - 1).int()
    stored_z = z - 1 if v1 else z
    qweight = torch.tensor([[_word([int(u[n, per * r + j]) for j in range(per)], bits) for n in range(out_f)]
                            for r in range(in_f // per)], dtype=torch.int32)
    qzeros = torch.tensor([[_word([int(stored_z[n, g]) for n in range(per * c, per * c + per)], bits)
                            for c in range(out_f // per)] for g in range(z.shape[1])], dtype=torch.int32)
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": s.T.half().contiguous(), "g_idx": g_idx.int()}
    return tensors, ((u - zk) * sk).float()


def _write(tmp_path, hf, cfg, quantization_config, tensors_for):
    """hf's weights with each trunk projection replaced by ``tensors_for(weight)``'s packed
    tensors (float16 elsewhere, as such checkpoints ship); returns {name: dense weight}."""
    state, dense = {}, {}
    for name, t in hf.state_dict().items():
        module = name.removesuffix(".weight")
        if name.endswith("_proj.weight") and ".layers." in name:
            packed, dense[name] = tensors_for(t)
            state.update({f"{module}.{k}": v for k, v in packed.items()})
        else:
            state[name] = t.half()
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization_config},
                                                     default=str))
    with torch.no_grad():  # the float16 norms and embeddings the checkpoint holds
        for name, p in hf.named_parameters():
            if name not in dense:
                p.copy_(p.half().float())
    return dense


@pytest.mark.parametrize("group", [32, 64])
def test_awq_checkpoint_runs_its_own_integers(tmp_path, group):
    hf, cfg = hf_reference("llama")
    dense = _write(tmp_path, hf, cfg, {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                                       "zero_point": True}, lambda w: _awq_tensors(w, group))
    engine = _check_model(tmp_path, hf, dense, "awq", cfg["vocab_size"])
    assert weight_formats(engine.loaded.model)["model.layers.1.mlp.down_proj"] == f"int4 g{group} (awq)"


GPTQ_CASES = [  # (bits, group, symmetric, checkpoint format v1)
    (4, 32, True, True),
    (4, 64, False, True),
    (8, 32, True, True),
    (4, 32, False, False),
    (8, -1, False, False),
]


@pytest.mark.parametrize("bits,group,symmetric,v1", GPTQ_CASES)
def test_gptq_checkpoint_runs_its_own_integers(tmp_path, bits, group, symmetric, v1):
    hf, cfg = hf_reference("llama")
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": symmetric,
          "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    dense = _write(tmp_path, hf, cfg, qc,
                   lambda w: _gptq_tensors(w, bits, w.shape[1] if group == -1 else group, symmetric, v1, None))
    engine = _check_model(tmp_path, hf, dense, "gptq", cfg["vocab_size"])
    o = engine.loaded.model.model.layers[0].self_attn.o_proj
    assert o.bits == bits and o.group_size == (cfg["hidden_size"] if group == -1 else group)


def test_gptq_dynamic_per_module_bits_and_groups(tmp_path):
    """GPTQModel's "dynamic" overrides: here the down projections in 8 bits with groups of 64
    beside 4-bit groups of 32; each module's bits and groups are read from its own tensors."""
    hf, cfg = hf_reference("llama")
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
          "dynamic": {"+:.*down_proj": {"bits": 8, "group_size": 64}}}

    def tensors(w):
        down = w.shape[1] == cfg["intermediate_size"]
        return _gptq_tensors(w, 8 if down else 4, 64 if down else 32, True, True, None)

    dense = _write(tmp_path, hf, cfg, qc, tensors)
    engine = _check_model(tmp_path, hf, dense, "gptq", cfg["vocab_size"])
    formats = weight_formats(engine.loaded.model)
    assert formats["model.layers.0.mlp.down_proj"] == "int8 g64 (gptq)"
    assert formats["model.layers.0.self_attn.o_proj"] == "int4 g32 (gptq)"
    from mtplx.loading.describe import describe

    stored = {r["stored"] for r in describe(tmp_path)["weights"] if "layers" in r["names"]}
    assert stored == {"gptq int4 g32", "gptq int8 g64"}


def test_gptq_activation_order_is_dequantized_exactly(tmp_path):
    """desc_act: a layer's groups are scattered over its inputs, which the kernels cannot take:
    those weights load as float, equal to the checkpoint's dequantized weights."""
    hf, cfg = hf_reference("llama")
    perm = torch.randperm(cfg["hidden_size"], generator=torch.Generator().manual_seed(0))

    def tensors(w):
        return _gptq_tensors(w, 4, 32, True, True, perm if w.shape[1] == cfg["hidden_size"] else None)

    dense = _write(tmp_path, hf, cfg, {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                                       "sym": True}, tensors)
    engine = mtplx.load(tmp_path, device="cpu")
    layer = engine.loaded.model.model.layers[0]
    torch.testing.assert_close(layer.self_attn.o_proj.weight, dense["model.layers.0.self_attn.o_proj.weight"],
                               rtol=0, atol=0)
    formats = weight_formats(engine.loaded.model)
    assert formats["model.layers.0.self_attn.o_proj"] == "float32"
    assert formats["model.layers.0.mlp.down_proj"] == "int4 g32 (gptq)"  # its inputs are in order


def test_fp8_block_checkpoint_matches_transformers_dequantization(tmp_path):
    """quant_method fp8 with weight_block_size (Qwen3's and DeepSeek-V3's fp8 releases):
    the per-block scales become per-row scales of 32-input groups; transformers dequantizes
    the same file as the reference."""
    transformers = pytest.importorskip("transformers")
    hf, cfg = hf_reference("llama")
    block = [32, 32]

    def tensors(w):
        out_f, in_f = w.shape
        blocks = w.reshape(out_f // 32, 32, in_f // 32, 32)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (blocks / scale[:, None, :, None]).reshape(out_f, in_f).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": scale}, None

    state = {}
    for name, t in hf.state_dict().items():
        if name.endswith("_proj.weight") and ".layers." in name:
            packed, _ = tensors(t)
            state.update({name.removesuffix("weight") + k: v for k, v in packed.items()})
        else:
            state[name] = t
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "weight_block_size": block}}, default=str))
    try:
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    except Exception as exc:  # pragma: no cover - transformers' fp8 path may want an accelerator
        pytest.skip(f"transformers cannot dequantize fp8 here: {exc}")
    loaded = load_checkpoint(tmp_path, device="cpu", dtype=torch.float32, quantize=None)
    assert loaded.quantize is None  # the CPU has no fp8 kernel: dequantized at load
    scheme = prequantized.scheme_of(hf_dir.read_hf_config(tmp_path), tmp_path)
    portable = prequantized.unpack_state(hf_dir.load_safetensors_state_dict(tmp_path), scheme, torch.float32)
    for i in range(cfg["num_hidden_layers"]):
        for name in LINEARS:
            key = f"model.layers.{i}.{name}.weight"
            want = ref.get_submodule(key.removesuffix(".weight")).weight.float()
            qw = portable[key]
            assert qw.fp8 and qw.group_size == 32
            torch.testing.assert_close(qw.dequantize(), want, rtol=0, atol=0)


# --- what is refused, and the other quantize choices ------------------------------------------

def _gptq_dir(tmp_path, **extra):
    hf, cfg = hf_reference("llama")
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True, **extra}
    dense = _write(tmp_path, hf, cfg, qc, lambda w: _gptq_tensors(w, 4, 32, True, True, None))
    return hf, cfg, dense


def test_quantize_none_dequantizes_and_int8_requantizes_a_gptq_checkpoint(tmp_path):
    _, _, dense = _gptq_dir(tmp_path)
    key = "model.layers.1.mlp.gate_proj.weight"
    plain = load_checkpoint(tmp_path, device="cpu", dtype=torch.float32, quantize="none")
    assert plain.quantize is None
    gate_up = plain.model.model.layers[1].mlp
    w = gate_up.gate_up_proj.weight if gate_up.gate_up_proj is not None else gate_up.gate_proj.weight
    torch.testing.assert_close(w[: dense[key].shape[0]], dense[key], rtol=0, atol=0)
    eight = mtplx.load(tmp_path, device="cpu", quantize="int8")
    assert weight_formats(eight.loaded.model)["model.layers.1.self_attn.o_proj"] == "int8 g32 (rtn)"


def test_a_gguf_quantize_choice_is_refused_for_a_prequantized_checkpoint(tmp_path):
    _gptq_dir(tmp_path)
    with pytest.raises(InvalidParameter, match="gptq checkpoint"):
        mtplx.load(tmp_path, device="cpu", quantize="gguf")


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4}}}}, "format nvfp4-pack-quantized"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two numbers"),
])
def test_unsupported_quantization_configs_are_refused_by_name(tmp_path, qc, message):
    hf, cfg = hf_reference("llama")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}, default=str))
    with pytest.raises(ModelLoadError, match=message):
        mtplx.load(tmp_path, device="cpu")


def test_missing_and_misshapen_packed_tensors_are_named(tmp_path):
    _gptq_dir(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.0.mlp.up_proj.qzeros"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.up_proj.qzeros"):
        mtplx.load(tmp_path, device="cpu")


def test_inspect_shows_each_layers_stored_format_and_the_weights_parameters(tmp_path):
    from mtplx.loading.describe import describe

    hf, cfg = hf_reference("llama")
    perm = torch.randperm(cfg["hidden_size"], generator=torch.Generator().manual_seed(0))
    _write(tmp_path, hf, cfg, {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True},
           lambda w: _gptq_tensors(w, 4, 32, True, True, perm if tuple(w.shape) == (64, 64) else None))
    info = describe(tmp_path)
    rows = {frozenset(r["names"].split(": ")[-1].split(",")): (r["stored"], r["runs_as"]) for r in info["weights"]}
    # q and o (64 x 64) in activation order; the others keep their groups in order
    assert rows[frozenset("qo")] == ("gptq int4 g32", "float (activation-order or partial groups: dequantized at load)")
    assert rows[frozenset(("gate", "up", "down", "k", "v"))] == ("gptq int4 g32", "int4 g32 (its own integers)")
    assert info["parameters"] == sum(p.numel() for p in hf.parameters())
    # a scheme mtplx cannot read: unsupported, saying why
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "hqq"}}))
    info = describe(tmp_path)
    assert info["tier"] == "unsupported" and "quant_method 'hqq' is not supported" in info["reason"]


def test_experts_and_other_non_projection_layers_load_dequantized():
    """Only the projections and the output matrix stay quantized (as a GGUF's blocks do): an
    MoE checkpoint's per-expert weights are stacked as float tensors on load, a router is float."""
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    tensors, dense = _gptq_tensors(w, 4, 32, True, True, None)
    state = {}
    for module in ("model.layers.0.mlp.experts.3.down_proj", "model.layers.0.mlp.gate",
                   "model.layers.0.mlp.shared_expert.down_proj"):
        state.update({f"{module}.{k}": v for k, v in tensors.items()})
    scheme = prequantized.Scheme("gptq", {4}, 32)
    out = prequantized.unpack_state(state, scheme, torch.float32)
    assert set(out) == {"model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.0.mlp.gate.weight",
                        "model.layers.0.mlp.shared_expert.down_proj.weight"}
    for key in ("model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.0.mlp.gate.weight"):
        torch.testing.assert_close(out[key], dense, rtol=0, atol=0)
    assert isinstance(out["model.layers.0.mlp.shared_expert.down_proj.weight"], QuantizedWeight)
    stacked = {f"model.layers.0.mlp.experts.{k}": v.unsqueeze(0).expand(4, *v.shape) for k, v in tensors.items()}
    with pytest.raises(ModelLoadError, match="stacked over experts"):
        prequantized.unpack_state(stacked, scheme, torch.float32)


@pytest.mark.parametrize("out_f", [96, 80, 16])
def test_compressed_tensors_fp8_blocks_take_the_configured_block(out_f):
    """strategy "block": a 32 x 32 block structure over weights whose outputs fill whole blocks
    (96), end in a partial one (80), or fit in one (16), against compressed-tensors' own
    quantize / dequantize of them."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

    in_f, bs = 64, (32, 32)
    args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=list(bs), symmetric=True)
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(out_f))
    rows, cols = -(-out_f // bs[0]), -(-in_f // bs[1])
    padded = torch.nn.functional.pad(w, (0, cols * bs[1] - in_f, 0, rows * bs[0] - out_f))
    scale = padded.reshape(rows, bs[0], cols, bs[1]).abs().amax((1, 3)) / 448.0
    q = quantize(w, scale, None, args, dtype=torch.float8_e4m3fn)
    ref = dequantize(q, scale, None, args).float()
    scheme = prequantized.Scheme("compressed-tensors", {8}, block=bs)
    key = "model.layers.0.mlp.down_proj"
    out = prequantized.unpack_state({f"{key}.weight": q, f"{key}.weight_scale": scale}, scheme,
                                    torch.float32)[f"{key}.weight"]
    assert isinstance(out, QuantizedWeight) and out.fp8
    torch.testing.assert_close(out.dequantize(), ref, rtol=0, atol=0)


def test_fp8_per_tensor_and_per_row_scales_without_blocks():
    """quant_method fp8 without weight_block_size (AutoFP8's layout): weight_scale per tensor or
    per output row."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)
    scheme = prequantized.scheme_of({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})
    for scale in (w.abs().max() / 448.0, w.abs().amax(1, keepdim=True) / 448.0):
        q = (w / scale).to(torch.float8_e4m3fn)
        key = "model.layers.0.self_attn.o_proj"
        state = {f"{key}.weight": q, f"{key}.weight_scale": scale, f"{key}.input_scale": torch.ones(())}
        out = prequantized.unpack_state(state, scheme, torch.float32)
        qw = out[f"{key}.weight"]
        assert set(out) == {f"{key}.weight"} and qw.fp8 and qw.group_size == 64
        torch.testing.assert_close(qw.dequantize(), q.float() * scale, rtol=0, atol=0)


def test_a_quantized_moe_checkpoint_loads_its_experts_dequantized(tmp_path):
    """Qwen3-Next stores one tensor per expert, stacked into float tensors on load: quantized
    experts are dequantized first; the attention and shared-expert projections stay quantized."""
    from tests.hybrid_models import hf_hybrid
    from tests.test_hybrid_loading import _per_expert

    hf, cfg = hf_hybrid("qwen3_next")
    state, dense = {}, {}
    for k, t in _per_expert(dict(hf.state_dict())).items():
        if k.endswith("_proj.weight") and ".layers." in k and t.shape[1] % 32 == 0 and t.shape[0] % 8 == 0:
            packed, dense[k] = _gptq_tensors(t, 4, 32, True, True, None)
            state.update({k.removesuffix("weight") + n: v for n, v in packed.items()})
        else:
            state[k] = t.contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg.pop("layer_types")
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "full_attention_interval": 4, "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}}))
    loaded = load_checkpoint(tmp_path, device="cpu", dtype=torch.float32)
    experts = loaded.model.get_submodule("model.layers.0.mlp.experts")
    gate = dense["model.layers.0.mlp.experts.1.gate_proj.weight"]
    torch.testing.assert_close(experts.gate_up_proj[1][: gate.shape[0]], gate, rtol=0, atol=0)
    formats = weight_formats(loaded.model)
    assert any(v == "int4 g32 (gptq)" for k, v in formats.items() if "shared_expert" in k)


def _fp8_block_tensors(w: torch.Tensor):
    out_f, in_f = w.shape
    blocks = w.reshape(out_f // 32, 32, in_f // 32, 32)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return {"weight": q.reshape(out_f, in_f), "weight_scale_inv": scale}, \
        (q.float() * scale[:, None, :, None]).reshape(out_f, in_f)


CUDA_CASES = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}, lambda w: _awq_tensors(w, 32)),
    "gptq4": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True},
              lambda w: _gptq_tensors(w, 4, 32, True, True, None)),
    "gptq8": ({"quant_method": "gptq", "bits": 8, "group_size": 32, "sym": False, "checkpoint_format": "gptq_v2"},
              lambda w: _gptq_tensors(w, 8, 32, False, False, None)),
    "fp8": ({"quant_method": "fp8", "weight_block_size": [32, 32]}, _fp8_block_tensors),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CUDA_CASES))
def test_quantized_checkpoints_run_their_integers_on_cuda(tmp_path, case, dtype):
    """The CUDA kernels (tensor-core int4, Triton int8 and fp8) over each checkpoint's own
    integers: the weights are the checkpoint's, the logits transformers' over them (float32:
    to float32 rounding; bf16: far closer than the float model's)."""
    qc, tensors = CUDA_CASES[case]
    hf, cfg = hf_reference("llama")
    dense = _write(tmp_path, hf, cfg, qc, tensors)
    ids = list(range(3, 15))
    with torch.no_grad():
        float_logits = hf(torch.tensor([ids])).logits[0]
    ref = _reference_logits(hf, dense, ids)
    engine = mtplx.load(tmp_path, device="cuda", dtype=dtype)
    layer = engine.loaded.model.model.layers[0]
    assert engine.loaded.quantize.endswith("checkpoint") and layer.self_attn.o_proj.backend in ("mma", "triton")
    torch.testing.assert_close(layer.self_attn.o_proj.dequantize().float().cpu(),
                               dense["model.layers.0.self_attn.o_proj.weight"], rtol=0, atol=1e-3)
    err = float((_logits(engine, ids).float().cpu() - ref).abs().max())
    # bf16: its activations' rounding (about 4e-3 here), far below a misread layout's error
    # (the 4-bit formats' own gap to the float model is ~0.1-0.3, the 8-bit ones' ~3e-3)
    assert err < (2e-3 if dtype == torch.float32 else max(0.1 * float((float_logits - ref).abs().max()), 0.02))
