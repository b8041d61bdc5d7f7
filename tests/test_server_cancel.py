"""Clients that vanish at random moments, in every scheduler mode: each disconnect stops its
generation and frees what it held (KV blocks, and recurrent state on hybrid models), and the
server then serves a request exactly as it did before.

"Idle" (docs/server.md, "Cancellation and faults"): no job running or queued, kv_cache
used_blocks == 0 and free_blocks == total_blocks (free counts the prefix cache's evictable
blocks: finished requests leave their full blocks there as "cached"), the block manager's
invariants hold, and no recurrent-state slot is taken. Every sequence holds at least one
block, so used_blocks == 0 also means no sequence is still registered.

The clients speak raw HTTP over asyncio sockets, so each one closes at an exact moment: halfway
through its request body, right after sending it (before the first response byte), after a
random delay (queued, mid-prefill or mid-decode), or after k SSE events; half of them reset the
connection (RST), the other half close it (FIN).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest

from mtplx.batching.state import SchedulerMode, SchedulerSettings
from mtplx.server.app import create_app
from tests.hybrid_models import hybrid_engine
from tests.test_server_harness import running_server, tiny_text_engine

MODEL = "tiny"
LONG = 600  # max_tokens of a chaos request: about 0.6 s of decoding, far longer than any client stays
CLIENTS = {"serial": 40, "mtp_batch": 40, "hyper": 36, "ar_batch": 40, "solo_mtp": 36}
HYBRID_CLIENTS = 36
WAVES = (1, 2, 4, 8)  # clients started together
HOWS = ("mid_body", "at_once", "after_ms", "after_ms", "after_events", "after_events")
FOLLOW_UP = "After the storm, one more question?"


@dataclass
class Plan:
    """One client: what it sends and when it hangs up."""

    path: str
    body: dict
    how: str  # one of HOWS
    delay_s: float = 0.0
    events: int = 0
    reset: bool = False  # RST instead of FIN


def text_plans(n: int, seed: int, *, ar_ok: bool) -> list[Plan]:
    """Chat and text completions, streamed and whole, short and long (prefill-heavy) prompts."""
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        how = rng.choice(HOWS)
        stream = how == "after_events" or rng.random() < 0.5
        words = "lorem ipsum " * rng.choice((1, 1, 2, 60))  # 60: ~700 prompt tokens to prefill
        body = {"model": MODEL, "max_tokens": LONG, "stream": stream,
                "temperature": rng.choice((0.0, 0.0, 0.8)), "seed": i}
        if ar_ok and rng.random() < 0.3:
            body["generation_mode"] = "ar"
        question = f"client {seed}.{i}: {words}"
        if rng.random() < 0.5:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": question}]
        else:  # ">> " as in the chat template: the tiny model then rarely stops early
            path, body["prompt"] = "/v1/completions", f"[user]{question}\n>> "
        plans.append(Plan(path, body, how, rng.uniform(0, 0.05), rng.randint(1, 6), rng.random() < 0.5))
    return plans


def token_plans(n: int, seed: int) -> list[Plan]:
    """Token-id prompts (the hybrid test model has no tokenizer)."""
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        how = rng.choice(HOWS)
        body = {"model": MODEL, "max_tokens": 300, "stream": how == "after_events" or rng.random() < 0.5,
                "temperature": rng.choice((0.0, 0.8)), "seed": i, "return_token_ids": True,
                "prompt": [rng.randrange(3, 96) for _ in range(rng.choice((4, 12, 200)))]}
        plans.append(Plan("/v1/completions", body, how, rng.uniform(0, 0.05), rng.randint(1, 6), rng.random() < 0.5))
    return plans


# -- the clients ------------------------------------------------------------------------------
def http_post(path: str, body: dict) -> tuple[bytes, bytes]:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    return head, data


async def read_events(reader: asyncio.StreamReader, count: int) -> None:
    """Read the response until ``count`` SSE events have arrived (or it ends)."""
    seen, buffer = 0, b""
    while seen < count:
        chunk = await reader.read(4096)
        if not chunk:
            return
        buffer += chunk
        seen = buffer.count(b"data: ")


async def hang_up(port: int, plan: Plan) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head, data = http_post(plan.path, plan.body)
        writer.write(head + (data[: len(data) // 2] if plan.how == "mid_body" else data))
        await writer.drain()
        if plan.how == "after_ms":
            await asyncio.sleep(plan.delay_s)
        elif plan.how == "after_events":
            await asyncio.wait_for(read_events(reader, plan.events), 60)
    finally:
        if plan.reset:
            writer.transport.abort()
        else:
            writer.close()


async def storm(port: int, plans: list[Plan], seed: int) -> None:
    rng, i = random.Random(seed), 0
    while i < len(plans):
        wave = plans[i: i + rng.choice(WAVES)]
        i += len(wave)
        await asyncio.gather(*(hang_up(port, p) for p in wave))


# -- checks -----------------------------------------------------------------------------------
def wait_idle(url: str, timeout: float = 30.0) -> dict:
    """The snapshot once no job runs or waits and no KV block is used (or fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = httpx.get(f"{url}/v1/mtplx/snapshot").json()
        if snap["active_requests"] == 0 and snap["queue_depth"] == 0 and snap["kv_cache"]["used_blocks"] == 0:
            return snap
        if time.monotonic() > deadline:
            pytest.fail(f"the server did not return to idle: {snap['kv_cache']}, "
                        f"active {snap['active_requests']}, queued {snap['queue_depth']}")
        time.sleep(0.05)


def assert_idle(engine, scheduler, snap: dict) -> None:
    kv = snap["kv_cache"]
    assert kv["used_blocks"] == 0 and kv["free_blocks"] == kv["total_blocks"]
    blocks = engine.runner.blocks
    blocks.check_invariants()
    assert blocks.num_used_blocks == 0
    if engine.runner.states is not None:
        assert engine.runner.states.num_used_slots == 0
        assert kv["state_slots_used"] == 0
    assert scheduler.policy.running == [] and getattr(scheduler.policy, "rows", []) == []
    assert snap["telemetry"]["active"] == 0  # hyper: the gate holds no ticket either
    totals = job_totals(snap)
    assert totals["failed"] == 0  # a disconnect is a cancel, never a failure
    assert totals["admitted"] == totals["started"] + totals["abandoned_before_start"]
    assert totals["started"] == totals["completed"] + totals["cancelled"]


def job_totals(snap: dict) -> dict:
    """The scheduler's job counters (hyper reports its gate's totals beside them)."""
    telemetry = snap["telemetry"]
    return telemetry.get("job_totals", telemetry["totals"])


class Outcomes:
    """A scheduler listener: how each started job ended (on the model thread)."""

    def __init__(self):
        self.ended: list[tuple[str, int, int]] = []  # (finish_reason, completion_tokens, max_tokens)

    def __call__(self, job, result) -> None:
        if result is not None:
            self.ended.append((result.finish_reason, result.completion_tokens, job.request.max_tokens))


def summary(ended: list[tuple[str, int, int]]) -> Counter:
    """Cancelled in prefill (at most the prefill's token) or in decode, or finished (EOS)."""
    return Counter("cancelled_in_prefill" if reason == "cancelled" and tokens <= 1 else
                   "cancelled_in_decode" if reason == "cancelled" else reason for reason, tokens, _ in ended)


def chaos(engine, mode: str, plans: list[Plan], seed: int, follow_up: dict, path: str) -> tuple[dict, dict]:
    """Serve ``mode``, let every plan hang up, check the server is idle and clean, then send
    ``follow_up`` (greedy) to ``path`` whole and streamed. Returns (counts, follow-up response)."""
    app = create_app(engine, SchedulerSettings.resolve(mode), model_id=MODEL)
    scheduler = app.state.mtplx.scheduler
    outcomes = Outcomes()
    scheduler.add_listener(outcomes)
    with running_server(app) as url:
        asyncio.run(storm(int(url.rsplit(":", 1)[1]), plans, seed))
        snap = wait_idle(url)
        assert_idle(engine, scheduler, snap)
        storm_ended = list(outcomes.ended)
        whole = httpx.post(f"{url}{path}", json=follow_up, timeout=60).json()
        streamed = stream_token_ids(url, path, follow_up)
        assert_idle(engine, scheduler, wait_idle(url))
    # a client that left before its request ended stopped it: nothing ran to max_tokens
    assert all(reason != "length" or tokens < limit for reason, tokens, limit in storm_ended)
    totals = job_totals(snap)
    counts = {"disconnects": len(plans), "abandoned_before_start": totals["abandoned_before_start"],
              **summary(storm_ended), "cancel_latency_max_s": snap["telemetry"]["cancel_latency_s"]["max"]}
    counts["cancelled_in_decode"] = counts.get("cancelled_in_decode", 0)
    assert whole["choices"][0]["token_ids"] == streamed
    return counts, whole


def stream_token_ids(url: str, path: str, body: dict) -> list[int]:
    ids = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    ids += choice.get("token_ids", [])
    return ids


# -- the tests --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    return tiny_text_engine(head="repeat", context=1024, kv_cache_tokens=16384)


@pytest.fixture(scope="module")
def reference(engine):
    """The follow-up request decoded alone before any server ran (greedy)."""
    return engine.generate([{"role": "user", "content": FOLLOW_UP}], chat=True, max_tokens=24, temperature=0.0)


@pytest.mark.parametrize("mode", SchedulerMode.choices())
def test_random_disconnects_free_everything_and_change_nothing(engine, reference, mode, capsys):
    seed = SchedulerMode.choices().index(mode)
    plans = text_plans(CLIENTS[mode], seed, ar_ok=mode not in ("mtp_batch", "solo_mtp"))
    follow_up = {"model": MODEL, "messages": [{"role": "user", "content": FOLLOW_UP}], "max_tokens": 24,
                 "temperature": 0, "return_token_ids": True}
    counts, whole = chaos(engine, mode, plans, seed, follow_up, "/v1/chat/completions")
    assert whole["choices"][0]["token_ids"] == reference.token_ids
    assert whole["choices"][0]["message"]["content"] == reference.text
    assert counts["cancelled_in_decode"] > 0  # the storm really hit running generations
    with capsys.disabled():
        print(f"\n{mode}: {counts}")


@pytest.mark.parametrize("mode", ["serial", "mtp_batch", "ar_batch"])
def test_random_disconnects_free_the_recurrent_state_of_a_hybrid_model(mode, capsys):
    engine, _ = hybrid_engine("qwen3_5", kv_cache_tokens=8192)
    prompt = [5, 17, 33, 8, 61, 42, 77, 19]
    reference = engine.generate(prompt, max_tokens=16, temperature=0.0)
    follow_up = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    counts, whole = chaos(engine, mode, token_plans(HYBRID_CLIENTS, 10 + len(mode)), 7, follow_up, "/v1/completions")
    assert whole["choices"][0]["token_ids"] == reference.token_ids
    with capsys.disabled():
        print(f"\nhybrid {mode}: {counts}")
