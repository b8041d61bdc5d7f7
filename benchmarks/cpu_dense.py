"""A float output matrix on the CPU (session 20): PyTorch's float32 ``F.linear`` against
``kernels.cpu.dense_matmul`` over the weight at float32 and over its bfloat16 / float16 copies
(``models.layers.cpu_dense`` takes the narrowest one that holds the weight exactly), at 1-48
token rows of the default model's output matrix (49,152 x 576), milliseconds per call, each way
alternating; the GB/s of weight read at one row, and how far row 0's outputs move between being
computed alone and among the others (a verify must give each token its AR step's numbers).

    python benchmarks/cpu_dense.py [--threads 2] [--rows 1,2,4,8,16,32,48] [--calls 10]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from mtplx.kernels import cpu as cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,32,48")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--shape", default="49152,576")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.split(","))
    w32 = (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16().float()
    ways = {"F.linear float32": lambda x: F.linear(x, w32),
            "dense float32": lambda x: cpu_kernels.dense_matmul(x, w32),
            "dense bfloat16": lambda x, w=w32.bfloat16(): cpu_kernels.dense_matmul(x, w),
            "dense float16": lambda x, w=w32.half(): cpu_kernels.dense_matmul(x, w)}
    print(f"{args.threads} threads, weight {n} x {k}; ms per call (GB/s of weight at 1 row)")
    print("rows | " + " | ".join(ways))
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        ref = F.linear(x.double(), w32.double())
        spent = dict.fromkeys(ways, 0.0)
        for name, fn in ways.items():
            assert (fn(x).double() - ref).abs().max() < 1e-4, name
            fn(x)
        for _ in range(args.calls):  # the ways alternate call by call
            for name, fn in ways.items():
                t0 = time.perf_counter()
                fn(x)
                spent[name] += time.perf_counter() - t0
        alone = {name: fn(x[:1]) for name, fn in ways.items()}  # row 0 computed alone
        drift = {name: float((fn(x)[0] - alone[name][0]).abs().max()) for name, fn in ways.items()}
        cells = []
        for name in ways:
            ms = spent[name] / args.calls * 1e3
            width = 4 if "float32" in name else 2
            cells.append(f"{ms:.2f}" + (f" ({n * k * width / ms / 1e6:.1f})" if rows == 1 else "")
                         + (f" [row 0 moves {drift[name]:.1e}]" if drift[name] else ""))
        print(f"{rows} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
