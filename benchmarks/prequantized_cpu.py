"""A checkpoint quantized by another tool, run from its own integers (loading/prequantized.py),
against the same model as float32 and as its GGUF blocks, on the CPU.

compressed-tensors (the library llm-compressor writes GPTQ / AWQ-style W4A16 and W8A16
checkpoints with) writes the default model's float weights (its GGUF dequantized) as
round-to-nearest ``pack-quantized`` checkpoints: int4 in groups of 64 with zero points (the
usual W4A16 shape; SmolLM2's 576 inputs take no groups of 128) and int8 with a scale per row
(W8A16); the output matrix stays float, as such checkpoints ship. Then, through ``engine.generate``: greedy agreement with the float32
model over the held-out chat prompts, and decode tok/s (after the first token) of AR and MTP
(depth 1, the shipped head, attached unverified: the trunk's bytes differ from the GGUF it was
verified against), greedy and at T 0.7, the engines alternating. First, each checkpoint's
logits through mtplx against transformers' over compressed-tensors' own decompression of it.

    python benchmarks/prequantized_cpu.py --out r.json [--threads 2] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.test_prequantized

import mtplx  # noqa: E402
from mtplx.forge.prompts import HELD_OUT_PROMPTS  # noqa: E402
from quantized_mtp import greedy, quality, speeds  # noqa: E402
import quantized_mtp  # noqa: E402

SCHEMES = {  # name: (bits, symmetric, strategy, group_size)
    "ct_int4_g64": (4, False, "group", 64),  # 576 inputs: 128 does not divide them
    "ct_int8_row": (8, True, "channel", None),
}


def write_checkpoint(gguf: Path, out: Path, bits: int, symmetric: bool, strategy: str, group: int | None) -> None:
    """The GGUF's weights (dequantized, float32) quantized round-to-nearest by compressed-tensors
    and saved as a Hugging Face directory with the GGUF's tokenizer."""
    import transformers

    from mtplx.loading.gguf_file import load_gguf
    from mtplx.loading.tokenizer import Tokenizer
    from tests.test_prequantized import compress_with_compressed_tensors

    cfg, state, metadata = load_gguf(gguf, dtype=torch.float32, quantized=False)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"GGUF -> transformers: missing {missing}, unexpected {unexpected}")
    compress_with_compressed_tensors(hf, out, "pack-quantized", bits, "int", symmetric, strategy, group)
    Tokenizer.from_gguf(gguf, metadata).hf.save_pretrained(out)


def logit_check(gguf: Path, folder: Path, bits: int, symmetric: bool, strategy: str, group: int | None) -> dict:
    """mtplx's logits from the checkpoint against transformers' over compressed-tensors' own
    decompression of its stored tensors (40 token ids), beside the quantization's own effect
    (the float model's logits against those)."""
    import transformers
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    from mtplx.loading.gguf_file import load_gguf
    from tests.test_prequantized import _logits

    cfg, state, _ = load_gguf(gguf, dtype=torch.float32, quantized=False)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    hf.load_state_dict(state, strict=False)
    ids = list(range(100, 140))
    stored = load_file(str(folder / "model.safetensors"))
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group))
    codec = BaseCompressor.get_value_from_registry("pack-quantized")
    with torch.no_grad():
        float_logits = hf(torch.tensor([ids])).logits[0]
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                local = {k[len(name) + 1:]: v for k, v in stored.items() if k.startswith(name + ".")}
                module.weight.copy_(codec.decompress(local, scheme)["weight"].float())
        ref = hf(torch.tensor([ids])).logits[0]
    ours = _logits(mtplx.load(folder, device="cpu"), ids)
    return {"max_logit_diff_vs_decompressed": float((ours - ref).abs().max()),
            "max_logit_diff_float_vs_decompressed": float((float_logits - ref).abs().max()),
            "argmax_agreement": float((ours.argmax(-1) == ref.argmax(-1)).float().mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=None, help="where the checkpoints are written (default: a temporary folder)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--quality-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from mtplx.loading.default_model import default_head_dir, default_model_path
    from mtplx.models.quant import weight_formats

    gguf, head = default_model_path(), default_head_dir()
    work = Path(args.work or tempfile.mkdtemp(prefix="mtplx_prequantized_"))
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads, "schemes": {}}
    engines = {"float32": mtplx.load(gguf, device="cpu", quantize="none", head=head),
               "gguf": mtplx.load(gguf, device="cpu", head=head)}
    for name, (bits, symmetric, strategy, group) in SCHEMES.items():
        folder = work / name
        if not (folder / "config.json").is_file():
            write_checkpoint(gguf, folder, bits, symmetric, strategy, group)
        engines[name] = mtplx.load(folder, device="cpu", head=head, allow_unverified_head=True)
        formats = weight_formats(engines[name].loaded.model)
        report["schemes"][name] = {**logit_check(gguf, folder, bits, symmetric, strategy, group),
                                   "quantize": engines[name].loaded.quantize,
                                   "down_proj": formats["model.layers.0.mlp.down_proj"], "lm_head": formats["lm_head"],
                                   "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors"))}
        print(name, json.dumps(report["schemes"][name]), flush=True)
    for engine in engines.values():
        engine.generate(quantized_mtp.chat("Hello"), chat=True, mode="mtp", depth=1, max_tokens=8, temperature=0)
    tokens = {name: greedy(e, HELD_OUT_PROMPTS, args.quality_tokens) for name, e in engines.items()}
    for name in engines:
        if name != "float32":
            report[f"quality_{name}_vs_float32"] = quality(tokens[name], tokens["float32"], args.quality_tokens)
            print(f"quality, {name} vs float32", json.dumps(report[f"quality_{name}_vs_float32"]), flush=True)
    quantized_mtp.CONFIGS = (("ar", 1), ("mtp", 1))
    speeds(engines, HELD_OUT_PROMPTS[: args.prompts], args.tokens, args.rounds, report, args.out)


if __name__ == "__main__":
    main()
