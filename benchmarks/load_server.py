"""Load test: N concurrent streaming clients against ``mtplx serve``, one scheduler mode at a time.

Each mode gets its own ``mtplx serve`` subprocess on a free 127.0.0.1 port, with a small queue
(``--max-queue``) so that some requests are refused. First the greedy prompts run one at a
time (their solo outputs, and a warm-up); then ``--clients`` clients loop for
``--duration-s``, each picking a request (a greedy prompt, checked against its solo output,
or a sampled one with temperature > 0 and a random max_tokens), streaming it and judging it:

  completed  HTTP 200, a well-formed SSE stream ending in [DONE], finish_reason stop or length,
             one response id throughout, and exactly as many streamed token ids as usage says
  refused    HTTP 503 with a Retry-After header and the OpenAI error shape (code queue_full):
             the client waits Retry-After seconds and sends the same request again
  failed     anything else (another status, an error chunk, a broken stream, a timeout)

Nothing lost or duplicated: every response id is unique, and the server's own counters
(``/metrics``) moved by exactly what the clients saw. When the deadline passes no new request
starts; those in flight finish. Then the server must return to idle (no queued or active
request, 0 used KV blocks in ``GET /health``) and still answer; its RSS (psutil) is compared
with the idle RSS before the load.

  python benchmarks/load_server.py --duration-s 150 --out benchmarks/results/load_cpu.json

The client side (``Mix``, ``run_load``, ``wait_idle``) is imported by tests/test_server_load.py.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import httpx

MODES = ("serial", "mtp_batch", "hyper", "ar_batch", "solo_mtp")
CHAT_ROUTE = "/v1/chat/completions"
KEEPALIVE_S = 2.0  # idle connections kept this long (uvicorn's keep-alive timeout: 5 s)
MAX_RETRY_WAIT_S = 30.0  # a Retry-After above this is obeyed only this long (keeps the loop bounded)
EXAMPLES = 5  # failure and mismatch examples kept per kind


# -- what the clients send --------------------------------------------------------------------
@dataclass(frozen=True)
class Ask:
    """One chat request: a single user message."""

    prompt: str
    max_tokens: int
    temperature: float

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def body(self, model: str) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": self.prompt}],
                "max_tokens": self.max_tokens, "temperature": self.temperature, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}


@dataclass(frozen=True)
class Mix:
    """What the clients pick from: greedy prompts (checked against their solo outputs) with a
    share of ``greedy_share``, else sampled prompts with a random temperature and max_tokens."""

    greedy_prompts: tuple[str, ...]
    greedy_max_tokens: int
    sampled_prompts: tuple[str, ...]
    sampled_max_tokens: tuple[int, ...]
    temperatures: tuple[float, ...] = (0.7, 1.0)
    greedy_share: float = 0.5

    def greedy_asks(self) -> list[Ask]:
        return [Ask(p, self.greedy_max_tokens, 0.0) for p in self.greedy_prompts]

    def pick(self, rng: random.Random) -> Ask:
        if rng.random() < self.greedy_share:
            return Ask(rng.choice(self.greedy_prompts), self.greedy_max_tokens, 0.0)
        return Ask(rng.choice(self.sampled_prompts), rng.choice(self.sampled_max_tokens), rng.choice(self.temperatures))


CHAT_MIX = Mix(
    greedy_prompts=(
        "What is the capital of France, and what is it famous for?",
        "Explain in two sentences how a rainbow forms.",
        "Give me three tips for writing clean Python code.",
        "What is the difference between a list and a tuple in Python?",
        "How do vaccines train the immune system?",
        "Suggest a healthy breakfast and explain why it is good.",
    ),
    greedy_max_tokens=32,
    sampled_prompts=(
        "Write a short poem about the sea at night.",
        "Summarise the plot of Romeo and Juliet in a few sentences.",
        "Tell me a story about a robot who learns to paint.",
        "List five animals that live in the Arctic.",
    ),
    sampled_max_tokens=(1, 8, 24, 48, 64),
)


# -- one HTTP attempt -------------------------------------------------------------------------
@dataclass
class Reply:
    """What one attempt got back. Times in seconds from sending."""

    status: int | None = None
    retry_after: str | None = None
    error: object = None  # the error body (JSON or text), an error chunk, or a transport error
    problem: str | None = None  # a malformed stream
    done: bool = False  # [DONE] seen
    ids: set = field(default_factory=set)  # response ids across the chunks
    chunks: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0


async def send(client: httpx.AsyncClient, model: str, ask: Ask) -> Reply:
    """Stream one chat completion and record everything needed to judge it."""
    reply, text = Reply(), []
    sent = time.perf_counter()
    try:
        async with client.stream("POST", CHAT_ROUTE, json=ask.body(model)) as response:
            reply.status = response.status_code
            if response.status_code != 200:
                reply.retry_after = response.headers.get("retry-after")
                raw = await response.aread()
                try:
                    reply.error = json.loads(raw)
                except ValueError:
                    reply.error = raw.decode(errors="replace")[:200]
                return reply
            async for line in response.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: ") or reply.done:
                    reply.problem = reply.problem or f"unexpected line {line[:60]!r}"
                    continue
                if line == "data: [DONE]":
                    reply.done = True
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    reply.error = data
                    continue
                reply.chunks += 1
                reply.ids.add(data.get("id"))
                for choice in data.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece and reply.ttft_s is None:
                        reply.ttft_s = time.perf_counter() - sent
                    text.append(piece)
                    reply.token_ids += choice.get("token_ids") or []
                    reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
                if data.get("usage"):
                    reply.usage = data["usage"]
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a chunk that is not JSON
        reply.error = f"{type(exc).__name__}: {exc}"
    finally:
        reply.text, reply.latency_s = "".join(text), time.perf_counter() - sent
    return reply


def refusal_problem(reply: Reply) -> str | None:
    """Why a 503 is not a proper "queue full" refusal (None: it is one)."""
    if reply.retry_after is None or not reply.retry_after.isdigit():
        return f"503 without a valid Retry-After header ({reply.retry_after!r})"
    body = reply.error.get("error") if isinstance(reply.error, dict) else None
    if not isinstance(body, dict) or set(body) != {"message", "type", "param", "code"}:
        return f"503 body is not the OpenAI error shape: {str(reply.error)[:120]}"
    if body["code"] != "queue_full":
        return f"503 with code {body['code']!r}, not queue_full"
    return None


def judge(reply: Reply, ask: Ask) -> tuple[str, str | None]:
    """("completed" | "refused" | "failed", why it failed)."""
    if reply.status == 503:
        why = refusal_problem(reply)
        return ("refused", None) if why is None else ("failed", why)
    if reply.status != 200:
        return "failed", f"HTTP {reply.status}: {str(reply.error)[:120]}"
    usage = reply.usage or {}
    checks = [
        (reply.error is None, f"error in the stream: {str(reply.error)[:120]}"),
        (reply.problem is None, f"malformed stream: {reply.problem}"),
        (reply.done, "the stream ended without [DONE]"),
        (len(reply.ids) == 1, f"the chunks carry {len(reply.ids)} response ids"),
        (reply.finish_reason in ("stop", "length"), f"finish_reason {reply.finish_reason!r}"),
        (reply.usage is not None, "no usage chunk"),
        (len(reply.token_ids) == usage.get("completion_tokens"),
         f"{len(reply.token_ids)} token ids streamed, usage says {usage.get('completion_tokens')}"),
        (usage.get("completion_tokens", 0) <= ask.max_tokens,
         f"{usage.get('completion_tokens')} tokens for max_tokens {ask.max_tokens}"),
    ]
    for ok, why in checks:
        if not ok:
            return "failed", why
    return "completed", None


# -- many clients -------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no values."""
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else None


