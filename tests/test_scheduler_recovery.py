"""A scheduler policy that raises (a bug in batching code, not in one request's decoding)
fails the requests it was running with a 500 in the OpenAI error shape, gives back every KV
block, recurrent-state slot and the cycle in flight, counts the failures, and the scheduler
keeps serving: requests queued behind and after it complete as they would alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mtplx.batching.state import SchedulerSettings
from mtplx.server.app import create_app
from tests.hybrid_models import hybrid_engine
from tests.test_server_cancel import wait_idle
from tests.test_server_faults import post
from tests.test_server_harness import running_server, tiny_text_engine

MODEL = "tiny"
PROMPTS = [f"[user]Question number {i}?\n>> " for i in range(3)]


class PolicyBug(RuntimeError):
    pass


def crash_once_mid_batch(policy, min_rows: int = 2, after_tokens: int = 4) -> dict:
    """Make ``policy.retire_done`` (called by the batching loop after every step) raise once,
    the first time at least ``min_rows`` rows are decoding and have ``after_tokens`` tokens."""
    state = {"fired": False, "rows": 0}
    original = policy.retire_done

    def retire_done():
        rows = [r for r in policy.rows if r.prefilled]
        if not state["fired"] and len(rows) >= min_rows and all(r.seq.num_generated >= after_tokens for r in rows):
            state["fired"], state["rows"] = True, len(rows)
            raise PolicyBug("a bug in the batching loop")
        original()

    policy.retire_done = retire_done
    return state


def serve_through_a_crash(engine, mode: str, prompts: list, max_tokens: int):
    app = create_app(engine, SchedulerSettings.resolve(mode), model_id=MODEL)
    scheduler = app.state.mtplx.scheduler
    crash = crash_once_mid_batch(scheduler.policy)
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    with running_server(app) as url:
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda ip: post(url, {**body, "prompt": ip[1], "stream": ip[0] % 2 == 1}),
                                 enumerate(prompts)))
        snap = wait_idle(url)
        after = post(url, {**body, "prompt": prompts[0]})
        health = httpx.get(f"{url}/health")
        alive = scheduler.alive
    return crash, outs, snap, after, (health, alive), scheduler


def assert_recovered(engine, crash, outs, snap, after, up, scheduler, reference: list[int]):
    health, alive = up
    assert crash["fired"] and crash["rows"] >= 2
    failed = [o for o in outs if "error" in o]
    assert len(failed) >= 2  # every request the policy was running fails
    for out in failed:
        assert out["status"] in (200, 500)  # a stream has begun (200) and ends with an error event
        error = out["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        assert "PolicyBug: a bug in the batching loop" in error["message"]
    totals = snap["telemetry"].get("job_totals", snap["telemetry"]["totals"])
    assert totals["failed"] == len(failed)
    assert scheduler.policies_crashed == 1 and alive
    # nothing is held: blocks, state slots, the cycle in flight
    assert snap["kv_cache"]["used_blocks"] == 0
    engine.runner.blocks.check_invariants()
    if engine.runner.states is not None:
        assert engine.runner.states.num_used_slots == 0
    assert engine.generator.live == {} and engine.generator.chain.flight is None
    # and the scheduler still serves, with the output a request gets alone
    assert health.status_code == 200
    assert after["status"] == 200 and after["token_ids"] == reference


@pytest.mark.parametrize("mode", ["mtp_batch", "ar_batch"])
def test_a_policy_that_raises_mid_batch_fails_its_requests_and_the_scheduler_serves_on(mode):
    engine = tiny_text_engine(head="repeat", context=512)
    reference = engine.generate(PROMPTS[0], max_tokens=24, temperature=0.0).token_ids
    assert_recovered(engine, *serve_through_a_crash(engine, mode, PROMPTS, 24), reference=reference)


def test_a_policy_crash_frees_a_hybrid_models_recurrent_state():
    engine, _ = hybrid_engine("qwen3_5")
    prompts = [[3 + i, 40, 41, 7 * i % 90 + 3, 12] for i in range(3)]
    reference = engine.generate(prompts[0], max_tokens=24, temperature=0.0).token_ids
    assert_recovered(engine, *serve_through_a_crash(engine, "mtp_batch", prompts, 24), reference=reference)
