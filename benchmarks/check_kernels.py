"""GPU check of the Triton paged-attention kernel against the reference path (fresh random
inputs, bf16 and fp32; unsplit and split-KV; a CUDA graph replayed at other lengths), then its
time per call, split and unsplit, on the kernel's own warps or 4 ("/w4"), at decode/verify shapes.

    PYTHONPATH=. python benchmarks/check_kernels.py --out results/paged_attention.json

Times come from CUDA graphs of LAYERS calls, each over its own pools (as the layers of a
captured forward), so host launch overhead is not counted.
"""

import argparse
import json
import statistics

import torch

from mtplx.cache.attention import AttentionMetadata, paged_attention_reference as paged_attention
from mtplx.kernels.paged_attention import choose_splits, default_block_n, paged_attention_triton

# (splits, block_n) the correctness check runs; None is the kernel's own choice
CHECKED = [(1, None), (2, None), (3, None), (8, None), (16, None), (None, None), (None, 16), (None, 64)]
TIMED = [(1, None, None), (None, None, None), (None, None, 4), (2, None, None), (4, None, None), (8, None, None),
         (16, None, None), (32, None, None), (None, 32, None), (None, 16, None)]  # (splits, block_n, warps)
MODELS = {"qwen3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}
LAYERS = 32
TABLE_KEYS = 8192  # the CUDA-graph runner pads block tables to the engine's longest context


def case(rows, q_len, heads, kvh, d, page, ctx, key_start, dtype, device="cuda", pools=1, width=0):
    """Row r holds ctx - 7r tokens (at least one), its last q_len of them the queries; ``pools``
    independent (q, k_pool, v_pool) share one block table, padded to ``width`` blocks or more."""
    lengths = [max(1, ctx - 7 * r) for r in range(rows)]
    nblocks = sum(-(-L // page) for L in lengths) + 4
    perm = torch.randperm(nblocks).tolist()
    tables, positions = [], []
    for L in lengths:
        nb = -(-L // page)
        tables.append(perm[:nb]); perm = perm[nb:]
        positions.append([max(0, p) for p in range(L - q_len, L)])
    w = max(width, *map(len, tables))
    tables = torch.tensor([t + [nblocks] * (w - len(t)) for t in tables], device=device)
    positions = torch.tensor(positions, device=device)
    meta = AttentionMetadata(positions, positions, tables, key_start)
    tensors = [(torch.randn(rows, q_len, heads, d, device=device, dtype=dtype),
                torch.randn(nblocks + 1, page, kvh, d, device=device, dtype=dtype),
                torch.randn(nblocks + 1, page, kvh, d, device=device, dtype=dtype)) for _ in range(pools)]
    return (tensors if pools > 1 else tensors[0]), meta


def rel_err(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def check_against_reference():
    for dtype in (torch.float32, torch.bfloat16):
        limit = 1e-2 if dtype == torch.bfloat16 else 2e-3
        for args in [(1, 1, 32, 8, 128, 16, 300, 0), (4, 4, 32, 8, 128, 16, 1000, 0), (8, 2, 9, 3, 64, 16, 77, 1),
                     (3, 3, 16, 8, 128, 16, 4096, 0), (1, 4, 16, 16, 64, 16, 33, 1), (2, 1, 32, 8, 128, 16, 1, 0)]:
            (q, kp, vp), meta = case(*args, dtype=dtype)
            scale = args[4] ** -0.5
            ref = paged_attention(q.double(), kp.double(), vp.double(), meta, scale)
            errs = []
            for splits, block_n in CHECKED:
                out = paged_attention_triton(q, kp, vp, meta.positions, meta.block_tables, meta.key_start, scale,
                                             splits=splits, block_n=block_n)
                err = rel_err(out, ref)
                errs.append(f"{err:.1e}")
                if not err < limit or torch.isnan(out).any():
                    raise SystemExit(f"FAIL {dtype} {args} splits={splits} block_n={block_n}: rel err {err:.2e}")
            print(f"{str(dtype):15} {args} rel err {' '.join(errs)} ok")


def check_graph_replay():
    """One capture at one set of lengths, replayed at others: each split must find its keys
    from the positions in memory."""
    (q, kp, vp), meta = case(3, 2, 32, 8, 128, 16, 1000, 0, torch.bfloat16)
    positions = meta.positions.clone()
    for splits in (1, 16, None):
        run = lambda: paged_attention_triton(q, kp, vp, positions, meta.block_tables, 0, 0.088, splits=splits)
        graph, out = capture(run)
        for lengths in ([1000, 993, 986], [1, 17, 700], [64, 2, 999]):
            positions.copy_(torch.tensor([[max(0, L - 2), L - 1] for L in lengths]))
            graph.replay()
            ref = paged_attention(q.double(), kp.double(), vp.double(),
                                  AttentionMetadata(positions, positions, meta.block_tables, 0), 0.088)
            err = rel_err(out, ref)
            if not err < 1e-2:
                raise SystemExit(f"FAIL graph replay splits={splits} lengths={lengths}: rel err {err:.2e}")
        print(f"graph replay at other lengths, splits={splits}: ok")


def capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm the allocator outside the graph
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_per_call(layers, meta, scale, splits, block_n, warps, reps=20):
    """Microseconds per call: median over reps of one graph replay of all the layers' calls."""
    def forward():
        for q, kp, vp in layers:
            paged_attention_triton(q, kp, vp, meta.positions, meta.block_tables, 0, scale,
                                   splits=splits, block_n=block_n, num_warps=warps)
    graph, _ = capture(forward)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(layers))
    return statistics.median(times)


def variant_name(splits, block_n, warps):
    return (("auto" if splits is None else f"s{splits}") + ("" if block_n is None else f"/bn{block_n}")
            + ("" if warps is None else f"/w{warps}"))


def time_table(models, rows_list, ctxs):
    results = []
    names = [variant_name(*v) for v in TIMED]
    print(f"\nus per call (graph of {LAYERS} calls over separate pools), bf16, page 16")
    print(f"{'model':9} {'rows':>4} {'q':>2} {'ctx':>5} {'auto=':>5}" + "".join(f"{n:>10}" for n in names))
    for model in models:
        heads, kvh, d = MODELS[model]
        for rows in rows_list:
            for q_len in (1, 4):
                for ctx in ctxs:
                    layers, meta = case(rows, q_len, heads, kvh, d, 16, ctx, 0, torch.bfloat16, pools=LAYERS,
                                        width=TABLE_KEYS // 16)
                    auto = choose_splits(rows, kvh, TABLE_KEYS, default_block_n(16), torch.device("cuda"))
                    times = {variant_name(*v): time_per_call(layers, meta, d ** -0.5, *v) for v in TIMED}
                    print(f"{model:9} {rows:>4} {q_len:>2} {ctx:>5} {auto:>5}"
                          + "".join(f"{times[n]:>10.2f}" for n in names))
                    results.append(dict(model=model, heads=heads, kv_heads=kvh, head_dim=d, rows=rows, q_len=q_len,
                                        ctx=ctx, auto_splits=auto, us_per_call=times))
                    del layers
    return results


def main():
    parser = argparse.ArgumentParser(description="Check and time the Triton paged-attention kernel.")
    parser.add_argument("--out", help="write the timing table here as JSON")
    parser.add_argument("--no-timing", action="store_true", help="only check correctness")
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--contexts", default="128,1024,4096")
    args = parser.parse_args()
    torch.manual_seed(0)
    check_against_reference()
    check_graph_replay()
    if args.no_timing:
        return
    results = time_table(args.models.split(","), [int(r) for r in args.rows.split(",")],
                         [int(c) for c in args.contexts.split(",")])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), layers_per_graph=LAYERS, results=results), f, indent=1)


if __name__ == "__main__":
    main()
