"""depth="auto" under other cycle-cost tables, side by side with the shipped one (issue 15: auto
at least as fast as the best fixed depth through the scheduler).

First, optionally, the cycle costs by batch width on the tune prompts (``width_costs.measure``,
the same process and card): from them a "measured" table, its cycles at one row and its growth
with width (sampled: the mean of the sampled regimes measured). Then the held-out prompts
through mtp_batch at 1, 4 and 8 closed-loop clients (``sampled_decoding.scheduler_depths``):
ar_batch, the fixed depths, and depth="auto" under the engine's own table and under each
variant, the configurations alternating within each round. A variant is
``TABLE[+growth][@HYSTERESIS]``: TABLE "shipped" (the engine's) or "measured", "+growth" the
measured growth with width, "@0.05" another hysteresis than ``adaptive_depth.HYSTERESIS``.

    PYTHONPATH=. python benchmarks/auto_tables.py --model GGUF --head DIR --device cuda --dtype bfloat16 \\
        [--measure-widths 1,2,4,8] [--width-costs FILE.json] [--variants measured,measured+growth,shipped@0.05] \\
        [--depths 1,3] [--streams 1,4,8] [--regimes greedy,t0.7,t1.0] [--requests 24 [--per-stream]] [--rounds 2] [--max-tokens 256] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sampled_decoding import HELD_OUT_CHAT, REGIMES, check_held_out, scheduler_depths  # noqa: E402
from width_costs import engine_arguments, measure  # noqa: E402


def measured_tables(costs: dict):
    """(greedy, sampled) DepthCosts without growth and with it, from a width_costs result
    ({regime: {"cost": {"d1_x1": ...}, "growth": {"2": [...]}}}) over the depths it measured
    (1..n); None where a regime is missing."""
    from mtplx.engine.adaptive_depth import DepthCosts

    def table(regimes: list[str]):
        got = [costs[r] for r in regimes if r in costs]
        if not got:
            return None, None
        depths = range(1, len(got[0]["growth"]["1"]) + 1)  # a growth per depth measured, from 1
        cycles = tuple(round(sum(g["cost"][f"d{d}_x1"] for g in got) / len(got), 3) for d in depths)
        widths = sorted(int(w) for w in got[0]["growth"] if int(w) > 1)
        growth = tuple((w, tuple(round(sum(g["growth"][str(w)][i] for g in got) / len(got), 3)
                                 for i in range(len(depths)))) for w in widths)
        flat = DepthCosts.of_cycles(cycles)
        return flat, replace(flat, width_growth=growth)

    return table(["greedy"]), table([r for r in costs if r != "greedy"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    engine_arguments(ap)
    ap.add_argument("--measure-widths", default="", help="run width_costs first at these widths (from 1)")
    ap.add_argument("--width-costs", default=None, help="or read its result from this file")
    ap.add_argument("--width-tokens", type=int, default=256, help="max tokens of the width-cost runs")
    ap.add_argument("--variants", default="measured,measured+growth")
    ap.add_argument("--depths", default="1,3", help="the fixed depths beside auto")
    ap.add_argument("--regimes", default="greedy,t0.7,t1.0", help=f"of: {', '.join(REGIMES)}")
    ap.add_argument("--streams", default="1,4,8", help="closed-loop clients of the held-out runs")
    ap.add_argument("--requests", type=int, default=24, help="requests a run, through closed-loop clients")
    ap.add_argument("--per-stream", action="store_true",
                    help="--requests a client (a run of 8 streams: 8 x --requests), so wide runs last as long")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    check_held_out()
    variants = [v for v in args.variants.split(",") if v]
    if any(v.split("@")[0] not in ("shipped", "measured", "measured+growth") for v in variants):
        ap.error("a variant is shipped|measured|measured+growth, optionally @HYSTERESIS")
    if any(v.startswith("measured") for v in variants) and not (args.measure_widths or args.width_costs):
        ap.error("the measured variants need --measure-widths or --width-costs")

    import torch

    import mtplx
    from mtplx.benchmarking import BENCH_PROMPTS
    from mtplx.engine import adaptive_depth

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    engine = mtplx.load(args.model, head=args.head, device=args.device, dtype=args.dtype)
    report: dict = {"engine_build_s": round(time.perf_counter() - t0, 1), "device": str(engine.device),
                    "cost_machine": engine.cost_machine, "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "shipped": repr(engine.auto_depth),
                    "hysteresis": adaptive_depth.HYSTERESIS, "requests": args.requests, "per_stream": args.per_stream, "rounds": args.rounds,
                    "max_tokens": args.max_tokens}
    if engine.device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    if args.measure_widths:
        widths = [int(w) for w in args.measure_widths.split(",")]
        report["width_costs"] = measure(engine, list(BENCH_PROMPTS), widths, [1, 2, 3], args.regimes.split(","),
                                        args.width_tokens, 2)
    elif args.width_costs:
        report["width_costs"] = json.loads(Path(args.width_costs).read_text())["regimes"]
    (greedy_flat, greedy_grown), (sampled_flat, sampled_grown) = measured_tables(report.get("width_costs", {}))
    shipped, hysteresis = engine.auto_depth, adaptive_depth.HYSTERESIS
    report["tables"] = {"measured": [repr(greedy_flat), repr(sampled_flat)],
                        "measured+growth": [repr(greedy_grown), repr(sampled_grown)]}

    def setup(variant: str):
        table, _, h = variant.partition("@")
        auto = {"shipped": shipped,
                "measured": replace(shipped, costs=greedy_flat or shipped.costs,
                                    sampled_costs=sampled_flat or shipped.sampled_costs),
                "measured+growth": replace(shipped, costs=greedy_grown or shipped.costs,
                                           sampled_costs=sampled_grown or shipped.sampled_costs)}[table]

        def apply() -> None:
            engine.auto_depth = auto
            adaptive_depth.HYSTERESIS = float(h) if h else hysteresis
        return apply

    calls = {v: setup(v) for v in variants}
    calls["restore"] = setup("shipped")
    fixed = [int(d) for d in args.depths.split(",") if d]
    streams = tuple(int(s) for s in args.streams.split(","))
    with torch.inference_mode():
        report["scheduler"] = scheduler_depths(engine, list(HELD_OUT_CHAT), args.max_tokens, fixed + ["auto"],
                                               args.regimes.split(","), args.rounds, requests_per_run=args.requests,
                                               variants=calls, widths=streams, per_stream=args.per_stream)
    for name, result in report["scheduler"].items():  # auto (each table) over the best fixed depth
        for width in streams:
            best = max(result[f"mtp_d{d}_over_ar_x{width}"] for d in fixed)
            for key in [k for k in result if k.startswith("mtp_dauto") and k.endswith(f"_over_ar_x{width}")]:
                result[key.replace("_over_ar_", "_over_best_fixed_")] = result[key] / best
        print(name, json.dumps({k: round(v, 3) for k, v in result.items() if "_over_best_fixed_" in k}), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
