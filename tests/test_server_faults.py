"""An exception inside one request's generation fails that request alone, in every scheduler
mode: its client gets a 500 in the OpenAI error shape (a stream: an error event, then [DONE])
naming the request, the log names it too, the requests beside it finish exactly as they would
alone (greedy), no KV block leaks and the server goes on serving.

Faults are injected with ``Engine.fault_hook`` at the generator's per-request points
(faults.FAULT_POINTS). A fault at "forward" stands for a batched forward that raised: no
row can be blamed, so every request of that step fails, and only those. Every case runs with
greedy cycles chained (the path a GPU runs: the host one cycle behind) and unchained.
"""

from __future__ import annotations

import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mtplx.batching.state import SchedulerSettings
from mtplx.engine.faults import FAULT_POINTS
from mtplx.server.app import create_app
from tests.hybrid_models import hybrid_engine
from tests.test_server_cancel import wait_idle
from tests.test_server_harness import running_server, tiny_text_engine

MODEL = "tiny"
MAX_TOKENS = 160  # batching modes: the other requests are still decoding when the fault fires
SHORT = 32  # one-at-a-time modes: the others run before or after it anyway
GOOD = [f"[user]Question number {i}?\n>> " for i in range(4)]
BAD = "[user]The one that breaks?\n>> "
BATCHING = ("mtp_batch", "ar_batch")


class InjectedFault(RuntimeError):
    pass


class Fault:
    """A fault hook: raises InjectedFault at ``point`` for the request whose prompt is
    ``prompt_ids`` once it has generated ``after`` tokens; records the requests of the
    scheduler's step at that moment (the rows a batched forward would have held)."""

    def __init__(self, scheduler, prompt_ids: list[int], point: str, after: int):
        assert point in FAULT_POINTS
        self.scheduler, self.prompt_ids, self.point, self.after = scheduler, prompt_ids, point, after
        self.fired: list[str] = []  # request ids of the rows stepping with it ("forward")
        self.live_rows = 0

    def __call__(self, point: str, seq) -> None:
        if point != self.point or seq.prompt_ids != self.prompt_ids or seq.num_generated < self.after:
            return
        rows = getattr(self.scheduler.policy, "rows", [])
        self.live_rows = len(rows)
        self.fired = [r.job.request_id for r in rows if r.prefilled and r.seq.mode == seq.mode]
        raise InjectedFault(f"injected at {point}")


def post(url: str, body: dict) -> dict:
    """One completion, streamed or whole: status, id, token ids, text, and the error if any."""
    if not body.get("stream"):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        data = r.json()
        if r.status_code != 200:
            return {"status": r.status_code, "error": data["error"]}
        choice = data["choices"][0]
        return {"status": 200, "id": data["id"], "token_ids": choice["token_ids"], "text": choice["text"]}
    out = {"status": None, "token_ids": [], "text": "", "events": []}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                out["events"].append(line[6:])
    assert out["events"][-1] == "[DONE]", out["events"][-3:]
    for event in map(json.loads, out["events"][:-1]):
        if "error" in event:
            out["error"] = event["error"]
            continue
        out["id"] = event["id"]
        for choice in event["choices"]:
            out["token_ids"] += choice.get("token_ids", [])
            out["text"] += choice["text"]
    return out


def failed_request_id(error: dict) -> str:
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert set(error) == {"message", "type", "param", "code"}
    return re.match(r"internal error in request (\S+): ", error["message"]).group(1)


def run_with_fault(engine, mode: str, point: str, *, good: list, bad, refs: list, bad_stream: bool,
                   after: int, caplog) -> tuple[Fault, list[dict], dict, dict]:
    """Serve ``mode``; start the good requests (alternately streamed and whole), then, once
    they run, the bad one with a fault at ``point``. Checks the bad request's error, the log,
    the idle state and a follow-up; returns (fault, good responses, bad response, snapshot).
    One-at-a-time modes run two good requests of SHORT tokens (their outputs are prefixes of
    the references)."""
    app = create_app(engine, SchedulerSettings.resolve(mode), model_id=MODEL)
    scheduler = app.state.mtplx.scheduler
    fault = Fault(scheduler, engine.encode_prompt(bad), point, after)
    if mode not in BATCHING:
        good = good[:2]
    body = {"model": MODEL, "max_tokens": MAX_TOKENS if mode in BATCHING else SHORT, "temperature": 0,
            "return_token_ids": True}
    engine.fault_hook = fault
    try:
        with running_server(app) as url, caplog.at_level(logging.ERROR, logger="mtplx.scheduler"):
            with ThreadPoolExecutor(len(good) + 1) as pool:
                futures = [pool.submit(post, url, {**body, "prompt": p, "stream": i % 2 == 0})
                           for i, p in enumerate(good)]
                if mode in BATCHING:  # the bad request joins a running batch
                    deadline = time.monotonic() + 30
                    while httpx.get(f"{url}/health").json()["active_requests"] < 2 and time.monotonic() < deadline:
                        time.sleep(0.005)
                bad_out = post(url, {**body, "prompt": bad, "stream": bad_stream})
                outs = [f.result() for f in futures]
            snap = wait_idle(url)
            follow_up = post(url, {**body, "prompt": good[0], "max_tokens": 12})
            health = httpx.get(f"{url}/health")
    finally:
        engine.fault_hook = None
    # the bad request: a 500 (or, streamed, an error event and [DONE]) naming it, and a log line
    assert bad_out["status"] == (200 if bad_stream else 500)
    assert f"InjectedFault: injected at {point}" in bad_out["error"]["message"]
    request_id = failed_request_id(bad_out["error"])
    if bad_stream:  # the error is the last event before [DONE], under the stream's own id
        assert "error" in json.loads(bad_out["events"][-2])
        assert bad_out.get("id", request_id) == request_id
    logged = [r.getMessage() for r in caplog.records if r.name == "mtplx.scheduler"]
    assert any(m.startswith(f"request {request_id} failed: InjectedFault") for m in logged), logged
    # the server is up, idle and clean
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert snap["kv_cache"]["used_blocks"] == 0
    engine.runner.blocks.check_invariants()
    if engine.runner.states is not None:
        assert engine.runner.states.num_used_slots == 0
    assert follow_up["token_ids"] == refs[0].token_ids[:12]
    return fault, outs, bad_out, snap


