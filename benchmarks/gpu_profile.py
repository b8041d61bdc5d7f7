"""Where a decode step's time goes on the GPU (issue 7 notes): kernel breakdown of one AR
trunk step, batch-1 matmul bandwidth per weight shape, and host overhead around a replay.

    PYTHONPATH=. python benchmarks/gpu_profile.py --out profile.json [--shapes qwen3-8b,smollm2-135m]
        [--gemv-sweep smollm2-135m,qwen3-1.7b,qwen3-8b [--gemv-rows 1,2,3,4,8]] [--no-steps]
        [--quant int4,int4/cuda-cores,int8 [--quant-group 32]]

Prints a table per shape; the JSON holds every number. ``--gemv-sweep`` times the GEMV
(mtplx/kernels/gemv.py) for each row count over a grid of tile configs against what it
replaces, and prints the best config per shape class and row count (``gemv.config_for``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from benchmarks.gpu import SHAPES, copy_bandwidth, random_engine, timed
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.sequence import Sequence


def kernel_rows(prof, per: float, name_chars: int = 100) -> list[tuple[str, float, float]]:
    """A profile's CUDA kernels by name: (name, launches, microseconds), each divided by ``per``
    (steps, tokens), costliest first."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name[ev.name[:name_chars]]
            entry[0] += 1
            entry[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return sorted(((n, c / per, us / per) for n, (c, us) in by_name.items()), key=lambda r: -r[2])


def kernel_breakdown(fn, steps: int = 5, top: int | None = 25) -> dict:
    """GPU kernel time per step by kernel name (torch.profiler over ``steps`` calls); ``top``:
    the costliest kernels listed (None: all)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = kernel_rows(prof, steps, name_chars=90)
    return {"kernels_per_step": sum(r[1] for r in rows), "gpu_us_per_step": sum(r[2] for r in rows),
            "top": [{"name": n, "count": c, "us": us} for n, c, us in rows[:top]]}


def gemv_bandwidth(device, shapes: dict[str, tuple[int, int]], copies: int, rows: int = 1) -> dict:
    """F.linear on [rows, in] x [out, in] bf16 weights, rotating over ``copies`` weights (more
    than the L2 holds) inside one CUDA graph; bytes of weight read per second."""
    out = {}
    for name, (n_out, n_in) in shapes.items():
        k = copies if n_out * n_in * 2 * copies < 24e9 else 1
        ws = [torch.randn(n_out, n_in, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(k)]
        x = torch.randn(rows, n_in, device=device, dtype=torch.bfloat16)
        reps = max(1, 36 // k)

        def body():
            for _ in range(reps):
                for w in ws:
                    F.linear(x, w)

        body()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        t = timed(g.replay, repeats=10) / (reps * k)
        out[name] = {"shape": [n_out, n_in], "rows": rows, "us": t * 1e6, "GBs": n_out * n_in * 2 / t / 1e9}
        ws = g = None
        torch.cuda.empty_cache()
    return out


def gemv_grid(rows: int) -> list[tuple[int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps) whose float32 accumulator (rows padded to a power of two x
    the tile) takes 16..64 registers a thread: fewer leave loads too small to fill the memory
    pipe, more cut the programs resident per multiprocessor or spill."""
    m = 1 << (rows - 1).bit_length()
    return [(bn, bk, w) for bn in (2, 4, 8, 16, 32) for bk in (256, 512, 1024) for w in (4, 8)
            if 16 <= m * bn * bk // (32 * w) <= 64]


def gemv_sweep(device, name: str, rows_list: list[int]) -> dict:
    """The GEMV for ``rows`` input rows with the prologue each projection gets in the decode block
    (norm before qkv and gate/up, SiLU * up before down) over ``gemv_grid``, against what it
    replaces (cuBLAS plus the separate elementwise kernel), 36 weight copies in a CUDA graph.
    Every config is checked against the baseline's output first. Returns {proj: {rows: entry}}
    with every config's time."""
    from concurrent.futures import ThreadPoolExecutor

    from mtplx.kernels import fused
    from mtplx.kernels.gemv import _launch

    out = {}
    for proj, (n_out, n_in) in projection_shapes(name).items():
        k = 36 if n_out * n_in * 2 * 36 < 24e9 else 1
        ws = [torch.randn(n_out, n_in, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(k)]
        reps = max(1, 36 // k)
        prologue = {"qkv": 1, "gate_up": 1, "down": 2}.get(proj, 0)
        nw = torch.randn(n_in, device=device, dtype=torch.bfloat16)
        out[proj] = {}
        for rows in rows_list:
            x = torch.randn(rows, n_in * (2 if prologue == 2 else 1), device=device, dtype=torch.bfloat16)
            delta = torch.randn(rows, n_in, device=device, dtype=torch.bfloat16)
            total = torch.empty_like(delta)

            def ours(w, cfg, x=x, delta=delta, total=total):
                return _launch(x, w, None, n_in, prologue, delta=delta if prologue == 1 else None,
                               norm_weight=nw if prologue == 1 else None, total=total, eps=1e-6, config=cfg)

            def theirs(w, x=x, delta=delta):
                if prologue == 1:
                    return F.linear(fused.rms_norm(x, nw, 1e-6, False, delta)[1], w)
                if prologue == 2:
                    return F.linear(fused.silu_mul(x), w)
                return F.linear(x, w)

            def graph_us(fn):
                fn(ws[0])
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(reps):
                        for w in ws:
                            fn(w)
                return timed(g.replay, repeats=7) / (reps * k) * 1e6

            grid = gemv_grid(rows)
            with ThreadPoolExecutor(16) as pool:  # compile the grid on several threads (minutes serially)
                list(pool.map(lambda cfg: ours(ws[0], cfg), grid))
            torch.cuda.synchronize()
            ref = theirs(ws[0]).float()
            times = {}
            for cfg in grid:
                total.fill_(float("nan"))
                got = ours(ws[0], cfg).float()
                err = float((got - ref).norm() / ref.norm())
                if not err <= 1e-2 or (prologue == 1 and not torch.equal(total, fused.rms_norm(x, nw, 1e-6, False,
                                                                                                 delta)[0])):
                    raise SystemExit(f"FAIL: gemv {name} {proj} rows {rows} config {cfg}: rel err {err}")
                times[cfg] = graph_us(lambda w, cfg=cfg: ours(w, cfg))
            best = min(times, key=times.get)
            entry = {"shape": [n_out, n_in], "prologue": prologue, "baseline_us": graph_us(theirs),
                     "ours_us": times[best], "config": list(best),
                     "configs": {",".join(map(str, c)): t for c, t in times.items()}}
            out[proj][rows] = entry
            print(f"  {name} {proj:8s} rows {rows} (prologue {prologue}): cuBLAS+elementwise "
                  f"{entry['baseline_us']:7.1f} us  ours {times[best]:7.1f} us {best}", flush=True)
        ws = None
        torch.cuda.empty_cache()
    return out


def best_per_class(sweeps: dict) -> dict:
    """The config that serves each (shape class of ``gemv.config_for``, rows) best: the least
    sum over the class's projections of time / that projection's best time."""
    from mtplx.kernels.gemv import SMALL_WEIGHT

    def shape_class(n, k, rows):
        if rows == 1:
            return "lm_head" if n >= 65536 else "small" if n * k <= SMALL_WEIGHT else "down" if k > n else "other"
        return "large" if n * k > SMALL_WEIGHT else "small_wide" if n > k else "small"  # large: cuBLAS (usable)

    groups = defaultdict(list)
    for name, projs in sweeps.items():
        for proj, by_rows in projs.items():
            for rows, e in by_rows.items():
                groups[(shape_class(*e["shape"], rows), rows)].append((f"{name}/{proj}", e))
    out = {}
    for (cls, rows), members in sorted(groups.items()):
        common = set.intersection(*(set(e["configs"]) for _, e in members))
        score = {c: sum(e["configs"][c] / e["ours_us"] for _, e in members) / len(members) for c in common}
        best = min(score, key=score.get)
        speedups = {m: round(e["baseline_us"] / e["configs"][best], 2) for m, e in members}
        out[f"{cls}/rows{rows}"] = {"config": best, "slowdown_vs_each_best": round(score[best], 3),
                                    "speedup_vs_cublas": speedups}
        print(f"  {cls:8s} rows {rows}: ({best})  {score[best]:.3f}x each projection's best;"
              f"  speed-up over cuBLAS+elementwise {speedups}", flush=True)
    return out


def projection_shapes(name: str) -> dict[str, tuple[int, int]]:
    cfg = SHAPES[name]
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    qd, kvd = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    return {"qkv": (qd + 2 * kvd, h), "o": (h, qd), "gate_up": (2 * i, h), "down": (h, i),
            "lm_head": (cfg["vocab_size"], h)}


def prefilled(engine, context: int = 128) -> Sequence:
    """A sequence holding ``context`` prompt tokens in the engine's cache (free it after)."""
    seq = Sequence(prompt_ids=list(range(1, context + 1)), params=SamplingParams(), max_tokens=1)
    engine.runner.blocks.allocate(seq.seq_id, seq.prompt_ids)
    engine.runner.blocks.ensure_capacity(seq.seq_id, context + 8)  # the steps profiled after it
    with torch.inference_mode():
        engine.runner.trunk([seq], [seq.prompt_ids], [0])
    return seq


def host_overhead(engine) -> dict:
    """AR step pieces at a 128-token context: graph replay alone, runner.trunk (fills inputs,
    replays), runner.trunk + logits + argmax + .item() (a sync), and the engine's whole step."""
    runner = engine.runner
    seq = prefilled(engine)
    out = {}
    with torch.inference_mode():
        runner.trunk([seq], [[5]], [128])
        g = runner.graphs.graphs[("trunk", 1, 1)]
        out["replay_only_us"] = timed(g.graph.replay) * 1e6
        out["runner_trunk_us"] = timed(lambda: runner.trunk([seq], [[5]], [128])) * 1e6

        def wall(fn, n=50):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n * 1e6

        out["trunk_wall_us"] = wall(lambda: runner.trunk([seq], [[5]], [128]))
        out["trunk_logits_argmax_item_wall_us"] = wall(
            lambda: runner.logits(runner.trunk([seq], [[5]], [128])[:, -1]).argmax(-1).item())
    runner.blocks.free(seq.seq_id)
    req = engine.make_request(list(range(3, 19)), mode="ar", max_tokens=257, ignore_eos=True)
    s = engine.new_sequence(req)
    engine.generator.admit(s)
    engine.generator.prefill(s)
    with torch.inference_mode():
        for _ in range(5):
            engine.step([s])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 0
        while not s.finished and n < 200:
            engine.step([s])
            n += 1
        torch.cuda.synchronize()
        out["engine_step_wall_us"] = (time.perf_counter() - t0) / n * 1e6
    engine.generator.release(s)
    return out


def quant_step(cfg: dict, device, label: str, group: int) -> dict:
    """The graph AR step's kernels with the trunk's weights in a quantized format ("int4",
    "int4/cuda-cores": MTPLX_CUDA_QUANT's kernel choice), as ``main`` prints the bf16 one."""
    import os

    fmt, _, kernel = label.partition("/")
    saved = os.environ.get("MTPLX_CUDA_QUANT")
    if kernel:
        os.environ["MTPLX_CUDA_QUANT"] = kernel
    try:
        engine = random_engine(cfg, device, quant=fmt, group=group)
    finally:
        os.environ.pop("MTPLX_CUDA_QUANT", None)
        if saved is not None:
            os.environ["MTPLX_CUDA_QUANT"] = saved
    runner = engine.runner
    seq = prefilled(engine)
    with torch.inference_mode():
        out = kernel_breakdown(lambda: runner.trunk([seq], [[5]], [128]))
    runner.blocks.free(seq.seq_id)
    del engine
    torch.cuda.empty_cache()
    print(f"  graph_step {label} g{group}: {out['kernels_per_step']:.0f} kernels, {out['gpu_us_per_step']:.0f} us GPU")
    for t in out["top"][:16]:
        print(f"    {t['count']:6.1f} x {t['us']:8.1f} us  {t['name']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qwen3-8b,smollm2-135m")
    ap.add_argument("--gemv-sweep", default="", help="shapes to sweep the GEMV's configs on (comma-separated)")
    ap.add_argument("--gemv-rows", default="2,3,4,8", help="input row counts for --gemv-sweep")
    ap.add_argument("--no-steps", action="store_true", help="skip the step profiles")
    ap.add_argument("--quant", default="", help="int4,int4/cuda-cores,int8: also each weight format's graph "
                                                "step (kernel breakdown only; --quant-group inputs per scale)")
    ap.add_argument("--quant-group", type=int, default=32)
    args = ap.parse_args()
    device = torch.device("cuda")
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "copy_bandwidth_GBs": copy_bandwidth(device) / 1e9, "shapes": {}}
    print(f"copy bandwidth {report['copy_bandwidth_GBs']:.0f} GB/s", flush=True)
    if args.gemv_sweep:
        rows = [int(r) for r in args.gemv_rows.split(",")]
        report["gemv_sweep"] = {n: gemv_sweep(device, n, rows) for n in args.gemv_sweep.split(",")}
        report["gemv_best_per_class"] = best_per_class(report["gemv_sweep"])
    for name in [n for n in args.shapes.split(",") if n and not args.no_steps]:
        cfg = SHAPES[name]
        mats = projection_shapes(name)
        entry = {"gemv_rows1": gemv_bandwidth(device, mats, cfg["num_hidden_layers"]),
                 "gemv_rows4": gemv_bandwidth(device, mats, cfg["num_hidden_layers"], rows=4)}
        engine = random_engine(cfg, device)
        runner = engine.runner
        seq = prefilled(engine)
        with torch.inference_mode():
            with runner.eager():
                entry["eager_step"] = kernel_breakdown(lambda: runner.trunk([seq], [[5]], [128]))
            entry["graph_step"] = kernel_breakdown(lambda: runner.trunk([seq], [[5]], [128]))
        runner.blocks.free(seq.seq_id)
        entry["host"] = host_overhead(engine)
        report["shapes"][name] = entry
        del engine
        torch.cuda.empty_cache()
        print(f"== {name}", flush=True)
        for m, r in entry["gemv_rows1"].items():
            r4 = entry["gemv_rows4"][m]
            print(f"  gemv {m:8s} {r['shape']}: {r['us']:8.1f} us {r['GBs']:6.0f} GB/s | rows4 {r4['us']:8.1f} us")
        for kind in ("eager_step", "graph_step"):
            b = entry[kind]
            print(f"  {kind}: {b['kernels_per_step']:.0f} kernels, {b['gpu_us_per_step']:.0f} us GPU")
            for t in b["top"][:14]:
                print(f"    {t['count']:6.1f} x {t['us']:8.1f} us  {t['name']}")
        print("  host", json.dumps({k: round(v, 1) for k, v in entry["host"].items()}))
        for label in [q for q in args.quant.split(",") if q]:
            entry[f"graph_step_{label}"] = quant_step(cfg, device, label, args.quant_group)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
