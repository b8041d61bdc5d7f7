"""A layer's four products at SmolLM2's shapes for a few token rows, three ways, each a chain of
30 layers (every layer its own weights, 212 MB in bf16, so they stream from memory, not the L2)
captured in one CUDA graph: cuBLAS (with the separate SiLU * up kernel), the CUDA-core GEMV
(``kernels/gemv.py``, up to its MAX_ROWS rows; SiLU * up the down projection's prologue) and
the bf16 tensor-core GEMV (``kernels/mma_gemv.py``, up to 16 rows; SiLU * up the gate/up
projection's epilogue) in each of its configurations. Every product is first checked against
float32 ``F.linear`` of the same bf16 weights. Microseconds per layer (median of the replays).

    PYTHONPATH=. python3 benchmarks/mma_gemv.py --out r.json [--rows 1,4,8] [--layers 30]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from mtplx.kernels import fused, gemv, mma_gemv

sys.path.insert(0, str(Path(__file__).parent))
from quant_gemv import graph_time  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
OUTPUT_SHAPES = {"lm_head": (49152, 576), "draft_rows": (16384, 576)}  # four copies each, rotated
CONFIGS = [(4, 4, 1), (4, 2, 1), (4, 8, 1), (8, 2, 1), (8, 4, 1), (2, 8, 1), (2, 16, 1), (4, 4, 2), (8, 2, 2),
           (4, 1, 1), (1, 8, 1)]  # (WARPS, UNITS, SPLIT)


def graph_us(fn) -> float:
    """Microseconds per replay of a CUDA graph of ``fn`` (quant_gemv.py's timing, median)."""
    return graph_time([fn], replays=20) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,4,8,12,16")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    layers = [{name: (torch.randn(n, k, device=dev) / k ** 0.5).bfloat16() for name, (n, k) in SHAPES.items()}
              for _ in range(args.layers)]
    packed = [{name: mma_gemv.pack(w) for name, w in layer.items()} for layer in layers]
    report = {"shapes": SHAPES, "layers": args.layers, "device": torch.cuda.get_device_name(), "results": {}}

    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 576, device=dev).bfloat16()
        h = torch.randn(rows, 1536, device=dev).bfloat16()
        gu = torch.randn(rows, 3072, device=dev).bfloat16()
        res = report["results"].setdefault(str(rows), {})
        # checks, layer 0
        w = layers[0]
        worst = 0.0
        for cfg in CONFIGS if rows <= mma_gemv.MAX_ROWS else ():
            for name in ("qkv", "o", "down"):
                inp = h if name == "down" else x
                got = mma_gemv.gemv(inp, packed[0][name], None, n=w[name].shape[0], k=w[name].shape[1], config=cfg)
                ref = F.linear(inp.float(), w[name].float())
                worst = max(worst, float((got.float() - ref).abs().max() / ref.abs().max()))
            got = mma_gemv.gemv(x, packed[0]["gate_up"], None, n=3072, k=576, silu=True, config=cfg)
            g, u = F.linear(x.float(), w["gate_up"].float()).bfloat16().float().chunk(2, dim=-1)
            ref = F.silu(g) * u
            worst = max(worst, float((got.float() - ref).abs().max() / ref.abs().max()))
        res["mma_worst_relative_error"] = worst
        if worst > 2e-2:
            raise SystemExit(f"the mma GEMV is wrong at {rows} rows: relative error {worst}")

        def cublas():
            for lw in layers:
                F.linear(x, lw["qkv"])
                F.linear(x, lw["o"])
                fused.silu_mul(F.linear(x, lw["gate_up"]))
                F.linear(h, lw["down"])
        res["cublas_us_per_layer"] = graph_us(cublas) / args.layers
        if rows <= gemv.MAX_ROWS:
            def cuda_cores():
                for lw in layers:
                    gemv.gemv(x, lw["qkv"])
                    gemv.gemv(x, lw["o"])
                    gemv.gemv(x, lw["gate_up"])
                    gemv.silu_gemv(gu, lw["down"])
            res["gemv_us_per_layer"] = graph_us(cuda_cores) / args.layers
        if rows <= mma_gemv.MAX_ROWS:
            for cfg in CONFIGS:  # noqa: B007 (each closure runs inside its iteration)
                def mma():
                    for lp in packed:
                        mma_gemv.gemv(x, lp["qkv"], None, n=960, k=576, config=cfg)
                        mma_gemv.gemv(x, lp["o"], None, n=576, k=576, config=cfg)
                        mma_gemv.gemv(x, lp["gate_up"], None, n=3072, k=576, silu=True, config=cfg)
                        mma_gemv.gemv(h, lp["down"], None, n=576, k=1536, config=cfg)
                res.setdefault("mma_us_per_layer", {})[str(cfg)] = graph_us(mma) / args.layers
            # per product, best config each
            for name, (n, k) in SHAPES.items():
                inp = h if name == "down" else x
                best = {}
                for cfg in CONFIGS:
                    def one():
                        for lp in packed:
                            mma_gemv.gemv(inp, lp[name], None, n=n, k=k, silu=name == "gate_up", config=cfg)
                    best[str(cfg)] = graph_us(one) / args.layers
                res.setdefault("mma_us_per_product", {})[name] = best
            # the output matrix and the pruned draft vocabulary's rows (above SMALL_WEIGHT: cuBLAS today)
            for name, (n, k) in OUTPUT_SHAPES.items():
                copies = [(torch.randn(n, k, device=dev) / k ** 0.5).bfloat16() for _ in range(4)]
                pc = [mma_gemv.pack(c) for c in copies]
                got = mma_gemv.gemv(x, pc[0], None, n=n, k=k)
                ref = F.linear(x.float(), copies[0].float())
                if float((got.float() - ref).abs().max() / ref.abs().max()) > 2e-2:
                    raise SystemExit(f"the mma GEMV is wrong for {name} at {rows} rows")
                entry = {"cublas_us": graph_us(lambda: [F.linear(x, c) for c in copies]) / len(copies)}
                for cfg in CONFIGS[:6]:
                    entry[str(cfg)] = graph_us(lambda: [mma_gemv.gemv(x, p, None, n=n, k=k, config=cfg)
                                                        for p in pc]) / len(pc)
                res.setdefault("output_matrices_us", {})[name] = entry
        print(rows, json.dumps({k: v for k, v in res.items() if k != "mma_us_per_product"}), flush=True)
        for name, best in res.get("mma_us_per_product", {}).items():
            cfg = min(best, key=best.get)
            print(f"  {name}: best {cfg} {best[cfg]:.2f} us", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