class Tally:
    """What all clients saw, attempt by attempt."""

    def __init__(self, solo: dict[str, dict]):
        self.solo = solo  # greedy prompt -> {"text", "token_ids"} of the request alone
        self.started = time.perf_counter()
        self.last_done = self.started
        self.outcomes: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()  # HTTP status of each attempt ("none": no response)
        self.failures: Counter[str] = Counter()
        self.failure_examples: list[str] = []
        self.greedy_checked = self.greedy_mismatched = 0
        self.mismatch_examples: list[dict] = []
        self.chunks = self.completion_tokens = 0
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.response_ids: Counter[str] = Counter()

    def record(self, ask: Ask, reply: Reply) -> str:
        self.last_done = time.perf_counter()
        outcome, why = judge(reply, ask)
        self.outcomes[outcome] += 1
        self.statuses[f"http_{reply.status}" if reply.status else "none"] += 1
        self.response_ids.update(i for i in reply.ids if i)
        if outcome == "failed":
            self.failures[why.split(":")[0]] += 1
            if len(self.failure_examples) < EXAMPLES:
                self.failure_examples.append(why)
        if outcome != "completed":
            return outcome
        self.chunks += reply.chunks
        self.completion_tokens += reply.usage["completion_tokens"]
        self.latencies.append(reply.latency_s)
        if reply.ttft_s is not None:
            self.ttfts.append(reply.ttft_s)
        if ask.greedy and ask.prompt in self.solo:
            self._check_greedy(ask, reply)
        return outcome

    def _check_greedy(self, ask: Ask, reply: Reply) -> None:
        self.greedy_checked += 1
        want = self.solo[ask.prompt]
        if reply.token_ids == want["token_ids"] and reply.text == want["text"]:
            return
        self.greedy_mismatched += 1
        if len(self.mismatch_examples) < EXAMPLES:
            at = next((i for i, (a, b) in enumerate(zip(reply.token_ids, want["token_ids"])) if a != b),
                      min(len(reply.token_ids), len(want["token_ids"])))
            self.mismatch_examples.append({"prompt": ask.prompt, "first_different_token": at,
                                           "solo": want["text"], "under_load": reply.text})

    def summary(self) -> dict:
        wall = self.last_done - self.started
        duplicates = sum(n - 1 for n in self.response_ids.values() if n > 1)
        return {
            "sent": sum(self.outcomes.values()), "completed": self.outcomes["completed"],
            "refused": self.outcomes["refused"], "failed": self.outcomes["failed"],
            "statuses": dict(self.statuses),
            "failure_reasons": dict(self.failures), "failure_examples": self.failure_examples,
            "greedy_checked": self.greedy_checked, "greedy_mismatched": self.greedy_mismatched,
            "mismatch_examples": self.mismatch_examples,
            "duplicate_response_ids": duplicates, "chunks": self.chunks,
            "completion_tokens": self.completion_tokens, "wall_s": wall,
            "output_tok_s": self.completion_tokens / wall if wall else None,
            "latency_s": {"p50": percentile(self.latencies, 0.5), "p99": percentile(self.latencies, 0.99)},
            "ttft_s": {"p50": percentile(self.ttfts, 0.5), "p99": percentile(self.ttfts, 0.99)},
        }


