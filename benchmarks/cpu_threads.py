"""CPU work on a second thread, as the server's model thread runs it, against the main thread:
with and without the main thread's idle OpenMP workers (``runtime.release_idle_openmp_threads``).

Each arm runs in a fresh process (its own OpenMP state). In each: a parallel add of 200,000
floats (us per call) and the default model's greedy AR decode (tok/s, ``engine.generate``, one
held-out prompt, ``--tokens`` tokens), first on the main thread, then on a second thread, the
main thread having run parallel regions (it built the engine) and, in the "released" arm, let
its workers go first.

    python benchmarks/cpu_threads.py --threads 2 [--tokens 96] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = """
import json, threading, time
import torch
import mtplx
from mtplx.runtime import release_idle_openmp_threads
torch.set_num_threads({threads})
engine = mtplx.load()
a = torch.randn(200_000)
messages = [{{"role": "user", "content": {prompt!r}}}]

def measure():
    t = time.perf_counter()
    for _ in range(2000):
        torch.add(a, a)
    add_us = (time.perf_counter() - t) / 2000 * 1e6
    t = time.perf_counter()
    result = engine.generate(messages, chat=True, mode="ar", max_tokens={tokens}, ignore_eos=True)
    return {{"add_us": add_us, "ar_tok_s": len(result.token_ids) / (time.perf_counter() - t)}}

measure()  # warm-up, on the main thread
out = {{"main": measure()}}
if {release}:
    out["released"] = release_idle_openmp_threads()
box = {{}}
thread = threading.Thread(target=lambda: box.update(measure()))
thread.start()
thread.join()
out["thread"] = box
print(json.dumps(out))
"""


def main() -> None:
    from sampled_decoding import HELD_OUT_CHAT

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2, help="each arm this many times, alternating")
    ap.add_argument("--json")
    args = ap.parse_args()
    runs = {"kept": [], "released": []}
    for _ in range(args.rounds):
        for arm in runs:
            code = CHILD.format(threads=args.threads, prompt=HELD_OUT_CHAT[11], tokens=args.tokens,
                                release=arm == "released")
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            runs[arm].append(run)
            print(f"{arm:9} main: add {run['main']['add_us']:6.1f} us, AR {run['main']['ar_tok_s']:6.1f} tok/s | "
                  f"second thread: add {run['thread']['add_us']:6.1f} us, AR {run['thread']['ar_tok_s']:6.1f} tok/s",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "tokens": args.tokens,
                       "prompt": HELD_OUT_CHAT[11], "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
