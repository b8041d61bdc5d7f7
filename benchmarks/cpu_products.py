"""The default model's quantized products on the CPU by activation width: each projection kind
(q/k/v, o, gate/up, down) over all 30 layers' own weights in a loop, 1-4 token rows, float32
against int16 activations (``quant_matmul``'s 32 and 16), interleaved in one process, best of
10 loops, us per product; and the largest difference between the two relative to the float
output's largest value.

    python benchmarks/cpu_products.py [--threads 2] [--rows 1,2,3,4]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4")
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


if __name__ == "__main__":
    main()
