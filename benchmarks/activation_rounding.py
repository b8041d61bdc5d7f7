"""How much the CPU's integer activations cost in precision, on the default model's own activations.

The default model decodes a few held-out chat prompts greedily with its layers run one product
at a time (not the one-call C++ layer), and the input rows of every quantized product that takes
the integer kernel (up to ``SMALL_ROWS`` rows: the decode steps, and prompts that short) are
kept. Each product is then recomputed in float64 from the same (dequantized) weight, with the
input rows rounded three ways, and compared with the float input's product:

- int16, one scale per 32 inputs (the AVX-512 VNNI tile's rounding);
- int16, one scale per row (the AVX2 tile's, since session 35);
- int8, one scale per 32 inputs (llama.cpp's Q8 activations, and ``MTPLX_CPU_ACTIVATIONS=int8``).

Reported per projection kind (q/k/v, o, gate/up, down, the output matrix): the largest and the
median, over layers, of max |error| / max |exact output| over the kept rows, and each row's
largest input magnitude over its median one (how uneven the rows are).

    python benchmarks/activation_rounding.py [--prompts 4] [--tokens 48] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from sampled_decoding import HELD_OUT_CHAT  # noqa: E402

ROUNDINGS = {"int16 per 32": (16, 32), "int16 per row": (16, None), "int8 per 32": (8, 32)}


def rounded(a: torch.Tensor, bits: int, block: int | None) -> torch.Tensor:
    """a [rows, K] rounded to signed ``bits``-bit integers, one scale max |a| / (2^(bits-1) - 1)
    per ``block`` inputs of a row (None: the whole row), and scaled back (float64)."""
    x = a.double().reshape(a.shape[0], -1, block or a.shape[1])
    d = x.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
    return (torch.round(x / torch.where(d > 0, d, 1)) * d).reshape(a.shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args()

    import mtplx
    import mtplx.models.layers as layers
    from mtplx.kernels import cpu as cpu_kernels
    from mtplx.models.quant import QuantLinear

    layers.DecoderLayer._cpu_layer = lambda self: None  # every product through QuantLinear, one at a time
    engine = mtplx.load()
    named = {name: m for name, m in engine.loaded.model.named_modules() if isinstance(m, QuantLinear)}
    modules = {id(m): name for name, m in named.items()}
    inputs: dict[str, list[torch.Tensor]] = {}

    def keep(forward):
        def wrapped(self, x, *a, **k):
            rows = x.detach().reshape(-1, x.shape[-1])
            # the trunk's (not the MTP head's), of products that take the integer kernel (more rows
            # take the dequantized weight's float32 product)
            if id(self) in modules and rows.shape[0] <= cpu_kernels.SMALL_ROWS:
                inputs.setdefault(modules[id(self)], []).append(rows.float().clone())
            return forward(self, x, *a, **k)
        return wrapped

    QuantLinear.forward = keep(QuantLinear.forward)  # (silu_mul_forward calls it on the CPU)
    for prompt in HELD_OUT_CHAT[:args.prompts]:
        engine.generate([{"role": "user", "content": prompt}], chat=True, mode="ar", max_tokens=args.tokens,
                        temperature=0)

    by_kind: dict[str, dict[str, list[float]]] = {}
    for name, rows in inputs.items():
        a = torch.cat(rows)
        w = named[name].dequantize().double()  # [out, in], padding rows cut
        exact = a.double() @ w.T
        top = exact.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        kind = by_kind.setdefault(name.split(".")[-1], {})
        for label, (bits, block) in ROUNDINGS.items():
            err = ((rounded(a, bits, block) @ w.T - exact).abs() / top).amax().item()
            kind.setdefault(label, []).append(err)
        spread = (a.abs().amax(-1) / a.abs().median(-1).values.clamp_min(1e-30)).median().item()
        kind.setdefault("row max / median", []).append(spread)

    report = {kind: {label: {"max": max(v), "median": statistics.median(v)} for label, v in stats.items()}
              for kind, stats in sorted(by_kind.items())}
    for kind, stats in report.items():
        print(kind + ": " + ", ".join(f"{label} {s['max']:.2e} (median {s['median']:.2e})"
                                      for label, s in stats.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"prompts": args.prompts, "tokens": args.tokens, "kinds": report},
                                              indent=1))


if __name__ == "__main__":
    main()
