"""The CUDA-core quantized GEMV's one-row configurations timed where they run: in a whole decode
step (issue 17's 8B targets). ``kernels/quant_gemv.config_for`` picks (BLOCK_N, num_warps, SPLIT)
from a sweep of each matrix timed alone (session 9); with programmatic dependent launch a GEMV
overlaps its neighbours, so the best configuration alone need not be the best in the step.

For each candidate (every one-row GEMV of the trunk takes it, or with --per-matrix only the
matrices of one shape at a time), the step's CUDA graphs are captured again, the logits of a
fixed input are checked against the default configuration's, and greedy AR decode tok/s at one
stream is measured through ``Engine.step`` (``gpu.ar_tok_s``), in ``--rounds`` interleaved rounds.

    PYTHONPATH=. python benchmarks/quant_step_configs.py --fmt int8 --group 128 --out r.json \
        [--shape qwen3-8b] [--configs "8,4,1;4,4,1"] [--per-matrix] [--rounds 2]

``--fmt int4`` runs int4 on the CUDA cores (``MTPLX_CUDA_QUANT=cuda-cores``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from gpu import SHAPES, ar_tok_s, random_engine  # noqa: E402

CANDIDATES = "8,4,1;4,4,1;16,4,1;8,8,1;8,2,1;16,8,1;4,2,1;8,4,2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--fmt", default="int8", choices=("int8", "int4"))
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--configs", default=CANDIDATES, help="BLOCK_N,num_warps,SPLIT;... (one-row GEMVs)")
    ap.add_argument("--per-matrix", action="store_true", help="each candidate on one matrix shape at a time")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from mtplx.engine.cuda_graphs import GraphCache
    from mtplx.kernels import quant_gemv
    from mtplx.models.quant import QuantLinear

    if args.fmt == "int4":
        os.environ["MTPLX_CUDA_QUANT"] = "cuda-cores"
    engine = random_engine(SHAPES[args.shape], torch.device("cuda"), quant=args.fmt, group=args.group)
    layers = [m for m in engine.loaded.model.modules() if isinstance(m, QuantLinear)]
    if not layers or any(m.backend == "mma" for m in layers):
        raise SystemExit("expected the CUDA-core GEMV's layers (kernels/quant_gemv.py)")
    shapes = sorted({(m.out_features, m.in_features) for m in layers})
    default = quant_gemv.config_for
    candidates = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c]
    cases = [("default", None, None)] + [(f"{c}", c, None) for c in candidates]
    if args.per_matrix:
        cases = [("default", None, None)] + [(f"{c}@{n}x{k}", c, (n, k)) for n, k in shapes for c in candidates]
    max_context = engine.runner.graphs.max_context
    x = torch.randint(0, engine.config.vocab_size, (1, 8), device="cuda")

    def use(config, only) -> torch.Tensor:
        def config_for(n, k, rows, bits):
            if rows == 1 and config is not None and (only is None or (n, k) == only):
                # silu layers count weight rows: the fused gate/up's n is twice its outputs
                return (*config, 0)
            return default(n, k, rows, bits)
        quant_gemv.config_for = config_for
        # a new cache (its own memory pool): capturing again into the old pool after dropping
        # its graphs trips the caching allocator's use-count assert (torch 2.11)
        engine.runner.graphs = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        engine.runner.graphs = GraphCache(engine.runner, max_context=max_context)
        engine.runner.graphs.capture_all(depths=(), rows=(1,))
        return _logits(engine, x)

    report = {"shape": args.shape, "fmt": args.fmt, "group": args.group, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "matrices": shapes, "cases": {}}
    reference = use(None, None)
    for rnd in range(args.rounds):
        for label, config, only in cases:
            t0 = time.perf_counter()
            logits = use(config, only)
            err = (logits - reference).abs().max().item() / reference.abs().max().item()
            if err > 0.1:  # bf16 sums in another order: the fast path differs from the reference by ~0.05
                raise SystemExit(f"FAIL: {label}: logits differ from the default configuration's by {err:.3g}")
            tok_s = ar_tok_s(engine, 1)
            entry = report["cases"].setdefault(label, {"tok_s": [], "max_rel_logit_diff": err})
            entry["tok_s"].append(tok_s)
            print(f"round {rnd} {label}: {tok_s:.1f} tok/s (logits {err:.2e}, {time.perf_counter() - t0:.1f} s)",
                  flush=True)
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    quant_gemv.config_for = default
    base = max(report["cases"]["default"]["tok_s"])
    for label, entry in report["cases"].items():
        entry["best_over_default"] = max(entry["tok_s"]) / base
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for label, entry in sorted(report["cases"].items(), key=lambda kv: -kv[1]["best_over_default"])[:12]:
        print(f"{entry['best_over_default']:.4f}  {label}  {[round(t, 1) for t in entry['tok_s']]}")


def _logits(engine, ids: torch.Tensor) -> torch.Tensor:
    """The logits of a one-token step (the captured graph of one row) after a prefill of the
    rest of ``ids`` [1, T]."""
    from mtplx.engine.sampling import SamplingParams
    from mtplx.engine.sequence import Sequence

    runner = engine.runner
    seq = Sequence(prompt_ids=ids[0].tolist(), params=SamplingParams(), max_tokens=1)
    runner.blocks.allocate(seq.seq_id, seq.prompt_ids)
    try:
        with torch.inference_mode():
            prompt = seq.prompt_ids
            runner.trunk([seq], [prompt[:-1]], [0])
            hidden = runner.trunk([seq], [prompt[-1:]], [len(prompt) - 1])
            return runner.logits(hidden[:, -1]).float()[0]
    finally:
        runner.blocks.free(seq.seq_id)


if __name__ == "__main__":
    main()