async def client_loop(client: httpx.AsyncClient, model: str, mix: Mix, tally: Tally, rng: random.Random,
                      deadline: float, requests: int | None) -> None:
    """Send requests until ``deadline`` (time.monotonic()) or until ``requests`` were answered
    (completed or failed); a refused request is sent again after its Retry-After."""
    answered = 0
    while time.monotonic() < deadline and (requests is None or answered < requests):
        ask = mix.pick(rng)
        while time.monotonic() < deadline:
            reply = await send(client, model, ask)
            if tally.record(ask, reply) != "refused":
                answered += 1
                break
            await asyncio.sleep(min(float(reply.retry_after), MAX_RETRY_WAIT_S))


class Monitor:
    """Polls GET /health (and an optional RSS probe) while the load runs: peaks and stalls."""

    def __init__(self, client: httpx.AsyncClient, rss_mib: Callable[[], float] | None, interval_s: float):
        self.client, self.rss_mib, self.interval_s = client, rss_mib, interval_s
        self.peak = Counter()  # queue_depth, active_requests, used_blocks, rss_mib
        self.polls = self.errors = 0
        self.slowest_s = 0.0

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            try:
                health = (await self.client.get("/health")).json()
                for key in ("queue_depth", "active_requests"):
                    self.peak[key] = max(self.peak[key], health[key])
                self.peak["used_blocks"] = max(self.peak["used_blocks"], health["kv_cache"]["used_blocks"])
            except (httpx.HTTPError, ValueError, KeyError):
                self.errors += 1
            self.polls += 1
            self.slowest_s = max(self.slowest_s, time.perf_counter() - started)
            if self.rss_mib is not None:
                self.peak["rss_mib"] = max(self.peak["rss_mib"], self.rss_mib())
            await asyncio.sleep(self.interval_s)

    def summary(self) -> dict:
        return {"peaks": dict(self.peak), "health_polls": self.polls, "health_errors": self.errors,
                "slowest_health_s": self.slowest_s}


