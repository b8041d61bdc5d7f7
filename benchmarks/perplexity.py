"""Perplexity of quantized-on-load weights against the float model (issue 17's quality targets:
int8 within 0.5%, int4 within 2% of the 16-bit model).

    python benchmarks/perplexity.py --json benchmarks/results/perplexity_cpu.json

Loads the model once per format (``mtplx.load(..., quantize=fmt)``: the float weights quantized
on load; by default the default model's GGUF dequantized to float32 stands for the 16-bit
model), scores a held-out text through the model API (trunk forward, logits; no sampling), and
reports perplexity per format and its ratio to ``none``. The text is cut into windows of
``--window`` tokens, each scored from an empty cache (every token but a window's first is
predicted). The default text ships on this machine and was never used for training or tuning
here: the long description of the ``diskcache`` package (its wheel's METADATA, after the mail
headers); its path and sha256 go into the JSON.
Runs on the CPU by default (a quality number, not a speed one); on the CPU int4/int8 run the
packed kernel (bf16 activations), fp8 multiplies the dequantized weight in the model's dtype.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from importlib import metadata
from pathlib import Path

import torch

import mtplx
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.sequence import Sequence


def default_text() -> Path:
    dist = metadata.distribution("diskcache")
    return Path(next(f for f in dist.files if f.name == "METADATA").locate())


def held_out_ids(engine, path: Path, max_tokens: int) -> tuple[list[int], dict]:
    raw = path.read_bytes()
    text = raw.decode("utf-8")
    body = text.split("\n\n", 1)[1] if path.name == "METADATA" else text  # skip the mail headers
    ids = engine.tokenizer.encode(body)[:max_tokens]
    return ids, {"path": str(path), "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw),
                 "scored_chars": len(engine.tokenizer.decode(ids)), "tokens": len(ids)}


def negative_log_likelihood(engine, ids: list[int], window: int) -> tuple[float, int]:
    """Sum of -log p(token | the window's tokens before it) over every token but each window's
    first, and how many tokens that is."""
    runner, total, count = engine.runner, 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        seq = Sequence(prompt_ids=chunk, params=SamplingParams(), max_tokens=1)
        runner.blocks.allocate(seq.seq_id, chunk)
        with torch.inference_mode():
            logits = runner.logits(runner.trunk([seq], [chunk], [0]))[0, :-1].float()
        runner.blocks.free(seq.seq_id)
        targets = torch.tensor(chunk[1:], device=logits.device)
        total -= float(torch.log_softmax(logits, -1).gather(1, targets[:, None]).sum())
        count += len(chunk) - 1
    return total, count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a model path (default: the default model's GGUF)")
    ap.add_argument("--text", default=None, help="held-out plain text (default: diskcache's METADATA)")
    ap.add_argument("--formats", default="none,int8,int4,fp8")
    ap.add_argument("--dtype", default="float32", help="the float model's dtype (and activations)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    text_path = Path(args.text) if args.text else default_text()
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "device": args.device,
              "dtype": args.dtype, "window": args.window, "formats": {}}
    for fmt in [f for f in args.formats.split(",") if f]:
        t0 = time.perf_counter()
        engine = mtplx.load(args.model, device=args.device, dtype=args.dtype, quantize=fmt,
                            kv_cache_tokens=args.window + 64)
        if "text" not in report:
            ids, report["text"] = held_out_ids(engine, text_path, args.max_tokens)
            report["model"] = str(engine.loaded.source)
        nll, n = negative_log_likelihood(engine, ids, args.window)
        entry = {"perplexity": math.exp(nll / n), "nll_per_token": nll / n, "scored_tokens": n,
                 "seconds": time.perf_counter() - t0}
        base = report["formats"].get("none")
        if base is not None:
            entry["ratio_to_none"] = entry["perplexity"] / base["perplexity"]
        report["formats"][fmt] = entry
        print(fmt, json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in entry.items()}), flush=True)
        del engine
    targets = {"int8": 1.005, "int4": 1.02}
    report["targets"] = {f"{f}_within_{(t - 1) * 100:.1f}%": report["formats"][f]["ratio_to_none"] <= t
                         for f, t in targets.items() if "ratio_to_none" in report["formats"].get(f, {})}
    print(json.dumps(report["targets"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
