"""``mtplx tune``: measure AR and MTP depths 1..3 on this machine; save the winner if it beats AR."""

from __future__ import annotations

import sys

from mtplx.commands.common import add_model_options, load_engine, measure_side_by_side, parse_depths


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="find the fastest MTP depth on this machine (saved to ~/.mtplx/tuning.json)")
    add_model_options(p)
    p.add_argument("--depths", default="1,2,3", help="comma-separated MTP depths to try (default 1,2,3)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompt suite")
    p.set_defaults(func=run)


def run(args) -> int:
    from mtplx.benchmarking import render_table
    from mtplx.tuning import pick_depth, save_choice

    parse_depths(args.depths)  # a bad value fails before the model loads
    engine = load_engine(args)
    if not engine.has_mtp:
        print("this model has no MTP head: it runs AR only, nothing to tune "
              "(forge one with `mtplx forge build`)", file=sys.stderr)
        return 0
    report = measure_side_by_side(engine, args)
    print(render_table(report))
    choice = pick_depth(report)
    print(choice["message"])
    path = save_choice(engine.loaded, engine.device, engine.dtype, choice, report)
    if choice["depth"] is not None:
        print(f"saved depth {choice['depth']} to {path}")
    else:
        print(f"saved to {path}: requests to this model default to AR here (a request can still ask for "
              "generation_mode mtp)")
    return 0
