"""Exactness of a head on the device, through the paths the GPU runs (CUDA graphs, chained
cycles): greedy MTP output equal to AR's (float32: bf16 verifies of k+1 tokens round differently
from 1-token steps and flip near-ties), and a chi-square test of sampled MTP decoding against the
trunk's enumerated distribution (forge.measure.sampled_exactness), chained and unchained.
With ``--context-tokens N`` it also decodes greedy prompts to the end of an N-token context
(float32) and with stop strings: MTP at depths 1, 3 and auto, chained and not, must end where AR
ends with AR's tokens.

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
    ap.add_argument("--context-tokens", type=int, default=0,
                    help="also check decoding to the end of a context of this many tokens (0: skip)")
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
    if args.context_tokens:
        report["context_end"] = context_end(args.model, args.heads.split(",")[0], args.context_tokens)
        print("context_end", json.dumps(report["context_end"]), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


def context_end(model, head: str, tokens: int) -> dict:
    """Greedy float32 decoding to the end of a ``tokens``-token context, and to a stop string cut
    from AR's own text: each MTP configuration must give AR's tokens and finish reason."""
    import torch

    import mtplx
    from mtplx.benchmarking import BENCH_PROMPTS

    engine = mtplx.load(model, dtype="float32", head=head, kv_cache_tokens=tokens)
    configs = [(d, chained) for d in (1, 3, "auto") for chained in (True, False)]
    out = {"max_context": engine.max_context, "checks": 0, "mismatches": []}
    default_chain = engine.generator.chain.enabled
    with torch.inference_mode():
        for p in BENCH_PROMPTS[:3]:
            msgs = [{"role": "user", "content": p}]
            ar = engine.generate(msgs, chat=True, mode="ar", max_tokens=10**6, ignore_eos=True)
            natural = engine.generate(msgs, chat=True, mode="ar", max_tokens=10**6).text  # to its end of sequence
            stop = natural[len(natural) // 2:][:6]  # a stop string the output reaches
            ar_stop = engine.generate(msgs, chat=True, mode="ar", max_tokens=10**6, stop=[stop])
            assert ar_stop.finish_reason == "stop" and len(ar_stop.text) < len(natural), (p, stop)
            for depth, chained in configs:
                engine.generator.chain.enabled = chained
                for kw, ref in (({"ignore_eos": True}, ar), ({"stop": [stop]}, ar_stop)):
                    got = engine.generate(msgs, chat=True, mode="mtp", depth=depth, max_tokens=10**6, **kw)
                    out["checks"] += 1
                    if (got.token_ids, got.text, got.finish_reason) != (ref.token_ids, ref.text, ref.finish_reason):
                        out["mismatches"].append({"prompt": p, "depth": depth, "chained": chained, "kw": sorted(kw),
                                                  "ar": [len(ref.token_ids), ref.finish_reason],
                                                  "mtp": [len(got.token_ids), got.finish_reason]})
            engine.generator.chain.enabled = default_chain
    assert engine.runner.blocks.num_used_blocks == 0
    return out


if __name__ == "__main__":
    main()
