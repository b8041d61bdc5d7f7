"""``mtplx bench``: AR and MTP at each depth, side by side in one run; prints a table, writes JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mtplx.commands.common import add_model_options, check_measure_options, load_engine, measure_side_by_side


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure AR vs MTP decode speed and acceptance on this machine")
    add_model_options(p)
    p.add_argument("--depths", default="1,2,3",
                   help="comma-separated MTP depths, each 1-8 or auto, measured beside AR (default 1,2,3)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("--repeats", type=int, default=1,
                   help="passes over the prompt suite; the configurations alternate within each (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the sampled runs: pass r samples with seed + r (default: a fresh one each)")
    p.add_argument("--json", dest="json_out", default=None, help="write the report to this file")
    p.set_defaults(func=run)


def run(args) -> int:
    check_measure_options(args)  # a bad value fails before the model loads (and before PyTorch is imported)
    from mtplx.benchmarking import render_table

    engine = load_engine(args)
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    if args.seed is not None:
        sampling["seed"] = args.seed
    report = measure_side_by_side(engine, args, **sampling)
    report["model"] = str(engine.loaded.source)
    print(render_table(report))
    if args.json_out:
        Path(args.json_out).expanduser().write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0
