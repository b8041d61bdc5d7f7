"""Seeded sampled requests sent again and again: does a repeat decode what the first run did?

The held-out chat prompts, one seeded request each (256 tokens past EOS), through the scheduler
modes given, run after run in one process: the first run finds the prompts new (only blocks other
requests share are cached), the later ones find their full blocks in the prefix cache. For each
run and regime, the prompts whose tokens differ from the first run's, and the first token where
they do.

    python benchmarks/seeded_repeats.py [--model GGUF] [--head DIR] [--device cuda] [--dtype bfloat16]
        [--modes serial,hyper] [--generation-mode ar|mtp] [--regimes t0.7,t1.0] [--runs 3] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import run_jobs  # noqa: E402
from sampled_decoding import HELD_OUT_CHAT, REGIMES, chat_requests  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--head", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--modes", default="serial,hyper", help="scheduler modes, alternating within each run")
    ap.add_argument("--generation-mode", default=None, help="ar or mtp (default: each request's default)")
    ap.add_argument("--regimes", default="t0.7,t1.0")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import mtplx

    engine = mtplx.load(args.model, head=args.head, device=args.device, dtype=args.dtype)
    prompts = list(HELD_OUT_CHAT)
    report = {"device": str(engine.device), "generation_mode": args.generation_mode, "regimes": {}}
    for name in args.regimes.split(","):
        runs = []
        for _ in range(args.runs):
            for mode in args.modes.split(","):
                _, results = run_jobs(engine, mode, chat_requests(engine, prompts, len(prompts), args.generation_mode,
                                                                  1, args.max_tokens, REGIMES[name], "auto", 100))
                runs.append((mode, [r.token_ids for r in results]))
        first = runs[0][1]
        rows = []
        for mode, ids in runs:
            differ = [j for j in range(len(ids)) if ids[j] != first[j]]
            rows.append({"mode": mode, "differs_from_first_run": differ,
                         "first_difference_at": {j: first_difference(ids[j], first[j]) for j in differ}})
        report["regimes"][name] = rows
        print(name, json.dumps(rows), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