def assert_others_as_alone(outs: list[dict], refs: list) -> None:
    """Each output is its reference's (or, when shorter, its reference's beginning: greedy)."""
    for out, ref in zip(outs, refs):
        assert "error" not in out, out["error"]
        assert out["token_ids"] == ref.token_ids[: len(out["token_ids"])]
        assert len(out["token_ids"]) == min(len(ref.token_ids), SHORT) or out["token_ids"] == ref.token_ids
        assert ref.text.startswith(out["text"])


@pytest.fixture(scope="module", params=[False, True], ids=["unchained", "chained"])
def engine(request):
    engine = tiny_text_engine(head="repeat", context=512)
    engine.generator.chain.enabled = request.param
    return engine


@pytest.fixture(scope="module")
def refs(engine):
    """Each good prompt decoded alone (greedy): what it must produce beside a failing request."""
    return [engine.generate(p, max_tokens=MAX_TOKENS, temperature=0.0) for p in GOOD]


# (mode, point, after): per-request points in every mode; admit and prefill fire before the
# first token, the others once the bad request decodes.
ATTRIBUTABLE = [
    ("serial", "commit", 3), ("serial", "detokenize", 3), ("serial", "prefill", 0),
    ("hyper", "commit", 3), ("hyper", "admit", 0),
    ("solo_mtp", "accept", 3), ("solo_mtp", "draft", 3),
    ("mtp_batch", "admit", 0), ("mtp_batch", "prefill", 0), ("mtp_batch", "draft", 3),
    ("mtp_batch", "accept", 3), ("mtp_batch", "commit", 3), ("mtp_batch", "detokenize", 3),
    ("ar_batch", "admit", 0), ("ar_batch", "prefill", 0), ("ar_batch", "sample", 3),
    ("ar_batch", "commit", 3), ("ar_batch", "detokenize", 3),
]


@pytest.mark.parametrize("mode, point, after", ATTRIBUTABLE)
def test_a_fault_in_one_request_fails_it_alone(engine, refs, mode, point, after, caplog):
    bad_stream = ATTRIBUTABLE.index((mode, point, after)) % 2 == 1
    fault, outs, bad_out, snap = run_with_fault(engine, mode, point, good=GOOD, bad=BAD, refs=refs,
                                                bad_stream=bad_stream, after=after, caplog=caplog)
    assert_others_as_alone(outs, refs)
    if mode in BATCHING:
        assert fault.live_rows >= 2  # it failed inside a running batch
    totals = snap["telemetry"].get("job_totals", snap["telemetry"]["totals"])
    assert totals["failed"] == 1


@pytest.mark.parametrize("mode", ["serial", "hyper", "solo_mtp", "mtp_batch", "ar_batch"])
def test_a_failed_forward_fails_its_step_and_the_scheduler_lives_on(engine, refs, mode, caplog):
    """Nothing in a failed batched forward can be blamed on one row: the requests of that step
    fail (500s naming each), the others go on unchanged."""
    fault, outs, bad_out, snap = run_with_fault(engine, mode, "forward", good=GOOD, bad=BAD, refs=refs,
                                                bad_stream=mode == "ar_batch", after=3, caplog=caplog)
    failed = {failed_request_id(o["error"]) for o in outs + [bad_out] if "error" in o}
    if mode in BATCHING:
        assert len(fault.fired) >= 2 and failed == set(fault.fired)
    else:
        assert failed == {failed_request_id(bad_out["error"])}
    others = [(out, ref) for out, ref in zip(outs, refs) if "error" not in out]
    assert_others_as_alone([out for out, _ in others], [ref for _, ref in others])


@pytest.mark.parametrize("mode, point", [("mtp_batch", "accept"), ("serial", "commit")])
def test_a_fault_on_a_hybrid_model_frees_its_recurrent_state(mode, point, caplog):
    engine, _ = hybrid_engine("qwen3_5")
    good = [[3 + i, 40, 41, 7 * i % 90 + 3, 12] for i in range(3)]
    refs = [engine.generate(p, max_tokens=MAX_TOKENS if mode in BATCHING else SHORT, temperature=0.0)
            for p in good]
    fault, outs, _, _ = run_with_fault(engine, mode, point, good=good, bad=[9, 9, 8, 50, 61], refs=refs,
                                       bad_stream=True, after=3, caplog=caplog)
    assert_others_as_alone(outs, refs)
    if mode in BATCHING:
        assert fault.live_rows >= 2
