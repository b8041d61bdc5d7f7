"""Per-request decode speed of the default model, to find where slow requests lose their time.

    PYTHONPATH=. python benchmarks/run_spread.py --gguf PATH [--head DIR] --out spread.json

AR and MTP depths 1-3 on the bench prompts, interleaved as ``mtplx bench`` runs them, twice;
for every request: decode tok/s, cycles, whether the chain stayed up (cycles started from the
host's state), Python garbage-collection pauses during it, and the longest gap between two of
its cycles' commits.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import mtplx
from mtplx.benchmarking import BENCH_PROMPTS, configs_for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--head", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    engine = mtplx.load(args.gguf, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
                        head=args.head)
    pauses: list[float] = []
    started = {}

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started.pop("t", time.perf_counter()))

    gc.callbacks.append(on_gc)
    commits: list[float] = []
    starts = [0]

    def observe(event, seq):  # the generator's public observer: the path is the production path
        if event == "commit":
            commits.append(time.perf_counter())
        elif event == "chain_start":
            starts[0] += 1

    engine.generator.observers.append(observe)
    runs = []
    messages = [[{"role": "user", "content": p}] for p in BENCH_PROMPTS]
    engine.generate(messages[0], chat=True, mode="mtp", depth=3, max_tokens=8)
    for repeat in range(2):
        for i, prompt in enumerate(messages):
            for config in configs_for(engine, (1, 2, 3)):
                pauses.clear()
                commits.clear()
                starts[0] = 0
                result = engine.generate(prompt, chat=True, mode=config.mode, depth=config.depth or None,
                                         max_tokens=128)
                s = result.stats
                gaps = [b - a for a, b in zip(commits, commits[1:])]
                runs.append({"config": config.label, "prompt": i, "repeat": repeat,
                             "decode_tok_s": (s["generated_tokens"] - 1) / s["decode_s"],
                             "tokens": s["generated_tokens"], "cycles": s["verify_calls"],
                             "chain_starts": starts[0], "gc_pauses_ms": [round(p * 1e3, 2) for p in pauses],
                             "longest_commit_gap_ms": round(max(gaps, default=0.0) * 1e3, 2)})
                print(json.dumps(runs[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
