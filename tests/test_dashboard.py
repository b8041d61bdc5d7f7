"""The dashboard's server side, against a real uvicorn server and the tiny text model: the page
is open and its data is behind the API key; the live stream's figures agree with what clients
received (usage, mtplx_stats); cancel by id stops a request and frees its blocks; live settings
are checked as ``mtplx serve`` checks its config and apply to the next request; shutdown ends
the stream at once. The page itself runs in Chromium in tests/test_dashboard_browser.py.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from mtplx.batching.state import SchedulerSettings
from mtplx.server import dashboard
from mtplx.server.app import create_app
from mtplx.server.errors import APIError
from mtplx.server.lifecycle import DrainingServer, uvicorn_config
from mtplx.server.live import INTERVAL_S, LiveSampler, speedup_vs_ar
from tests.serve_process import free_port, wait_until
from tests.test_server_harness import running_server, tiny_text_engine

KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"


@pytest.fixture(scope="module")
def engine():
    return tiny_text_engine(context=4096)  # room for a 4,000-token request (a few seconds at ~1,600 tok/s)


@pytest.fixture(scope="module")
def server(engine):
    """(base URL, ServerState) of one serial server with an API key, shared by the module."""
    app = create_app(engine, model_id=MODEL, api_key=KEY)
    with running_server(app) as url:
        yield url, app.state.mtplx


class Completion(threading.Thread):
    """A streamed /v1/completions request in a thread: ``id`` once the first chunk arrives,
    then the last chunk with a finish_reason (``final``) and its usage."""

    def __init__(self, url: str, max_tokens: int, **extra):
        super().__init__(daemon=True)
        self.url, self.body = url, {"model": MODEL, "prompt": "[user]tell me a story\n>> ", "stream": True,
                                    "max_tokens": max_tokens, "ignore_eos": True, **extra}
        self.id: str | None = None
        self.final: dict | None = None
        self.tokens = 0
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        body = {**self.body, "return_token_ids": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                self.id = chunk["id"]
                self.tokens += len(chunk["choices"][0].get("token_ids", []))
                self.started.set()
                if chunk["choices"][0]["finish_reason"] is not None:
                    self.final = chunk

    def finish_reason(self) -> str:
        return self.final["choices"][0]["finish_reason"]


def samples(url: str, headers=AUTH):
    """The live stream's samples, as they come, with their arrival time."""
    with httpx.stream("GET", f"{url}/v1/mtplx/metrics/stream", headers=headers, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield time.monotonic(), json.loads(line[len("data: "):])


def one_sample(url: str) -> dict:
    return next(samples(url))[1]


def test_page_is_open_but_its_data_needs_the_key(server):
    url, _ = server
    root = httpx.get(f"{url}/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/dashboard"
    page = httpx.get(f"{url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]  # no CDN: nothing loads from elsewhere
    assert '<script src="/dashboard/app.js"' in page.text and KEY not in page.text
    assert httpx.get(f"{url}/dashboard/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{url}/dashboard/style.css").headers["content-type"].startswith("text/css")
    assert httpx.get(f"{url}/dashboard/other.js").status_code == 401  # only the page's files are open
    head = httpx.head(f"{url}/dashboard")  # link checkers and monitors ask HEAD
    assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) == len(page.content)

    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"X-API-Key": "wrong-key"}):
        for method, path in (("GET", "/v1/mtplx/metrics/stream"), ("GET", "/v1/mtplx/settings"),
                             ("POST", "/v1/mtplx/settings"), ("POST", "/v1/mtplx/cancel/cmpl-1")):
            r = httpx.request(method, f"{url}{path}", headers=headers)
            assert r.status_code == 401, (method, path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert next(samples(url, {"X-API-Key": KEY}))[1]["scheduler_mode"] == "serial"


def test_stream_shows_a_running_request_and_counts_what_clients_received(server):
    url, _ = server
    before = one_sample(url)
    # long enough to be sampled running several times: the tiny model decodes ~1,600 tok/s here
    # (1,500 tokens ran under a second, about two 400 ms samples, and failed often once its decode
    # steps lost ~5 us a layer of Python)
    job = Completion(url, 4000, temperature=0)
    seen_running, arrivals = [], []
    for arrived, s in samples(url):
        arrivals.append(arrived)
        rows = [r for r in s["running"] if r["id"] == job.id]
        if rows and rows[0]["tok_s"]:
            seen_running.append((s, rows[0]))
        if len(seen_running) >= 3:
            break
        assert len(arrivals) < 100, "the request never showed as running"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert INTERVAL_S * 0.9 <= sum(gaps) / len(gaps) <= INTERVAL_S * 1.75 and max(gaps) < 1.5, gaps
    s, row = seen_running[-1]
    assert row["state"] == "running" and row["generation_mode"] == "mtp" and row["tok_s"] > 0
    assert s["tok_s"] > 0 and s["active_requests"] == 1
    assert 1.0 <= row["mean_acceptance_length"] <= 1.0 + row["depth"]
    assert s["spec"]["cycles"] > before["spec"]["cycles"]  # running requests count while they run
    assert all(0.0 <= r <= 1.0 for r in s["spec"]["acceptance_by_position"] if r is not None)
    job.join(120)

    after = one_sample(url)
    stats = job.final["mtplx_stats"]
    ended = next(r for r in after["recent"] if r["id"] == job.id)
    assert ended["finish_reason"] == "length"
    assert ended["completion_tokens"] == job.final["usage"]["completion_tokens"] == job.tokens == 4000
    assert ended["prompt_tokens"] == job.final["usage"]["prompt_tokens"]
    assert ended["tok_s"] == pytest.approx(stats["decode_tok_s"])
    assert ended["mean_acceptance_length"] == pytest.approx(stats["mean_acceptance_length"])
    # totals since start moved by exactly this request's own statistics
    spec, old = after["spec"], before["spec"]
    assert spec["cycles"] - old["cycles"] == stats["verify_calls"]
    assert spec["accepted_tokens"] - old["accepted_tokens"] == stats["accepted_tokens"]
    grown = [a - b for a, b in zip(spec["drafted_by_position"], old["drafted_by_position"] + [0] * 8)]
    assert grown == stats["drafted_by_depth"]
    assert after["running"] == [] and after["kv_cache"]["used_blocks"] == 0


def test_tok_s_counts_every_token_the_clients_received(server):
    """Requests that start and end between two samples count too: the sampler's token total over
    a burst equals the clients' usage, exactly."""
    url, state = server
    sampler = LiveSampler(state)
    sampler.sample()
    jobs = []
    for i, max_tokens in enumerate((40, 7, 300, 1, 120, 16, 64)):
        jobs.append(Completion(url, max_tokens, seed=i))
        time.sleep(0.05)
        sampler.sample()
    for job in jobs:
        job.join(60)
        sampler.sample()
    sampler.sample()
    assert sampler.emitted == sum(job.final["usage"]["completion_tokens"] for job in jobs)


def test_cancel_by_id_stops_running_and_queued_requests(server):
    url, state = server
    running = Completion(url, 3000)
    assert running.started.wait(30)
    queued = Completion(url, 3000)  # serial: waits behind the first
    wait_until(lambda: state.scheduler.queue_depth == 1)
    sample = one_sample(url)
    queued_id = sample["running"][1]["id"]
    assert [(r["id"], r["state"]) for r in sample["running"]] == [(running.id, "running"), (queued_id, "queued")]

    r = httpx.post(f"{url}/v1/mtplx/cancel/{queued_id}", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"id": queued_id, "cancelled": True, "was": "queued"}
    queued.join(10)
    assert queued.finish_reason() == "cancelled" and queued.final["usage"]["completion_tokens"] == 0
    assert running.is_alive()  # the other one goes on

    r = httpx.post(f"{url}/v1/mtplx/cancel/{running.id}", headers=AUTH)
    assert r.status_code == 200 and r.json()["was"] == "running"
    running.join(10)
    assert running.finish_reason() == "cancelled" and 0 < running.tokens < 3000
    wait_until(lambda: state.scheduler.active_requests == 0 and state.kv_cache()["used_blocks"] == 0)

    again = httpx.post(f"{url}/v1/mtplx/cancel/{running.id}", headers=AUTH)
    assert again.status_code == 404 and again.json()["error"]["param"] == "request_id"
    assert httpx.post(f"{url}/v1/mtplx/cancel/cmpl-never", headers=AUTH).status_code == 404
    reasons = {r["id"]: r["finish_reason"] for r in one_sample(url)["recent"]}
    assert reasons[running.id] == reasons[queued_id] == "cancelled"


def test_live_settings_apply_to_the_next_request(server):
    url, state = server
    def post(body):
        return httpx.post(f"{url}/v1/mtplx/settings", json=body, headers=AUTH)

    def stats_and_ids(**extra):
        body = {"model": MODEL, "prompt": "[user]hi\n>> ", "max_tokens": 24, "ignore_eos": True,
                "return_token_ids": True, **extra}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).json()
        return r["mtplx_stats"], r["choices"][0]["token_ids"]

    try:
        r = post({"generation_mode": "ar", "temperature": 0})
        assert r.status_code == 200 and r.json()["live"]["generation_mode"] == "ar"
        stats, ids = stats_and_ids()
        assert stats["generation_mode"] == "ar"
        assert ids == stats_and_ids(temperature=0, generation_mode="ar")[1]  # default temperature 0: greedy

        assert post({"generation_mode": "mtp", "depth": "auto"}).status_code == 200  # adaptive, up to 3
        stats, _ = stats_and_ids()
        assert (stats["generation_mode"], stats["depth"], stats["adaptive"]) == ("mtp", 3, True)
        assert post({"generation_mode": "mtp", "depth": 3}).status_code == 200
        stats, _ = stats_and_ids()
        assert (stats["generation_mode"], stats["depth"], stats["adaptive"]) == ("mtp", 3, False)
        assert one_sample(url)["defaults"] == {"generation_mode": "mtp", "depth": 3, "temperature": 0.0,
                                               "engine_depth": state.engine.request_depth(state.default_temperature)}
        assert post({"scheduler_mode": "serial"}).status_code == 200  # unchanged: nothing to restart
    finally:
        assert post({"generation_mode": "auto", "depth": None, "temperature": "auto"}).status_code == 200
    assert state.scheduler.settings.generation_mode is None and state.default_temperature == state.model_temperature