def local_client(url: str, timeout_s: float, connections: int = 8) -> httpx.AsyncClient:
    """An httpx client for ``url`` that never goes through a proxy (loopback only).

    Idle connections are dropped after ``KEEPALIVE_S``, well before uvicorn closes them (its
    keep-alive timeout is 5 s, the same as httpx's default expiry): with equal timeouts a client
    waking from a Retry-After sleep could send on a connection the server was closing and get a
    ReadError with no response, which is a race in the client, not a server failure."""
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0), trust_env=False,
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                                                 keepalive_expiry=KEEPALIVE_S))


async def run_load(url: str, model: str, mix: Mix, solo: dict[str, dict], *, clients: int = 64,
                   duration_s: float = 180.0, requests_per_client: int | None = None, seed: int = 0,
                   timeout_s: float = 600.0, rss_mib: Callable[[], float] | None = None,
                   monitor_interval_s: float = 1.0) -> dict:
    """``clients`` concurrent streaming clients for ``duration_s`` seconds (or until each had
    ``requests_per_client`` requests answered); the client-side tally, the /health peaks and
    the change in the server's counters over the run (``server``)."""
    tally = Tally(solo)
    async with local_client(url, timeout_s, clients + 4) as client, local_client(url, 30.0) as side:
        before = await server_counters(side)
        monitor = Monitor(side, rss_mib, monitor_interval_s)
        watching = asyncio.create_task(monitor.run())
        deadline = time.monotonic() + duration_s
        try:
            await asyncio.gather(*(client_loop(client, model, mix, tally, random.Random(seed * 100_003 + i),
                                               deadline, requests_per_client) for i in range(clients)))
        finally:
            watching.cancel()
        result = {**tally.summary(), **monitor.summary()}
        result["server"] = await counter_delta(side, before, result["sent"])
    return result


# -- the server's view ---------------------------------------------------------------------------
_SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


async def server_counters(client: httpx.AsyncClient) -> Counter:
    """From /metrics: generations ended (completed / cancelled / failed) and chat route
    responses by status (``http_<status>``)."""
    out: Counter = Counter()
    for line in (await client.get("/metrics")).text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.group(1), dict(_LABEL.findall(match.group(2) or "")), float(match.group(3))
        if name == "mtplx_request_success_total":
            out["cancelled" if labels.get("finish_reason") == "cancelled" else "completed"] += value
        elif name == "mtplx_request_failure_total":
            out["failed"] += value
        elif name == "mtplx_http_requests_total" and labels.get("route") == CHAT_ROUTE:
            out[f"http_{labels.get('status')}"] += value
    return out


