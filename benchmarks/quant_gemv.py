"""The quantized GEMVs on the 8B shape's matrices against bf16 cuBLAS: the CUDA-core kernel
(mtplx/kernels/quant_gemv.py, "gemv") and the tensor-core one for int4/int8
(mtplx/kernels/quant_mma.py, "mma"; bf16 cuBLAS is timed with "gemv"); per matrix, format,
token rows and kernel configuration, the time of one product in a CUDA graph (weights rotated
over enough copies that they stream from memory, not L2) and the weight bytes read per second.
Each configuration's output is first checked against the dequantized weight's float32 product.

    PYTHONPATH=. python3 benchmarks/quant_gemv.py --out r.json [--formats int4,int8] [--quick]
        [--kernels gemv,mma] [--offsets] [--group 32] [--wide]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from mtplx.kernels import quant_gemv, quant_mma
from mtplx.models.quant import QuantLinear, quantize

# Qwen3-8B: hidden 4096, 32 query heads and 8 KV heads of 128, intermediate 12288, vocabulary 151936
MATRICES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
            "lm_head": (151936, 4096)}
# gate/up as a layer runs it: fused, SiLU(gate) * up as the GEMV's epilogue (the tensor-core kernel only)
SILU_MATRICES = {"gate_up_silu": (24576, 4096)}
ALL_MATRICES = {**MATRICES, **SILU_MATRICES}
ROTATE_BYTES = 512 << 20  # copies of a weight until this many bytes: several times the 60 MB L2


def graph_time(fns, replays: int = 10) -> float:
    """Seconds per call of one replay of a graph that calls each of ``fns`` once (median)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); graph.replay(); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del graph
    return sorted(times)[len(times) // 2] / len(fns)


SWEEP = {  # (format, rows) -> (BLOCK_N, num_warps, SPLIT, DOT_C); DOT_C 0: the CUDA-core kernel,
    # tiles of 32 * num_warps chunks (int4: 1024 inputs per warp, 8-bit 512); else tensor cores
    ("int4", 1): [(8, 2, 1, 0), (8, 4, 1, 0)],
    ("int4", 4): [(8, 4, 1, 0), (16, 4, 1, 4), (64, 4, 1, 4)],
    ("int4", 8): [(4, 4, 1, 0), (64, 4, 1, 4)],
    ("int8", 4): [(4, 4, 1, 0), (64, 4, 1, 8)],
}


def wide_sweep(rows: int) -> list:
    """``--wide``: the CUDA-core kernel's grid for ``rows`` token rows up to 4: BLOCK_N 4-16 and
    1-4 warps, one split, and two for a few of them."""
    grid = [(block_n, warps, 1, 0) for block_n in (4, 8, 16) for warps in (1, 2, 4) if block_n * rows <= 64]
    return grid + [(8, warps, 2, 0) for warps in (2, 4)]


def configs(fmt: str, rows: int, quick: bool, wide: bool = False) -> list:
    """(BLOCK_N, num_warps, SPLIT, DOT_C) to try, None (the default) first."""
    if quick:
        return [None]
    return [None, *(wide_sweep(rows) if wide and rows <= 4 else SWEEP.get((fmt, rows), []))]


def effective(cfg: tuple[int, int, int, int], n: int, k: int, bits: int) -> tuple[int, int, int, int]:
    """The configuration gemv runs for ``cfg``: SPLIT as split_ranges rounds it."""
    block_n, warps, split, dot_c = cfg
    chunks = -(-k // quant_gemv.inputs_per_chunk(bits))
    return block_n, warps, quant_gemv.split_ranges(chunks, split, dot_c or 32 * warps)[1], dot_c


MMA_SWEEP = [(4, 1, 1), (4, 2, 1), (4, 4, 1), (8, 1, 1), (8, 2, 1),  # (WARPS, UNITS, SPLIT)
             (4, 1, 2), (4, 2, 2), (8, 1, 2), (4, 1, 4), (4, 2, 4)]
# ``--wide`` for the tensor-core kernel: more tiles in flight a loop step (UNITS up to 8, 8 warps)
MMA_WIDE = [(w, u, s) for w in (2, 4, 8) for u in (1, 2, 4, 8) for s in (1, 2, 4) if w * u <= 32]


def _quantized(n: int, k: int, fmt: str, group: int, device, offsets: bool):
    """A random weight [n, k] quantized to ``fmt``; offsets: with random group offsets as
    GGUF's Q4_1 / Q4_K minima give (round-to-nearest is symmetric)."""
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    qw = quantize(w, fmt, group)
    if offsets:
        qw.zero = torch.randn_like(qw.scale) * 0.01
    return qw


def _layer(n: int, k: int, fmt: str, group: int, device, offsets: bool, backend: str):
    """(the layer, its weight bytes, its dequantized weight, copies of its buffers (words, scale,
    zero) enough to stream from memory)."""
    layer = QuantLinear(_quantized(n, k, fmt, group, device, offsets), device=device, backend=backend)
    qbytes = layer.weight_bytes()
    copies = max(2, -(-ROTATE_BYTES // qbytes))
    bufs = [(layer.words.clone(), layer.scale.clone(), None if layer.zero is None else layer.zero.clone())
            for _ in range(copies)]
    return layer, qbytes, layer.dequantize(), bufs


def mma_effective(cfg: tuple[int, int, int], tiles_k: int) -> tuple[int, int, int]:
    """The (WARPS, UNITS, SPLIT) the tensor-core gemv runs for ``cfg``: SPLIT as split_ranges
    rounds it."""
    warps, units, split = cfg
    return warps, units, quant_gemv.split_ranges(tiles_k, split, warps * units)[1]


def bench_mma(name: str, n: int, k: int, fmt: str, rows_list, quick: bool, device, group: int = 32,
              offsets: bool = False, wide: bool = False) -> dict:
    """The tensor-core GEMV on one weight [n, k] at each of ``rows_list``: its default config and
    (unless quick) MMA_SWEEP (wide: MMA_WIDE), each checked against the dequantized weight first
    (a SILU_MATRICES one with its SiLU epilogue, against SiLU(gate) * up of the bf16-rounded sums)."""
    layer, qbytes, wq, bufs = _layer(n, k, fmt, group, device, offsets, "mma")
    silu = name in SILU_MATRICES
    args = dict(n=n, k=k, bits=layer.bits, silu=silu)
    out = {}
    for rows in rows_list:
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        ref = x.float() @ wq.T
        magnitude = x.float().abs() @ wq.abs().T + 1e-6
        if silu:
            gate, up = ref.to(torch.bfloat16).float().chunk(2, dim=-1)
            ref = F.silu(gate) * up
            magnitude = ref.abs().amax() + 1e-6
        entry = {"us_by_config": {}}
        default = mma_effective(quant_mma.config_for(n, k, silu, layer.zero is not None, layer.bits,
                                                     quant_mma.tiles_per_group(layer.words, layer.scale)),
                                layer.words.shape[1])
        worst, seen = 0.0, set()
        grid = MMA_WIDE if wide else MMA_SWEEP
        for cfg in [default] + ([] if quick else [mma_effective(c, layer.words.shape[1]) for c in grid]):
            if cfg in seen:
                continue
            seen.add(cfg)
            got = quant_mma.gemv(x, layer.words, layer.scale, layer.zero, None, config=cfg, **args)
            err = float(((got.float() - ref).abs() / magnitude).max())
            worst = max(worst, err)
            if not err < 1e-2:
                raise SystemExit(f"FAIL: mma {fmt} {name} rows {rows} config {cfg}: error {err}")
            t = graph_time([lambda b=b: quant_mma.gemv(x, b[0], b[1], b[2], None, config=cfg, **args) for b in bufs])
            entry["us_by_config"][("default " if cfg == default else "") + "x".join(map(str, cfg))] = t * 1e6
        best = min(entry["us_by_config"], key=entry["us_by_config"].get)
        t = entry["us_by_config"][best] / 1e6
        dflt = next(v for key, v in entry["us_by_config"].items() if key.startswith("default"))
        entry.update(best=best, best_us=t * 1e6, best_GBs=qbytes / t / 1e9, default_us=dflt,
                     default_GBs=qbytes / dflt / 1e3, max_rel_err=worst)
        out[f"rows{rows}"] = entry
        print(f"mma {fmt:5s} {name:8s} {n}x{k} rows {rows}: default {dflt:7.1f} us ({qbytes / dflt / 1e3:.0f} GB/s) | "
              f"best {best} {t * 1e6:7.1f} us ({qbytes / t / 1e9:.0f} GB/s)", flush=True)
    del bufs, wq
    torch.cuda.empty_cache()
    return out


def bench_matrix(name: str, n: int, k: int, fmt: str, rows_list, quick: bool, device, group: int = 32,
                 offsets: bool = False, wide: bool = False) -> dict:
    """One weight [n, k] (random, quantized to ``fmt`` with ``group``) at each of ``rows_list``,
    on the CUDA-core kernel."""
    layer, qbytes, wq, bufs = _layer(n, k, fmt, group, device, offsets, "triton")
    w = wq.to(torch.bfloat16)  # the bf16 baseline: the same weight in bf16
    wb = [w.clone() for _ in range(max(2, -(-ROTATE_BYTES // (2 * n * k))))]
    out = {}
    for rows in rows_list:
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        bf16 = graph_time([lambda wi=wi: F.linear(x, wi) for wi in wb])
        entry = {"bf16_cublas_us": bf16 * 1e6, "bf16_GBs": 2 * n * k / bf16 / 1e9, "us_by_config": {}}
        ref = x.float() @ wq.T
        magnitude = x.float().abs() @ wq.abs().T + 1e-6
        default = effective(quant_gemv.config_for(n, k, rows, layer.bits), n, k, layer.bits)
        seen = set()
        for cfg in configs(fmt, rows, quick, wide):
            cfg_used = default if cfg is None else effective(cfg, n, k, layer.bits)
            if cfg_used in seen:
                continue
            seen.add(cfg_used)
            label = ("default " if cfg is None else "") + "x".join(map(str, cfg_used))
            args = layer._kernel_args()
            got = quant_gemv.gemv(x, layer.words, layer.scale, layer.zero, None, config=cfg_used, **args)
            err = float(((got.float() - ref).abs() / magnitude).max())
            if not err < 1e-2:
                raise SystemExit(f"FAIL: {fmt} {name} rows {rows} config {cfg_used}: error {err}")
            t = graph_time([lambda b=b: quant_gemv.gemv(x, b[0], b[1], b[2], None, config=cfg_used, **args)
                            for b in bufs])
            entry["us_by_config"][label] = t * 1e6
        best = min(entry["us_by_config"], key=entry["us_by_config"].get)
        t = entry["us_by_config"][best]
        default = next(v for key, v in entry["us_by_config"].items() if key.startswith("default"))
        entry.update(best=best, best_us=t, best_GBs=qbytes / t / 1e3, default_us=default,
                     default_GBs=qbytes / default / 1e3, speedup_over_bf16=bf16 * 1e6 / t)
        out[f"rows{rows}"] = entry
        print(f"{fmt:5s} {name:8s} {n}x{k} rows {rows}: bf16 {bf16 * 1e6:7.1f} us ({entry['bf16_GBs']:.0f} GB/s) | "
              f"default {default:7.1f} us ({entry['default_GBs']:.0f} GB/s) | best {best} {t:7.1f} us "
              f"({entry['best_GBs']:.0f} GB/s, {entry['speedup_over_bf16']:.2f}x bf16)", flush=True)
    del bufs, wb, wq
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default="int4,int8,fp8")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--matrices", default=",".join(MATRICES), help=f"of {', '.join(ALL_MATRICES)}")
    ap.add_argument("--quick", action="store_true", help="the default configuration only")
    ap.add_argument("--kernels", default="gemv,mma", help="gemv: the CUDA-core kernel; mma: the tensor-core one")
    ap.add_argument("--offsets", action="store_true", help="weights with group offsets (GGUF's Q4_1, Q4_K)")
    ap.add_argument("--group", type=int, default=32, help="inputs per scale group")
    ap.add_argument("--wide", action="store_true",
                    help="the CUDA-core kernel over wide_sweep's grid (1-4 rows), the tensor-core one over MMA_WIDE")
    args = ap.parse_args()
    device = torch.device("cuda")
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "results": {}}
    rows_list = [int(r) for r in args.rows.split(",")]
    kernels = args.kernels.split(",")
    for fmt in args.formats.split(","):
        for kernel in kernels:
            if kernel == "mma" and fmt == "fp8":
                continue
            bench = bench_mma if kernel == "mma" else bench_matrix
            names = [name for name in args.matrices.split(",") if kernel == "mma" or name not in SILU_MATRICES]
            report["results"][f"{fmt} {kernel}"] = {
                name: bench(name, *ALL_MATRICES[name], fmt, rows_list, args.quick, device, group=args.group,
                            offsets=args.offsets, wide=args.wide)
                for name in names}
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
