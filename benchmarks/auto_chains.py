"""Why depth="auto" can trail a fixed depth at one stream on a GPU (issue 15): each depth
change ends a chain of cycles, and the next chain starts from the host's state. Per
configuration (AR, fixed depths, auto), on the held-out chat prompts through
``engine.generate``, side by side: decode tok/s, tokens a cycle, chain starts per 100 tokens
(``Generator.observers``' "chain_start"; always 0 on the CPU, whose engines do not chain) and,
for auto, how often a cycle's depth differs from the one before it.

    PYTHONPATH=. python benchmarks/auto_chains.py --model GGUF --device cuda [--head DIR]
        [--depths 1,3,auto] [--regimes greedy,t0.7] [--draft-policy auto|greedy|mirror] [--prompts 12]
        [--max-tokens 256] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from sampled_decoding import HELD_OUT_CHAT, REGIMES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--head")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--depths", default="1,3,auto")
    ap.add_argument("--regimes", default="greedy,t0.7", help=f"of: {', '.join(REGIMES)}")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft-policy", default="auto", help="the MTP requests' draft policy (auto, greedy, mirror)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    import mtplx

    engine = mtplx.load(args.model, device=args.device, head=args.head,
                        dtype=getattr(torch, args.dtype) if args.device != "cpu" else None)
    events = {"chain_start": 0, "switches": 0}
    last_depth: dict[int, int] = {}

    def observe(event: str, seq) -> None:
        if event == "chain_start":
            events["chain_start"] += 1
        elif event == "commit" and seq.mode == "mtp":
            if seq.seq_id in last_depth and last_depth[seq.seq_id] != seq.depth:
                events["switches"] += 1
            last_depth[seq.seq_id] = seq.depth

    engine.generator.observers.append(observe)
    configs = [("ar", None)] + [("mtp", d if d == "auto" else int(d)) for d in args.depths.split(",")]
    engine.generate("Hello", mode="mtp", max_tokens=8)  # warm
    prompts = HELD_OUT_CHAT[:args.prompts]
    report = {"device": str(engine.device), "gpu": torch.cuda.get_device_name() if engine.device.type == "cuda" else None,
              "torch": torch.__version__, "dtype": str(engine.dtype), "model": args.model, "head": args.head,
              "auto_depth": repr(engine.auto_depth), "max_tokens": args.max_tokens, "prompts": len(prompts),
              "draft_policy": args.draft_policy, "regimes": {}}
    for regime in args.regimes.split(","):
        sums = {}
        sampling = REGIMES[regime]  # sampled_decoding.py's settings (sampled: seed 1234 on every prompt)
        for prompt in prompts:
            for mode, depth in configs:
                name = mode if depth is None else f"mtp_d{depth}"
                events.update(chain_start=0, switches=0)
                r = engine.generate([{"role": "user", "content": prompt}], chat=True, mode=mode, depth=depth,
                                    max_tokens=args.max_tokens, ignore_eos=True,
                                    **({"draft_policy": args.draft_policy} if mode == "mtp" else {}), **sampling)
                s = sums.setdefault(name, {"seconds": 0.0, "tokens": 0, "cycles": 0, "chain_starts": 0, "switches": 0})
                s["seconds"] += r.stats["decode_s"]
                s["tokens"] += r.stats["generated_tokens"] - 1
                s["cycles"] += r.stats.get("verify_calls") or 0
                s["chain_starts"] += events["chain_start"]
                s["switches"] += events["switches"]
        ar = sums["ar"]["tokens"] / sums["ar"]["seconds"]
        out = {}
        for name, s in sums.items():
            rate = s["tokens"] / s["seconds"]
            out[name] = {"tok_s": round(rate, 1), "x_ar": round(rate / ar, 3),
                         "tokens_per_cycle": round(s["tokens"] / s["cycles"], 3) if s["cycles"] else None,
                         "chain_starts_per_100_tokens": round(100 * s["chain_starts"] / s["tokens"], 2),
                         "depth_switches_per_100_tokens": round(100 * s["switches"] / s["tokens"], 2)}
            print(regime, name, out[name])
        report["regimes"][regime] = out
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
