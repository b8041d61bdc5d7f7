"""The CPU decode path with and without kernels/cpu.py's C++ kernels, side by side.

Each configuration runs in its own process (the kernels are chosen once per process), the two
alternating ``--rounds`` times so that machine noise hits both alike: the default model from its
GGUF's own blocks (``quantize="gguf"``), AR and MTP depth 1, greedy, chat prompts not used for
tuning, decode tok/s after the first token. "pytorch" is ``MTPLX_CPU_KERNELS=0``: PyTorch's
packed int4 kernel (bf16 activations) and PyTorch's ops for norms, RoPE, attention and SiLU.

    python benchmarks/cpu_kernels_ab.py [--threads 1] [--rounds 3] [--tokens 96] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

PROMPTS = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "How does a hash map handle collisions? Explain with an example.")


def one_run(threads: int, tokens: int) -> dict:
    import torch

    import mtplx

    torch.set_num_threads(threads)
    engine = mtplx.load(device="cpu", quantize="gguf")
    out = {"ar": [], "mtp": []}
    for prompt in PROMPTS:
        for mode in out:
            r = engine.generate([{"role": "user", "content": prompt}], chat=True, mode=mode, depth=1,
                                max_tokens=tokens, temperature=0, ignore_eos=True)
            out[mode].append(r.stats["decode_tok_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(args.threads, args.tokens)))
        return
    runs = {"pytorch": {"ar": [], "mtp": []}, "kernels": {"ar": [], "mtp": []}}
    for _ in range(args.rounds):
        for name in runs:
            env = {**os.environ, "MTPLX_CPU_KERNELS": "0" if name == "pytorch" else "1"}
            cmd = [sys.executable, __file__, "--child", "--threads", str(args.threads), "--tokens", str(args.tokens)]
            res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            for mode, values in res.items():
                runs[name][mode].extend(values)
    summary = {name: {mode: round(statistics.mean(v), 2) for mode, v in modes.items()} for name, modes in runs.items()}
    ratio = {mode: round(summary["kernels"][mode] / summary["pytorch"][mode], 3) for mode in ("ar", "mtp")}
    report = {"date": datetime.date.today().isoformat(), "threads": args.threads, "tokens": args.tokens,
              "rounds": args.rounds, "prompts": list(PROMPTS), "runs": runs, "mean_tok_s": summary,
              "kernels_x_pytorch": ratio, "load_average_end": list(os.getloadavg())}
    for name, modes in summary.items():
        print(f"{name:8s} AR {modes['ar']:6.1f} tok/s   MTP d1 {modes['mtp']:6.1f} tok/s")
    print(f"kernels / pytorch: AR {ratio['ar']:.2f}x, MTP {ratio['mtp']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
