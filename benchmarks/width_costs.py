"""What a batched MTP cycle costs against a batched AR step, by batch width (depth="auto" in
mtp_batch; ``adaptive_depth.DepthCosts.width_growth``).

At each width w, w requests decode at once through the scheduler (ar_batch, and mtp_batch at
each fixed depth), every one to the same length past EOS, so the batch stays w rows wide from
the first cycle to the last; ``8 // w`` such batches one after another, so every configuration
decodes the same number of tokens. The configurations alternate batch by batch. A depth-d
cycle's cost in AR steps of the same width is

    cost(d, w) = (tokens a row commits per cycle) x (ar_batch tok/s at w) / (mtp_batch tok/s at w)

and its growth with width, ``cost(d, w) / cost(d, 1)``, is what the engine's width-1 table (the
defaults, or ``mtplx tune``'s) is multiplied by at width w. On the tune prompts (BENCH_PROMPTS),
not the held-out ones the result is judged on.

    python benchmarks/width_costs.py [--device cpu] [--threads 2] [--widths 1,2,4,8] [--depths 1,2,3]
        [--regimes greedy,t0.7,t1.0] [--max-tokens 96] [--rounds 2] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import run_jobs  # noqa: E402
from sampled_decoding import REGIMES, Tally, chat_requests  # noqa: E402


def measure(engine, prompts, widths: list[int], depths: list[int], regimes: list[str], max_tokens: int,
            rounds: int) -> dict:
    out = {}
    configs = [("ar_batch", None)] + [("mtp_batch", d) for d in depths]
    per_config = max(widths)  # requests per configuration and width: max(widths) // w batches of w
    for name in regimes:
        sampling = REGIMES[name]
        for mode, depth in configs:  # warm-up: each mode's first scheduler, each depth's first cycles
            run_jobs(engine, mode, chat_requests(engine, prompts, 1, "ar" if depth is None else "mtp", depth,
                                                 8, sampling))
        tally = Tally()
        for r in range(rounds):
            for w in widths:
                for b in range(per_config // w):
                    for mode, depth in configs:  # side by side, batch by batch: this VM's speed drifts
                        key = f"{'ar' if depth is None else f'd{depth}'}_x{w}"
                        batch = chat_requests(engine, prompts[b * w:] + prompts[:b * w], w,
                                              "ar" if depth is None else "mtp", depth, max_tokens, sampling,
                                              seed0=1000 * r + 10 * b)
                        elapsed, results = run_jobs(engine, mode, batch)
                        tally.add(key, elapsed, results, depth is not None)
        tok_s = tally.tok_s()
        result: dict = {"tok_s": tok_s, "tokens_per_cycle": tally.tokens_per_cycle(), "cost": {}, "growth": {}}
        for w in widths:
            for d in depths:
                key = f"d{d}_x{w}"
                result["cost"][key] = result["tokens_per_cycle"][key] * tok_s[f"ar_x{w}"] / tok_s[key]
        for w in widths:
            result["growth"][str(w)] = [round(result["cost"][f"d{d}_x{w}"] / result["cost"][f"d{d}_x{widths[0]}"], 3)
                                        for d in depths]
        out[name] = result
        print(name, "cost", json.dumps({k: round(v, 3) for k, v in result["cost"].items()}), flush=True)
        print(name, "growth", json.dumps(result["growth"]), flush=True)
    return out


def engine_arguments(ap: argparse.ArgumentParser) -> None:
    """The engine's options (--model, --head, --device, --dtype, --threads)."""
    ap.add_argument("--model", default=None, help="a .gguf or HF directory (default: the default model)")
    ap.add_argument("--head", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    engine_arguments(ap)
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--regimes", default="greedy,t0.7,t1.0", help=f"of: {', '.join(REGIMES)}")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    import mtplx
    from mtplx.benchmarking import BENCH_PROMPTS

    if args.threads:
        torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    if widths[0] != 1 or any(max(widths) % w for w in widths):
        ap.error("--widths must start at 1 and each must divide the largest")
    t0 = time.perf_counter()
    engine = mtplx.load(args.model, head=args.head, device=args.device, dtype=args.dtype)
    report = {"engine_build_s": round(time.perf_counter() - t0, 1), "device": str(engine.device),
              "cost_machine": engine.cost_machine, "cpu": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "widths": widths,
              "regimes": measure(engine, list(BENCH_PROMPTS), widths, [int(d) for d in args.depths.split(",")],
                                 args.regimes.split(","), args.max_tokens, args.rounds)}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
