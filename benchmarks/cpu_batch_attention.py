"""A batch's forwards on the CPU (session 19): several rows (a batch's AR steps and verifies)
attend row by row over their own keys (``paged_attention_reference``, the C++ row kernel)
where they took one masked product over every row's gathered block table
(``attention._gathered``), and up to 48 token rows take the quantized kernel where more than 16
dequantized every weight (``kernels.cpu.SMALL_ROWS``).

1. One layer's attention at the default model's shapes (9 query heads, 3 KV heads, head dim 64,
   blocks of 16), both ways, microseconds per call.
2. ``--products``: the default model's quantized projections (gate/up 3072 x 576, down 576 x
   1536, k/v 960 x 576) at 8-96 token rows, the kernel against dequantize + BLAS, microseconds.
3. ``--silu``: the C++ ``silu_mul`` (SiLU(gate) * up, vectorized in session 19) against PyTorch's
   ops at 1-48 rows of the default model's 2 x 1,536, microseconds.
4. ``--engine``: the default model decoding W greedy chat rows together through ``engine.step``
   (AR, MTP at depths 1 and 2), the two ways alternating in one process ("before": the
   gathered product for several rows and SMALL_ROWS 16), tok/s.

    python benchmarks/cpu_batch_attention.py [--threads 2] [--contexts 100,500,2000] [--rows 4,8]
        [--queries 1,3] [--products] [--silu] [--engine] [--widths 4,8] [--tokens 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="100,500,2000")
    ap.add_argument("--rows", default="4,8")
    ap.add_argument("--queries", default="1,3")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--products", action="store_true", help="phase 2: the quantized kernel against dequantize + BLAS")
    ap.add_argument("--silu", action="store_true", help="phase 3: silu_mul against PyTorch's ops")
    ap.add_argument("--engine", action="store_true", help="phase 4: engine.step over W rows, before and now")
    ap.add_argument("--widths", default="4,8")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from mtplx.cache.attention import AttentionMetadata, _gathered, paged_attention_reference

    block, heads, kv_heads, d = 16, 9, 3, 64

    def timed(f) -> float:
        f()
        t = time.perf_counter()
        for _ in range(args.calls):
            f()
        return (time.perf_counter() - t) / args.calls * 1e6

    gen = torch.Generator().manual_seed(0)
    for ctx in (int(c) for c in args.contexts.split(",")):
        per_row = (ctx + 64) // block + 1
        for rows in (int(r) for r in args.rows.split(",")):
            k_pool = torch.randn(rows * per_row + 1, block, kv_heads, d, generator=gen)
            v_pool = torch.randn(rows * per_row + 1, block, kv_heads, d, generator=gen)
            tables = torch.arange(rows * per_row).view(rows, per_row)
            for q_len in (int(q) for q in args.queries.split(",")):
                q = torch.randn(rows, q_len, heads, d, generator=gen)
                positions = torch.tensor([[ctx - 1 + 7 * r + j for j in range(q_len)] for r in range(rows)])
                meta = AttentionMetadata(positions, positions.clone(), tables)
                with torch.inference_mode():
                    row = timed(lambda: paged_attention_reference(q, k_pool, v_pool, meta, 0.125))
                    gathered = timed(lambda: _gathered(q, k_pool, v_pool, meta, 0.125))
                    diff = (paged_attention_reference(q, k_pool, v_pool, meta, 0.125)
                            - _gathered(q, k_pool, v_pool, meta, 0.125)).abs().max().item()
                print(f"context {ctx}, {rows} rows x {q_len} queries: row by row {row:.0f} us, gathered "
                      f"{gathered:.0f} us ({gathered / row:.2f}x), max difference {diff:.1e}", flush=True)
    if args.products:
        products(timed)
    if args.silu:
        silu(timed)
    if args.engine:
        engine_ab(args)


def silu(timed) -> None:
    import torch.nn.functional as F

    from mtplx.kernels import cpu

    gen = torch.Generator().manual_seed(0)
    for rows in (1, 2, 16, 24, 48):
        x = torch.randn(rows, 3072, generator=gen) * 3
        with torch.inference_mode():
            ours = timed(lambda: cpu.silu_mul(x))
            ops = timed(lambda: F.silu(x[:, :1536]) * x[:, 1536:])
            error = ((cpu.silu_mul(x) - F.silu(x[:, :1536]) * x[:, 1536:]).abs()
                     / (x[:, :1536].abs() * x[:, 1536:].abs() + 1e-6)).max().item()
        print(f"{rows} rows x 3072: silu_mul {ours:.1f} us, PyTorch {ops:.1f} us, max relative difference {error:.1e}",
              flush=True)


def products(timed) -> None:
    import mtplx
    from mtplx.kernels import cpu
    from mtplx.models.quant import QuantLinear

    engine = mtplx.load(device="cpu", quantize="gguf")
    layers = [m for m in engine.runner.model.modules() if type(m) is QuantLinear]
    ext = cpu.extension()
    for shape in ((3072, 576), (576, 1536), (960, 576)):
        m = next(x for x in layers if (x.out_features, x.in_features) == shape)
        for rows in (8, 16, 24, 32, 48, 64, 96):
            a = torch.randn(rows, m.in_features)
            kernel = timed(lambda: ext.quant_matmul(a, m.words, m.scale, m.zero, m.group_size, m.bits, m.activation_bits))
            blas = timed(lambda: a @ cpu.dequantize(m.words, m.scale, m.zero, m.group_size, m.bits).T)
            print(f"{shape[0]} x {shape[1]}, {rows} rows: kernel {kernel:.0f} us, dequantize + BLAS {blas:.0f} us", flush=True)


def engine_ab(args) -> None:
    import sys
    from pathlib import Path

    import mtplx
    from mtplx.cache import attention
    from mtplx.kernels import cpu

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sampled_decoding import HELD_OUT_CHAT

    engine = mtplx.load(device="cpu", quantize="gguf")
    now_attention, now_rows = attention.paged_attention_reference, cpu.SMALL_ROWS

    def before_attention(q, k_pool, v_pool, meta, scale):
        if q.shape[0] > 1:
            return attention._gathered(q, k_pool, v_pool, meta, scale)
        return now_attention(q, k_pool, v_pool, meta, scale)

    def use(way: str) -> None:
        attention.paged_attention_reference = now_attention if way == "now" else before_attention
        cpu.SMALL_ROWS = now_rows if way == "now" else 16

    def decode(mode: str, depth: int, width: int, tokens: int) -> float:
        seqs = []
        for i in range(width):
            req = engine.make_request([{"role": "user", "content": HELD_OUT_CHAT[i % len(HELD_OUT_CHAT)]}], chat=True,
                                      mode=mode, depth=depth or None, max_tokens=tokens, temperature=0, ignore_eos=True)
            seq = engine.new_sequence(req)
            engine.generator.admit(seq)
            engine.generator.prefill(seq)
            seqs.append(seq)
        t0 = time.perf_counter()
        with torch.inference_mode():
            while live := [s for s in seqs if not s.finished]:
                engine.step(live)
        elapsed = time.perf_counter() - t0
        generated = sum(s.num_generated - 1 for s in seqs)  # past each row's first token (its prefill's)
        for s in seqs:
            engine.generator.release(s)
        return generated / elapsed

    configs = [(mode, depth, int(w)) for w in args.widths.split(",") for mode, depth in (("ar", 0), ("mtp", 1), ("mtp", 2))]
    tok_s = {}
    try:
        for way in ("before", "now"):
            use(way)
            decode("mtp", 1, 2, 8)  # warm-up
        for r in range(args.rounds):
            for config in configs:
                for way in ("before", "now") if r % 2 == 0 else ("now", "before"):
                    use(way)
                    tok_s.setdefault((config, way), []).append(decode(*config, args.tokens))
    finally:
        use("now")
    for config in configs:
        before, now = (sum(tok_s[(config, w)]) / args.rounds for w in ("before", "now"))
        mode, depth, width = config
        label = "AR" if mode == "ar" else f"MTP depth {depth}"
        print(f"{width} rows, {label}: before {before:.1f} tok/s, now {now:.1f} ({now / before:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
