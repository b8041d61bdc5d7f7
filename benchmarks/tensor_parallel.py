"""Tensor parallelism (issue 20): batch-1 AR and MTP decode tok/s at each rank count, and the
share of a decode step rank 0 spends in collectives.

    PYTHONPATH=. python benchmarks/tensor_parallel.py --shape qwen3-8b --tp 1,2 --out tp.json
    PYTHONPATH=. python benchmarks/tensor_parallel.py --shape tiny --tp 1,2 --device cpu   # a check of the script

Random-weight models of real shapes (benchmarks/gpu.py's SHAPES; each rank draws its own
slice), bfloat16 on CUDA, float32 on the CPU, a random MTP head (its acceptance is that of
random weights: the MTP figure measures a cycle's cost, not a real head's speed-up).
At TP=1 the engine runs twice: with CUDA graphs (what serving uses) and eagerly (what every
TP>1 run does: graphs are not captured under tensor parallelism yet), so the TP speed-up is
read against both. The collective share profiles a few AR steps on rank 0 (torch.profiler):
device time (CPU time on the CPU) of all-reduce / all-gather over the steps' wall time, and
apart from it the command broadcasts of the mirror.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch

from benchmarks.gpu import SHAPES
from mtplx.engine.llm_engine import Engine
from mtplx.engine.tensor_parallel import launch
from mtplx.loading.random_model import random_loaded

TINY = dict(model_type="qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=2048)
PROMPT = list(range(3, 3 + 16))
COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather")


def decode_tok_s(engine: Engine, mode: str, tokens: int, repeats: int = 2) -> float:
    """Best of ``repeats`` greedy runs of ``tokens`` new tokens after one warm-up: decode tok/s."""
    kwargs = dict(mode=mode, max_tokens=tokens, ignore_eos=True, **({"depth": 1} if mode == "mtp" else {}))
    engine.generate(PROMPT, **dict(kwargs, max_tokens=8))
    return max(engine.generate(PROMPT, **kwargs).stats["decode_tok_s"] for _ in range(repeats))


def collective_share(engine: Engine, steps: int = 16) -> dict:
    """Rank 0's time in collectives and in the mirror's broadcasts over AR steps' wall time."""
    from torch.profiler import ProfilerActivity, profile

    gen = engine.generator
    seq = engine.new_sequence(engine.make_request(PROMPT, mode="ar", max_tokens=steps + 8, ignore_eos=True))
    gen.admit(seq)
    gen.prefill(seq)
    for _ in range(4):
        engine.step([seq])
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.inference_mode(), profile(activities=activities) as prof:
        _sync(engine)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step([seq])
        _sync(engine)
        wall = time.perf_counter() - t0
    gen.release(seq)
    collective = broadcast = 0.0
    for event in prof.key_averages():
        if cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue  # kernels only: a CPU op's device time is its kernels', counted once here
        name = event.key.lower()
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if any(c in name for c in COLLECTIVES):
            collective += us
        elif "broadcast" in name:
            broadcast += us
    return {"step_ms": wall / steps * 1e3, "collective_share": collective / 1e6 / wall,
            "broadcast_share": broadcast / 1e6 / wall}


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def run(shape: dict, tp: int, device: torch.device, dtype: torch.dtype, tokens: int) -> list[dict]:
    load = functools.partial(random_loaded, shape, dtype=dtype)
    out = []
    if tp == 1:
        variants = [("graphs", True), ("eager", False)] if device.type == "cuda" else [("eager", False)]
        for label, graphs in variants:
            engine = Engine(load(device=device), cuda_graphs=graphs, kv_cache_tokens=4096)
            out.append({"tp": 1, "variant": label, "ar_tok_s": decode_tok_s(engine, "ar", tokens),
                        "mtp_d1_tok_s": decode_tok_s(engine, "mtp", tokens)})
            del engine
        return out
    group, loaded = launch(load, tp, device)
    try:
        engine = Engine(loaded, kv_cache_tokens=4096, tensor_parallel=group)
        entry = {"tp": tp, "variant": "eager", "ar_tok_s": decode_tok_s(engine, "ar", tokens),
                 "mtp_d1_tok_s": decode_tok_s(engine, "mtp", tokens)}
        entry.update(collective_share(engine))
        return [entry]
    finally:
        group.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b", help=f"one of {', '.join(SHAPES)}, tiny")
    ap.add_argument("--tp", default="1,2", help="rank counts, comma-separated")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.shape == "tiny" else SHAPES[args.shape]
    results = []
    for tp in (int(t) for t in args.tp.split(",")):
        for entry in run(shape, tp, device, dtype, args.tokens):
            results.append(entry)
            print(json.dumps(entry), flush=True)
    base = {r["variant"]: r for r in results if r["tp"] == 1}
    for r in results:
        for label, b in base.items():
            r[f"ar_speedup_vs_tp1_{label}"] = r["ar_tok_s"] / b["ar_tok_s"]
    report = {"shape": args.shape, "device": str(device), "dtype": str(dtype), "tokens": args.tokens,
              "torch": torch.__version__, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
