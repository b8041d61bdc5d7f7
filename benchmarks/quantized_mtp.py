"""The default model from its own GGUF blocks (``quantize="gguf"``) against the same file's
weights dequantized (``quantize="none"``) on one device: greedy output equality over the held-out
chat prompts, then wall-clock decode tok/s (after the first token) of AR and MTP, greedy and at
temperature 0.7 (top-p 0.95), both engines' configurations alternating round by round.

On CUDA the GGUF's Q4_1 projections run kernels/quant_mma.py's tensor-core GEMV (its 4-row
verify costs about what a 1-row step does) and the Q8_0 output matrix kernels/quant_gemv.py's
CUDA-core one; on the CPU kernels/cpu.py's.

    PYTHONPATH=. python3 benchmarks/quantized_mtp.py --model model.gguf \
        --head mtplx/assets/heads/SmolLM2-135M-Instruct --device cuda --out r.json
"""

from __future__ import annotations

import argparse
import json
import time

import mtplx
from mtplx.forge.prompts import HELD_OUT_PROMPTS

CONFIGS = (("ar", 1), ("mtp", 1), ("mtp", 3), ("mtp", "auto"))


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def greedy(engine, prompts, tokens: int) -> list[list[int]]:
    return [engine.generate(chat(p), chat=True, mode="ar", max_tokens=tokens, temperature=0, ignore_eos=True).token_ids
            for p in prompts]


def quality(outputs: list[list[int]], reference: list[list[int]], tokens: int) -> dict:
    """Per prompt, where two engines' greedy tokens first differ, and how many agree for all
    ``tokens``."""
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                  for a, b in zip(outputs, reference)]
    return {"tokens": tokens, "prompts": len(first_diff), "identical": sum(d >= tokens for d in first_diff),
            "first_difference": first_diff}


def speed(engines: dict, prompts, tokens: int, rounds: int, temperature: float) -> dict:
    """tok/s after the first token per (engine, config), summed over prompts and rounds; the
    configurations alternate within each round."""
    totals = {(name, mode, depth): [0, 0.0, 0.0, 0] for name in engines for mode, depth in CONFIGS}
    for r in range(rounds):
        for p in prompts:
            for name, engine in engines.items():
                for mode, depth in CONFIGS:
                    res = engine.generate(chat(p), chat=True, mode=mode, depth=depth, max_tokens=tokens,
                                          temperature=temperature, top_p=0.95 if temperature else 1.0,
                                          ignore_eos=True, seed=1000 * r + len(p))
                    t = totals[(name, mode, depth)]
                    t[0] += res.stats["generated_tokens"] - 1
                    t[1] += res.stats["decode_s"]
                    t[2] += res.stats.get("mean_acceptance_length") or 0.0
                    t[3] += 1
    out = {}
    for (name, mode, depth), (n, s, acc, count) in totals.items():
        label = f"{name} {mode}" + (f" d{depth}" if mode == "mtp" else "")
        out[label] = {"tok_s": n / s, "mean_acceptance_length": acc / count if mode == "mtp" else None}
    for name in engines:
        ar = out[f"{name} ar"]["tok_s"]
        for mode, depth in CONFIGS[1:]:
            out[f"{name} {mode} d{depth}"]["x_own_ar"] = out[f"{name} {mode} d{depth}"]["tok_s"] / ar
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    ap.add_argument("--head", default=None, help="the MTP head's directory (default: beside the model)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--quality-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="timed passes over the prompts (0: quality only)")
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts timed (quality uses all)")
    ap.add_argument("--float32-reference", action="store_true",
                    help="also compare both engines' greedy tokens with the dequantized weights in float32")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.perf_counter()
    engines = {name: mtplx.load(args.model, device=args.device, dtype=args.dtype, quantize=q, head=args.head)
               for name, q in (("gguf", "gguf"), ("dequantized", "none"))}
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": args.device, "load_s": time.perf_counter() - t0,
              "quantize": {name: e.loaded.quantize for name, e in engines.items()}}
    for name, engine in engines.items():  # warm: graphs, kernels
        engine.generate(chat("Hello"), chat=True, mode="mtp", depth=3, max_tokens=8, temperature=0)
        engine.generate(chat("Hello"), chat=True, mode="ar", max_tokens=8, temperature=0.7, seed=1)
    tokens = {name: greedy(e, HELD_OUT_PROMPTS, args.quality_tokens) for name, e in engines.items()}
    report["quality"] = quality(tokens["gguf"], tokens["dequantized"], args.quality_tokens)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print("quality, gguf vs dequantized", json.dumps(report["quality"]), flush=True)
    if args.float32_reference:  # what each engine's rounding costs against float32 (activations and weights)
        ref = mtplx.load(args.model, device=args.device, dtype="float32", quantize="none", head=args.head)
        tokens["float32"] = greedy(ref, HELD_OUT_PROMPTS, args.quality_tokens)
        del ref
        for name in engines:
            report[f"quality_{name}_vs_float32"] = quality(tokens[name], tokens["float32"], args.quality_tokens)
            print(f"quality, {name} vs float32", json.dumps(report[f"quality_{name}_vs_float32"]), flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if args.rounds:
        speeds(engines, HELD_OUT_PROMPTS[: args.prompts], args.tokens, args.rounds, report, args.out)


def speeds(engines: dict, prompts, tokens: int, rounds: int, report: dict, out: str) -> None:
    """``speed`` greedy and at T 0.7 into ``report`` ("T0.0", "T0.7"), printed and written to
    ``out`` after each."""
    for temperature in (0.0, 0.7):
        key = f"T{temperature}"
        report[key] = speed(engines, prompts, tokens, rounds, temperature)
        for label, v in report[key].items():
            print(key, label, json.dumps({k: round(x, 3) if isinstance(x, float) else x for k, x in v.items()}),
                  flush=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
