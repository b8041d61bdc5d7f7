"""depth="auto" under sampling (issue 15): its cycle costs measured the way ``mtplx tune`` measures
them, on other prompts than the ones it is judged on.

1. The tune prompts (``BENCH_PROMPTS``): AR and fixed depths 1..3 side by side for each sampled
   regime and draft policy; from each run the cycle costs (``DepthCosts.from_measurement``: a
   depth-d cycle's time in AR steps) and the conditional acceptance by position.
2. The held-out chat prompts (``sampled_decoding.HELD_OUT_CHAT``): AR, fixed depths 1..3 and
   depth="auto" under several tables, interleaved prompt by prompt: the engine's built-in
   sampled table ("builtin"), the mean of the measured costs over every sampled regime
   ("pooled": one table serves every sampled row), "pooled" with the measured acceptance as the
   prior ("pooled_prior"), that with a slower running estimate ("pooled_prior_slow"), and where
   phase 1 measured greedy cycles too, both measured tables ("measured").
   Sampled regimes draw a new seed on each pass (``--repeats``): one seed fixes one trajectory
   per prompt, and a configuration's acceptance then rests on that one draw.
3. Optionally (``--policies T``) argmax against mirror drafts at depths 1 and 3 at temperature T
   (top-p 0.95): where mirror drafts start to pay.
4. Optionally (``--scheduler``) mtp_batch at depths 1..3 and auto (under ``--scheduler-table``)
   against ar_batch at 1, 4 and 8 streams, for each draft policy.

    PYTHONPATH=. python benchmarks/auto_depth.py --model GGUF [--head DIR] [--device cuda]
        [--dtype bfloat16] [--max-tokens 256] [--repeats 4] [--tune-from EARLIER.json]
        [--runs t0.7:mirror,t1.0:mirror] [--policies 0.5] [--scheduler] --out FILE.json

``--tune-from`` takes phase 1's tables from an earlier report of this script instead of measuring.
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

# (regime, draft policy) pairs whose cycles a sampled table must price
SAMPLED_RUNS = (("t0.7", "greedy"), ("t0.7", "mirror"), ("t1.0", "mirror"))
DEPTHS = (1, 2, 3)


def interleaved(engine, prompts, runs: list[tuple[str, object, object]], max_tokens: int, repeats: int,
                sampling: dict) -> dict:
    """Each (label, Config, AutoDepth or None) on every prompt, in turn; the AutoDepth is the
    engine's while its configuration runs (a request takes its plan when it is made). Pass r
    of a seeded regime samples with seed + r."""
    from mtplx.benchmarking import pass_sampling, run_once, summarize

    builtin = engine.auto_depth
    results = {label: [] for label, _, _ in runs}
    try:
        for label, config, auto in runs:  # warm-up
            engine.auto_depth = auto or builtin
            run_once(engine, prompts[0], config, 8, **sampling)
        for r in range(repeats):
            seeded = pass_sampling(sampling, r)
            for prompt in prompts:
                for label, config, auto in runs:
                    engine.auto_depth = auto or builtin
                    results[label].append(run_once(engine, prompt, config, max_tokens, **seeded))
    finally:
        engine.auto_depth = builtin
    out = {label: summarize(results[label], config) for label, config, _ in runs}
    for e in out.values():
        e["speedup_vs_ar"] = e["tok_s"] / out["ar"]["tok_s"]
    return out


def conditional(acceptance: list[float]) -> list[float]:
    """P(draft j accepted | drafts before it accepted), from unconditional rates by position."""
    before = [1.0, *acceptance[:-1]]
    return [a / b if b > 0 else 0.0 for a, b in zip(acceptance, before)]


def pairs(text: str) -> list[tuple[str, str]]:
    """``"t0.7:mirror,t1.0:mirror"`` -> [("t0.7", "mirror"), ("t1.0", "mirror")]."""
    return [tuple(run.split(":")) for run in text.split(",") if run]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--head", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tune-max-tokens", type=int, default=256, help="tokens per tune prompt (phase 1)")
    ap.add_argument("--tune-repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=len(HELD_OUT_CHAT))
    ap.add_argument("--repeats", type=int, default=4, help="passes over the held-out prompts, a seed each (phase 2)")
    ap.add_argument("--tune-from", default=None, help="phase 1's tables from an earlier report")
    ap.add_argument("--tune-runs", default=",".join(f"{r}:{p}" for r, p in SAMPLED_RUNS),
                    help="phase 1's regime:policy pairs (greedy:greedy adds the greedy table: candidate 'measured')")
    ap.add_argument("--runs", default=",".join(f"{r}:{p}" for r, p in SAMPLED_RUNS),
                    help="phase 2's regime:policy pairs")
    ap.add_argument("--policies", default="", help="temperatures (top-p 0.95) for phase 3")
    ap.add_argument("--tables", default="builtin,pooled,pooled_prior,pooled_prior_slow",
                    help="the tables depth=auto runs under in phase 2")
    ap.add_argument("--depths", default="1,2,3", help="the fixed depths beside auto in phase 2")
    ap.add_argument("--scheduler", action="store_true", help="phase 3: the scheduler at 1, 4 and 8 streams")
    ap.add_argument("--scheduler-table", default="pooled_prior", help="the table auto uses in phase 3")
    ap.add_argument("--scheduler-rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    check_held_out()

    import torch

    import mtplx
    from mtplx.benchmarking import BENCH_PROMPTS, Config, machine_info, measure
    from mtplx.engine.adaptive_depth import DepthCosts
    from mtplx.tuning import depth_costs

    engine = mtplx.load(args.model, head=args.head, device=args.device, dtype=args.dtype)
    builtin = engine.auto_depth
    report = {"machine": machine_info(engine), "head": args.head, "builtin": repr(builtin), "tune": {}, "held_out": {}}

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    # 1. the tune prompts
    tables, priors = {}, {}
    if args.tune_from:
        report["tune"] = json.loads(Path(args.tune_from).read_text())["tune"]
        report["tune_from"] = args.tune_from
        for name, t in report["tune"].items():
            tables[name] = DepthCosts(tuple(t["cycles"]), t["per_draft"])
            priors[name] = t["conditional_acceptance"]
    with torch.inference_mode():
        for regime, policy in () if args.tune_from else pairs(args.tune_runs):
            t0 = time.perf_counter()
            r = measure(engine, depths=DEPTHS, prompts=BENCH_PROMPTS, max_tokens=args.tune_max_tokens,
                        repeats=args.tune_repeats, draft_policies=(policy,), **REGIMES[regime])
            costs = depth_costs(r, draft_policy=policy)
            name = f"{regime}_{policy}"
            tables[name] = costs
            priors[name] = conditional(r["configs"][Config("mtp", DEPTHS[-1], policy).label]["acceptance_by_depth"])
            for e in r["configs"].values():
                e.pop("token_ids", None)
            report["tune"][name] = {"wall_s": time.perf_counter() - t0, "cycles": costs.cycles,
                                    "per_draft": costs.per_draft, "conditional_acceptance": priors[name],
                                    "configs": r["configs"]}
            print(f"tune {name}: cycles {[round(c, 3) for c in costs.cycles]}, conditional acceptance "
                  f"{[round(a, 3) for a in priors[name]]}", flush=True)
            save()
    sampled = [name for name in tables if not name.startswith("greedy")]
    cycles = tuple(sum(tables[n].cycles[d] for n in sampled) / len(sampled) for d in range(len(DEPTHS)))
    pooled = DepthCosts(cycles, max(cycles[-1] - cycles[-2], 0.05))
    prior = tuple(sum(priors[n][j] for n in sampled) / len(sampled) for j in range(len(DEPTHS)))
    candidates = {"pooled": replace(builtin, sampled_costs=pooled),
                  "pooled_prior": replace(builtin, sampled_costs=pooled, sampled_prior=prior),
                  "pooled_prior_slow": replace(builtin, sampled_costs=pooled, sampled_prior=prior, rate=0.08)}
    if "greedy_greedy" in tables:  # greedy cycles measured too: both tables as measured
        candidates["measured"] = replace(builtin, costs=tables["greedy_greedy"], sampled_costs=pooled)
    report["pooled"] = {"cycles": pooled.cycles, "per_draft": pooled.per_draft, "prior": prior}
    print(f"pooled: cycles {[round(c, 3) for c in pooled.cycles]}, prior {[round(a, 3) for a in prior]}", flush=True)

    # 2. the held-out prompts
    fixed = [int(d) for d in args.depths.split(",") if d]
    tables_wanted = args.tables.split(",")
    prompts = [[{"role": "user", "content": p}] for p in HELD_OUT_CHAT[: args.prompts]]
    with torch.inference_mode():
        for regime, policy in pairs(args.runs):
            runs = [("ar", Config("ar"), None)] + [(f"d{d}", Config("mtp", d, policy), None) for d in fixed]
            runs += [(f"auto_{name}", Config("mtp", "auto", policy), auto)
                     for name, auto in (("builtin", None), *candidates.items()) if name in tables_wanted]
            t0 = time.perf_counter()
            configs = interleaved(engine, prompts, runs, args.max_tokens, args.repeats, REGIMES[regime])
            name = f"{regime}_{policy}"
            report["held_out"][name] = {"wall_s": time.perf_counter() - t0, "configs": configs}
            print(f"held out {name}: " + ", ".join(
                f"{label} {e['tok_s']:.0f} ({e['speedup_vs_ar']:.3f}x"
                + (f", cycles by depth {e['cycles_by_depth']})" if "cycles_by_depth" in e else ")")
                for label, e in configs.items()), flush=True)
            save()

    # 3. argmax against mirror drafts
    for t in (float(x) for x in args.policies.split(",") if x):
        runs = [("ar", Config("ar"), None)] + [(f"d{d}_{p}", Config("mtp", d, p), None)
                                               for p in ("greedy", "mirror") for d in (1, 3)]
        with torch.inference_mode():
            configs = interleaved(engine, prompts, runs, args.max_tokens, args.repeats,
                                  {"temperature": t, "top_p": 0.95, "seed": 1234})
        report.setdefault("policies", {})[f"t{t}"] = configs
        print(f"policies t{t}: " + ", ".join(f"{label} {e['tok_s']:.0f} ({e['speedup_vs_ar']:.3f}x)"
                                            for label, e in configs.items()), flush=True)
        save()

    # 4. the scheduler
    if args.scheduler:
        engine.auto_depth = builtin if args.scheduler_table == "builtin" else candidates[args.scheduler_table]
        report["scheduler"] = {"table": args.scheduler_table}
        for policy in ("greedy", "mirror"):
            report["scheduler"][policy] = scheduler_depths(engine, [p[0]["content"] for p in prompts], args.max_tokens,
                                                           [*DEPTHS, "auto"], ["t0.7", "t1.0"],
                                                           args.scheduler_rounds, policy)
            save()
    save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
