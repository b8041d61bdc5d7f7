"""AR and MTP on the CPU at the temperatures people use (issue 17: "MTP no slower than AR at
temperature 0.7"), side by side: the default model from its GGUF, held-out chat prompts
(``sampled_decoding.HELD_OUT_CHAT``: no bench, tuning or forge prompt), each prompt with a seed of
its own per round, ``engine.generate`` wall-clock. Per temperature and configuration: decode
tok/s as all runs' tokens after the first over their decode seconds, and the tokens a cycle
commits. Configurations (``--configs``, ``CONFIGS``): AR; MTP at depth 1 and 2 with argmax drafts
("greedy"), with mirror drafts and with the engine's own draft policy ("auto"), and at
depth="auto" ("mtpauto_auto"); a request naming no mode at the default depth ("default") and at
depth="auto" ("default_dauto"), which decode as the engine decides. ``--head-quantize int8`` (or int4, fp8) runs each MTP
configuration a second time on an engine whose head is quantized (``mtplx.load(head_quantize=)``),
named "<config>+int8". Every child process runs every configuration on each prompt in turn, so
machine noise hits them alike; ``--baseline-tree DIR`` adds another checkout's package
("baseline"), alternating with this tree's (a tree without ``head_quantize`` cannot take it).

    python benchmarks/cpu_sampled.py [--threads 2] [--rounds 2] [--tokens 96] [--prompts 12]
        [--temperatures 0,0.7,1.0] [--top-p 1.0] [--top-k 0] [--min-p 0] [--configs ar,mtp1_greedy,...] [--head-quantize FMT]
        [--baseline-tree DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from sampled_decoding import HELD_OUT_CHAT  # noqa: E402
from trees import add_arguments, rounds, with_baseline  # noqa: E402

CONFIGS = {"ar": ("ar", 1, "greedy"), "mtp1_greedy": ("mtp", 1, "greedy"), "mtp1_mirror": ("mtp", 1, "mirror"),
           "mtp2_greedy": ("mtp", 2, "greedy"), "mtp2_mirror": ("mtp", 2, "mirror"), "mtp1_auto": ("mtp", 1, "auto"),
           "mtp2_auto": ("mtp", 2, "auto"), "mtpauto_auto": ("mtp", "auto", "auto"),
           # a request naming no mode (the engine's default: before `mtplx tune`, AR where MTP is expected to
           # lose) at the default depth and at depth="auto"
           "default": (None, None, "auto"), "default_dauto": (None, "auto", "auto")}  # name: (mode, depth, policy)
DEFAULT_CONFIGS = "ar,mtp1_greedy,mtp1_mirror,mtp2_greedy,mtp2_mirror,mtp1_auto"


def one_run(threads: int, tokens: int, prompts: int, temperatures: list[float], top_p: float, seed: int,
            configs: list[str], head_quantize: str | None = None, top_k: int = 0, min_p: float = 0.0) -> dict:
    import torch

    import mtplx

    torch.set_num_threads(threads)
    engines = {None: mtplx.load(device="cpu", quantize="gguf")}
    if head_quantize:
        engines[head_quantize] = mtplx.load(device="cpu", quantize="gguf", head_quantize=head_quantize)
    for engine in engines.values():
        engine.generate("Hello", mode="mtp", max_tokens=8)  # kernels built and warm
    runs = [(name, fmt) for name in configs for fmt in engines if fmt is None or CONFIGS[name][0] != "ar"]
    out = {}
    for t in temperatures:
        for i, prompt in enumerate(HELD_OUT_CHAT[:prompts]):  # every configuration per prompt, in turn
            filters = {**({"top_k": top_k} if top_k else {}), **({"min_p": min_p} if min_p else {})}
            sampling = dict(temperature=t, seed=seed + i, top_p=top_p, **filters) if t else dict(temperature=0)
            for name, fmt in runs:
                mode, depth, policy = CONFIGS[name]
                if t == 0 and policy == "mirror":
                    continue  # greedy requests draft by argmax whatever the policy
                sums = out.setdefault(f"t{t}", {}).setdefault(name if fmt is None else f"{name}+{fmt}",
                                                              {"seconds": 0.0, "tokens": 0, "cycles": 0})
                r = engines[fmt].generate([{"role": "user", "content": prompt}], chat=True, mode=mode, depth=depth,
                                    draft_policy=policy, max_tokens=tokens, ignore_eos=True, **sampling)
                sums["seconds"] += r.stats["decode_s"]
                sums["tokens"] += r.stats["generated_tokens"] - 1
                sums["cycles"] += r.stats.get("verify_calls") or 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="the sampled requests' top-k (0: none)")
    ap.add_argument("--min-p", type=float, default=0.0, help="the sampled requests' min-p (0: none)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"of: {', '.join(CONFIGS)}")
    ap.add_argument("--head-quantize", default=None, choices=("int8", "int4", "fp8"),
                    help="also run each MTP configuration with the head's weights in this format")
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    add_arguments(ap)
    args = ap.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",")]
    configs = args.configs.split(",")
    if "ar" not in configs or any(c not in CONFIGS for c in configs):
        raise SystemExit(f"--configs: 'ar' and any of {', '.join(CONFIGS)}")
    if args.child:
        print(json.dumps(one_run(args.threads, args.tokens, args.prompts, temperatures, args.top_p, args.seed,
                                 configs, args.head_quantize, args.top_k, args.min_p)))
        return
    envs = with_baseline({"this": dict(os.environ)}, args.baseline_tree)
    totals: dict = {name: {} for name in envs}
    for r in range(args.rounds):  # each round its own seeds, the same for every tree
        argv = ["--threads", str(args.threads), "--tokens", str(args.tokens), "--prompts", str(args.prompts),
                "--temperatures", args.temperatures, "--top-p", str(args.top_p), "--seed", str(1000 * r),
                *(["--top-k", str(args.top_k)] if args.top_k else []),
                *(["--min-p", str(args.min_p)] if args.min_p else []),
                "--configs", args.configs] + (["--head-quantize", args.head_quantize] if args.head_quantize else [])
        for name, res in rounds(__file__, argv, envs, 1, start=r):
            for regime, configs in res.items():
                for config, sums in configs.items():
                    into = totals[name].setdefault(regime, {}).setdefault(config, {"seconds": 0.0, "tokens": 0,
                                                                                    "cycles": 0})
                    for key in into:
                        into[key] += sums[key]
    summary = {}
    for name, regimes in totals.items():
        for regime, configs in regimes.items():
            ar = configs["ar"]["tokens"] / configs["ar"]["seconds"]
            for config, s in configs.items():
                rate = s["tokens"] / s["seconds"]
                summary.setdefault(name, {}).setdefault(regime, {})[config] = {
                    "tok_s": round(rate, 1), "x_ar": round(rate / ar, 3),
                    "tokens_per_cycle": round(s["tokens"] / s["cycles"], 3) if s["cycles"] else None}
    for name, regimes in summary.items():
        for regime, configs in regimes.items():
            print(f"{name:8s} {regime:5s} " + "  ".join(
                f"{c} {v['tok_s']:.1f} ({v['x_ar']:.3f}x" + (f", {v['tokens_per_cycle']:.2f}/cycle)" if v["tokens_per_cycle"]
                                                              else ")") for c, v in configs.items()))
    if "baseline" in summary:
        print("this / baseline: " + "; ".join(
            f"{regime} {c} {v['tok_s'] / summary['baseline'][regime][c]['tok_s']:.3f}x"
            for regime, configs in summary["this"].items() for c, v in configs.items()))
    report = {"date": datetime.date.today().isoformat(), "threads": args.threads, "tokens": args.tokens,
              "rounds": args.rounds, "prompts": list(HELD_OUT_CHAT[:args.prompts]), "temperatures": temperatures,
              "configs": args.configs.split(","), "head_quantize": args.head_quantize, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, "baseline_tree": args.baseline_tree, "totals": totals, "summary": summary,
              "load_average_end": list(os.getloadavg())}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
