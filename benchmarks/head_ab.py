"""Two or more MTP heads on one trunk, side by side in one process: AR and MTP at one depth with
each head, greedy and sampled, on the held-out chat prompts of ``sampled_decoding.py``, the
configurations interleaved prompt by prompt, so that a machine whose speed drifts between runs
(this project's CPU VMs: AR moved 130-181 tok/s between processes in session 16) weighs on every
head alike. ``forge verify --against`` compares heads' acceptance; this compares their speed.

    python benchmarks/head_ab.py --heads NEW_DIR,OLD_DIR [--model GGUF] [--device cpu] [--depth 1]
        [--prompts 12] [--max-tokens 96] [--repeats 2] [--regimes greedy,t0.7,t1.0] --out FILE.json

Pass r of a seeded regime samples with seed + r (``benchmarking.pass_sampling``; until
session 19 every pass re-ran one seed's trajectory). Sampled requests take the engine's default
draft policy (``draft_policy="auto"``: argmax drafts below temperature 0.85, mirror drafts from
it). Every engine loads the trunk the same way
(``mtplx.load``); AR runs on the first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sampled_decoding import HELD_OUT_CHAT, REGIMES, check_held_out  # noqa: E402


def main() -> None:
    import torch

    import mtplx
    from mtplx.benchmarking import Config, machine_info, pass_sampling, run_once, summarize

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", required=True, help="comma-separated head folders (mtp.safetensors + mtplx_forge.json)")
    ap.add_argument("--model", default=None, help="a .gguf or HF directory (default: the default model)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--depth", default="1", help="the MTP depth of every head (an integer, or auto)")
    ap.add_argument("--prompts", type=int, default=len(HELD_OUT_CHAT))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts")
    ap.add_argument("--regimes", default="greedy,t0.7,t1.0", help=f"of: {', '.join(REGIMES)}")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    check_held_out()
    heads = [h for h in args.heads.split(",") if h]
    regimes = args.regimes.split(",")
    unknown = [r for r in regimes if r not in REGIMES]
    if len(heads) < 2 or unknown:
        raise SystemExit(f"give two or more --heads and regimes of {', '.join(REGIMES)} (unknown: {unknown})")
    depth = "auto" if args.depth == "auto" else int(args.depth)
    engines = [mtplx.load(args.model, head=h, device=args.device, dtype=args.dtype) for h in heads]
    prompts = [[{"role": "user", "content": p}] for p in HELD_OUT_CHAT[: args.prompts]]
    runs = [("ar", engines[0], Config("ar"), None)] + [(f"head{i}", e, Config("mtp", depth, "auto"), h)
                                                        for i, (e, h) in enumerate(zip(engines, heads))]
    report = {"machine": machine_info(engines[0]), "threads": torch.get_num_threads(), "heads": heads,
              "depth": depth, "max_tokens": args.max_tokens, "prompts": len(prompts), "repeats": args.repeats,
              "regimes": {}}
    for regime in regimes:
        sampling = REGIMES[regime]
        for _, engine, config, _ in runs:  # warm-up
            run_once(engine, prompts[0], config, 8, **sampling)
        results = {name: [] for name, *_ in runs}
        t0 = time.perf_counter()
        for r in range(args.repeats):  # pass r of a seeded regime samples with seed + r
            seeded = pass_sampling(sampling, r)
            for prompt in prompts:
                for name, engine, config, _ in runs:
                    results[name].append(run_once(engine, prompt, config, args.max_tokens, **seeded))
        entry = {name: {**summarize(results[name], config), "head": head} for name, _, config, head in runs}
        for e in entry.values():
            e["speedup_vs_ar"] = e["tok_s"] / entry["ar"]["tok_s"]
        report["regimes"][regime] = {"sampling": sampling, "wall_s": time.perf_counter() - t0, "configs": entry}
        line = ", ".join(f"{name} {e['tok_s']:.1f} tok/s ({e['speedup_vs_ar']:.3f}x"
                         + (f", d1 acceptance {e['acceptance_by_depth'][0]:.3f})" if name != "ar" else ")")
                         for name, e in entry.items())
        print(f"{regime}: {line}", flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
