"""Forge experiment matrix (issue 16): several head variants trained on one stored corpus, each for
a fixed time, each measured on the held-out prompts through the engine, as a build measures.

    PYTHONPATH=. python benchmarks/forge_matrix.py --model MODEL.gguf --corpus WORK/corpus.pt \
        --variants final,prenorm,fuse3,final+2layers,fuse3+2layers,final+vocab16384 \
        --max-seconds-each 120 --out matrix.json [--heads-dir HEADS] [--device cuda]

A variant is a feature choice (final, prenorm, fuse3) with optional "+2layers" (a two-layer head),
"+mlpN" (its second layer's MLP N wide) and "+vocabN" (a pruned draft vocabulary of the N most
frequent corpus tokens). The trunk pass runs once over the corpus, keeping the union of the
variants' feature layers; each variant reads its own columns. Per variant the JSON holds:
held-out acceptance by depth and mean acceptance length at temperature 0 and (mirror drafts)
0.7 and 1.0, validation agreement, steps and seconds trained, the draft vocabulary's coverage,
and the cost of one draft step beside one AR step (one row, median). ``--heads-dir`` also writes each variant's head (mtp.safetensors and
mtplx_forge.json), ready for ``mtplx forge verify --head HEADS/VARIANT --against ...``.
The corpus comes from ``mtplx forge build --model MODEL --work WORK --corpus-only``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path

import torch

from mtplx.forge import ForgeError
from mtplx.forge import prompts as prompt_set
from mtplx.forge.artifact import head_state, write_head
from mtplx.forge.build import (BuildSettings, draft_vocabulary, encode_prompts, head_engine, load_corpora, load_trunk,
                               mtp_layers, provenance_of, start_head, train_head, training_batches)
from mtplx.forge.measure import acceptance_by_temperature, acceptance_line, step_costs
from mtplx.forge.train import TrainSettings

VARIANT = re.compile(r"^(final|prenorm|fuse3)((?:\+2layers|\+mlp\d+|\+vocab\d+)*)$")


def parse_variant(name: str) -> dict:
    """``fuse3+2layers+mlp1024+vocab16384`` -> {"features": "fuse3", "head_layers": 2,
    "second_mlp": 1024, "draft_vocab": 16384} (``+mlpN``: the second layer's MLP width)."""
    match = VARIANT.match(name)
    if not match:
        raise ForgeError(f"variant {name!r}: expected final|prenorm|fuse3, then optionally +2layers, +mlpN "
                         "and +vocabN")
    extras = match.group(2)
    vocab, mlp = re.search(r"\+vocab(\d+)", extras), re.search(r"\+mlp(\d+)", extras)
    layers = 2 if "+2layers" in extras else 1
    if mlp and layers < 2:
        raise ForgeError(f"variant {name!r}: +mlpN sets the second layer's MLP width; add +2layers")
    return {"features": match.group(1), "head_layers": layers, "second_mlp": int(mlp.group(1)) if mlp else 0,
            "draft_vocab": int(vocab.group(1)) if vocab else 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="the trunk (default: the default model)")
    p.add_argument("--corpus", action="append", required=True,
                   help="a stored corpus (forge build --corpus-only); repeat it to train on several as one")
    p.add_argument("--variants", default="final,prenorm,fuse3,final+2layers,fuse3+2layers,final+vocab16384")
    p.add_argument("--max-seconds-each", type=float, required=True, help="training time per variant")
    p.add_argument("--out", required=True, help="JSON results")
    p.add_argument("--heads-dir", default=None, help="write each variant's head to HEADS_DIR/VARIANT")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", help="trunk dtype for targets and measurement (default float32)")
    p.add_argument("--epochs", type=float, default=8.0, help="at most (the time budget usually stops first)")
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--start-from", default="", help="continue training this forged head (every variant: its form)")
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--measure-max-tokens", type=int, default=128)
    p.add_argument("--measure-temperatures", default="0,0.7,1.0")
    p.add_argument("--held-out-prompts", type=int, default=len(prompt_set.HELD_OUT_PROMPTS),
                   help="measure on the first N held-out prompts (default: all)")
    args = p.parse_args(argv)

    command = "python benchmarks/forge_matrix.py " + " ".join(  # a head's provenance rebuilds it
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    variants = {name: parse_variant(name) for name in args.variants.split(",") if name.strip()}
    temperatures = tuple(float(t) for t in args.measure_temperatures.split(","))
    log = lambda line: print(f"matrix: {line}", file=sys.stderr, flush=True)  # noqa: E731
    trunk = load_trunk(args.model, device=args.device, dtype=args.dtype)
    loaded = trunk.loaded
    corpus_files = [Path(c) for c in args.corpus]
    corpus = load_corpora(corpus_files, trunk)
    log(f"corpus: {len(corpus.samples)} sequences, {corpus.generated_tokens} generated tokens")
    ts = TrainSettings(depth=args.depth, lr=args.lr, epochs=args.epochs, batch_tokens=args.batch_tokens,
                       seed=args.seed, eval_every=100, checkpoint_every=10**9, start_from=args.start_from)
    base = BuildSettings(seed=args.seed, measure_max_tokens=args.measure_max_tokens, measure_depth=args.depth,
                         measure_temperatures=temperatures, train=ts)
    held_ids = encode_prompts(loaded, list(prompt_set.HELD_OUT_PROMPTS[: args.held_out_prompts]))
    union = tuple(sorted({i for v in variants.values()
                          for i in mtp_layers(BuildSettings(features=v["features"]).head_config(loaded), loaded)}))
    starts = {name: start_head(ts, trunk, BuildSettings(**{**vars(base), **choice}).head_config(loaded))
              for name, choice in variants.items()}  # a head of another form fails before the trunk's pass
    batches = training_batches(loaded, corpus, ts, union, log)
    device = loaded.model.lm_head.weight.device
    results = {"model": trunk.name, "trunk_sha256": trunk.sha256, "corpus": ", ".join(args.corpus),
               "corpus_sequences": len(corpus.samples), "corpus_generated_tokens": corpus.generated_tokens,
               "corpus_description": corpus.description, "max_seconds_each": args.max_seconds_each,
               "train": vars(ts), "device": str(device), "dtype": args.dtype,
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
               "torch": torch.__version__, "variants": {}}
    for name, choice in variants.items():
        t0 = time.monotonic()
        settings = BuildSettings(**{**vars(base), **choice})
        mtp = settings.head_config(loaded)
        trainer = train_head(loaded, batches, mtp, ts, None, False, time.monotonic() + args.max_seconds_each,
                             lambda line: None, starts[name])
        weights = head_state(trainer.head, torch.bfloat16)
        vocab = None
        if mtp.draft_vocab:
            ids, vocab = draft_vocabulary(corpus, mtp.draft_vocab, loaded.config.vocab_size)
            weights["mtp.draft_vocab"] = ids.to(torch.int32)
        engine = head_engine(loaded, weights, mtp, held_ids, settings)
        measured = acceptance_by_temperature(engine, held_ids, temperatures=temperatures, depth=settings.measure_depth,
                                             max_tokens=settings.measure_max_tokens, rows=settings.measure_rows,
                                             seed=args.seed)
        costs = step_costs(engine, held_ids[0])
        st = trainer.state
        results["variants"][name] = {
            **choice, "parameters": sum(p.numel() for p in trainer.head.parameters()), "steps": st.step,
            "train_seconds": round(st.seconds, 1), "target_tokens_seen": st.tokens_seen,
            "validation_agreement_by_depth": st.history[-1]["agreement"] if st.history else None,
            "draft_vocab": vocab, "held_out": measured,
            "draft_step_ms": round(costs["draft_step_s"] * 1e3, 4), "ar_step_ms": round(costs["ar_step_s"] * 1e3, 4),
            "seconds": round(time.monotonic() - t0, 1)}
        log(f"{name}: {st.step} steps; held-out {acceptance_line(measured)}; draft step "
            f"{costs['draft_step_s'] * 1e3:.3f} ms vs AR step {costs['ar_step_s'] * 1e3:.3f} ms")
        if args.heads_dir:
            provenance = provenance_of(trunk, trainer, corpus, measured, settings, mtp, vocab, [], None, [],
                                       prompt_set.PROMPT_SET_VERSION, f"{command} (variant {name})",
                                       corpus_files, time.monotonic() - t0)
            write_head(Path(args.heads_dir) / name.replace("+", "_"), weights, provenance)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")  # after each variant: a crash keeps the rest
    return 0


if __name__ == "__main__":
    sys.exit(main())
