"""Where a decode cycle's time goes on the CPU: wall-clock of the trunk forward (the decoder
layers, each one C++ call where kernels/cpu.layer runs), the output matrix (``compute_logits``),
the MTP head's forward and its draft logits, and with ``--temperature`` above 0 the sampler's
parts (logits to probabilities, mirror drafts' q, races, the verify's rejection sampling), by
wrapping those functions with timers, over one 96-token chat generation per mode (AR, then MTP
at depths 1-3), in ms per cycle (the wrappers add a little of their own). A diagnostic for the
CPU decode path (docs/performance.md, sessions 10, 11 and 28).

    python benchmarks/cpu_step_breakdown.py [--threads 1] [--quantize gguf] [--depths 1,2,3]
        [--temperature 0] [--top-p 1.0] [--draft-policy auto] [--head-quantize int8]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import mtplx
from mtplx.engine import generator, sampling, speculative
from mtplx.models import base, mtp


TRUNK, LOGITS = "trunk forward (decoder layers)", "output matrix (compute_logits)"
PROMPT_PARTS = (TRUNK, LOGITS)  # their first call in a run is the prompt's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantize", default="gguf")
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--draft-policy", default="auto", help="auto, greedy (argmax drafts) or mirror")
    ap.add_argument("--head-quantize", default=None, help="the MTP head's linear weights: int8, int4 or fp8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = mtplx.load(device="cpu", quantize=args.quantize, head_quantize=args.head_quantize)
    spent, calls = collections.defaultdict(float), collections.Counter()

    def wrap(owner, name, key):
        original = getattr(owner, name)

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                calls[key] += 1
                if calls[key] > 1 or key not in PROMPT_PARTS:  # the prompt's forward is not a cycle's
                    spent[key] += time.perf_counter() - start
        setattr(owner, name, timed)

    wrap(base.CausalLM, "forward", TRUNK)
    wrap(base.CausalLM, "compute_logits", LOGITS)
    wrap(mtp.MTPHead, "forward", "MTP head forward")
    wrap(mtp.MTPHead, "feed", "MTP head, a prompt's pairs (feed: cache entries only)")
    wrap(mtp.MTPHead, "draft_subset", "draft logits (pruned vocabulary)")
    wrap(sampling.SamplerBatch, "probs", "sampler: logits to probabilities")
    wrap(sampling.SamplerBatch, "draft_probs", "sampler: mirror drafts' q")
    wrap(sampling.SamplerBatch, "draw", "sampler: races (a token, a mirror draft)")
    wrap(generator, "sampled_outcome", "sampler: a verify's rejection sampling")
    prompt = [{"role": "user", "content": "How does a hash map handle collisions? Explain with an example."}]
    engine.generate(prompt, chat=True, mode="mtp", max_tokens=4, temperature=0)
    runs = [("ar", 1)] + [("mtp", int(d)) for d in args.depths.split(",")]
    for mode, depth in runs:
        spent.clear()
        calls.clear()
        r = engine.generate(prompt, chat=True, mode=mode, depth=depth, max_tokens=96, temperature=args.temperature,
                            top_p=args.top_p, seed=1, draft_policy=args.draft_policy, ignore_eos=True)
        cycles = r.stats.get("verify_calls") or r.stats["generated_tokens"] - 1
        label = "AR" if mode == "ar" else f"MTP depth {depth}"
        print(f"{label}: {r.stats['decode_tok_s']:.1f} tok/s, {r.stats['decode_s'] * 1e3 / cycles:.2f} ms per "
              f"cycle ({cycles} cycles), acceptance length {r.stats.get('mean_acceptance_length')}")
        for key, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
            print(f"  {key}: {seconds * 1e3 / cycles:.2f} ms per cycle ({calls[key]} calls)")
        rest = r.stats["decode_s"] - sum(spent.values())
        print(f"  everything else (host glue, sampling, embedding, bookkeeping): {rest * 1e3 / cycles:.2f} ms per cycle")


if __name__ == "__main__":
    main()
