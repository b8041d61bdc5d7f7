"""``mtplx tune``: measure AR and MTP depths 1..3 on this machine, greedy and sampled; for each
regime derive the cycle costs depth="auto" weighs (adaptive_depth.DepthCosts), measure auto
against AR and the best fixed depth with them, and save the fastest (a depth or auto) if it
beats AR, else that AR is fastest; the costs are saved either way."""

from __future__ import annotations

import sys

from mtplx.commands.common import add_model_options, check_measure_options, load_engine, measure_side_by_side


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="find the fastest MTP depth on this machine, greedy and sampled "
                                    "(saved to ~/.mtplx/tuning.json)")
    add_model_options(p)
    p.add_argument("--depths", default="1,2,3", help="comma-separated MTP depths to try, each 1-8 (default 1,2,3)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompt suite")
    p.add_argument("--no-auto", action="store_true", help="do not measure depth=auto (saves the second pass)")
    p.set_defaults(func=run)


def run(args) -> int:
    from dataclasses import replace

    check_measure_options(args)  # a bad value fails before the model loads (and before PyTorch is imported)
    from mtplx.benchmarking import render_table
    from mtplx.tuning import SAMPLED, depth_costs, pick_depth, save_choice

    engine = load_engine(args)
    if not engine.has_mtp:
        print("this model has no MTP head: it runs AR only, nothing to tune "
              "(forge one with `mtplx forge build`)", file=sys.stderr)
        return 0
    verdicts = {}
    for regime, sampling in (("greedy", {}), ("sampled", SAMPLED)):
        settings = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in sampling.items()) or "temperature 0"
        print(f"{regime} ({settings}):")
        report = measure_side_by_side(engine, args, **sampling)
        print(render_table(report))
        choice = pick_depth(report)
        costs = depth_costs(report)
        if costs is not None and not args.no_auto and choice["depth"] is not None:
            # depth=auto with this regime's measured costs, against AR and the best fixed depth
            engine.auto_depth = replace(engine.auto_depth, **{"costs" if regime == "greedy" else "sampled_costs": costs})
            second = measure_side_by_side(engine, args, depths=f"{choice['depth']},auto", **sampling)
            print(render_table(second))
            if (rechosen := pick_depth(second))["depth"] == "auto":
                choice, report = rechosen, second
        choice["depth_costs"] = costs
        print(f"{regime}: {choice['message']}")
        verdicts[regime] = choice, report
    path = save_choice(engine.loaded, engine.device, engine.dtype, *verdicts["greedy"], sampled=verdicts["sampled"],
                       kv_dtype=engine.runner.cache.kv_dtype)
    uses = {regime: f"use depth {choice['depth']}" if choice["depth"] is not None else "default to AR"
            for regime, (choice, _) in verdicts.items()}
    any_ar = any(choice["depth"] is None for choice, _ in verdicts.values())
    note = " (a request can still ask for generation_mode mtp)" if any_ar else ""
    print(f"saved to {path}: greedy requests {uses['greedy']}, sampled requests (temperature > 0) "
          f"{uses['sampled']}{note}")
    return 0
