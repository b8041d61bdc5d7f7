"""A CPU decode cycle's small host-side ops, each timed alone against the PyTorch ops it replaced
(session 30): RoPE's cos/sin for a forward's positions (``RotaryEmbedding.bind``: rows of a
table against computing them), the argmax of a verify's logits and of a pruned draft row
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
from mtplx.models.config import ModelConfig
from mtplx.models.layers import BoundRotary, RotaryEmbedding


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
    config = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=8192, rope_theta=100_000.0)
    rotary = RotaryEmbedding(config)
    positions = torch.tensor([[100, 101]])
    verify = torch.randn(1, 2, config.vocab_size)
    draft_row = torch.randn(1, 16384)
    drafts = verify[:, :1].argmax(-1)

    def computed_bind():
        cos, sin = rotary._cos_sin(positions)
        return BoundRotary(cos.unsqueeze(2).to(torch.float32), sin.unsqueeze(2).to(torch.float32), rotary.rotary_dim)

    pairs = {
        "RoPE cos/sin of a 2-token forward": (computed_bind, lambda: rotary.bind(positions, torch.float32)),
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
