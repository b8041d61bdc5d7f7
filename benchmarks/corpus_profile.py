"""Where forge's corpus generation spends its time (issue 16: more data per device second): the
trunk decodes forge's training prompts AR in ``ROWS`` rows at once, as ``forge build`` does,
under cProfile; prints tok/s and the functions with the most own and cumulative time.

    PYTHONPATH=. python benchmarks/corpus_profile.py --model GGUF [--device cuda] [--rows 512]
        [--tokens 150000] > profile.txt

cProfile slows the Python side (session 18 on the H200: 7,081 tok/s under it, 7,940 in the run
that generated the corpus), so compare shares, not absolute times.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf or HF directory (default: the default model)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32", help="forge's corpus dtype (float32)")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=150_000, help="generated tokens to profile")
    ap.add_argument("--lines", type=int, default=45)
    args = ap.parse_args()

    from mtplx.forge.build import decoding_engine, encode_prompts, load_trunk
    from mtplx.forge.data import Corpus, generate_corpus, make_jobs
    from mtplx.forge.prompts import training_prompts

    trunk = load_trunk(args.model, args.device, args.dtype)
    ids = encode_prompts(trunk.loaded, training_prompts(0)[:4000])
    engine = decoding_engine(trunk.loaded, None, args.rows, max(len(p) for p in ids) + 256 + 16, spare=4096)
    jobs = make_jobs(ids, (0.0, 0.7, 1.0), 1, 0)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    # warm-up: one batch of short completions (kernels compiled, graphs captured)
    generate_corpus(engine, jobs[: args.rows], max_new_tokens=32, rows=args.rows, target_tokens=10_000, corpus=Corpus())
    sync()
    corpus, prof = Corpus(), cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    generate_corpus(engine, jobs[args.rows:], max_new_tokens=256, rows=args.rows, target_tokens=args.tokens,
                    corpus=corpus)
    prof.disable()
    sync()
    elapsed = time.perf_counter() - t0
    print(f"rows {args.rows}: {corpus.generated_tokens} tokens, {len(corpus.samples)} sequences in {elapsed:.1f} s: "
          f"{corpus.generated_tokens / elapsed:.0f} tok/s (under cProfile)", flush=True)
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.lines)
        print(out.getvalue())


if __name__ == "__main__":
    main()
