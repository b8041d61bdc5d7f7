"""Every scheduler mode behind a real server: 8 concurrent streams each get what the request
alone produces; hyper is byte-identical to serial; settings that break a mode's rules are
refused before any model loads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import mtplx
from mtplx.batching.state import SchedulerConfigError, SchedulerMode, SchedulerSettings
from mtplx.cli import main
from mtplx.batching import settings as scheduler_settings
from mtplx.server.app import create_app
from tests.test_server_harness import running_server, tiny_text_engine

MODEL = "tiny"
QUESTIONS = [f"Question number {i}?" for i in range(8)]
MAX_TOKENS = 20


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def engine():
    return tiny_text_engine(head="repeat")


@pytest.fixture(scope="module")
def solo(engine):
    return [engine.generate(chat(q), chat=True, max_tokens=MAX_TOKENS, temperature=0.0) for q in QUESTIONS]


def stream_one(client: openai.OpenAI, question: str, **kwargs) -> dict:
    """One streamed chat completion: its text, finish reason, usage and stats."""
    text, finish, last = [], None, None
    for chunk in client.chat.completions.create(model=MODEL, messages=chat(question), stream=True,
                                                stream_options={"include_usage": True}, **kwargs):
        last = chunk
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return {"text": "".join(text), "finish_reason": finish, "usage": last.usage,
            "stats": last.model_extra["mtplx_stats"]}


@pytest.mark.parametrize("mode", SchedulerMode.choices())
def test_each_mode_serves_8_concurrent_streams_exactly_as_alone(engine, solo, mode):
    with running_server(create_app(engine, SchedulerSettings.resolve(mode), model_id=MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            outs = list(pool.map(lambda q: stream_one(client, q, max_tokens=MAX_TOKENS, temperature=0), QUESTIONS))
        snap = httpx.get(f"{url}/v1/mtplx/snapshot").json()
    for out, ref in zip(outs, solo):
        assert out["text"] == ref.text
        assert out["finish_reason"] == ref.finish_reason
        assert out["usage"].completion_tokens == len(ref.token_ids)
        assert out["stats"]["scheduler_mode"] == mode
    assert snap["scheduler_mode"] == mode and snap["scheduler"][mode] == snap["telemetry"]
    assert snap["active_requests"] == 0 and snap["kv_cache"]["used_blocks"] == 0
    block = snap["telemetry"]
    if mode == "mtp_batch":
        assert snap["scheduler_policy"] == "fixed_mtp_batch_width_8"
        assert max(int(w) for w in block["batch_histogram"]) > 1  # rows really verified together
    if mode == "ar_batch":
        assert max(int(w) for w in block["batch_histogram"]) > 1
        assert any(o["stats"]["mtp_disabled_reason"] for o in outs)
    if mode == "hyper":
        assert snap["scheduler_policy"] == "hyper_singleton_admission_1"
        assert block["width_stats"]["requests_by_width"] == {"1": len(QUESTIONS)}
        assert {o["stats"]["scheduler_lane"] for o in outs} == {"serial_b1"}
    if mode == "solo_mtp":
        assert block["cycles"] == sum(o["stats"]["verify_calls"] for o in outs)
    if mode != "hyper":
        assert snap["scheduler"]["hyper"] == {}


REQUESTS = [  # greedy and seeded, MTP and AR, both draft policies
    dict(temperature=0.0),
    dict(temperature=0.8, seed=7),
    dict(temperature=1.0, top_p=0.9, seed=123, extra_body={"draft_policy": "mirror"}),
    dict(temperature=0.7, seed=5, extra_body={"generation_mode": "ar"}),
    dict(temperature=0.0, extra_body={"depth": 3}),
]


def trajectories(mode: str) -> list[tuple]:
    """Every REQUESTS entry on a fresh engine under ``mode``: text bytes, token ids, usage."""
    engine = tiny_text_engine(head="repeat")
    with running_server(create_app(engine, SchedulerSettings.resolve(mode), model_id=MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        out = []
        for question, request in zip(QUESTIONS, REQUESTS):
            kwargs = {k: v for k, v in request.items() if k != "extra_body"}
            extra = request.get("extra_body", {})
            r = client.chat.completions.create(model=MODEL, messages=chat(question), max_tokens=MAX_TOKENS,
                                               extra_body={**extra, "return_token_ids": True}, **kwargs)
            s = stream_one(client, question, max_tokens=MAX_TOKENS, extra_body=extra, **kwargs)
            out.append((r.choices[0].message.content.encode(), r.choices[0].model_extra["token_ids"],
                        r.choices[0].finish_reason, r.usage.completion_tokens, s["text"].encode()))
        return out


def test_hyper_trajectories_are_byte_identical_to_serial():
    serial, hyper = trajectories("serial"), trajectories("hyper")
    assert hyper == serial
    assert all(non_stream == stream for non_stream, _, _, _, stream in serial)


# -- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("knobs, rule", [
    (dict(max_active_requests=4), "hyper admits one request at a time (HYPER_ADMISSION_CAP = 1, no external admission)"),
    (dict(decode_batch_max=8), "hyper never batches separate requests"),
    (dict(batch_wait_ms=20), "hyper never holds a gather window: batch_wait_ms must be 0, got 20"),
])
def test_hyper_validation_names_the_rule(knobs, rule):
    with pytest.raises(SchedulerConfigError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        scheduler_settings.validate_hyper_settings(**knobs)
    scheduler_settings.validate_hyper_settings(max_active_requests=1, decode_batch_max=1, batch_wait_ms=0)


@pytest.mark.parametrize("mode, knobs, words", [
    ("serial", dict(max_active_requests=2), "serial runs one request at a time"),
    ("serial", dict(batch_wait_ms=5), "serial never holds a gather window"),
    ("solo_mtp", dict(generation_mode="ar"), "solo_mtp decodes MTP only (no AR fallback)"),
    ("solo_mtp", dict(decode_batch_max=2), "solo_mtp does not batch"),
    ("mtp_batch", dict(generation_mode="ar"), "mtp_batch decodes MTP only"),
    ("mtp_batch", dict(decode_batch_max=4, max_active_requests=6), "mtp_batch admits up to decode_batch_max"),
    ("ar_batch", dict(decode_batch_max=4), "ar_batch's width is max_active_requests"),
    ("ar_batch", dict(batch_wait_ms=10), "ar_batch admits at every decode step and never holds a gather window"),
    ("turbo", {}, "choose one of serial, mtp_batch, hyper, ar_batch, solo_mtp"),
])
def test_every_mode_validates_its_settings(mode, knobs, words):
    with pytest.raises(SchedulerConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        scheduler_settings.validate_scheduler_settings(mode, **knobs)


def test_valid_settings_resolve_to_the_mode_defaults():
    mtp_batch = scheduler_settings.validate_scheduler_settings("mtp_batch")
    assert (mtp_batch.decode_batch_max, mtp_batch.batch_wait_ms, mtp_batch.max_active_requests) == (8, 20.0, 8)
    assert mtp_batch.policy_label == "fixed_mtp_batch_width_8"
    assert scheduler_settings.validate_scheduler_settings("ar_batch").max_active_requests == 8
    hyper = scheduler_settings.validate_scheduler_settings("hyper")
    assert (hyper.max_active_requests, hyper.decode_batch_max, hyper.batch_wait_ms) == (1, 1, 0.0)
    assert scheduler_settings.validate_scheduler_settings("mtp_batch", decode_batch_max=4).policy_label == \
        "fixed_mtp_batch_width_4"


def test_serve_refuses_bad_settings_before_loading_the_model(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("MTPLX_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setattr(mtplx, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", "--scheduler-mode", "hyper", "--max-active-requests", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("mtplx serve: error: hyper admits one request at a time")
    assert "(from flag --max-active-requests)" in err
    monkeypatch.setenv("MTPLX_SCHEDULER_MODE", "nope")
    assert main(["serve"]) == 2
    assert "serial, mtp_batch, hyper, ar_batch, solo_mtp" in capsys.readouterr().err
    monkeypatch.delenv("MTPLX_SCHEDULER_MODE")
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err


def test_mtp_only_modes_need_a_head():
    settings = SchedulerSettings.resolve("solo_mtp")
    with pytest.raises(SchedulerConfigError, match="needs a model with an MTP head"):
        scheduler_settings.validate_model_for_mode(settings, has_mtp=False)
    scheduler_settings.validate_model_for_mode(SchedulerSettings.resolve("serial"), has_mtp=False)


@pytest.mark.parametrize("mode, expected", [("serial", "ar"), ("hyper", "ar"), ("mtp_batch", "mtp"), ("solo_mtp", "mtp")])
def test_an_engine_tuned_to_ar_serves_ar_by_default_except_in_mtp_only_modes(mode, expected):
    """After `mtplx tune` found MTP slower (the engine's default mode is AR), requests that name
    no generation_mode decode AR; the MTP-only modes still run MTP."""
    engine = tiny_text_engine(head="repeat")
    engine.default_mode = "ar"
    app = create_app(engine, SchedulerSettings.resolve(mode), model_id="tiny")
    with running_server(app) as url:
        body = {"model": "tiny", "prompt": "row 1: a says", "max_tokens": 6, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert reply["mtplx_stats"]["generation_mode"] == expected
        asked = httpx.post(f"{url}/v1/completions", json={**body, "generation_mode": "mtp"}, timeout=60).json()
        assert asked["mtplx_stats"]["generation_mode"] == "mtp"
