"""Rows leaving and joining a chained batch (issue 15's 8-stream runs): requests of different
lengths decoded in one batch of eight, stepped through ``Engine.step`` as the batching
schedulers step them (a row that ends is released at once; one row is cancelled
mid-decoding), against each request decoded alone. With ``--arrivals N``, N more requests come
one by one: each is admitted and prefilled when a row ends, with the chain's cycle in flight,
and steps with the others from then on (a closed-loop client). Every row that ran to its end
must decode the tokens it decodes alone, and the cancelled one a prefix of them. Also counts
the chains started (each start leaves the device idle while the host commits, plans and
launches) and the rows that joined a running chain, and times the batch.

    PYTHONPATH=. python benchmarks/chain_rows.py --model GGUF --head DIR --out FILE.json
        [--device cuda] [--dtype float32] [--depths 0,1,3] [--regimes greedy,t0.7] [--arrivals 4] [--beside]
        [--first 5]

float32 by default: bf16 batches of 8 rows and lone rows round differently and may flip a
near-tie. Depth 0 is AR (chained AR steps). Runs on the CPU too, where chains run eagerly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from sampled_decoding import HELD_OUT_CHAT, REGIMES  # noqa: E402

ROWS = 8


def requests(engine, depth: int, sampling: dict, arrivals: int = 0) -> list:
    """8 + ``arrivals`` chat requests, 24 to 80 tokens past EOS (the first eight; then 24 to 48),
    seeds apart."""
    mode = dict(mode="mtp", depth=depth) if depth else dict(mode="ar")
    return [engine.make_request([{"role": "user", "content": HELD_OUT_CHAT[i % len(HELD_OUT_CHAT)]}], chat=True,
                                ignore_eos=True, max_tokens=24 + 8 * (i if i < ROWS else i % 4), **mode,
                                **{**sampling, **({"seed": sampling["seed"] + i} if "seed" in sampling else {})})
            for i in range(ROWS + arrivals)]


def alone_tokens(engine, req) -> list[int]:
    """The request decoded by itself (``Engine.run``, the serial path)."""
    for seq, _ in engine.run(req):
        pass
    return seq.generated


def batch(engine, reqs: list, cancel_at: int = 5, beside: bool = False,
          first: int = ROWS) -> tuple[list[list[int]], int, int, float, bool]:
    """The requests decoded side by side, the first ``first`` at once and the rest of the
    first eight one a step (the batch grows inside the 8-row graph: each takes a padding row
    of the running chain), each later one admitted when a row ends; -> (tokens per row, chains
    started, rows that joined a chain, seconds, whether the cancelled row (the eighth) was
    still live when cancelled). beside: a later one's prompt runs beside the chain
    (``Generator.prefill(wait=False)``, as the batching schedulers feed it), and it steps with
    the others once its first token is drawn."""
    import torch

    starts, joins = set(), set()

    def observe(event, seq):
        if event == "chain_start":
            starts.add(steps)
        elif event == "chain_join":
            joins.add(seq.seq_id)

    gen = engine.generator
    gen.observers.append(observe)
    seqs = []

    def arrive(req, wait: bool = True) -> bool:
        seq = engine.new_sequence(req)
        gen.admit(seq)
        seqs.append(seq)
        return gen.prefill(seq, wait=wait)

    for req in reqs[:first]:
        arrive(req)
    growing, waiting = list(reqs[first:ROWS]), list(reqs[ROWS:])
    live, pending = list(seqs), []
    steps, cancelled = 0, False
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            while live or pending:
                for s in list(pending):  # prompts run beside the chain: rows join once their first token is drawn
                    if gen.prefill(s, wait=not live):
                        pending.remove(s)
                        live.append(s)
                if not live:
                    continue
                engine.step(live)
                steps += 1
                if growing:  # one more of the first eight, with the chain's cycle in flight
                    (live if arrive(growing.pop(0), wait=not beside) else pending).append(seqs[-1])
                target = seqs[ROWS - 1] if len(seqs) >= ROWS else None
                if steps == cancel_at and any(s is target for s in live) and not target.finished:
                    target.finish_reason = "cancelled"
                    cancelled = True
                for s in [s for s in live if s.finished]:
                    gen.release(s)
                    live.remove(s)
                    if waiting:  # the next request, prefilled with the chain's cycle in flight
                        (live if arrive(waiting.pop(0), wait=not beside) else pending).append(seqs[-1])
            gen.drain()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    finally:
        gen.observers.remove(observe)
        for s in seqs:
            gen.release(s)
    return [s.generated for s in seqs], len(starts), len(joins), seconds, cancelled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--head", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--depths", default="0,1,3")
    ap.add_argument("--regimes", default="greedy,t0.7")
    ap.add_argument("--arrivals", type=int, default=0, help="requests that arrive as rows end")
    ap.add_argument("--first", type=int, default=ROWS,
                    help="rows at the start (5-8); the rest of the first eight arrive one a step, each joining "
                         "the running chain in its 8-row graph's padding rows")
    ap.add_argument("--beside", action="store_true",
                    help="arrivals' prompts run beside the chain, as the batching schedulers run them (on the "
                         "CPU in order: Generator.beside = 'inline')")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not 5 <= args.first <= ROWS:
        raise SystemExit(f"--first {args.first}: 5 to {ROWS} (rows that share the {ROWS}-row graph)")

    import torch

    import mtplx

    engine = mtplx.load(args.model, device=args.device, dtype=args.dtype, head=args.head)
    cpu = not engine.generator.chain.enabled
    if cpu:
        engine.generator.chain.enabled = True  # the CPU: the eager chain
    if args.beside:  # on CUDA the second stream, on the CPU in order
        engine.generator.beside = "inline" if cpu else "auto"
    report = {"device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
              "dtype": args.dtype, "first": args.first, "beside": engine.generator.beside,
              "side_stream": getattr(engine.generator.side_prefill, "cuda_stream", None) is not None, "runs": {}}
    failures = 0
    for regime in args.regimes.split(","):
        for depth in (int(d) for d in args.depths.split(",")):
            reqs = lambda: requests(engine, depth, REGIMES[regime], args.arrivals)  # noqa: E731
            alone = [alone_tokens(engine, r) for r in reqs()]
            batch(engine, reqs(), beside=args.beside, first=args.first)  # warm-up
            tokens, chains, joins, seconds, cancelled = batch(engine, reqs(), beside=args.beside, first=args.first)
            c = ROWS - 1  # the cancelled row
            same = [t == a for i, (t, a) in enumerate(zip(tokens, alone)) if i != c]
            prefix = tokens[c] == alone[c][: len(tokens[c])]
            first = [next((i for i, (x, y) in enumerate(zip(t, a)) if x != y), None) for t, a in zip(tokens, alone)]
            run = {"rows_equal_alone": f"{sum(same)}/{len(same)}", "cancelled_row_prefix": prefix,
                   "cancelled_row_tokens": len(tokens[c]), "cancelled_live": cancelled,
                   "first_difference": first, "chains_started": chains, "rows_joined": joins,
                   "tokens": sum(map(len, tokens)), "seconds": round(seconds, 4),
                   "tok_s": round(sum(map(len, tokens)) / seconds, 1)}
            failures += (not all(same)) + (not prefix)
            report["runs"][f"{regime}/depth{depth}"] = run
            print(f"{regime} depth {depth}: {run}", flush=True)
    report["failures"] = failures
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}; {failures} failures")


if __name__ == "__main__":
    main()
