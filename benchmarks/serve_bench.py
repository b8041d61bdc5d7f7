"""Serving benchmark: concurrency levels against ``mtplx serve``, one server per scheduler mode.

Metrics follow vLLM's ``bench serve`` definitions; output tokens come from ``usage`` (an MTP
chunk can carry several tokens), never from counting chunks:
  TTFT   request sent -> first chunk with text (seconds)
  TPOT   (latency - TTFT) / (output_tokens - 1), per request with more than one token
  ITL    gaps between successive text chunks, pooled over requests
  E2E    request sent -> last byte
  throughput: requests / s and output tokens / s over the level's wall time
Load is closed-loop: ``concurrency`` workers each send the next request as soon as theirs ends.

serial and hyper run side by side: both servers are up, and every level runs on serial then
on hyper before the next level, so drift on a shared machine hits both alike.

  python benchmarks/serve_bench.py --requests 8 --max-tokens 64 --out benchmarks/results/serve_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

PROMPTS = [
    "What is the capital of France, and what is it famous for?",
    "Explain in two sentences how a rainbow forms.",
    "Give me three tips for writing clean Python code.",
    "Write a short poem about the sea at night.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
    "How do vaccines train the immune system?",
    "Suggest a healthy breakfast and explain why it is good.",
]
MODES = ("serial", "hyper", "ar_batch", "mtp_batch", "solo_mtp")


# -- one request --------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    chunk_times, usage, stats = [], None, {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage, stats = data["usage"], data.get("mtplx_stats", {})
            if data["choices"] and data["choices"][0]["delta"].get("content"):
                chunk_times.append(time.perf_counter())
    end = time.perf_counter()
    return {"latency": end - sent, "ttft": (chunk_times[0] - sent) if chunk_times else None,
            "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
            "output_tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"],
            "generation_mode": stats.get("generation_mode"), "verify_calls": stats.get("verify_calls") or 0,
            "accepted_tokens": stats.get("accepted_tokens") or 0, "drafted_tokens": stats.get("drafted_tokens") or 0}


async def run_level(url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> tuple[list, float]:
    """Per-request measurements and the level's wall time (seconds)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        async def worker():
            while prompts:
                results.append(await one_request(client, model, prompts.pop(0), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def summarise(results: list[dict], duration: float, concurrency: int) -> dict:
    def stats(values: list[float]) -> dict:
        values = sorted(v for v in values if v is not None)
        if not values:
            return {"mean": None, "median": None, "p99": None}
        p99 = values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]
        return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}

    output = sum(r["output_tokens"] for r in results)
    cycles, accepted = sum(r["verify_calls"] for r in results), sum(r["accepted_tokens"] for r in results)
    drafted = sum(r["drafted_tokens"] for r in results)
    modes = sorted({r["generation_mode"] for r in results if r["generation_mode"]})
    tpot = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in results
            if r["ttft"] is not None and r["output_tokens"] > 1]
    return {
        "concurrency": concurrency, "completed": len(results), "duration_s": duration,
        "output_tokens": output, "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "request_throughput": len(results) / duration, "output_token_throughput": output / duration,
        "ttft_s": stats([r["ttft"] for r in results]), "tpot_s": stats(tpot),
        "itl_s": stats([g for r in results for g in r["itl"]]), "e2e_s": stats([r["latency"] for r in results]),
        "generation_modes": modes,  # from each response's mtplx_stats
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / cycles if cycles else None,
    }


# -- servers ----------------------------------------------------------------------------------------
class Server:
    """``mtplx serve`` in a subprocess on a free port, with an empty config file."""

    def __init__(self, mode: str, extra_args: list[str], config_dir: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.mode, self.url = mode, f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "MTPLX_CONFIG": str(Path(config_dir) / f"{mode}.toml")}
        cmd = [sys.executable, "-m", "mtplx.cli", "serve", "--port", str(self.port), "--scheduler-mode", mode,
               "--log-level", "warning", *extra_args]
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        self.model = self.card = self.error = None

    def wait_ready(self, timeout: float = 600) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.error = self.proc.stderr.read().strip().splitlines()[-1]
                return False
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.card = httpx.get(f"{self.url}/v1/models").json()["data"][0]
                    self.model = self.card["id"]
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.error = "did not come up in time"
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


