"""The CPU decode path with and without kernels/cpu.py's C++ kernels, side by side.

Each configuration runs in its own process (the kernels are chosen once per process), all of
them alternating ``--rounds`` times so that machine noise hits each alike: the default model from
its GGUF's own blocks (``quantize="gguf"``), AR and MTP depth 1, greedy (and with ``--sampled``
also temperature 0.7, top-p 0.95, seed 1), chat prompts not used for tuning, decode tok/s after
the first token. "pytorch" is ``MTPLX_CPU_KERNELS=0``: PyTorch's packed int4 kernel (bf16
activations) and PyTorch's ops for norms, RoPE, attention and SiLU. "avx2" is
``MTPLX_CPU_VECTOR_WIDTH=256`` (the AVX2 products on an AVX-512 CPU); "float32" is
``MTPLX_CPU_ACTIVATIONS=float32`` (float activations where int16 is the default). ``--baseline-tree DIR``
adds "baseline": the same runs with the ``mtplx`` package of another checkout (an earlier
commit's worktree), its kernels built apart.

    python benchmarks/cpu_kernels_ab.py [--threads 1] [--rounds 3] [--tokens 96] [--sampled]
        [--configs kernels,pytorch,avx2,float32] [--baseline-tree DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from trees import add_arguments, rounds, with_baseline  # noqa: E402

PROMPTS = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "How does a hash map handle collisions? Explain with an example.")


def one_run(threads: int, tokens: int, sampled: bool) -> dict:
    import torch

    import mtplx

    torch.set_num_threads(threads)
    engine = mtplx.load(device="cpu", quantize="gguf")
    regimes = {"": dict(temperature=0)}
    if sampled:
        regimes["_t0.7"] = dict(temperature=0.7, top_p=0.95, seed=1)
    out = {mode + name: [] for name in regimes for mode in ("ar", "mtp")}
    for prompt in PROMPTS:
        for key in out:
            mode, _, name = key.partition("_")
            r = engine.generate([{"role": "user", "content": prompt}], chat=True, mode=mode, depth=1,
                                max_tokens=tokens, ignore_eos=True, **regimes["_" + name if name else ""])
            out[key].append(r.stats["decode_tok_s"])
    return out


CONFIG_ENV = {"kernels": {"MTPLX_CPU_KERNELS": "1"}, "pytorch": {"MTPLX_CPU_KERNELS": "0"},
              "avx2": {"MTPLX_CPU_KERNELS": "1", "MTPLX_CPU_VECTOR_WIDTH": "256"},
              "float32": {"MTPLX_CPU_KERNELS": "1", "MTPLX_CPU_ACTIVATIONS": "float32"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--sampled", action="store_true", help="also temperature 0.7, top-p 0.95")
    ap.add_argument("--configs", default="kernels,pytorch", help="of: kernels, pytorch, avx2, float32")
    add_arguments(ap)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(args.threads, args.tokens, args.sampled)))
        return
    envs = with_baseline({name: {**os.environ, **CONFIG_ENV[name]} for name in args.configs.split(",")},
                         args.baseline_tree)
    runs = {name: {} for name in envs}
    argv = ["--threads", str(args.threads), "--tokens", str(args.tokens)] + (["--sampled"] if args.sampled else [])
    for name, res in rounds(__file__, argv, envs, args.rounds):
        for mode, values in res.items():
            runs[name].setdefault(mode, []).extend(values)
    summary = {name: {mode: round(statistics.mean(v), 2) for mode, v in modes.items()} for name, modes in runs.items()}
    first = next(iter(summary))
    ratios = {f"{name}_x_{first}": {mode: round(v / summary[first][mode], 3) for mode, v in modes.items()}
              for name, modes in summary.items() if name != first}
    report = {"date": datetime.date.today().isoformat(), "threads": args.threads, "tokens": args.tokens,
              "rounds": args.rounds, "prompts": list(PROMPTS), "configs": list(envs),
              "baseline_tree": args.baseline_tree, "runs": runs, "mean_tok_s": summary, "ratios": ratios,
              "mtp_x_ar": {name: {key: round(modes[key] / modes[key.replace("mtp", "ar")], 3)
                                  for key in modes if key.startswith("mtp")} for name, modes in summary.items()},
              "load_average_end": list(os.getloadavg())}
    for name, modes in summary.items():
        print(f"{name:8s} " + "   ".join(f"{mode} {v:6.1f}" for mode, v in modes.items()) + "  tok/s")
    for name, modes in ratios.items():
        print(f"{name}: " + ", ".join(f"{mode} {v:.2f}x" for mode, v in modes.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
