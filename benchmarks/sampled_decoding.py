"""MTP at every temperature (issue 15): AR and MTP at fixed depths and depth="auto", with argmax
and mirror drafts, greedy and sampled, on held-out chat prompts, side by side in one run;
then the scheduler at 1, 4 and 8 streams, hyper vs serial, and one client's requests in turn
through mtp_batch vs serial, with sampling.

    PYTHONPATH=. python benchmarks/sampled_decoding.py --model GGUF [--head DIR] --out FILE.json
        [--device cuda] [--max-tokens 256] [--prompts 12] [--no-scheduler | --scheduler-only]
        [--scheduler-rounds N] [--repeats N] [--regimes greedy,t0.7,t1.0] [--scheduler-depths 1,2,3,auto]
        [--ignore-eos] [--head-quantize int8] [--scheduler-widths 1,4,8] [--scheduler-varied-lengths]

The prompts (``HELD_OUT_CHAT``) were written for this benchmark: none is a bench prompt
(``mtplx bench``, ``mtplx tune``), a forge training prompt or one of forge's held-out prompts
(which select heads), so nothing was trained or tuned on them. Wall-clock through
``engine.generate`` (decode tok/s after the first token) and the in-process scheduler.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HELD_OUT_CHAT = (
    "My tomato plants have yellow leaves at the bottom. What could be wrong and how do I fix it?",
    "Write a short cover letter for a junior data analyst position at a logistics company.",
    "How does a refrigerator keep food cold? Explain it to a twelve-year-old.",
    "Write a JavaScript function that removes duplicate values from an array and explain how it works.",
    "What should I pack for a three-day hiking trip in the mountains in autumn?",
    "Compare renting and buying a home for someone who may move cities in four years.",
    "Write a limerick about a cat who is afraid of cucumbers.",
    "Explain what a hash table is and why lookups are usually fast.",
    "Give me a weekly plan to start running if I have never run before.",
    "Translate into plain English: 'The party of the first part shall indemnify the party of the second part.'",
    "What are three common mistakes people make when writing SQL queries, with examples?",
    "Describe the water cycle in five steps.",
)

REGIMES = {"greedy": {}, "t0.7": {"temperature": 0.7, "top_p": 0.95, "seed": 1234},
           "t1.0": {"temperature": 1.0, "seed": 1234}}
# more temperatures with top-p 0.95 (--regimes): where mirror drafts start to pay
REGIMES.update({f"t{t}p": {"temperature": t, "top_p": 0.95, "seed": 1234} for t in (0.8, 0.9, 1.0)})
DEFAULT_REGIMES = "greedy,t0.7,t1.0"


def check_held_out() -> None:
    from mtplx.benchmarking import BENCH_PROMPTS
    from mtplx.forge.prompts import HELD_OUT_PROMPTS, training_prompts

    used = {p.strip().lower() for p in (*BENCH_PROMPTS, *HELD_OUT_PROMPTS, *training_prompts())}
    clash = [p for p in HELD_OUT_CHAT if p.strip().lower() in used]
    if clash:
        raise SystemExit(f"held-out prompts used elsewhere: {clash}")


def decoding(engine, prompts, max_tokens: int, depths, regimes: list[str], repeats: int = 1,
             ignore_eos: bool = False) -> dict:
    from mtplx.benchmarking import measure, render_table

    out = {}
    for name in regimes:
        sampling = {**REGIMES[name], **({"ignore_eos": True} if ignore_eos else {})}
        policies = ("greedy",) if not REGIMES[name] else ("greedy", "mirror")
        t0 = time.perf_counter()
        out[name] = measure(engine, depths=depths, prompts=prompts, max_tokens=max_tokens, repeats=repeats,
                            draft_policies=policies, **sampling)
        out[name]["wall_s"] = time.perf_counter() - t0
        for r in out[name]["configs"].values():
            r.pop("token_ids", None)
        print(f"{name} {sampling}:\n{render_table(out[name])}", flush=True)
    return out


def chat_requests(engine, prompts, n: int, mode: str | None, depth, max_tokens: int, sampling: dict,
                  draft_policy: str = "auto", seed0: int = 0, varied: bool = False) -> list:
    """n chat requests over ``prompts`` in turn, each run to ``max_tokens`` past EOS (the
    scheduler runs' requests); in a seeded regime request i gets seed ``seed0 + i``. varied:
    request i runs to ``varied_length(i, max_tokens)`` instead, so that rows end apart."""
    return [engine.make_request([{"role": "user", "content": prompts[i % len(prompts)]}], chat=True, mode=mode,
                                depth=depth if mode == "mtp" else None, ignore_eos=True, draft_policy=draft_policy,
                                max_tokens=varied_length(i, max_tokens) if varied else max_tokens,
                                **{**sampling, **({"seed": seed0 + i} if "seed" in sampling else {})})
            for i in range(n)]


def varied_length(i: int, max_tokens: int) -> int:
    """Request i's length in a run of varied lengths: from half to 1.5x ``max_tokens``, spread."""
    return max(1, max_tokens // 2 + (i * 29) % (max_tokens + 1))


class Tally:
    """Runs' totals by configuration key: tokens and seconds (tok/s over all runs, and the best
    run's), and for MTP runs accepted drafts and cycles (tokens a cycle and row: 1 + accepted /
    cycles)."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.best: dict[str, float] = {}
        self.accepted: dict[str, int] = {}
        self.cycles: dict[str, int] = {}

    def add(self, key: str, elapsed: float, results: list, mtp: bool) -> None:
        n = sum(res.completion_tokens for res in results)
        self.tokens[key] = self.tokens.get(key, 0) + n
        self.seconds[key] = self.seconds.get(key, 0.0) + elapsed
        self.best[key] = max(self.best.get(key, 0.0), n / elapsed)
        if mtp:
            self.accepted[key] = self.accepted.get(key, 0) + sum(res.stats["accepted_tokens"] for res in results)
            self.cycles[key] = self.cycles.get(key, 0) + sum(res.stats["verify_calls"] for res in results)

    def tok_s(self) -> dict[str, float]:
        return {key: self.tokens[key] / self.seconds[key] for key in self.tokens}

    def tokens_per_cycle(self) -> dict[str, float]:
        return {key: 1 + self.accepted[key] / max(self.cycles[key], 1) for key in self.cycles}


def scheduler(engine, prompts, max_tokens: int, depth, regimes: list[str], rounds: int = 1,
              draft_policy: str = "auto") -> dict:
    """mtp_batch and ar_batch at 1, 4 and 8 streams (best of ``rounds``), hyper vs serial, and
    one stream of the same seeded requests through mtp_batch vs serial (each submitted when the
    last finished: a lone client's view, byte-identical outputs expected), with each request's
    ``draft_policy`` (default "auto": each request's default)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu import run_jobs, run_stream

    def requests(n: int, mode: str | None, sampling: dict, seed0: int = 0) -> list:
        return chat_requests(engine, prompts, n, mode, depth, max_tokens, sampling, draft_policy, seed0)

    out = {}
    for name in regimes:
        sampling = REGIMES[name]
        entry = out[name] = {}
        for mode, gen_mode in (("mtp_batch", "mtp"), ("ar_batch", "ar")):
            run_jobs(engine, mode, requests(1, gen_mode, sampling))  # warm-up
            for streams in (1, 4, 8):
                best = 0.0
                for _ in range(rounds):
                    elapsed, results = run_jobs(engine, mode, requests(streams, gen_mode, sampling))
                    best = max(best, sum(r.completion_tokens for r in results) / elapsed)
                entry[f"{mode}_tok_s_x{streams}"] = best
        if sampling:  # hyper vs serial: the same seeded requests, best of three interleaved
            runs = {"serial": [], "hyper": []}
            for _ in range(3):
                for mode in runs:
                    elapsed, results = run_jobs(engine, mode, requests(len(prompts), None, sampling, 100))
                    runs[mode].append((sum(r.completion_tokens for r in results) / elapsed, results))
            serial, hyper = (max(runs[m], key=lambda t: t[0]) for m in ("serial", "hyper"))
            entry["serial_tok_s"], entry["hyper_tok_s"] = serial[0], hyper[0]
            entry["hyper_over_serial"] = hyper[0] / serial[0]
            entry["hyper_byte_identical"] = all(a.token_ids == b.token_ids for a, b in zip(serial[1], hyper[1]))
            streams = {"serial": [], "mtp_batch": []}  # one client, the same requests in turn
            for _ in range(3):
                for mode in streams:
                    elapsed, results = run_stream(engine, mode, requests(len(prompts), "mtp", sampling, 100))
                    streams[mode].append((sum(r.completion_tokens for r in results) / elapsed, results))
            serial, batch = (max(streams[m], key=lambda t: t[0]) for m in ("serial", "mtp_batch"))
            entry["serial_stream_tok_s"], entry["mtp_batch_stream_tok_s"] = serial[0], batch[0]
            entry["mtp_batch_stream_over_serial"] = batch[0] / serial[0]
            entry["mtp_batch_stream_byte_identical"] = all(a.token_ids == b.token_ids
                                                           for a, b in zip(serial[1], batch[1]))
        print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in entry.items()}), flush=True)
    return out


def scheduler_depths(engine, prompts, max_tokens: int, depths: list, regimes: list[str], rounds: int = 1,
                     draft_policy: str = "auto", requests_per_run: int = 0, variants: dict | None = None,
                     widths: tuple[int, ...] = (1, 4, 8), per_stream: bool = False, varied: bool = False) -> dict:
    """mtp_batch at each of ``depths`` and ar_batch at 1, 4 and 8 streams (``widths``), the configurations
    alternating within each round: which depth pays at which width. With ``requests_per_run``
    (n > 0), each run is n requests over every prompt in turn, decoded by that many clients in a
    closed loop (``gpu.run_clients``: each client sends its next request when its last one
    ends), the same n requests at every width; else (0) a run is one request per stream, all sent
    at once, so that 1 stream decodes the first prompt alone; with ``per_stream``, n requests a
    client (n x streams a run), so that a wide run lasts as long as a narrow one. Round r of a seeded regime
    gives request i seed 1000 r + i (one seed fixes one trajectory per prompt); each
    configuration's tok/s is over all its rounds (tokens / seconds), "best" its best round; MTP
    configurations also report tokens per cycle and row (1 + accepted / cycles). ``variants``
    ({name: setup}) adds a depth="auto" configuration per name ("auto@name" in the keys), each
    run after its ``setup()`` (which swaps the engine's auto-depth table: auto_tables.py), and the
    last setup is undone by a final ``variants["restore"]()`` where given."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu import run_clients, run_jobs

    variants = dict(variants or {})
    restore = variants.pop("restore", None)
    depths = list(depths) + [f"auto@{name}" for name in variants]

    def depth_of(depth):
        if isinstance(depth, str) and depth.startswith("auto@"):
            variants[depth[5:]]()
            return "auto"
        if restore is not None:
            restore()
        return depth

    out = {}
    for name in regimes:
        sampling = REGIMES[name]

        def requests(n: int, depth, seed0: int = 0) -> list:
            return chat_requests(engine, prompts, n, "ar" if depth is None else "mtp", depth, max_tokens, sampling,
                                 draft_policy, seed0, varied)

        configs = [("ar_batch", None)] + [("mtp_batch", d) for d in depths]
        for mode, depth in configs:
            run_jobs(engine, mode, requests(1, depth_of(depth)))  # warm-up
        tally = Tally()
        for r in range(rounds):
            for streams in widths:
                for mode, depth in configs:
                    count = requests_per_run * (streams if per_stream else 1) or streams
                    elapsed, results = run_clients(engine, mode, requests(count, depth_of(depth), 1000 * r), streams)
                    tally.add(f"{mode}{'' if depth is None else f'_d{depth}'}_tok_s_x{streams}", elapsed, results,
                              depth is not None)
        result = tally.tok_s()
        result.update({f"best_{key}": value for key, value in tally.best.items()})
        result.update({key.replace("_tok_s_", "_tokens_per_cycle_"): value
                       for key, value in tally.tokens_per_cycle().items()})
        for streams in widths:
            ar = result[f"ar_batch_tok_s_x{streams}"]
            for depth in depths:
                result[f"mtp_d{depth}_over_ar_x{streams}"] = result[f"mtp_batch_d{depth}_tok_s_x{streams}"] / ar
        out[name] = result
        print(name, json.dumps({k: round(v, 3) for k, v in result.items() if "_over_" in k}), flush=True)
    if restore is not None:
        restore()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf or HF directory (default: the default model)")
    ap.add_argument("--head", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quantize", default=None, help="the trunk's weights: none, gguf, int4, int8, fp8")
    ap.add_argument("--head-quantize", default=None, help="the MTP head's linear weights: int8, int4 or fp8")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=len(HELD_OUT_CHAT))
    ap.add_argument("--depths", default="1,2,3,auto")
    ap.add_argument("--repeats", type=int, default=1,
                    help="passes over the prompts, configurations interleaved (sampled regimes: a new seed each)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="engine.generate's requests run to --max-tokens past EOS (as the scheduler runs' do)")
    ap.add_argument("--scheduler-depth", default="1", help="the MTP depth of the scheduler runs (or auto)")
    ap.add_argument("--scheduler-depths", default=None,
                    help="instead of the full scheduler run: mtp_batch at these depths (e.g. 1,2,3,auto) and "
                         "ar_batch at 1/4/8 streams, alternating")
    ap.add_argument("--no-scheduler", action="store_true")
    ap.add_argument("--scheduler-only", action="store_true", help="skip the engine.generate part")
    ap.add_argument("--scheduler-rounds", type=int, default=1,
                    help="mtp_batch / ar_batch rounds per width (with --scheduler-depths a new seed each, tok/s "
                         "over all rounds; else the best round)")
    ap.add_argument("--scheduler-draft-policy", default="auto", help="the scheduler requests' draft policy")
    ap.add_argument("--scheduler-requests", type=int, default=0,
                    help="--scheduler-depths: each run decodes this many requests (every prompt in turn) "
                         "through as many closed-loop clients as streams (0: one request a stream, sent at once)")
    ap.add_argument("--scheduler-widths", default="1,4,8", help="--scheduler-depths: the streams of its runs")
    ap.add_argument("--scheduler-varied-lengths", action="store_true",
                    help="--scheduler-depths: request i runs to half to 1.5x --max-tokens (varied_length), so "
                         "that rows end apart and new ones join a running batch, as under real traffic; else "
                         "every request runs to --max-tokens")
    ap.add_argument("--beside", default=None, choices=("auto", "off"),
                    help="where the scheduler runs' new prompts go while a chain runs (Generator.beside; "
                         "default: the engine's)")
    ap.add_argument("--regimes", default=DEFAULT_REGIMES, help=f"of: {', '.join(REGIMES)}")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.scheduler_depths and args.no_scheduler:
        raise SystemExit("--scheduler-depths is a scheduler run: drop --no-scheduler")
    check_held_out()
    regimes = args.regimes.split(",")
    if unknown := [r for r in regimes if r not in REGIMES]:
        raise SystemExit(f"unknown regimes {unknown}; known: {', '.join(REGIMES)}")

    import torch

    import mtplx
    from mtplx.commands.common import parse_depth, parse_depths

    t0 = time.perf_counter()
    engine = mtplx.load(args.model, device=args.device, dtype=args.dtype, head=args.head, quantize=args.quantize,
                        **({"head_quantize": args.head_quantize} if args.head_quantize else {}))
    report = {"engine_build_s": time.perf_counter() - t0, "device": str(engine.device), "dtype": str(engine.dtype),
              "torch": torch.__version__, "max_tokens": args.max_tokens, "auto_depth": repr(engine.auto_depth),
              "quantize": args.quantize, "head": args.head, "prompts": list(HELD_OUT_CHAT[: args.prompts]),
              "scheduler_requests": args.scheduler_requests}
    if engine.device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    if args.beside:
        engine.generator.beside = args.beside
    report["beside"] = engine.generator.beside
    if not args.scheduler_only:
        with torch.inference_mode():
            report["decoding"] = decoding(engine, report["prompts"], args.max_tokens, parse_depths(args.depths),
                                          regimes, args.repeats, args.ignore_eos)
    if args.scheduler_depths:
        depths = [parse_depth(d.strip()) for d in args.scheduler_depths.split(",")]
        report["scheduler_depths"] = scheduler_depths(engine, report["prompts"], args.max_tokens, depths, regimes,
                                                      args.scheduler_rounds, args.scheduler_draft_policy,
                                                      args.scheduler_requests,
                                                      widths=tuple(int(w) for w in args.scheduler_widths.split(",")),
                                                      varied=args.scheduler_varied_lengths)
    elif not args.no_scheduler:
        report["scheduler"] = scheduler(engine, report["prompts"], args.max_tokens, parse_depth(args.scheduler_depth),
                                        regimes, args.scheduler_rounds, args.scheduler_draft_policy)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
