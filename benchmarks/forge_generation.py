"""How fast forge generates its corpus at several row counts (``--gen-rows``): a random trunk of a
real model's shape (benchmarks/gpu.py ``SHAPES``; no weights to carry), token-id prompts of 20-60
tokens at temperatures 0, 0.7 and 1.0, ``forge.data.generate_corpus`` for a fixed time per
configuration (rows in flight then finish); a configuration's third field is
``forge.data.PREFILL_TOKENS`` (0: one prompt per prefill forward, as before session 31). Per configuration: generated tokens over the whole
run's seconds, and the decode rate in the window from 3 s to the deadline (tokens the steps
advanced over their time; rows finish in waves, so it moves more than the whole-run figure).
``--profile`` adds cProfile's top functions and torch.profiler's kernels for the first one.

    PYTHONPATH=. python3 benchmarks/forge_generation.py --out r.json [--shape smollm2-135m]
        [--configs float32:512,float32:2048,float32:2048:0] [--seconds 20] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from gpu import SHAPES, random_engine  # noqa: E402

from mtplx.engine.llm_engine import Engine  # noqa: E402
from mtplx.forge import data  # noqa: E402
from mtplx.forge.data import Corpus, generate_corpus, make_jobs  # noqa: E402
from mtplx.loading.checkpoint import LoadedModel  # noqa: E402

MAX_NEW_TOKENS = 192  # about a real completion's mean (session 17's corpora: 204)


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab - 5, (int(torch.randint(20, 61, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def run(shape: str, dtype: torch.dtype, rows: int, seconds: float, jobs, profile: bool, device: str = "cuda") -> dict:
    base = random_engine(SHAPES[shape], torch.device(device), dtype=dtype).loaded
    engine = Engine(LoadedModel(base.model, None, None, base.config, None),
                    kv_cache_tokens=rows * (60 + MAX_NEW_TOKENS + 16) + 4096, block_size=16)
    generate_corpus(engine, jobs[:rows], max_new_tokens=4, rows=rows, target_tokens=10**9, corpus=Corpus([]))
    marks = []
    step = engine.step

    def timed_step(running):
        out = step(running)
        marks.append((time.perf_counter(), len(running)))
        return out

    engine.step = timed_step
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    corpus = generate_corpus(engine, jobs, max_new_tokens=MAX_NEW_TOKENS, rows=rows, target_tokens=10**9,
                             corpus=Corpus([]), deadline=time.monotonic() + seconds)
    if prof:
        prof.disable()
    elapsed = time.perf_counter() - t0
    window = [(t, n) for t, n in marks if t0 + 3 <= t <= t0 + seconds]
    out = {"tokens": corpus.generated_tokens, "seconds": elapsed, "tok_s": corpus.generated_tokens / elapsed,
           "sequences": len(corpus.samples), "steps_in_window": len(window),
           "window_tok_s": (sum(n for _, n in window[1:]) / (window[-1][0] - window[0][0])
                            if len(window) > 2 else None)}
    if prof:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        out["cprofile_tottime"] = text.getvalue()
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            generate_corpus(engine, jobs[len(jobs) // 2:], max_new_tokens=24, rows=rows, target_tokens=10**9,
                            corpus=Corpus([]), deadline=time.monotonic() + 2)
        out["kernels"] = p.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        out["cpu_ops"] = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--configs", default="float32:512,float32:2048,float32:2048:0",
                    help="dtype:rows[:prefill tokens], comma-separated")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--profile", action="store_true", help="cProfile and torch.profiler for the first config")
    ap.add_argument("--device", default="cuda", help="(cpu: a check of the script, not a measurement)")
    args = ap.parse_args()
    default_prefill = data.PREFILL_TOKENS
    jobs = make_jobs(prompts(20_000, SHAPES[args.shape]["vocab_size"]), [0.0, 0.7, 1.0], 1, 0)
    report = {"gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None, "torch": torch.__version__, "shape": args.shape,
              "max_new_tokens": MAX_NEW_TOKENS, "results": {}}
    for i, config in enumerate(args.configs.split(",")):
        name, rows, *prefill = config.split(":")
        data.PREFILL_TOKENS = int(prefill[0]) if prefill else default_prefill
        result = run(args.shape, getattr(torch, name), int(rows), args.seconds, jobs, args.profile and i == 0,
                     args.device)
        report["results"][config] = result
        print(config, {k: round(v, 1) if isinstance(v, float) else v for k, v in result.items()
                       if not isinstance(v, str)}, flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
