"""What an open dashboard costs the decode loop: one ``mtplx serve`` (default model, its MTP
head, greedy), the same request run alternately with no live stream open and with
``--streams`` streams open (as that many dashboard tabs), ``--rounds`` times each. Reports each
condition's decode tok/s (the requests' own ``mtplx_stats.decode_tok_s``: tokens after the
first over the time since it), the samples the streams received and their size, and the
server's CPU time per second while only the streams are open (the idle server's baseline
subtracted).

  python benchmarks/dashboard_cost.py --rounds 4 --streams 4 --out benchmarks/results/dashboard_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.serve_process import COUNTING, MODEL, ServeProcess  # noqa: E402


class Streams:
    """``n`` live streams read in threads until ``stop()``; counts samples and bytes."""

    def __init__(self, url: str, n: int):
        self.url, self.samples, self.bytes = url, 0, 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._read, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        with httpx.stream("GET", f"{self.url}/v1/mtplx/metrics/stream", timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    with self._lock:
                        self.samples += 1
                        self.bytes += len(line) + 2
                if self._stop.is_set():
                    return

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(5)


def decode_tok_s(url: str, max_tokens: int) -> float:
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["mtplx_stats"]["decode_tok_s"]


def cpu_per_s(proc: psutil.Process, seconds: float) -> float:
    """The server's CPU seconds per wall second over ``seconds``."""
    before = proc.cpu_times()
    time.sleep(seconds)
    after = proc.cpu_times()
    return (after.user + after.system - before.user - before.system) / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        server = ServeProcess(Path(tmp)).wait_ready()
        try:
            proc = psutil.Process(server.proc.pid)
            decode_tok_s(server.url, 16)  # warm-up
            idle_cpu = cpu_per_s(proc, 5)
            streams = Streams(server.url, args.streams)
            streams_cpu = cpu_per_s(proc, 5)
            streams.stop()
            rates: dict[str, list[float]] = {"no stream": [], f"{args.streams} streams": []}
            samples = size = 0
            for _ in range(args.rounds):
                rates["no stream"].append(decode_tok_s(server.url, args.max_tokens))
                streams = Streams(server.url, args.streams)
                rates[f"{args.streams} streams"].append(decode_tok_s(server.url, args.max_tokens))
                streams.stop()
                samples, size = samples + streams.samples, size + streams.bytes
        finally:
            server.kill()

    result = {
        "command": " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
        "cpus": psutil.cpu_count(), "load_average": list(psutil.getloadavg()),
        "max_tokens": args.max_tokens, "rounds": args.rounds, "decode_tok_s": rates,
        "median_decode_tok_s": {k: statistics.median(v) for k, v in rates.items()},
        "samples_received": samples, "mean_sample_bytes": size / samples if samples else None,
        "server_cpu_s_per_s": {"idle": idle_cpu, f"idle + {args.streams} streams": streams_cpu},
    }
    for name, values in rates.items():
        print(f"{name:>12}: decode tok/s median {statistics.median(values):.2f}  "
              f"({', '.join(f'{v:.2f}' for v in values)})")
    print(f"samples {samples}, mean {result['mean_sample_bytes'] or 0:.0f} bytes; server CPU s/s idle "
          f"{idle_cpu:.4f}, with {args.streams} streams {streams_cpu:.4f}; load average {result['load_average']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
