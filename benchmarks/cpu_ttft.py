"""Time to first token on the CPU through ``engine.generate``: prompts of random common words
(about 36, 130 and 537 tokens, each new to the prefix cache), one generated token each, one
thread by default. A diagnostic for the prompt path (products of more than 16 rows dequantize
each weight, then one BLAS product; docs/performance.md, session 11).

    python benchmarks/cpu_ttft.py [--threads 1] [--words 30,120,500]
"""

from __future__ import annotations

import argparse
import random

import torch

import mtplx

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jam fever".split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--words", default="30,120,500")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = mtplx.load(device="cpu")
    engine.generate("warm up", max_tokens=2)
    rng = random.Random(0)
    for n in (int(w) for w in args.words.split(",")):
        text = f"[{n}] " + " ".join(rng.choice(WORDS) for _ in range(n))
        r = engine.generate(text, max_tokens=1)
        print(f"{r.stats['prompt_tokens']} prompt tokens: time to first token {r.stats['ttft_s']:.3f} s")


if __name__ == "__main__":
    main()