def bench(servers: dict[str, Server], levels: list[int], requests: int, max_tokens: int, rounds: int) -> dict:
    """{mode: {level: summary}}. With several servers, every round of every level runs on each
    server in turn (side by side); a level's summary pools its rounds."""
    for server in servers.values():
        asyncio.run(run_level(server.url, server.model, 1, 1, 8))  # warm-up, not recorded
    out = {m: {} for m in servers}
    for c in levels:
        pooled = {m: ([], 0.0) for m in servers}
        for _ in range(rounds):
            for mode, server in servers.items():
                results, duration = asyncio.run(run_level(server.url, server.model, c, requests, max_tokens))
                pooled[mode] = (pooled[mode][0] + results, pooled[mode][1] + duration)
        for mode, (results, duration) in pooled.items():
            out[mode][str(c)] = summarise(results, duration, c)
            print(f"  {mode:<9} c={c}: {out[mode][str(c)]['output_token_throughput']:.2f} tok/s", flush=True)
    return out


def head_info(serve_args: list[str]) -> dict | None:
    """The MTP head the servers load (``--head DIR`` or the default model's): path and sha256,
    so results can be tied to the exact head (it may be re-forged between runs)."""
    import hashlib

    if "--head" in serve_args:
        head = Path(serve_args[serve_args.index("--head") + 1])
    else:
        from mtplx.loading.default_model import default_head_dir

        head = default_head_dir()
    weights = head / "mtp.safetensors" if head else None
    if weights is None or not weights.is_file():
        return None
    return {"dir": str(head), "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}


# -- report ------------------------------------------------------------------------------------------
def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(), "load_average_at_start": os.getloadavg()}


def table(results: dict) -> str:
    rows = ["| mode | conc. | decode | req/s | out tok/s | TTFT median s | TPOT median s | ITL median s | "
            "E2E median s | acceptance |", "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, entry in results["modes"].items():
        if "skipped" in entry:
            rows.append(f"| {mode} | - | skipped: {entry['skipped']} | | | | | | | |")
            continue
        for c, m in entry["levels"].items():
            f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            rows.append(f"| {mode} | {c} | {'+'.join(m['generation_modes'])} | {m['request_throughput']:.3f} | "
                        f"{m['output_token_throughput']:.2f} | {f(m['ttft_s']['median'])} | {f(m['tpot_s']['median'])} | "
                        f"{f(m['itl_s']['median'])} | {f(m['e2e_s']['median'])} | {f(m['acceptance_rate'])} |")
    if results.get("hyper_vs_serial"):
        rows += ["", "| conc. | serial tok/s | hyper tok/s | hyper / serial |", "|---|---|---|---|"]
        for c, r in results["hyper_vs_serial"].items():
            rows.append(f"| {c} | {r['serial_tok_s']:.2f} | {r['hyper_tok_s']:.2f} | {r['ratio']:.3f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated scheduler modes")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--requests", type=int, default=8, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="repeat each level this many times (pooled)")
    p.add_argument("--serve-args", default="", help="extra `mtplx serve` arguments, e.g. '--model X --head Y'")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    levels = [int(c) for c in args.concurrency.split(",")]
    extra = args.serve_args.split()
    results = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
               "command": " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
               "settings": {"requests_per_level": args.requests, "rounds": args.rounds, "max_tokens": args.max_tokens,
                            "concurrency": levels, "temperature": 0, "serve_args": extra},
               "head": head_info(extra), "modes": {}}
    with tempfile.TemporaryDirectory(prefix="mtplx-bench-") as config_dir:
        paired = [m for m in ("serial", "hyper") if m in modes]
        if len(paired) == 2:
            servers = {m: Server(m, extra, config_dir) for m in paired}
            try:
                if all(s.wait_ready() for s in servers.values()):
                    print("serial and hyper, side by side", flush=True)
                    both = bench(servers, levels, args.requests, args.max_tokens, args.rounds)
                    for m in paired:
                        results["modes"][m] = {"levels": both[m]}
                    results["model"] = servers["serial"].card
                    results["hyper_vs_serial"] = {
                        str(c): {"serial_tok_s": both["serial"][str(c)]["output_token_throughput"],
                                 "hyper_tok_s": both["hyper"][str(c)]["output_token_throughput"],
                                 "ratio": both["hyper"][str(c)]["output_token_throughput"]
                                 / both["serial"][str(c)]["output_token_throughput"]} for c in levels}
                else:
                    for m, s in servers.items():
                        results["modes"][m] = {"skipped": s.error or "the other server of the pair failed"}
            finally:
                for s in servers.values():
                    s.stop()
        for mode in [m for m in modes if m not in results["modes"]]:
            server = Server(mode, extra, config_dir)
            try:
                if not server.wait_ready():
                    results["modes"][mode] = {"skipped": server.error}
                    print(f"{mode}: skipped ({server.error})", flush=True)
                    continue
                print(mode, flush=True)
                levels_out = bench({mode: server}, levels, args.requests, args.max_tokens, args.rounds)[mode]
                results["modes"][mode] = {"levels": levels_out}
                results.setdefault("model", server.card)
            finally:
                server.stop()
    results["load_average_at_end"] = os.getloadavg()
    print(table(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
