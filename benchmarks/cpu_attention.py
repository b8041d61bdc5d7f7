"""The CPU decode attention (``kernels/cpu.row_attention``) as a decode step runs it: one row's
1-4 queries (an AR step, a verify of depth 1-3) over a context of N keys, at the default
model's shapes (9 query heads, 3 KV heads, head size 64, blocks of 16 in order), through 30
layers of their own pools, so a long context's cache streams from memory as in a step. Best of
5 passes, microseconds a layer. ``--kv-dtype float16`` holds the pools in float16, as the
engine's CPU cache does by default (float32 otherwise). ``--baseline-tree DIR`` runs the same in
another checkout (its kernels built apart), alternating.

    python benchmarks/cpu_attention.py [--threads 1] [--contexts 500,4000] [--queries 1,2,3,4]
        [--kv-dtype float32] [--rounds 2] [--baseline-tree DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from trees import add_arguments, rounds, with_baseline

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def one_run(threads: int, contexts: list[int], queries: list[int], kv_dtype: str) -> dict:
    import torch

    from mtplx.kernels import cpu

    torch.set_num_threads(threads)
    out = {}
    for n in contexts:
        blocks = n // BLOCK + 2
        g = torch.Generator().manual_seed(n)
        dtype = getattr(torch, kv_dtype)
        k = [torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(LAYERS)]
        v = [torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(LAYERS)]
        table = torch.arange(blocks)
        for count in queries:
            q = torch.randn(count, HEADS, HEAD_DIM, generator=g)
            positions = torch.arange(n - count, n)
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for layer in range(LAYERS):
                    cpu.row_attention(q, k[layer], v[layer], table, positions, 0, HEAD_DIM ** -0.5)
                best = min(best, time.perf_counter() - t)
            out[f"{n} keys, {count} queries"] = round(best / LAYERS * 1e6, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contexts", default="500,4000")
    ap.add_argument("--queries", default="1,2,3,4")
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--rounds", type=int, default=2)
    add_arguments(ap)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    queries = [int(q) for q in args.queries.split(",")]
    if args.child:
        print(json.dumps(one_run(args.threads, contexts, queries, args.kv_dtype)))
        return
    envs = with_baseline({"this tree": dict(os.environ)}, args.baseline_tree)
    best: dict[str, dict[str, float]] = {name: {} for name in envs}
    argv = ["--threads", str(args.threads), "--contexts", args.contexts, "--queries", args.queries,
            "--kv-dtype", args.kv_dtype]
    for name, res in rounds(__file__, argv, envs, args.rounds):
        for key, value in res.items():
            best[name][key] = min(best[name].get(key, float("inf")), value)
    for name, values in best.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.0f} us" for k, v in values.items()))
    report = {"threads": args.threads, "kv_dtype": args.kv_dtype, "layers": LAYERS, "rounds": args.rounds, "us_per_layer": best,
              "baseline_tree": args.baseline_tree}
    if "baseline" in best:
        report["baseline_over_this"] = {k: round(best["baseline"][k] / v, 3) for k, v in best["this tree"].items()}
        print("baseline / this tree: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["baseline_over_this"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
