"""What a second token row costs in the CPU trunk's layers (a depth-1 verify against an AR step),
op by op: the trunk's C++ layer steps (``kernels/cpu.layer``) captured from a real decode of the
default model, an AR step's (1 row) and a verify's (2 rows) at the same position, replayed in
turn, whole and then each op of ``Layer.step`` alone over the 30 layers (the two norms, the q/k/v
product, RoPE and the KV write, attention, o, gate/up, SiLU x up, down; the products through
their modules, so each op also pays a Python call), ms over the 30 layers, the median of
``--repeats`` replays.

    python benchmarks/cpu_layer_rows.py [--threads 2] [--tokens 200] [--repeats 40] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=200, help="tokens decoded before the captured steps")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import mtplx
    from mtplx.kernels import cpu as cpu_kernels
    from mtplx.models import base

    engine = mtplx.load(device="cpu")
    layers = engine.runner.model.model.layers
    trunk = {layer._cpu_layer(): i for i, layer in enumerate(layers)}
    captured: dict[tuple[int, int], list] = {}  # (rows, first position) -> the step's layer calls
    original = base.run_cpu_step

    def capture(step, x, delta, rotary, meta, k_pool, v_pool):
        if step in trunk and x.shape[1] in (1, 2):
            table, positions = meta.first_row()
            captured.setdefault((x.shape[1], int(positions[0])), []).append(
                (trunk[step], step, x.clone(), None if delta is None else delta.clone(), *[t.clone() for t in rotary.flat()],
                 meta.slot_mapping.clone(), k_pool, v_pool, table.clone(), positions.clone(), meta.key_start))
        return original(step, x, delta, rotary, meta, k_pool, v_pool)

    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
    base.run_cpu_step = capture
    try:  # MTP depth 1 (its verifies: 2 rows), then AR (1 row); each keeps its own cache blocks
        engine.generate(messages, chat=True, mode="mtp", depth=1, max_tokens=args.tokens, ignore_eos=True)
        engine.generate(messages, chat=True, mode="ar", max_tokens=args.tokens, ignore_eos=True)
    finally:
        base.run_cpu_step = original
    # the latest verify whose first position an AR step also decoded
    at = max(p for rows, p in captured if rows == 2 and (1, p) in captured)
    steps = {rows: sorted(captured[(rows, at)], key=lambda c: c[0]) for rows in (1, 2)}
    assert all(len(calls) == len(layers) for calls in steps.values())
    ext = cpu_kernels.extension()

    def ops_of(calls) -> list[dict]:
        out = []
        for i, step, x, delta, cos, sin, slots, k_pool, v_pool, table, positions, key_start in calls:
            layer = layers[i]
            attn, mlp = layer.self_attn, layer.mlp
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            x2 = x.reshape(-1, x.shape[-1])
            d2 = None if delta is None else delta.reshape(-1, x.shape[-1])
            r = ext.add_rms_norm(x2, d2, ln1.weight, ln1.eps)
            qkv = attn.qkv_proj(r[1])
            rope = (cos, sin, slots, k_pool, v_pool, attn.heads, attn.kv_heads, attn.head_dim, None, None, 1e-6)
            q = ext.rope_write(qkv, *rope)
            where = (k_pool, v_pool, table, positions, key_start, attn.scale)
            a = ext.row_attention(q, *where)
            o = attn.o_proj(a)
            r2 = ext.add_rms_norm(r[0], o, ln2.weight, ln2.eps)
            gate_up = mlp.gate_up_proj(r2[1])
            s = ext.silu_mul(gate_up)
            out.append({
                "layer step": lambda step=step, args=(x, delta, cos, sin, slots, k_pool, v_pool, table, positions,
                                                      key_start): step.step(*args),
                "norms": lambda x2=x2, d2=d2, r=r, o=o, ln1=ln1, ln2=ln2: (ext.add_rms_norm(x2, d2, ln1.weight, ln1.eps),
                                                                          ext.add_rms_norm(r[0], o, ln2.weight, ln2.eps)),
                "q/k/v": lambda m=attn.qkv_proj, v=r[1]: m(v),
                "RoPE, KV write": lambda qkv=qkv, rope=rope: ext.rope_write(qkv, *rope),
                "attention": lambda q=q, where=where: ext.row_attention(q, *where),
                "o": lambda m=attn.o_proj, v=a: m(v),
                "gate/up": lambda m=mlp.gate_up_proj, v=r2[1]: m(v),
                "SiLU x up": lambda v=gate_up: ext.silu_mul(v),
                "down": lambda m=mlp.down_proj, v=s: m(v),
            })
        return out

    ops = {rows: ops_of(calls) for rows, calls in steps.items()}
    names = list(ops[1][0])
    times: dict[tuple[int, str], list[float]] = {(rows, n): [] for rows in ops for n in names}
    for _ in range(args.repeats):
        for n in names:
            for rows in (1, 2):  # the two widths in turn, op by op: this VM's speed drifts
                start = time.perf_counter()
                for layer_ops in ops[rows]:
                    layer_ops[n]()
                times[(rows, n)].append(time.perf_counter() - start)
    report = {"threads": args.threads, "repeats": args.repeats,
              "positions": {rows: steps[rows][0][-2].tolist() for rows in steps}, "ms": {}}
    for n in names:
        one, two = (statistics.median(times[(rows, n)]) * 1e3 for rows in (1, 2))
        report["ms"][n] = {"1 row": round(one, 3), "2 rows": round(two, 3)}
        print(f"{n:16s} 1 row {one:7.3f} ms   2 rows {two:7.3f} ms   +{two - one:6.3f}   x{two / one:.2f}")
    print("positions", report["positions"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