@pytest.mark.parametrize("body, status, param, says", [
    ({"depth": 9}, 400, "depth", "an integer from 1 to 8"),
    ({"depth": "deep"}, 400, "depth", "depth = 'deep'"),
    ({"generation_mode": "fast"}, 400, "generation_mode", "mtp, ar or auto"),
    ({"temperature": -1}, 400, "temperature", ">= 0"),
    ({"temperature": "hot"}, 400, "temperature", "must be a number"),
    ({"temperature": 5}, 400, "temperature", "at most 2"),  # a default no request could ask for
    ({"top_p": 0.5}, 400, "top_p", "not a setting"),
    ({"scheduler_mode": "turbo"}, 400, "scheduler_mode", "one of serial, mtp_batch"),
    ({"scheduler_mode": "mtp_batch"}, 409, "scheduler_mode", "restart with --scheduler-mode mtp_batch"),
    ({"max_active_requests": 4}, 409, "max_active_requests", "restart"),
    ({"depth": 2, "temperature": -1}, 400, "temperature", ">= 0"),  # nothing applies, depth included
])
def test_bad_settings_are_refused_naming_the_field(server, body, status, param, says):
    url, state = server
    r = httpx.post(f"{url}/v1/mtplx/settings", json=body, headers=AUTH)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"]
    assert error["code"] == ("restart_required" if status == 409 else "invalid_value")
    assert state.scheduler.settings.depth is None and state.default_temperature == state.model_temperature