async def counter_delta(client: httpx.AsyncClient, before: Counter, sent: int, timeout_s: float = 10.0) -> dict:
    """How the server's counters moved since ``before``. Both can lag a client's [DONE] by a
    moment (a response is counted once its body is sent; a generation once the model thread's
    listeners ran, just after its last event): wait (bounded) until ``sent`` responses and a
    generation for every 200 are counted."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = await server_counters(client)
        delta = {k: int(after[k] - before[k]) for k in after if after[k] != before[k]}
        answered = sum(v for k, v in delta.items() if k.startswith("http_"))
        generations = sum(delta.get(k, 0) for k in ("completed", "cancelled", "failed"))
        if (answered >= sent and generations >= delta.get("http_200", 0)) or time.monotonic() > deadline:
            return delta
        await asyncio.sleep(0.1)


async def wait_idle(url: str, timeout_s: float = 60.0) -> tuple[bool, dict]:
    """Poll GET /health until nothing is queued or active and no KV block is used: (idle?, the
    last /health body)."""
    deadline = time.monotonic() + timeout_s
    async with local_client(url, 30.0) as client:
        while True:
            health = (await client.get("/health")).json()
            idle = (health["queue_depth"] == 0 and health["active_requests"] == 0
                    and health["kv_cache"]["used_blocks"] == 0)
            if idle or time.monotonic() > deadline:
                return idle, health
            await asyncio.sleep(0.2)


async def solo_outputs(url: str, model: str, asks: list[Ask], timeout_s: float = 600.0) -> dict[str, dict]:
    """Each greedy ask alone, one after another: prompt -> {"text", "token_ids"}."""
    out = {}
    async with local_client(url, timeout_s) as client:
        for ask in asks:
            reply = await send(client, model, ask)
            outcome, why = judge(reply, ask)
            if outcome != "completed":
                raise RuntimeError(f"solo request {ask.prompt!r} did not complete: {why or outcome}")
            out[ask.prompt] = {"text": reply.text, "token_ids": reply.token_ids}
    return out


def problems(mode_result: dict) -> list[str]:
    """What broke the load promises in one mode's result (empty: all kept)."""
    r, server = mode_result, mode_result["server"]
    found = []
    if r["failed"]:
        found.append(f"{r['failed']} failed: {r['failure_reasons']}")
    if r["completed"] + r["refused"] + r["failed"] != r["sent"]:
        found.append("sent != completed + refused + failed")
    if r["greedy_mismatched"]:
        found.append(f"{r['greedy_mismatched']} of {r['greedy_checked']} greedy outputs differ from solo")
    if r["duplicate_response_ids"]:
        found.append(f"{r['duplicate_response_ids']} duplicate response ids")
    responses = {k: v for k, v in server.items() if k.startswith("http_")}
    if responses != r["statuses"]:
        found.append(f"the server sent {responses}, the clients got {r['statuses']}")
    generations = sum(server.get(k, 0) for k in ("completed", "cancelled", "failed"))
    if generations != r["statuses"].get("http_200", 0):
        found.append(f"the server ended {generations} generations for {r['statuses'].get('http_200', 0)} streams")
    if server.get("cancelled") or server.get("failed"):
        found.append(f"server ended {server.get('cancelled', 0)} cancelled / {server.get('failed', 0)} failed")
    if not r.get("idle_after", True):
        found.append(f"not idle after the load: {r.get('health_after')}")
    if r.get("still_answers") is False:
        found.append("the server did not answer a request after the load")
    return found


# -- the server process --------------------------------------------------------------------------
@functools.cache
def queue_flag() -> str:
    """``--max-queue`` if this ``mtplx serve`` has it, else its older name ``--max-queued-requests``."""
    help_text = subprocess.run([sys.executable, "-m", "mtplx.cli", "serve", "--help"], capture_output=True,
                               text=True, check=True).stdout
    return "--max-queue" if re.search(r"--max-queue(?![\w-])", help_text) else "--max-queued-requests"


