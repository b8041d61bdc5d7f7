"""Where a batched cycle's time goes (issue 15): mtp_batch against ar_batch at several widths,
each run plainly ``--rounds`` times, the two modes alternating (wall time, steps, tokens; the
pair's entry "REGIME/xWIDTH" holds the ratio over all rounds and the median round's), then once
under the CUDA profiler (kernel time per step, launches per step, the costliest kernels). A low
busy share (kernel time over wall time) means the host, not the GPU, sets the pace.

    PYTHONPATH=. python benchmarks/scheduler_profile.py --model GGUF --head DIR --out FILE.json
        [--widths 4,8] [--regimes t0.7] [--max-tokens 128] [--depth 1] [--draft-policy auto]
        [--per-stream 3] [--rounds 5] [--cprofile] [--graph-time] [--trace DIR] [--split] [--chain]

Requests are the held-out chat prompts of ``sampled_decoding.py``, run past EOS.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from gpu import run_clients  # noqa: E402
from gpu_profile import kernel_rows  # noqa: E402
from sampled_decoding import HELD_OUT_CHAT, REGIMES, chat_requests  # noqa: E402


class StepCounter:
    """Counts ``Engine.step`` calls (one per scheduler cycle) and the host seconds inside them,
    and splits the wall time between steps that started a chain of cycles (the first cycle
    from the host's state: rows the chain could not keep or take, or a depth changed), steps
    where rows joined a running chain, and steps that continued one (``Generator.observers``'
    "chain_start" and "chain_join")."""

    def __init__(self, engine, split: bool = False):
        self.engine, self.inner = engine, None
        self.calls, self.seconds = 0, 0.0
        self.event = None  # the current step's chain event: "chain_start" over "chain_join"
        self.kinds = {"chain_start": [0, 0.0], "chain_join": [0, 0.0], "continued": [0, 0.0]}  # -> [steps, wall s]
        self.last_end: float | None = None
        # split: host seconds in ``split_functions``, per kind of step (the work since the step before's end)
        self.split = {kind: collections.Counter() for kind in self.kinds} if split else None
        self.pending = collections.Counter()
        self.wrapped: list = []  # (owner, name, what its class dict held, or None)

    def observe(self, event, seq) -> None:
        if event == "chain_start" or (event == "chain_join" and self.event is None):
            self.event = event

    def __enter__(self):
        self.last_end = None  # (a counter entered again, a later round: the time between runs is no step's)
        self.inner = self.engine.step

        def step(seqs):
            t0 = time.perf_counter()
            self.event = None
            try:
                return self.inner(seqs)
            finally:
                end = time.perf_counter()
                self.calls += 1
                self.seconds += end - t0
                if self.last_end is not None:  # wall from the last step's end: the scheduler's work between included
                    kind = self.kinds[self.event or "continued"]
                    kind[0] += 1
                    kind[1] += end - self.last_end
                    if self.split is not None:
                        self.split[self.event or "continued"].update(self.pending)
                self.pending.clear()
                self.last_end = end
        self.engine.step = step
        self.engine.generator.observers.append(self.observe)
        try:
            for owner, name, label in split_functions() if self.split is not None else ():
                self._time(owner, name, label)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _time(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)  # (the function itself: each is a plain method of its own class)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.pending[label] += time.perf_counter() - t0
        self.wrapped.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, timed)

    def __exit__(self, *exc):
        self.engine.step = self.inner
        self.engine.generator.observers.remove(self.observe)
        for owner, name, held in reversed(self.wrapped):  # each class as it was
            if held is None:
                delattr(owner, name)
            else:
                setattr(owner, name, held)
        self.wrapped.clear()

    def breakdown(self) -> dict:
        """Per kind of step: how many, and the mean wall us from the step before's end to its end
        (each run's first step has no step before: the kinds count one step a run fewer than
        ``calls``)."""
        out = {kind: {"steps": n, "wall_us_per_step": round(s * 1e6 / n, 1) if n else None}
               for kind, (n, s) in self.kinds.items()}
        for kind, spent in (self.split or {}).items():
            n = self.kinds[kind][0]
            out[kind]["host_us_in"] = {label: round(t * 1e6 / n, 1) for label, t in spent.most_common()} if n else {}
        return out


def split_functions() -> list[tuple]:
    """What ``--split`` times on the host (nested ones count in both): a new row's prefill (its
    trunk forward and first token, which waits for the device), the head's catch-up of its
    prompt, the chain's launch of the next cycle (and within it the blocks' reservation, a
    joining row's inputs and the next cycle's launch), the wait for the cycle in flight and its
    commit, an unchained cycle's start, and the rows' next depths with depth="auto" rows'
    running estimates (their bookkeeping)."""
    from mtplx.engine.adaptive_depth import DepthPlan
    from mtplx.engine.chain import CycleChain
    from mtplx.engine.generator import Generator
    from mtplx.engine.runner import ModelRunner

    return [(Generator, "prefill", "prefill"), (Generator, "_sample_rows", "sample (prefill's first token, AR)"),
            (Generator, "_head_pre_feed", "head pre-feed"), (CycleChain, "advance", "chain advance (launch)"),
            (CycleChain, "reserve", "launch: reserve (blocks, tables)"),
            (ModelRunner, "join_cycle", "launch: new rows' inputs (join_cycle)"),
            (ModelRunner, "next_cycle", "launch: the next cycle (noise, replay)"),
            (Generator, "_read_launch", "read launch (wait)"), (Generator, "_commit_launch", "commit"),
            (Generator, "drain", "drain"), (Generator, "_start_chain", "start chain"),
            (Generator, "next_depths", "next depths"), (DepthPlan, "observe", "auto rows' estimates (observe)")]


def host_profile(engine, mode: str, requests: list, clients: int, steps: int, lines: int = 30) -> list[dict]:
    """The model-owner thread under cProfile for one run: the functions with the most own time,
    in microseconds per step (cProfile's overhead inflates them all; compare shares)."""
    import cProfile
    import pstats

    from mtplx.batching.scheduler import Scheduler

    prof, inner = cProfile.Profile(), Scheduler._run

    def run(self):
        prof.enable()
        try:
            inner(self)
        finally:
            prof.disable()

    Scheduler._run = run
    try:
        run_clients(engine, mode, requests, clients)
    finally:
        Scheduler._run = inner
    stats = pstats.Stats(prof).stats
    rows = [(f"{Path(f).name}:{line} {fn}", calls, tt, ct) for (f, line, fn), (_, calls, tt, ct, _) in stats.items()]

    def listed(key):
        return [{"function": name, "calls_per_step": round(calls / steps, 2), "own_us": round(tt * 1e6 / steps, 1),
                 "cumulative_us": round(ct * 1e6 / steps, 1)} for name, calls, tt, ct in sorted(rows, key=key)[:lines]]
    return {"by_own": listed(lambda r: -r[2]), "by_cumulative": listed(lambda r: -r[3])}


class GraphTimer:
    """The GPU's own time in each chained cycle's graph and in the host's noise work before it
    (each sampling row's draws up to 79ea6e6; since 8e4e50c one copy of the rows' noise plan,
    the draws being in the graph): CUDA events around that work and the replay of every
    ``CudaGraphs.run_chained``. Against the wall time per step it says whether the device or
    the host sets the pace (events queued behind a busy stream still time only the work between
    them; a GPU left idle while the host queues that work counts it)."""

    def __init__(self, graphs):
        self.graphs, self.inner, self.pairs = graphs, graphs.run_chained, []

    def __enter__(self):
        import torch

        def run_chained(seqs, depth, variant="greedy", ghosts=frozenset()):
            g = self.graphs.chained(len(seqs), depth, variant)
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record()
            more = (ghosts,) if ghosts else ()  # (trees before the chain's ghost rows take no ghosts)
            g.buffers.draw_noise(seqs, *more)
            marks[1].record()
            draw, replay = g.buffers.draw_noise, g.graph.replay
            g.buffers.draw_noise = lambda *args: None  # drawn above
            g.graph.replay = lambda: (replay(), marks[2].record())
            try:
                return self.inner(seqs, depth, variant, *more)
            finally:
                g.buffers.draw_noise, g.graph.replay = draw, replay
                self.pairs.append(marks)
        self.graphs.run_chained = run_chained
        return self

    def __exit__(self, *exc):
        import torch

        self.graphs.run_chained = self.inner
        torch.cuda.synchronize()

    def per_step(self, steps: int) -> dict:
        noise = sum(a.elapsed_time(b) for a, b, _ in self.pairs) * 1e3
        graph = sum(b.elapsed_time(c) for _, b, c in self.pairs) * 1e3
        return {"chained_launches_per_step": len(self.pairs) / steps, "gpu_noise_us_per_step": noise / steps,
                "gpu_graph_us_per_step": graph / steps}


class ModeRuns:
    """One mode's runs at one width and regime: its requests (the same list every run; with
    ``per_stream`` > 1 their lengths vary, so rows end apart and new ones join a running batch)
    and its plain runs, added up over rounds."""

    def __init__(self, engine, mode: str, width: int, sampling: dict, depth, max_tokens: int, draft_policy: str,
                 per_stream: int, beside: str | None = None):
        self.engine, self.mode, self.width, self.beside = engine, mode, width, beside
        self.sampling, self.depth, self.max_tokens = sampling, depth, max_tokens
        self.draft_policy, self.per_stream = draft_policy, per_stream
        self.counter = StepCounter(engine)
        self.elapsed, self.tokens, self.rounds = 0.0, 0, []  # rounds: each plain run's tok/s

    def requests(self) -> list:
        return chat_requests(self.engine, HELD_OUT_CHAT, self.width * self.per_stream,
                             "mtp" if self.mode == "mtp_batch" else "ar", self.depth, self.max_tokens, self.sampling,
                             self.draft_policy, 7, varied=self.per_stream > 1)

    def run(self):  # ``width`` clients in a closed loop
        gen = self.engine.generator
        held, gen.beside = gen.beside, self.beside or gen.beside
        try:
            return run_clients(self.engine, self.mode, self.requests(), self.width)
        finally:
            gen.beside = held

    def plain(self) -> None:
        """One run counted: its wall time, tokens and steps (by kind)."""
        with self.counter:
            elapsed, results = self.run()
        tokens = sum(r.completion_tokens for r in results)
        self.elapsed += elapsed
        self.tokens += tokens
        self.rounds.append(tokens / elapsed)


def one(config: ModeRuns, cprofile: bool = False, graph_time: bool = False, trace: Path | None = None,
        split: bool = False, profile_run: bool = True) -> dict:
    """The plain runs' figures (over every round), then one run under the CUDA profiler (and
    cProfile, CUDA events where asked); ``trace``: where that run's kernel timeline goes, as a
    Chrome trace (chrome://tracing, ui.perfetto.dev): the device's idle gaps between steps. The
    model thread's own ops are not on it (the profiler records the thread that started it).
    profile_run=False: the plain runs' figures alone."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine, mode, width, run, plain = config.engine, config.mode, config.width, config.run, config.counter
    elapsed, tokens = config.elapsed, config.tokens
    wall_us = elapsed * 1e6 / plain.calls
    figures = {"tok_s": tokens / elapsed, "rounds_tok_s": [round(t, 1) for t in config.rounds],
               "steps": plain.calls, "tokens_per_step": tokens / plain.calls, "wall_us_per_step": wall_us,
               "host_us_in_step": plain.seconds * 1e6 / plain.calls, "steps_by_kind": plain.breakdown()}
    if not profile_run:
        return figures
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    with StepCounter(engine) as profiled, profile(activities=[activity]) as prof:
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    rows = kernel_rows(prof, profiled.calls, name_chars=80)
    kernel_us = sum(r[2] for r in rows)
    per_run = plain.calls / len(config.rounds)  # the one profiled run's steps, as a plain run's
    extra = {"host_profile": host_profile(engine, mode, config.requests(), width, per_run)} if cprofile else {}
    if split:  # a run of its own: the timers' cost (about 0.4 us a call) stays out of the plain runs' figures
        with StepCounter(engine, split=True) as timed:
            run()
        extra["split_steps_by_kind"] = timed.breakdown()
    if graph_time and engine.runner.graphs is not None:
        with StepCounter(engine) as timed, GraphTimer(engine.runner.graphs) as timer:
            run()
        extra["graph_time"] = timer.per_step(timed.calls)
    return {**extra, **figures,
            "kernel_us_per_step": kernel_us, "launches_per_step": sum(r[1] for r in rows),
            "busy_share": kernel_us / wall_us,
            "top": [{"name": n, "count": round(c, 2), "us": round(us, 2)} for n, c, us in rows[:60]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--head", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (no kernel times)")
    ap.add_argument("--widths", default="4,8")
    ap.add_argument("--regimes", default="t0.7")
    ap.add_argument("--depth", default="1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-policy", default="auto", help="the MTP requests' draft policy")
    ap.add_argument("--per-stream", type=int, default=1,
                    help="requests per client, in a closed loop; over 1, their lengths vary from half to 1.5x "
                         "--max-tokens (rows leave and join a running batch)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="plain runs of each mode, mtp_batch and ar_batch alternating; tok/s over all of them, "
                         "and the median of the rounds' ratios")
    ap.add_argument("--cprofile", action="store_true", help="also profile the model-owner thread's Python")
    ap.add_argument("--trace", default=None,
                    help="a folder: each configuration's profiled run as a Chrome trace there "
                         "(REGIME_MODE_xWIDTH.json)")
    ap.add_argument("--graph-time", action="store_true",
                    help="also time each chained cycle's graph and noise draws on the GPU (CUDA events)")
    ap.add_argument("--split", action="store_true",
                    help="one more run, with host time per kind of step in a new row's prefill, the head's "
                         "pre-feed, the chain's launch, the wait, the commit and auto's bookkeeping "
                         "(split_functions)")
    ap.add_argument("--chain", action="store_true",
                    help="chain cycles where the engine would not (the CPU: eagerly, op by op): the chain's "
                         "starts, joins and continued steps, and --split's host times, without a GPU")
    ap.add_argument("--beside", default=None,
                    help="where a prompt that arrives at a running chain runs (Generator.beside; default: the "
                         "engine's): auto (beside it, on a second CUDA stream), off (the step waits for it), "
                         "or both, alternating (auto,off: each mode once per setting a round)")
    ap.add_argument("--plain", action="store_true", help="the plain runs alone (no profiled run)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    besides = args.beside.split(",") if args.beside else [None]
    if bad := [b for b in besides if b not in ("auto", "off", "inline", None)]:
        raise SystemExit(f"unknown --beside {bad}: auto, off or inline")
    if unknown := [r for r in args.regimes.split(",") if r not in REGIMES]:
        raise SystemExit(f"unknown regimes {unknown}; known: {', '.join(REGIMES)}")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")

    import torch

    import mtplx
    from mtplx.commands.common import parse_depth

    engine = mtplx.load(args.model, device=args.device, dtype=args.dtype, head=args.head)
    if args.chain:
        engine.generator.chain.enabled = True
    depth = parse_depth(args.depth)
    gpu = torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu"
    report = {"gpu": gpu, "torch": torch.__version__, "depth": args.depth,
              "max_tokens": args.max_tokens, "per_stream": args.per_stream, "rounds": args.rounds,
              "chained": engine.generator.chain.enabled, "beside": args.beside or engine.generator.beside,
              "runs": {}}
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)

    def tag(beside) -> str:  # a configuration's key suffix: its --beside setting where several alternate
        return f"@{beside}" if len(besides) > 1 else ""
    for regime in args.regimes.split(","):
        for width in (int(w) for w in args.widths.split(",")):
            configs = {f"{mode}{tag(b)}": ModeRuns(engine, mode, width, REGIMES[regime], depth, args.max_tokens,
                                                   args.draft_policy, args.per_stream, b)
                       for b in besides for mode in ("mtp_batch", "ar_batch")}
            for config in configs.values():
                config.run()  # warm-up
            for r in range(args.rounds):  # ABBA: neither mode always runs right after the other
                for config in list(configs.values())[:: 1 if r % 2 == 0 else -1]:
                    config.plain()
            for b in besides:
                mtp, ar = configs[f"mtp_batch{tag(b)}"], configs[f"ar_batch{tag(b)}"]
                ratios = [m / a for m, a in zip(mtp.rounds, ar.rounds)]
                report["runs"][f"{regime}/x{width}{tag(b)}"] = {
                    "mtp_over_ar": mtp.tokens / mtp.elapsed / (ar.tokens / ar.elapsed),
                    "median_round_ratio": statistics.median(ratios), "round_ratios": [round(x, 3) for x in ratios]}
            for mode, config in configs.items():
                trace = Path(args.trace) / f"{regime}_{mode}_x{width}.json" if args.trace else None
                r = report["runs"][f"{regime}/{mode}/x{width}"] = one(config, args.cprofile, args.graph_time, trace,
                                                                      args.split, not args.plain)
                print(f"{regime} {mode} x{width}: {r['tok_s']:.0f} tok/s, {r['tokens_per_step']:.2f} tok/step, "
                      f"wall {r['wall_us_per_step']:.0f} us/step (host in step {r['host_us_in_step']:.0f})"
                      + ("" if args.plain else f", kernels {r['kernel_us_per_step']:.0f} us in "
                         f"{r['launches_per_step']:.0f} launches, busy {r['busy_share']:.2f}"), flush=True)
                for k in r.get("top", [])[:8]:
                    print(f"    {k['us']:8.1f} us {k['count']:6.1f}x  {k['name']}")
                print("    steps: " + ", ".join(f"{k} {v['steps']} at {v['wall_us_per_step']} us"
                                            for k, v in r["steps_by_kind"].items()))
                for k, v in r.get("split_steps_by_kind", {}).items():
                    print(f"    split run, {k} ({v['steps']} at {v['wall_us_per_step']} us): "
                          + ", ".join(f"{f} {us}" for f, us in v["host_us_in"].items()))
                if "graph_time" in r:
                    print("    GPU per step: " + ", ".join(f"{k} {v:.1f}" for k, v in r["graph_time"].items()))
                for order in ("by_own", "by_cumulative"):
                    for f in r.get("host_profile", {}).get(order, [])[:25]:
                        print(f"    host {f['own_us']:8.1f} us own {f['cumulative_us']:8.1f} cum "
                              f"{f['calls_per_step']:6.1f}x  {f['function']}")
            for b in besides:
                pair = report["runs"][f"{regime}/x{width}{tag(b)}"]
                print(f"{regime} x{width}{tag(b)}: mtp_batch / ar_batch {pair['mtp_over_ar']:.3f} over {args.rounds} "
                      f"rounds (median round {pair['median_round_ratio']:.3f}: {pair['round_ratios']})", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
