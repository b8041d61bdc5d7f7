"""Decode speed on the CPU as the context grows: the default model from its GGUF, a prompt of
``--contexts`` tokens (held-out prose, not a tuning prompt; each context's its own heading, so
that none starts with another's), then ``--tokens`` greedy tokens past
EOS, AR and MTP depth 1. Each mode decodes the prompt twice: fresh, and again with it in the
prefix cache (AR's and MTP's blocks are cached apart, so neither reuses the other's). Reported:
decode tok/s after the first token (``decode_tok_s``), the time to the first token and the whole
request's seconds, for the fresh prompt; decode tok/s for the cached one; MTP over AR (for the
whole request, AR's seconds over MTP's). An MTP request's head
reads the prompt in its first cycle (after the first token), so its fresh decode figure holds that
pass; with the prompt cached the pass covers only the last, uncached block, which leaves the
steady decode rate. Each configuration runs in its own process, alternating ``--rounds`` times;
``--baseline-tree DIR`` adds the same runs with another checkout's ``mtplx`` package (an earlier
commit's worktree, its kernels built apart).

    python benchmarks/cpu_long_context.py [--threads 2] [--contexts 100,1000,4000] [--tokens 64]
        [--rounds 3] [--baseline-tree DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cpu_vs_llama_cpp import LONG_TEXT  # noqa: E402
from trees import add_arguments, rounds, with_baseline  # noqa: E402


def one_run(threads: int, contexts: list[int], tokens: int) -> dict:
    import torch

    import mtplx

    torch.set_num_threads(threads)
    engine = mtplx.load(device="cpu", quantize="gguf")
    text = engine.tokenizer.encode(LONG_TEXT * (max(contexts) // 20 + 1))
    out = {}
    for n in contexts:
        # a heading of its own, so that no context's prompt starts with a shorter one's (the prefix
        # cache would serve that part)
        heading = engine.tokenizer.encode(f"Document {n}:\n")
        prompt = heading + text[: n - len(heading)]
        for mode in ("ar", "mtp"):
            for cached in ("", "_cached"):
                r = engine.generate(prompt, mode=mode, depth=1, max_tokens=tokens, ignore_eos=True, temperature=0)
                out[f"{mode}@{n}{cached}"] = r.stats["decode_tok_s"]
                if not cached:
                    out[f"{mode}@{n}_ttft_s"] = r.stats["ttft_s"]
                    out[f"{mode}@{n}_request_s"] = r.stats["ttft_s"] + r.stats["decode_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="100,1000,4000")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    add_arguments(ap)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.child:
        print(json.dumps(one_run(args.threads, contexts, args.tokens)))
        return
    envs = with_baseline({"this tree": dict(os.environ)}, args.baseline_tree)
    runs = {name: {} for name in envs}
    argv = ["--threads", str(args.threads), "--contexts", args.contexts, "--tokens", str(args.tokens)]
    for name, res in rounds(__file__, argv, envs, args.rounds):
        for key, value in res.items():
            runs[name].setdefault(key, []).append(value)
    mean = {name: {k: round(statistics.mean(v), 3 if k.endswith("_s") else 1) for k, v in r.items()}
            for name, r in runs.items()}
    for name, values in mean.items():
        print(f"{name:9s} " + ", ".join(f"{k} {v:.3f} s" if k.endswith("_s") else f"{k} {v:.1f} tok/s"
                                         for k, v in values.items()))
    report = {"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, "contexts": contexts,
              "baseline_tree": args.baseline_tree, "runs": runs, "mean_tok_s": mean}
    # MTP's speed over AR's: decode rates divided, and for the whole request AR's seconds over MTP's
    report["mtp_x_ar"] = {name: {k[4:]: round(values["ar" + k[3:]] / values[k] if k.endswith("_request_s")
                                              else values[k] / values["ar" + k[3:]], 3)
                                 for k in values if k.startswith("mtp@") and not k.endswith("_ttft_s")}
                          for name, values in mean.items()}
    for name, ratios in report["mtp_x_ar"].items():
        print(f"{name:9s} MTP / AR: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    if "baseline" in mean:
        # faster than the baseline above 1: rates divided, and the baseline's seconds over this tree's
        base = mean["baseline"]
        report["this_x_baseline"] = {k: round(base[k] / v if k.endswith("_s") else v / base[k], 3)
                                     for k, v in mean["this tree"].items()}
        print("this tree x baseline: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["this_x_baseline"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
