"""CPU kernel candidates for weight-only quantized decode, on the default model's shapes.

Every candidate multiplies 1, 2 or 4 activation rows by all of a token's weights: 30 layers of
(qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536), each layer its own random weights so
the set (like a real forward) does not stay in cache, plus the 49152x576 output matrix apart.

  f32 / bf16        F.linear on float32 / bfloat16 weights
  int4_bf16         aten._weight_int4pack_mm_for_cpu, groups of 32, bf16 activations
  int8x2_bf16       an int8 weight as two int4 planes through the same kernel (models/quant.py)
  int8pc_bf16       aten._weight_int8pack_mm (per-channel scales only: cannot hold GGUF's groups)
  int8_inductor     torch.compile'd dequantize-and-reduce of int8 with group scales (rows 1 only)

    python benchmarks/quant_kernels_cpu.py [--threads N] [--json benchmarks/results/quant_kernels_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
OUTPUT = (49152, 576)


def make(kind: str, n: int, k: int, rows: int):
    x = torch.randn(rows, k)
    if kind in ("f32", "bf16"):
        dt = torch.float32 if kind == "f32" else torch.bfloat16
        w, xx = torch.randn(n, k).to(dt), x.to(dt)
        return lambda: F.linear(xx, w)
    if kind in ("int4_bf16", "int8x2_bf16"):
        kk = k * (2 if kind == "int8x2_bf16" else 1)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, kk), dtype=torch.int32), 1)
        sz = torch.randn(kk // 32, n, 2).bfloat16()
        xb = x.bfloat16()

        def run():
            a = torch.cat((xb, xb), 1) if kk != k else xb
            return torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, 32, sz)
        return run
    if kind == "int8pc_bf16":
        w, s, xb = torch.randint(-127, 127, (n, k), dtype=torch.int8), torch.rand(n).bfloat16(), x.bfloat16()
        return lambda: torch.ops.aten._weight_int8pack_mm(xb, w, s)
    if kind == "int8_inductor":
        w, s = torch.randint(-127, 127, (n, k), dtype=torch.int8), torch.rand(n, k // 32)
        return lambda: _dequant_reduce(x, w, s)
    raise ValueError(kind)


@torch.compile(dynamic=False)
def _dequant_reduce(x, w, s):
    n, k = w.shape
    part = (x.view(x.shape[0], 1, k // 32, 32) * w.view(1, n, k // 32, 32).float()).sum(-1)
    return (part * s).sum(-1)


def timed(fns, repeats: int) -> float:
    for f in fns:
        f()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for f in fns:
            f()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="benchmarks/results/quant_kernels_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = {"threads": args.threads, "torch": torch.__version__, "ms_best_of": args.repeats, "results": []}
    kinds = ("f32", "bf16", "int4_bf16", "int8x2_bf16", "int8pc_bf16", "int8_inductor")
    for rows in (1, 2, 4):
        for kind in kinds:
            if kind == "int8_inductor" and rows > 1:
                continue
            layers = [make(kind, n, k, rows) for _ in range(LAYERS) for n, k in SHAPES]
            head = [make(kind, *OUTPUT, rows)]
            row = {"rows": rows, "kind": kind, "layers_ms": round(timed(layers, args.repeats), 2),
                   "output_ms": round(timed(head, args.repeats), 2)}
            out["results"].append(row)
            print(row, flush=True)
            del layers, head
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
