"""Acceptance of two or more MTP heads on one trunk over many draws: each head decodes the same
prompts (the 12 held-out chat prompts of ``sampled_decoding.py`` and forge's 24 held-out ones)
with the same seeds, at each temperature, and the drafts accepted by position are summed over
every prompt and seed. Seeded sampling makes a run one draw of trajectories; a head's sampled
acceptance on 12 prompts moves by a few hundredths between draws (session 17), so this sums
several. Greedy runs one seed (its trajectory is the trunk's, the same for every head).

    python benchmarks/head_acceptance.py --heads NEW_DIR,OLD_DIR [--model GGUF] [--device cpu] [--dtype D] [--depth 1]
        [--temperatures 0,0.7,1.0] [--seeds 11,12,13] [--max-tokens 96] --out FILE.json

Sampled rows draft from the head's distribution (``draft_policy="mirror"``), greedy rows its argmax.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sampled_decoding import HELD_OUT_CHAT  # noqa: E402


def main() -> None:
    import torch

    import mtplx
    from mtplx.forge.prompts import HELD_OUT_PROMPTS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", required=True, help="comma-separated head folders")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="the trunk's dtype (default: mtplx.load's for the device)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--seeds", default="11,12,13")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    heads = args.heads.split(",")
    engines = [mtplx.load(args.model, device=args.device, dtype=args.dtype, head=h) for h in heads]
    prompts = list(HELD_OUT_CHAT) + list(HELD_OUT_PROMPTS)
    report = {"heads": heads, "depth": args.depth, "max_tokens": args.max_tokens, "prompts": len(prompts),
              "threads": torch.get_num_threads(), "temperatures": {}}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        seeds = [int(s) for s in args.seeds.split(",")] if temperature > 0 else [0]
        counts = {h: {"drafted": [0] * args.depth, "accepted": [0] * args.depth} for h in heads}
        for seed in seeds:
            for i, prompt in enumerate(prompts):
                for head, engine in zip(heads, engines):
                    r = engine.generate([{"role": "user", "content": prompt}], chat=True, mode="mtp",
                                        depth=args.depth, max_tokens=args.max_tokens, temperature=temperature,
                                        seed=seed * 1000 + i, draft_policy="mirror" if temperature > 0 else "greedy")
                    for j in range(args.depth):
                        counts[head]["drafted"][j] += r.stats["drafted_by_depth"][j]
                        counts[head]["accepted"][j] += r.stats["accepted_by_depth"][j]
        rates = {h: [round(a / max(d, 1), 4) for a, d in zip(c["accepted"], c["drafted"])] for h, c in counts.items()}
        report["temperatures"][f"{temperature:g}"] = {"seeds": seeds, "counts": counts, "acceptance_by_depth": rates}
        print(f"T {temperature:g} ({len(seeds)} seeds x {len(prompts)} prompts): "
              + ", ".join(f"{h}: {'/'.join(f'{a:.3f}' for a in v)}" for h, v in rates.items()), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
