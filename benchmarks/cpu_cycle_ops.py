"""A CPU decode cycle's small host-side ops, each timed alone against the PyTorch ops it replaced
(session 30): the argmax of a verify's logits and of a pruned draft row
(``kernels.cpu.argmax`` against ``torch.argmax``), and greedy acceptance from the verify's logits
(``kernels.cpu.greedy_verify`` against ``greedy_outcome(torch.argmax(...))``). Microseconds a
call, the median of ``--repeats`` timings of ``--calls`` calls each, the default model's shapes.

    python benchmarks/cpu_cycle_ops.py [--threads 2] [--calls 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtplx.engine.speculative import greedy_outcome
from mtplx.kernels import cpu as cpu_kernels


def timed(fn, calls: int, repeats: int) -> float:
    for _ in range(calls // 10):
        fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    verify = torch.randn(1, 2, 49152)  # the default model's vocabulary
    draft_row = torch.randn(1, 16384)
    drafts = verify[:, :1].argmax(-1)

    pairs = {
        "argmax of a 2 x 49,152 verify": (lambda: verify.argmax(-1), lambda: cpu_kernels.argmax(verify)),
        "argmax of a 16,384-token draft row": (lambda: draft_row.argmax(-1), lambda: cpu_kernels.argmax(draft_row)),
        "greedy acceptance of a depth-1 verify": (lambda: greedy_outcome(verify.argmax(-1), drafts, None),
                                                  lambda: cpu_kernels.greedy_verify(verify, drafts, None)),
    }
    with torch.inference_mode():
        for name, (before, after) in pairs.items():
            a, b = timed(before, args.calls, args.repeats), timed(after, args.calls, args.repeats)
            print(f"{name:40s} PyTorch ops {a:7.1f} us   now {b:6.1f} us   ({a / b:.1f}x)", flush=True)


if __name__ == "__main__":
    main()