def test_settings_follow_the_modes_rules(engine):
    """mtp_batch decodes MTP only: its default cannot become AR (the rule `mtplx serve` applies)."""
    app = create_app(engine, SchedulerSettings.resolve("mtp_batch"), model_id=MODEL)  # not started
    with pytest.raises(APIError) as refused:
        dashboard.validate_settings(app.state.mtplx, {"generation_mode": "ar"})
    assert refused.value.param == "generation_mode" and "mtp_batch decodes MTP only" in refused.value.message
    assert dashboard.validate_settings(app.state.mtplx, {"generation_mode": "mtp"}) == {"generation_mode": "mtp"}


def test_shutdown_ends_the_stream_at_once(engine):
    """A dashboard left open does not hold up a drain: on SIGTERM its stream ends within one
    sample interval and the server stops long before the grace period."""
    app = create_app(engine, model_id=MODEL)
    grace_s = 20.0
    config = uvicorn_config(app, "warning")
    config.host, config.port = "127.0.0.1", free_port()
    server = DrainingServer(config, app.state.mtplx.scheduler, grace_s)
    thread = threading.Thread(target=server.run, daemon=True)  # not the main thread: no signal handlers
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    wait_until(lambda: server.started)
    stream = samples(url, {})
    next(stream)
    signalled = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    for _ in stream:
        pass  # ends when the server closes it
    ended = time.monotonic()
    thread.join(grace_s)
    assert not thread.is_alive()
    assert ended - signalled < INTERVAL_S + 1.0
    assert time.monotonic() - signalled < 5.0  # far below the 20 s grace


def test_speedup_compares_mtp_with_ar_of_the_same_temperature_regime():
    def row(mode, temperature, tok_s, reason="length", tokens=64):
        return {"generation_mode": mode, "temperature": temperature, "tok_s": tok_s, "finish_reason": reason,
                "completion_tokens": tokens}

    recent = [row("mtp", 0, 30.0), row("mtp", 0, 34.0), row("ar", 0, 20.0),
              row("ar", 0, 2.0, reason="cancelled"), row("ar", 0, 1.0, tokens=2),  # neither counts
              row("mtp", 0.7, 18.0), row("mtp", 1.0, 22.0)]  # sampled: no AR request to compare with
    out = speedup_vs_ar(recent)
    assert out["greedy"] == {"speedup": pytest.approx(1.6), "mtp_tok_s": 32.0, "ar_tok_s": 20.0}
    assert out["sampled"] == {"speedup": None, "mtp_tok_s": 20.0, "ar_tok_s": None}


def test_streams_beyond_the_cap_are_refused(server, monkeypatch):
    url, state = server
    monkeypatch.setattr(dashboard, "MAX_STREAMS", 2)
    with httpx.Client(headers=AUTH, timeout=30) as client:
        with client.stream("GET", f"{url}/v1/mtplx/metrics/stream") as one, \
                client.stream("GET", f"{url}/v1/mtplx/metrics/stream") as two:
            lines = [one.iter_lines(), two.iter_lines()]  # kept: a dropped iterator closes its stream
            assert all(next(stream).startswith("data: {") for stream in lines)
            third = client.get(f"{url}/v1/mtplx/metrics/stream")
            assert third.status_code == 503 and third.json()["error"]["code"] == "too_many_streams"
    wait_until(lambda: state.dashboard_streams == 0)  # closed streams give their places back
    assert next(samples(url))[1]["scheduler_mode"] == "serial"
