"""Where a sampled cycle's time goes on the GPU (issue 15): for AR and MTP, greedy and sampled,
the wall time and the GPU kernel time per generated token through ``engine.generate``, the
GPU's busy share and the costliest kernels; then the sampling pieces alone, each replayed in a
CUDA graph, at the shapes a batch-1 cycle uses.

    PYTHONPATH=. python benchmarks/sampled_profile.py --model GGUF --head DIR --out FILE.json
        [--max-tokens 128] [--prompts 2] [--configs a,b] [--no-pieces] [--cprofile]

--cprofile adds the host's side (``host_profile``): a host that seldom waits for the device sets
the pace itself. The prompts are the first of ``sampled_decoding.HELD_OUT_CHAT``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.gpu import timed
from benchmarks.gpu_profile import kernel_rows
from benchmarks.sampled_decoding import HELD_OUT_CHAT

CONFIGS = {  # label: (mode, depth, draft policy, sampling)
    "ar_greedy": ("ar", None, "greedy", {}),
    "ar_t0.7": ("ar", None, "greedy", {"temperature": 0.7, "top_p": 0.95, "seed": 1}),
    "ar_t1.0": ("ar", None, "greedy", {"temperature": 1.0, "seed": 1}),
    "d1_greedy": ("mtp", 1, "greedy", {}),
    "d1_t0.7": ("mtp", 1, "greedy", {"temperature": 0.7, "top_p": 0.95, "seed": 1}),
    "d1_t1.0": ("mtp", 1, "greedy", {"temperature": 1.0, "seed": 1}),
    "mirror_d1_t1.0": ("mtp", 1, "mirror", {"temperature": 1.0, "seed": 1}),
    "d3_greedy": ("mtp", 3, "greedy", {}),
    "auto_greedy": ("mtp", "auto", "greedy", {}),
    "mirror_d3_t0.7": ("mtp", 3, "mirror", {"temperature": 0.7, "top_p": 0.95, "seed": 1}),
}


def generate(engine, prompts, config, max_tokens: int) -> int:
    mode, depth, policy, sampling = config
    tokens = 0
    for p in prompts:
        extra = {"draft_policy": policy} if mode == "mtp" else {}
        r = engine.generate([{"role": "user", "content": p}], chat=True, mode=mode, depth=depth,
                            max_tokens=max_tokens, **sampling, **extra)
        tokens += r.stats["generated_tokens"]
    return tokens


def profile_config(engine, prompts, config, max_tokens: int, cprofile: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile

    generate(engine, prompts[:1], config, 16)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = generate(engine, prompts, config, max_tokens)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        p_tokens = generate(engine, prompts, config, max_tokens)
        torch.cuda.synchronize()
    rows = kernel_rows(prof, p_tokens)
    gpu_us = sum(us for _, _, us in rows)  # per token
    busy_us = busy_union_us(prof) / p_tokens
    out = {"tokens": tokens, "wall_us_per_token": wall / tokens * 1e6, "tok_s": tokens / wall,
           "gpu_us_per_token": gpu_us, "kernels_per_token": sum(c for _, c, _ in rows),
           "gpu_busy_share": gpu_us / (wall / tokens * 1e6),
           # kernels overlap under programmatic dependent launch: the union of their intervals
           "gpu_busy_union_us_per_token": busy_us, "gpu_busy_union_share": busy_us / (wall / tokens * 1e6),
           "top": [{"name": n, "per_token": round(c, 2), "us_per_token": round(us, 2)} for n, c, us in rows]}
    if cprofile:
        out["host"] = host_profile(engine, prompts, config, max_tokens)
    return out


def busy_union_us(prof) -> float:
    """Microseconds in which at least one CUDA kernel ran (the union of their intervals)."""
    spans = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA)
    total, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def host_profile(engine, prompts, config, max_tokens: int, top: int = 30) -> dict:
    """Where the host's time goes in ``engine.generate`` (cProfile): per token, all of it, the
    part spent waiting for the device (tolist / item / synchronize: the cycle's one transfer),
    and the functions of most own time. A host that rarely waits sets the pace itself."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prof.enable()
    tokens = generate(engine, prompts, config, max_tokens)
    torch.cuda.synchronize()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats
    wait = sum(tt for (_, _, name), (_, _, tt, _, _) in stats.items()
               if any(w in name for w in ("'tolist'", "'item'", "synchronize", "'cpu'")))
    own = sorted(((f"{Path(f).name}:{line}:{name}", nc, tt, ct) for (f, line, name), (_, nc, tt, ct, _) in stats.items()),
                 key=lambda r: -r[2])[:top]
    per = 1e6 / tokens
    return {"tokens": tokens, "wall_us_per_token_profiled": wall * per, "wait_us_per_token": wait * per,
            "top_own_time": [{"fn": f, "calls_per_token": round(nc / tokens, 2), "own_us_per_token": round(tt * per, 2),
                              "cum_us_per_token": round(ct * per, 2)} for f, nc, tt, ct in own]}


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds of one ``fn()`` inside a CUDA graph of ``reps`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return timed(g.replay, repeats=15) / reps * 1e6


def pieces(engine) -> dict:
    """The sampling pieces of a batch-1 cycle alone (positions 1 = AR, 2 = a depth-1 verify),
    the PyTorch path against the Triton kernels (checked against each other first)."""
    from mtplx import kernels
    from mtplx.engine.sampling import SamplerTensors, SamplingParams, process_logits
    from mtplx.engine.sampling import NoiseStream
    from mtplx.engine.speculative import draw_noise, rejection_outcome

    model = engine.runner.model
    dev, vocab = engine.device, model.config.vocab_size
    hidden_size = model.config.hidden_size
    regimes = {"t0.7_top_p": SamplingParams(temperature=0.7, top_p=0.95), "t1.0": SamplingParams(temperature=1.0),
               "top_k50_min_p": SamplingParams(temperature=0.8, top_k=50, min_p=0.05)}
    out = {}
    for rows in (1, 4):
        for positions in (1, 2):
            key = f"rows{rows}_pos{positions}"
            hidden = torch.randn(rows, positions, hidden_size, device=dev, dtype=engine.dtype)
            logits = model.compute_logits(hidden).float()
            race = torch.empty(rows, vocab, device=dev).exponential_()
            uniforms = torch.rand(rows, 1, device=dev)
            depths = torch.full((rows, 1), positions - 1, device=dev, dtype=torch.long)
            entry = {"lm_head": graph_us(lambda: model.compute_logits(hidden)),
                     "argmax": graph_us(lambda: torch.argmax(logits, dim=-1))}
            for name, params in regimes.items():
                s = SamplerTensors(rows, dev)
                s.write([params] * rows)
                kernels.ENABLED = False
                want = process_logits(logits, s)
                entry[f"torch_process_{name}"] = graph_us(lambda: process_logits(logits, s, top_k=False, min_p=False))
                kernels.ENABLED = True
                got = process_logits(logits, s)
                if not torch.equal(got > 0, want > 0) or not torch.allclose(got, want, rtol=1e-5, atol=1e-7):
                    raise SystemExit(f"FAIL: the sampling kernel differs from process_logits ({key}, {name})")
                entry[f"kernel_process_{name}"] = graph_us(lambda: process_logits(logits, s))
                entry[f"kept_{name}"] = int((got[0, 0] > 0).sum())
            probs = got
            drafts = probs[:, : positions - 1].argmax(-1)
            kernels.ENABLED = False
            want = rejection_outcome(probs, None, drafts, depths, uniforms, race)
            entry["torch_rejection"] = graph_us(lambda: rejection_outcome(probs, None, drafts, depths, uniforms, race))
            kernels.ENABLED = True
            if not torch.equal(rejection_outcome(probs, None, drafts, depths, uniforms, race), want):
                raise SystemExit(f"FAIL: the rejection kernel differs from rejection_outcome ({key})")
            entry["kernel_rejection"] = graph_us(lambda: rejection_outcome(probs, None, drafts, depths, uniforms, race))
            out[key] = {k: round(v, 2) for k, v in entry.items()}
            print(key, out[key], flush=True)
    stream = NoiseStream(0)

    def host_draw():
        for _ in range(100):
            draw_noise(1, vocab, stream, dev)
        torch.cuda.synchronize()

    host_draw()
    t0 = time.perf_counter()
    host_draw()
    out["draw_noise_eager_us"] = (time.perf_counter() - t0) / 100 * 1e6
    print("draw_noise eager us", out["draw_noise_eager_us"], flush=True)
    return out


def sweep(engine) -> dict:
    """The sampling kernel's time by (BLOCK, num_warps), and its first pass alone (argmax)."""
    from mtplx.engine.sampling import SamplerTensors, SamplingParams
    from mtplx.kernels import sampling as k

    model = engine.runner.model
    out = {}
    for positions in (1, 2):
        logits = model.compute_logits(torch.randn(1, positions, model.config.hidden_size, device=engine.device,
                                                  dtype=engine.dtype)).float()
        race = torch.empty(1, positions, logits.shape[-1], device=engine.device).exponential_()
        for name, params in {"t1.0": SamplingParams(temperature=1.0),
                             "top_p": SamplingParams(temperature=0.7, top_p=0.95)}.items():
            s = SamplerTensors(1, engine.device)
            s.write([params])
            for block in (2048, 4096, 8192, 16384):
                for warps in (4, 8, 16, 32):
                    key = f"pos{positions}_{name}_b{block}_w{warps}"
                    try:
                        out[key] = {
                            "process": graph_us(lambda: k.process(logits, s.greedy, s.temperature, s.top_k, s.top_p,
                                                                  s.min_p, block=block, num_warps=warps)),
                            "race": graph_us(lambda: k.process(logits, s.greedy, s.temperature, s.top_k, s.top_p,
                                                               s.min_p, race=race, block=block, num_warps=warps)),
                            "argmax": graph_us(lambda: k.argmax(logits, block=block, num_warps=warps))}
                    except Exception as e:  # a config that does not compile (registers)
                        out[key] = {"error": repr(e)[:200]}
                    print(key, {a: round(b, 1) if isinstance(b, float) else b for a, b in out[key].items()}, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--sweep", action="store_true", help="time the sampling kernel's tile configs")
    ap.add_argument("--no-pieces", action="store_true", help="skip timing the sampling pieces alone")
    ap.add_argument("--cprofile", action="store_true", help="also profile the host (cProfile) per config")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import mtplx

    t0 = time.perf_counter()
    engine = mtplx.load(args.model, device="cuda", dtype=args.dtype, head=args.head)
    report = {"engine_build_s": time.perf_counter() - t0, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "max_tokens": args.max_tokens, "configs": {}}
    prompts = list(HELD_OUT_CHAT[: args.prompts])
    with torch.inference_mode():
        if args.sweep:
            report["sweep"] = sweep(engine)
        if not args.no_pieces:
            report["pieces"] = pieces(engine)
        for label in [c for c in args.configs.split(",") if c]:
            entry = report["configs"][label] = profile_config(engine, prompts, CONFIGS[label], args.max_tokens,
                                                                  args.cprofile)
            print(f"== {label}: {entry['tok_s']:.0f} tok/s, wall {entry['wall_us_per_token']:.0f} us/token, GPU "
                  f"{entry['gpu_us_per_token']:.0f} us/token ({entry['gpu_busy_share']:.0%} busy), "
                  f"{entry['kernels_per_token']:.0f} kernels/token, kernels' union "
                  f"{entry['gpu_busy_union_us_per_token']:.0f} us/token ({entry['gpu_busy_union_share']:.0%})", flush=True)
            if "host" in entry:
                h = entry["host"]
                print(f"   host (cProfile): {h['wall_us_per_token_profiled']:.0f} us/token, waiting for the device "
                      f"{h['wait_us_per_token']:.0f}", flush=True)
                for t in h["top_own_time"][:20]:
                    print(f"   {t['own_us_per_token']:7.2f} us own {t['cum_us_per_token']:8.2f} cum "
                          f"{t['calls_per_token']:6.2f}/tok  {t['fn']}", flush=True)
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
            for t in entry["top"][:14]:
                print(f"   {t['per_token']:6.2f} x {t['us_per_token']:7.2f} us  {t['name']}", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
