"""The default model's quantized products on the CPU by activation width: each projection kind
(q/k/v, o, gate/up, down) over all 30 layers' own weights in a loop, 1-4 token rows, float32
against int16 activations (``quant_matmul``'s 32 and 16), interleaved in one process, best of
10 loops, us per product; and the largest difference between the two relative to the float
output's largest value.

``--decode-order``: instead, the products as a decode step streams them: every layer's four in
the model's order (53 MB, more than the L3 holds, so each weight comes from memory as in a step),
then the output matrix, ms per pass and GB/s of weights, scales and offsets read. A kind's own
loop keeps the smaller kinds (o: 6 MB over 30 layers) in the L3 and so hides waits on memory
that a step has.

    python benchmarks/cpu_products.py [--threads 2] [--rows 1,2,3,4] [--decode-order]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--decode-order", action="store_true", help="all layers' products in order, then the output matrix")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import mtplx
    from mtplx.kernels import cpu
    from mtplx.models.quant import QuantLinear

    engine = mtplx.load(device="cpu", quantize="gguf")
    kinds: dict[str, list] = {}
    for name, m in engine.runner.model.named_modules():
        if isinstance(m, QuantLinear) and m.backend == "cpu" and ".layers." in name:
            kinds.setdefault(name.rsplit(".", 1)[-1], []).append(m)
    ext = cpu.extension()
    if args.decode_order:
        return decode_order(engine, ext, [int(r) for r in args.rows.split(",")])
    with torch.inference_mode():
        for kind, mods in kinds.items():
            cells = []
            for rows in (int(r) for r in args.rows.split(",")):
                a = torch.randn(rows, mods[0].in_features, generator=torch.Generator().manual_seed(rows))
                best = {32: float("inf"), 16: float("inf")}
                for _ in range(2):
                    for bits in (32, 16):
                        for _ in range(10):
                            t = time.perf_counter()
                            for m in mods:
                                ext.quant_matmul(a, m.words, m.scale, m.zero, m.group_size, m.bits, bits)
                            best[bits] = min(best[bits], (time.perf_counter() - t) * 1e6 / len(mods))
                m = mods[0]
                f, i = (ext.quant_matmul(a, m.words, m.scale, m.zero, m.group_size, m.bits, b) for b in (32, 16))
                err = float((i - f).abs().max() / f.abs().max())
                cells.append(f"{rows} rows {best[32]:5.1f} / {best[16]:5.1f} us ({best[32] / best[16]:.2f}x, {err:.0e})")
            print(f"{kind:12s} {mods[0].out_features} x {mods[0].in_features}: " + "   ".join(cells), flush=True)


def decode_order(engine, ext, rows_list: list[int]) -> None:
    from mtplx.models.quant import QuantLinear

    trunk = [m for name, m in engine.runner.model.named_modules()
             if isinstance(m, QuantLinear) and m.backend == "cpu" and ".layers." in name]
    head = engine.runner.model.lm_head
    if not (isinstance(head, QuantLinear) and head.backend == "cpu"):
        raise SystemExit("--decode-order times a quantized output matrix on the CPU kernel; this model's is not one")
    layers = engine.runner.model.config.num_hidden_layers
    size = lambda ms: sum(t.numel() * t.element_size() for m in ms for t in (m.words, m.scale, m.zero))  # noqa: E731
    with torch.inference_mode():
        for rows in rows_list:
            xs = {k: torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                  for k in {m.in_features for m in trunk + [head]}}
            best = {(bits, part): float("inf") for bits in (32, 16) for part in ("trunk", "output")}
            for _ in range(3):
                for bits in (32, 16):
                    for _ in range(5):
                        t0 = time.perf_counter()
                        for m in trunk:
                            ext.quant_matmul(xs[m.in_features], m.words, m.scale, m.zero, m.group_size, m.bits, bits)
                        t1 = time.perf_counter()
                        ext.quant_matmul(xs[head.in_features], head.words, head.scale, head.zero, head.group_size,
                                         head.bits, bits)
                        t2 = time.perf_counter()
                        best[bits, "trunk"] = min(best[bits, "trunk"], t1 - t0)
                        best[bits, "output"] = min(best[bits, "output"], t2 - t1)
            for bits in (32, 16):
                tr, out = best[bits, "trunk"], best[bits, "output"]
                print(f"{rows} rows, activations {bits}: {layers} layers' products {tr * 1e3:.3f} ms "
                      f"({size(trunk) / tr / 1e9:.1f} GB/s), then the output matrix {out * 1e3:.3f} ms "
                      f"({size([head]) / out / 1e9:.1f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