class ServeProcess:
    """``mtplx serve`` in a subprocess on a free 127.0.0.1 port, logging to a file."""

    def __init__(self, mode: str, max_queue: int, serve_args: list[str], workdir: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{port}", workdir / f"{mode}.log"
        self.command = [sys.executable, "-m", "mtplx.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                        "--scheduler-mode", mode, queue_flag(), str(max_queue), "--log-level", "warning", *serve_args]
        env = {**os.environ, "MTPLX_CONFIG": str(workdir / "no-config.toml")}  # flags and defaults only
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.command, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.model: str | None = None

    def wait_ready(self, timeout_s: float = 600.0) -> str | None:
        """None once /health answers 200, else why not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited {self.proc.returncode}: {self.log_tail()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200:
                    self.model = httpx.get(f"{self.url}/v1/models", trust_env=False).json()["data"][0]["id"]
                    return None
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        return "did not come up in time"

    def rss_mib(self) -> float:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def log_tail(self, lines: int = 5) -> str:
        return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        return self.proc.returncode


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30, trust_env=False).json()


def run_mode(mode: str, args, workdir: Path) -> dict:
    """One server in ``mode``: solo outputs, the load, then the idle checks."""
    server = ServeProcess(mode, args.max_queue, args.serve_args.split(), workdir)
    out: dict = {}
    try:
        error = server.wait_ready()
        if error:
            out = {"skipped": error}
            return out
        out.update(rss_mib_at_start=server.rss_mib(), kv_at_start=health(server.url)["kv_cache"])
        asks = CHAT_MIX.greedy_asks()
        solo = asyncio.run(solo_outputs(server.url, server.model, asks))
        idle, before = asyncio.run(wait_idle(server.url))
        out.update(model=server.model, solo=solo, rss_mib_before=server.rss_mib(), kv_before=before["kv_cache"])
        print(f"{mode}: {args.clients} clients for {args.duration_s:g} s", flush=True)
        out.update(asyncio.run(run_load(server.url, server.model, CHAT_MIX, solo, clients=args.clients,
                                        duration_s=args.duration_s, seed=args.seed, rss_mib=server.rss_mib)))
        out["idle_after"], after = asyncio.run(wait_idle(server.url))
        out.update(health_after={k: after[k] for k in ("status", "queue_depth", "active_requests")},
                   kv_after=after["kv_cache"], rss_mib_after=server.rss_mib())
        again = asyncio.run(solo_outputs(server.url, server.model, asks[:1]))
        out["still_answers"] = again == {asks[0].prompt: solo[asks[0].prompt]}
        out["problems"] = problems(out)
        return out
    except Exception as exc:  # record it and go on with the other modes
        out = {"skipped": f"{type(exc).__name__}: {exc} (server log: {server.log_tail()})"}
        return out
    finally:
        out["exit_code_after_sigterm"] = server.stop()


# -- report ---------------------------------------------------------------------------------------
def code_state() -> dict:
    """The commit the servers ran, and the files that differed from it."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "changed_files": git("status", "--porcelain").splitlines()}


def table(results: dict) -> str:
    rows = ["| mode | sent | completed | refused (503) | failed | greedy checked / mismatched | chunks | "
            "out tok/s | latency p50 / p99 s | RSS before / after MiB | KV used before / after | problems |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, r in results["modes"].items():
        if "skipped" in r:
            rows.append(f"| {mode} | skipped: {r['skipped']} |" + " |" * 10)
            continue
        lat = r["latency_s"]
        rows.append(
            f"| {mode} | {r['sent']} | {r['completed']} | {r['refused']} | {r['failed']} | "
            f"{r['greedy_checked']} / {r['greedy_mismatched']} | {r['chunks']} | {r['output_tok_s']:.1f} | "
            f"{lat['p50']:.1f} / {lat['p99']:.1f} | {r['rss_mib_before']:.0f} / {r['rss_mib_after']:.0f} | "
            f"{r['kv_before']['used_blocks']} / {r['kv_after']['used_blocks']} | "
            f"{'; '.join(r['problems']) or 'none'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated scheduler modes, run in turn")
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--duration-s", type=float, default=180.0, help="seconds of load per mode")
    p.add_argument("--max-queue", type=int, default=16, help="the server's queue: waiting requests before 503")
    p.add_argument("--model", default=None, help="model path (default: mtplx serve's default model and its "
                   "head); mtp_batch and solo_mtp need a head: --serve-args '--head DIR'")
    p.add_argument("--serve-args", default="", help="more `mtplx serve` arguments, e.g. '--head DIR'")
    p.add_argument("--seed", type=int, default=0, help="seeds the clients' choice of requests")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.model:
        args.serve_args = f"--model {args.model} {args.serve_args}"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serve_bench import machine  # the sibling benchmark's machine description

    results = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
               "command": " ".join(["python", Path(sys.argv[0]).as_posix(),
                                    *(argv if argv is not None else sys.argv[1:])]),
               "code": code_state(),
               "settings": {"clients": args.clients, "duration_s": args.duration_s, "max_queue": args.max_queue,
                            "queue_flag": queue_flag(), "serve_args": args.serve_args.split(), "seed": args.seed,
                            "greedy_prompts": list(CHAT_MIX.greedy_prompts),
                            "greedy_max_tokens": CHAT_MIX.greedy_max_tokens,
                            "sampled_max_tokens": list(CHAT_MIX.sampled_max_tokens),
                            "temperatures": list(CHAT_MIX.temperatures), "greedy_share": CHAT_MIX.greedy_share},
               "modes": {}}
    with tempfile.TemporaryDirectory(prefix="mtplx-load-") as workdir:
        for mode in [m for m in args.modes.split(",") if m]:
            results["modes"][mode] = run_mode(mode, args, Path(workdir))
            r = results["modes"][mode]
            print(f"  {mode}: " + (f"skipped ({r['skipped']})" if "skipped" in r else
                                  f"{r['completed']} completed, {r['refused']} refused, {r['failed']} failed, "
                                  f"problems: {r['problems'] or 'none'}"), flush=True)
    solos = [r["solo"] for r in results["modes"].values() if "solo" in r]
    results["solo_outputs_agree_across_modes"] = all(s == solos[0] for s in solos)
    results["load_average_at_end"] = os.getloadavg()
    print(table(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    failed = any("skipped" in r or r["problems"] for r in results["modes"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
