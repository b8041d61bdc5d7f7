"""Decode speed on the CPU as the context grows: the default model from its GGUF, a prompt of
``--contexts`` tokens (held-out prose, not a tuning prompt), then ``--tokens`` greedy tokens past
EOS, AR and MTP depth 1, decode tok/s after the first token. Each configuration runs in its own
process, alternating ``--rounds`` times; ``--baseline-tree DIR`` adds the same runs with another
checkout's ``mtplx`` package (an earlier commit's worktree, its kernels built apart).

    python benchmarks/cpu_long_context.py [--threads 2] [--contexts 100,1000,4000] [--tokens 64]
        [--rounds 3] [--baseline-tree DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cpu_vs_llama_cpp import LONG_TEXT  # noqa: E402


def one_run(threads: int, contexts: list[int], tokens: int) -> dict:
    import torch

    import mtplx

    torch.set_num_threads(threads)
    engine = mtplx.load(device="cpu", quantize="gguf")
    text = engine.tokenizer.encode(LONG_TEXT * (max(contexts) // 20 + 1))
    out = {}
    for n in contexts:
        for mode in ("ar", "mtp"):
            r = engine.generate(text[:n], mode=mode, depth=1, max_tokens=tokens, ignore_eos=True, temperature=0)
            out[f"{mode}@{n}"] = r.stats["decode_tok_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="100,1000,4000")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-tree", help="a checkout whose mtplx package runs as 'baseline'")
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.child:
        print(json.dumps(one_run(args.threads, contexts, args.tokens)))
        return
    envs = {"this tree": (dict(os.environ), None)}
    if args.baseline_tree:
        tree = os.path.abspath(args.baseline_tree)
        envs["baseline"] = ({**os.environ, "PYTHONPATH": tree, "TORCH_EXTENSIONS_DIR": os.path.join(tree, ".ext")},
                            tree)
    runs = {name: {} for name in envs}
    for _ in range(args.rounds):
        for name, (env, cwd) in envs.items():
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--threads", str(args.threads),
                   "--contexts", args.contexts, "--tokens", str(args.tokens)]
            res = json.loads(subprocess.run(cmd, env=env, cwd=cwd, check=True, capture_output=True,
                                            text=True).stdout.splitlines()[-1])
            for key, value in res.items():
                runs[name].setdefault(key, []).append(value)
    mean = {name: {k: round(statistics.mean(v), 1) for k, v in r.items()} for name, r in runs.items()}
    for name, values in mean.items():
        print(f"{name:9s} " + "  ".join(f"{k} {v:6.1f}" for k, v in values.items()) + "  tok/s")
    report = {"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, "contexts": contexts,
              "baseline_tree": args.baseline_tree, "runs": runs, "mean_tok_s": mean}
    if "baseline" in mean:
        report["this_x_baseline"] = {k: round(v / mean["baseline"][k], 3) for k, v in mean["this tree"].items()}
        print("this tree x baseline: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["this_x_baseline"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
