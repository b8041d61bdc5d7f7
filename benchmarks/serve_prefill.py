"""A long prompt's time to first token through ``mtplx serve``: one serial server on a free
loopback port, prompts of random common words (each new to the prefix cache) sent one at a
time as streaming chat requests of one token; seconds from sending to the first text chunk, and
prompt tokens per second (the prompt's count from ``usage``).

    python benchmarks/serve_prefill.py [--words 6000] [--requests 2] [--serve-args '--threads 2'] [--json r.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import httpx
from cpu_ttft import WORDS
from serve_bench import Server


def first_token(url: str, model: str, prompt: str) -> tuple[float, int]:
    """(seconds to the first text chunk, prompt tokens) of one streaming request."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, prompt_tokens = None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=1800) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t0), prompt_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--words", type=int, default=6000)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--json")
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as config_dir:
        server = Server("serial", args.serve_args.split(), config_dir)
        try:
            if not server.wait_ready():
                raise SystemExit(f"the server did not start: {server.error}")
            runs = []
            for i in range(args.requests):
                prompt = f"Request {i}. " + " ".join(rng.choice(WORDS) for _ in range(args.words))
                ttft, tokens = first_token(server.url, server.model, prompt)
                runs.append({"ttft_s": ttft, "prompt_tokens": tokens, "prompt_tok_s": tokens / ttft})
                print(f"request {i}: {tokens} prompt tokens, first token after {ttft:.2f} s "
                      f"({tokens / ttft:.1f} tok/s)", flush=True)
        finally:
            server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "words": args.words, "serve_args": args.serve_args,
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
