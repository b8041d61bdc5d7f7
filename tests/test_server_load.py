"""Load: 64 concurrent streaming clients against a real server in each scheduler mode, with a
queue too small for them. Every request completes or is refused with 503 + Retry-After (and
then retried), none is lost or duplicated (unique response ids; the server's counters match
what the clients saw), greedy outputs equal the request alone, and afterwards the server is
idle: nothing queued or active, no KV block used, the block accounting consistent.

The clients are benchmarks/load_server.py's, which runs the same load for minutes against
``mtplx serve`` subprocesses.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.load_server import Mix, run_load, wait_idle
from mtplx.batching.state import SchedulerMode, SchedulerSettings
from mtplx.server.app import create_app
from tests.test_server_harness import running_server, tiny_text_engine

MODEL = "tiny"
CLIENTS = 64
MAX_QUEUE = 8  # with at most 8 running, 64 clients overflow it at once
REQUESTS_PER_CLIENT = 2  # answered (not refused) requests each client waits for
MIX = Mix(greedy_prompts=tuple(f"Question number {i}?" for i in range(6)), greedy_max_tokens=16,
          sampled_prompts=("Tell me a story.", "Count to ten."), sampled_max_tokens=(1, 5, 12, 24))


@pytest.fixture(scope="module")
def engine():
    # 80 blocks of 4 tokens; a request reserves 8-14: 8 rows of the larger requests do not
    # fit, so the batching modes' admission also waits for KV room, not only for a free row.
    return tiny_text_engine(head="repeat", kv_cache_tokens=320)


@pytest.fixture(scope="module")
def solo(engine):
    """Each greedy prompt alone, straight through the engine."""
    out = {}
    for ask in MIX.greedy_asks():
        r = engine.generate([{"role": "user", "content": ask.prompt}], chat=True, max_tokens=ask.max_tokens,
                            temperature=0.0)
        out[ask.prompt] = {"text": r.text, "token_ids": r.token_ids}
    return out


@pytest.mark.parametrize("mode", SchedulerMode.choices())
def test_64_streaming_clients_complete_or_are_refused_and_the_server_returns_to_idle(engine, solo, mode):
    settings = SchedulerSettings.resolve(mode, max_queued_requests=MAX_QUEUE)
    with running_server(create_app(engine, settings, model_id=MODEL)) as url:
        r = asyncio.run(run_load(url, MODEL, MIX, solo, clients=CLIENTS, duration_s=120,
                                 requests_per_client=REQUESTS_PER_CLIENT, timeout_s=60, monitor_interval_s=0.2))
        idle, health = asyncio.run(wait_idle(url, timeout_s=10))
    engine.runner.blocks.check_invariants()  # the scheduler thread has stopped

    assert r["failed"] == 0, r["failure_examples"]
    assert r["completed"] == CLIENTS * REQUESTS_PER_CLIENT
    assert r["refused"] > 0 and r["sent"] == r["completed"] + r["refused"]
    assert r["peaks"]["queue_depth"] <= MAX_QUEUE
    assert r["health_errors"] == 0  # GET /health answered throughout
    assert r["greedy_checked"] > 0 and r["greedy_mismatched"] == 0, r["mismatch_examples"]
    # nothing lost or duplicated: the server's counters moved by exactly what the clients saw
    assert r["duplicate_response_ids"] == 0
    assert r["server"] == {"completed": r["completed"], "http_200": r["completed"], "http_503": r["refused"]}
    assert idle, health
    assert health["kv_cache"]["used_blocks"] == 0 == engine.runner.blocks.num_used_blocks
