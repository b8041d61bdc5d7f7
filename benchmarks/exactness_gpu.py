"""Exactness of a head on the device, through the paths the GPU runs (CUDA graphs, chained
cycles): greedy MTP output equal to AR's (float32: bf16 verifies of k+1 tokens round differently
from 1-token steps and flip near-ties), and a chi-square test of sampled MTP decoding against the
trunk's enumerated distribution (forge.measure.sampled_exactness), chained and unchained.

    PYTHONPATH=. python benchmarks/exactness_gpu.py --model GGUF --heads DIR[,DIR] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--heads", required=True)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    import mtplx
    from mtplx.benchmarking import BENCH_PROMPTS
    from mtplx.forge.measure import sampled_exactness
    from mtplx.forge.prompts import HELD_OUT_PROMPTS, as_chat

    report = {}
    for head in args.heads.split(","):
        for dtype in args.dtypes.split(","):
            engine = mtplx.load(args.model, dtype=dtype, head=head)
            entry = {}
            with torch.inference_mode():
                same = 0
                for p in BENCH_PROMPTS:
                    ar = engine.generate([{"role": "user", "content": p}], chat=True, mode="ar", max_tokens=args.max_tokens)
                    same += all(engine.generate([{"role": "user", "content": p}], chat=True, mode="mtp", depth=d,
                                                max_tokens=args.max_tokens).token_ids == ar.token_ids for d in (1, 3))
                entry["greedy_identical_prompts"] = f"{same}/{len(BENCH_PROMPTS)}"
                prompt = engine.tokenizer.apply_chat_template(as_chat(HELD_OUT_PROMPTS[0]))
                for chained in (True, False):
                    engine.generator.chain.enabled = chained
                    for policy in ("mirror", "greedy"):
                        entry[f"sampled_{policy}_{'chained' if chained else 'unchained'}"] = sampled_exactness(
                            engine, prompt, samples=args.samples, draft_policy=policy)
            report[f"{head}|{dtype}"] = entry
            print(head, dtype, json.dumps({k: (v if isinstance(v, str) else {"p": round(v["p_value"], 4),
                                                                             **({"impossible": v["impossible_outcomes"]} if "impossible_outcomes" in v else {})})
                                           for k, v in entry.items()}), flush=True)
            del engine
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
