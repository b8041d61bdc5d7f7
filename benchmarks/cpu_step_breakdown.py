"""Where an AR step's time goes on the CPU: wall-clock of each part of the default model's
decoder (the quantized products, attention, MLP, norms, RoPE, KV write), by wrapping those
functions with timers, over one 65-token greedy generation, in ms per token (the wrappers add a
little of their own). A diagnostic for the CPU decode path (docs/performance.md, session 10).

    python benchmarks/cpu_step_breakdown.py [--threads 1] [--quantize gguf]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import mtplx
from mtplx.kernels import cpu as cpu_kernels
from mtplx.models import layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantize", default="gguf")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = mtplx.load(device="cpu", quantize=args.quantize)
    spent = collections.defaultdict(float)

    def wrap(owner, name, key):
        original = getattr(owner, name)

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                spent[key] += time.perf_counter() - start
        setattr(owner, name, timed)

    wrap(cpu_kernels, "matmul", "quantized products (C++ kernel)")
    wrap(layers.RMSNorm, "add_forward", "residual add + RMSNorm")
    wrap(layers.Attention, "forward", "attention block (with its products)")
    wrap(layers.MLP, "forward", "MLP block (with its products)")
    wrap(layers.BoundRotary, "__call__", "RoPE (PyTorch ops)")
    wrap(layers, "write_kv", "KV write (PyTorch ops)")
    wrap(layers, "paged_attention", "attention over the cache")
    wrap(type(engine.loaded.model), "forward", "trunk forward")
    prompt = "Describe the water cycle to a ten-year-old."
    engine.generate(prompt, mode="ar", max_tokens=2, temperature=0, ignore_eos=True)
    spent.clear()
    start = time.perf_counter()
    engine.generate(prompt, mode="ar", max_tokens=65, temperature=0, ignore_eos=True)
    print(f"total {(time.perf_counter() - start) * 1e3 / 65:.2f} ms/token")
    for key, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {key}: {seconds * 1e3 / 65:.2f} ms/token")


if __name__ == "__main__":
    main()
