"""Which kernels a decode step and a greedy MTP cycle launch on the GPU, and how long each takes
there, with programmatic dependent launch on and off (``mtplx.kernels.PDL``): random weights
of a model shape and a random head (benchmarks/gpu.py's ``random_engine``), one AR step (trunk +
logits + argmax, as ``step_costs`` times it) and the greedy cycle at depths 1 and 3 as decoding
runs it (one graph). Kernels whose name is not one of mtplx's Triton kernels (PyTorch's, cuBLAS)
launch without PDL and break the chain of overlapped launches (docs/performance.md, session 21).

    PYTHONPATH=. python3 benchmarks/cycle_kernels.py --shape smollm2-135m --out r.json
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.gpu import SHAPES, random_engine, timed
from benchmarks.gpu_profile import kernel_breakdown
from mtplx import kernels
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.sequence import Sequence


def measure(engine, context: int = 128) -> dict:
    runner = engine.runner
    seq = Sequence(prompt_ids=list(range(1, context + 1)), params=SamplingParams(), max_tokens=1)
    runner.blocks.allocate(seq.seq_id, seq.prompt_ids)
    runner.blocks.ensure_capacity(seq.seq_id, context + 8)
    out = {}
    with torch.inference_mode():
        runner.trunk([seq], [seq.prompt_ids], [0])
        hidden = torch.zeros(1, 1, engine.config.hidden_size, dtype=engine.dtype, device=engine.device)
        seq.tokens = seq.prompt_ids + [5] * 8
        seq.trunk_len = seq.head_len = context
        cases = {"ar": lambda: runner.logits(runner.trunk([seq], [[5]], [context])[:, -1]).argmax(-1)}
        for d in (1, 3):
            cases[f"cycle_d{d}"] = lambda d=d: (setattr(seq, "depth", d), runner.greedy_cycle([seq], hidden, d))
        for name, fn in cases.items():
            kernels_ = kernel_breakdown(fn, steps=10, top=None)["top"]
            triton_names = {k["name"] for k in kernels_ if k["name"].startswith("_")}
            out[name] = {"s": timed(fn, repeats=50), "kernels": kernels_,
                         "launches": round(sum(k["count"] for k in kernels_), 1),
                         "launches_not_triton": round(sum(k["count"] for k in kernels_
                                                          if k["name"] not in triton_names), 1)}
    runner.blocks.free(seq.seq_id)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    report = {"shape": args.shape, "gpu": torch.cuda.get_device_name(), "runs": {}}
    for pdl in (True, False):
        kernels.PDL = pdl
        engine = random_engine(SHAPES[args.shape], torch.device("cuda"))
        run = report["runs"]["pdl_on" if pdl else "pdl_off"] = measure(engine)
        del engine
        torch.cuda.empty_cache()
        for name, r in run.items():
            print(f"PDL {'on' if pdl else 'off'} {name}: {r['s'] * 1e6:.1f} us, {r['launches']} launches "
                  f"({r['launches_not_triton']} not mtplx's Triton kernels)")
    for name in report["runs"]["pdl_on"]:
        print(f"{name}: PDL on / off = {report['runs']['pdl_on'][name]['s'] / report['runs']['pdl_off'][name]['s']:.3f}")
        for k in report["runs"]["pdl_on"][name]["kernels"]:
            print(f"    {k['count']:6.1f} x {k['us']:8.2f} us  {k['name']}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
