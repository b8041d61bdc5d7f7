"""The OpenAI-compatible API on a real uvicorn server, driven by the official ``openai``
client and by raw HTTP (httpx). References come from the engine alone, before serving."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mtplx.batching.state import SchedulerSettings
from mtplx.server.app import create_app
from mtplx.batching.hyper_gate import HyperAdmissionGate, HyperCohortPlan
from tests.test_server_harness import running_server, tiny_text_engine

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Tell me a story"}]
GREEDY = dict(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def engine():
    return tiny_text_engine(head="repeat", context=4096)


@pytest.fixture(scope="module")
def refs(engine):
    """What the engine produces alone; computed before the server owns the engine."""
    return {"chat": engine.generate(CHAT, chat=True, **GREEDY),
            "text": engine.generate("The sea", **GREEDY),
            "ids": engine.generate([5, 6, 7, 8], **GREEDY)}


@pytest.fixture(scope="module")
def url(engine, refs):
    with running_server(create_app(engine, model_id=MODEL)) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def sse(response: httpx.Response) -> list:
    """The data payloads of an SSE response: dicts, and the final "[DONE]"."""
    out = []
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def snapshot(url: str, **headers) -> dict:
    return httpx.get(f"{url}/v1/mtplx/snapshot", headers=headers).json()


# -- completions --------------------------------------------------------------------------------
def test_chat_completion_matches_the_engine_and_reports_usage_and_stats(client, refs):
    ref = refs["chat"]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason == "length"
    assert r.usage.prompt_tokens == ref.prompt_tokens and r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stats = r.model_extra["mtplx_stats"]
    assert stats["generation_mode"] == "mtp" and stats["verify_calls"] > 0
    assert stats["mean_acceptance_length"] == 1 + stats["accepted_tokens"] / stats["verify_calls"]
    assert stats["scheduler_mode"] == "serial" and stats["scheduler_lane"] == "serial"
    assert stats["queue_wait_s"] >= 0 and stats["run_s"] > 0 and stats["ttft_s"] > 0


def test_chat_stream_with_include_usage(client, refs):
    ref = refs["chat"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
    assert last.model_extra["mtplx_stats"]["generated_tokens"] == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_framing_and_stats_in_the_final_chunk(url, refs):
    body = {"model": MODEL, "messages": CHAT, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse(response)
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == len(refs["chat"].token_ids)
    assert "acceptance_rate" in final["mtplx_stats"]


def test_text_and_token_id_completions(client, refs):
    r = client.completions.create(model=MODEL, prompt="The sea", **GREEDY)
    assert r.object == "text_completion" and r.choices[0].text == refs["text"].text
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], extra_body={"return_token_ids": True}, **GREEDY)
    assert r.choices[0].model_extra["token_ids"] == refs["ids"].token_ids
    streamed = client.completions.create(model=MODEL, prompt="The sea", stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == refs["text"].text


def test_stop_strings_cut_the_text_before_the_stop(client, refs):
    full = refs["chat"].text
    stop = full[6:8]
    expected = full[:full.find(stop)]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, stop=[stop, "never-appears"], **GREEDY)
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, stop=stop, stream=True, **GREEDY)
    streamed = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_max_tokens_and_max_completion_tokens(client):
    a = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=5, temperature=0)
    assert a.usage.completion_tokens == b.usage.completion_tokens == 5
    assert a.choices[0].finish_reason == b.choices[0].finish_reason == "length"
    assert a.choices[0].message.content == b.choices[0].message.content


def test_legacy_completions_default_to_16_tokens_but_never_past_the_context(client, engine):
    """OpenAI's (and vLLM's) default max_tokens for /v1/completions is 16; a prompt that leaves
    less room decodes to the context's end rather than failing on a limit it did not send."""
    r = client.completions.create(model=MODEL, prompt="The sea", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    long = [5 + i % 50 for i in range(engine.max_context - 6)]
    r = client.completions.create(model=MODEL, prompt=long, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_top_p_0_keeps_the_most_probable_token_alone(client, refs):
    """OpenAI's top_p range is [0, 1]: 0 keeps the top token only, so sampling at any
    temperature gives the greedy output."""
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=1.3, top_p=0, seed=5)
    assert r.choices[0].message.content == refs["chat"].text


def test_assistant_refusal_parts_are_what_the_model_said(client):
    """An assistant turn's content parts may be refusals (what the OpenAI SDK hands back when a
    model refuses); the prompt holds their text as the turn's content."""
    turns = lambda content: [*CHAT, {"role": "assistant", "content": content}, {"role": "user", "content": "Why?"}]  # noqa: E731
    parts = client.chat.completions.create(model=MODEL, messages=turns([{"type": "refusal", "refusal": "I can't."}]),
                                           **GREEDY)
    plain = client.chat.completions.create(model=MODEL, messages=turns("I can't."), **GREEDY)
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert parts.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:  # a user turn's refusal part is not a thing
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "refusal", "refusal": "no"}]}], **GREEDY)
    assert err.value.body["param"] == "messages.0.content"


def test_every_response_carries_an_x_request_id(url):
    """The client's own x-request-id comes back (a proxy's trace id); else a new req_ id, on
    errors too."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-request-id": "trace-42"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    ids = [httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).headers["x-request-id"] for _ in range(2)]
    missing = httpx.get(f"{url}/v1/nowhere", timeout=30)
    assert missing.status_code == 404
    ids.append(missing.headers["x-request-id"])
    assert all(i.startswith("req_") for i in ids) and len(set(ids)) == 3
    spaced = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-request-id": "a b"}, timeout=30)
    assert spaced.headers["x-request-id"] == spaced.headers["request-id"] == "a b"  # (Anthropic's SDK reads request-id)
    bad = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-request-id": "a\tb"}, timeout=30)
    assert bad.headers["x-request-id"].startswith("req_")  # a tab is not printable: replaced


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=20, temperature=0.9, top_p=0.95, seed=1234,
                  presence_penalty=0.3, frequency_penalty=0.2, extra_body={"top_k": 40, "min_p": 0.01})
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    again = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kwargs) if c.choices)
    other = client.chat.completions.create(**{**kwargs, "seed": 99}).choices[0].message.content
    assert first == again == streamed
    assert other != first  # 20 tokens sampled at temperature 0.9 from 96: a collision is negligible


def test_per_request_generation_mode_and_depth(client, refs):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"generation_mode": "ar"}, **GREEDY)
    assert r.choices[0].message.content == refs["chat"].text
    assert r.model_extra["mtplx_stats"]["generation_mode"] == "ar"
    r = client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"depth": 3}, **GREEDY)
    assert r.choices[0].message.content == refs["chat"].text
    assert len(r.model_extra["mtplx_stats"]["drafted_by_depth"]) == 3


# -- errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param, words", [
    (dict(temperature=-1), "temperature", "must be a finite number >= 0"),
    (dict(top_p=1.5), "top_p", "[0, 1]"),
    (dict(n=0), "n", "greater than or equal to 1"),
    (dict(max_tokens=0), "max_tokens", "greater than or equal to 1"),
    (dict(extra_body={"top_k": -3}), "top_k", "integer >= 0"),
    (dict(extra_body={"depth": 9}), "depth", "from 1 to 8"),
    (dict(presence_penalty=3), "presence_penalty", "[-2, 2]"),
    (dict(logit_bias={"5": 100}), "logit_bias", "would change the output"),
    (dict(response_format={"type": "xml"}), "response_format.type", "json_object or json_schema"),
    (dict(extra_body={"min_tokens": 3}), "min_tokens", "not supported"),
    (dict(extra_body={"repetition_penalty": 1.2}), "repetition_penalty", "not supported"),
    (dict(temperature=2.5), "temperature", "less than or equal to 2"),
    (dict(extra_body={"best_of": 3}), "best_of", "not supported"),
    (dict(extra_body={"best_of": True}), "best_of", "not supported"),  # true is not the neutral 1
    (dict(stream_options={"include_usage": True}), "stream_options", "only allowed when stream is true"),
    (dict(seed=2 ** 64 + 5), "seed", "64-bit integer"),
    (dict(seed=-2 ** 63 - 1), "seed", "64-bit integer"),
    # a field of several shapes is named, with its shapes, not by pydantic's first try ("stop.str")
    (dict(stop=["a", 14]), "stop", "stop: expected a string or a list of strings"),
    (dict(extra_body={"depth": "deep"}), "depth", "depth: expected an integer or 'auto'"),
])
def test_bad_parameters_are_400_naming_the_parameter(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, **{"max_tokens": 4, **kwargs})
    error = err.value.body
    assert err.value.status_code == 400 and error["param"] == param and words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_field_sent_as_null_is_not_sent(url, refs):
    """OpenAI's and Anthropic's specs let a request's fields be null: null reads as unset on
    every route (it was a 400 for n, stream, top_p, penalties, echo, ...), and decodes what
    the same request without those fields decodes."""
    nulls = dict(n=None, stream=None, top_p=None, presence_penalty=None, frequency_penalty=None, stop=None,
                 parallel_tool_calls=None, seed=None, user=None)
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **GREEDY, **nulls}).json()
    assert chat["choices"][0]["message"]["content"] == refs["chat"].text
    text = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "The sea", **GREEDY, "echo": None,
                                                    "top_k": None, "min_p": None, "logprobs": None}).json()
    assert text["choices"][0]["text"] == refs["text"].text
    messages = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "messages": CHAT, "max_tokens": 24, "temperature": 0,
                                                     "stream": None, "top_p": None, "system": None}).json()
    assert messages["content"][0]["text"] == refs["chat"].text
    responses = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": CHAT, "max_output_tokens": 24,
                                                       "temperature": 0, "top_p": None, "stream": None,
                                                       "parallel_tool_calls": None}).json()
    assert responses["output"][0]["content"][0]["text"] == refs["chat"].text


def test_a_body_that_is_no_json_object_is_400_saying_so(url):
    bad_json = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": "x", "messages": [}',
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["message"].startswith("the body is not valid JSON: ")
    assert bad_json.json()["error"]["param"] is None  # not the character offset
    nan = httpx.post(f"{url}/v1/chat/completions", headers={"content-type": "application/json"},
                     content=f'{{"model": "{MODEL}", "messages": [], "temperature": NaN}}'.encode())
    assert nan.status_code == 400 and "finite number" in nan.json()["error"]["message"]
    form = httpx.post(f"{url}/v1/chat/completions", content=json.dumps({"model": MODEL, "messages": CHAT}),
                      headers={"content-type": "application/x-www-form-urlencoded"})  # curl -d's default
    assert form.status_code == 400 and "content-type: application/json" in form.json()["error"]["message"]
    listed = httpx.post(f"{url}/v1/chat/completions", json=[1, 2])
    assert listed.status_code == 400 and listed.json()["error"]["message"].startswith("the body must be a JSON object")
    null = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                          "messages": [{"role": "assistant", "content": None}]})
    assert null.json()["error"]["message"] == ("messages.0.content: an assistant message needs content (a string "
                                               "or text parts), got null")


def test_seeds_are_their_64_bits(client):
    """-1 and 2**64 - 1 are one seed (the same bits), and choice 1 of 2**64 - 1 takes seed 0 (no
    overflow past the range); 2**64 + 5 is refused (test_bad_parameters_are_400_naming_the_parameter),
    not taken as 5."""
    kw = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0)
    texts = [client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (-1, 2 ** 64 - 1)]
    assert texts[0] == texts[1]
    two = client.chat.completions.create(seed=2 ** 64 - 1, n=2, **kw)  # choice 1 takes seed 0: no overflow
    assert two.choices[0].message.content == texts[0]
    assert two.choices[1].message.content == client.chat.completions.create(seed=0, **kw).choices[0].message.content


def test_neutral_values_of_unsupported_fields_and_harmless_unknown_fields_pass(client, refs):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, logit_bias={}, response_format={"type": "text"},
                                       user="someone", extra_body={"repetition_penalty": 1.0, "store": False},
                                       **GREEDY)
    assert r.choices[0].message.content == refs["chat"].text


def test_ignore_eos_decodes_past_the_end_of_sequence_token(client, engine):
    first = engine.generate("a", max_tokens=1, temperature=0.0).token_ids[0]
    eos = engine.generator.eos_token_ids
    engine.generator.eos_token_ids = {first}  # greedy decoding now ends at once...
    try:
        stopped = client.completions.create(model=MODEL, prompt="a", max_tokens=40, temperature=0)
        ignored = client.completions.create(model=MODEL, prompt="a", max_tokens=40, temperature=0,
                                            extra_body={"ignore_eos": True})
    finally:
        engine.generator.eos_token_ids = eos
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 0
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 40  # ...unless ignored


def test_a_prompt_longer_than_the_context_is_400_context_length_exceeded(client):
    """OpenAI's code for it (clients check it to trim a conversation), naming each route's
    prompt field: prompt, messages, input."""
    with pytest.raises(openai.BadRequestError, match="context is 4096 tokens") as err:
        client.completions.create(model=MODEL, prompt="x" * 5000, max_tokens=2)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "prompt"
    long = [{"role": "user", "content": "x" * 5000}]
    with pytest.raises(openai.BadRequestError, match="messages: the prompt has") as err:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=2)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="input: the prompt has") as err:
        client.responses.create(model=MODEL, input=long, max_output_tokens=2)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError, match="leaves for output") as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4090)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="leaves for output") as err:  # no shorter prompt would help
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5000)
    assert err.value.body["code"] == "invalid_value"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="messages: the prompt has") as err:  # rendered with tools
        client.chat.completions.create(model=MODEL, messages=long, tools=[tool], max_tokens=2)
    assert err.value.body["param"] == "messages"


def test_unknown_model_and_route_are_404_in_the_openai_shape(client, url):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert err.value.body["code"] == "model_not_found" and "'tiny'" in err.value.body["message"]
    assert err.value.body["type"] == "invalid_request_error"  # as OpenAI's API answers
    r = httpx.post(f"{url}/v1/nothing", json={})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_models_endpoint(client):
    [card] = client.models.list().data
    assert card.id == MODEL and card.owned_by == "mtplx"
    assert client.models.retrieve(MODEL) == card
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found"


def test_a_request_of_n_choices_counts_its_prompt_once_in_the_metrics(client, url):
    def counters() -> dict:
        families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
        return {s.name: s.value for f in families for s in f.samples if s.name.endswith("_total") and not s.labels
                or s.name == "mtplx_e2e_request_latency_seconds_count"}

    before = counters()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, n=3, max_tokens=6, temperature=0.8, seed=4)
    after = counters()
    moved = {k: after[k] - before.get(k, 0.0) for k in after}
    assert moved["mtplx_prompt_tokens_total"] == r.usage.prompt_tokens
    assert moved["mtplx_generation_tokens_total"] == r.usage.completion_tokens == 3 * 6
    assert moved["mtplx_e2e_request_latency_seconds_count"] == 1
    choices = r.model_extra["mtplx_choice_stats"]  # every choice's drafts and acceptances count
    for counter, stat in (("mtplx_spec_decode_num_drafts_total", "verify_calls"),
                          ("mtplx_spec_decode_num_draft_tokens_total", "drafted_tokens"),
                          ("mtplx_spec_decode_num_accepted_tokens_total", "accepted_tokens")):
        assert moved[counter] == sum(c[stat] for c in choices), counter
    assert moved["mtplx_spec_decode_num_drafts_total"] > 0


# -- telemetry --------------------------------------------------------------------------------
def test_metrics_health_and_snapshot_report_what_ran(client, url):
    client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    metrics = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    value = lambda name, **labels: sum(s.value for s in metrics[name].samples  # noqa: E731
                                       if s.name.endswith(("_total", "_count")) or s.name == name
                                       if all(s.labels.get(k) == v for k, v in labels.items()))
    for name in ("mtplx_spec_decode_num_drafts", "mtplx_spec_decode_num_draft_tokens",
                 "mtplx_spec_decode_num_accepted_tokens", "mtplx_prompt_tokens", "mtplx_generation_tokens"):
        assert value(name) > 0, name
    # depth 1 by default (engine.DEFAULT_DEPTH), and one earlier request asked for depth 3
    assert value("mtplx_spec_decode_num_draft_tokens") > value("mtplx_spec_decode_num_drafts")
    assert value("mtplx_spec_decode_num_accepted_tokens") <= value("mtplx_spec_decode_num_draft_tokens")
    per_pos = {s.labels["position"]: s.value for s in metrics["mtplx_spec_decode_num_accepted_tokens_per_pos"].samples
               if s.name.endswith("_total")}
    assert {"0", "1"} <= set(per_pos) and sum(per_pos.values()) == value("mtplx_spec_decode_num_accepted_tokens")
    assert value("mtplx_time_to_first_token_seconds") >= 1 and value("mtplx_e2e_request_latency_seconds") >= 1
    assert value("mtplx_request_success", finish_reason="length") >= 1
    assert value("mtplx_http_requests", route="/v1/chat/completions", status="200") >= 1
    assert value("mtplx_kv_cache_blocks_total") == 1024 and value("mtplx_kv_cache_blocks_used") == 0
    assert "mtplx_num_requests_waiting" in metrics and "mtplx_num_requests_running" in metrics

    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["scheduler_mode"] == "serial"
    assert health["scheduler"]["serial"]["totals"]["completed"] >= 1 and health["scheduler"]["hyper"] == {}

    snap = snapshot(url)
    assert snap["scheduler_mode"] == "serial" and snap["scheduler_policy"] == "serial_fifo"
    assert snap["active_lane"] == "idle" and snap["config"]["max_active_requests"] == 1
    assert snap["scheduler"]["serial"] == snap["telemetry"] and snap["scheduler"]["mtp_batch"] == {}
    kv = snap["kv_cache"]
    assert kv["total_blocks"] == 1024 and kv["free_blocks"] == 1024 and kv["cached_blocks"] > 0
    assert snap["latest_request"]["mtplx_stats"]["generated_tokens"] == GREEDY["max_tokens"]


# -- disconnects --------------------------------------------------------------------------------
def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_closed_stream_cancels_its_generation_and_frees_its_blocks(url):
    before = snapshot(url)["telemetry"]["totals"]["cancelled"]
    body = {"model": MODEL, "prompt": "The sea", "stream": True, "max_tokens": 3000, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    assert wait_until(lambda: snapshot(url)["telemetry"]["totals"]["cancelled"] == before + 1)
    snap = snapshot(url)
    assert snap["active_requests"] == 0 and snap["kv_cache"]["used_blocks"] == 0
    assert snap["latest_request"]["finish_reason"] == "cancelled"
    assert snap["latest_request"]["completion_tokens"] < 3000


def test_a_dropped_connection_cancels_a_whole_response(url):
    before = snapshot(url)["telemetry"]["totals"]["cancelled"]
    body = {"model": MODEL, "prompt": "The sea", "max_tokens": 3000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.3))
    assert wait_until(lambda: snapshot(url)["telemetry"]["totals"]["cancelled"] == before + 1)
    assert snapshot(url)["kv_cache"]["used_blocks"] == 0


# -- servers with limits ----------------------------------------------------------------------
def test_api_key_is_required_when_set(engine):
    app = create_app(engine, model_id=MODEL, api_key="s3cret")
    with running_server(app) as base:
        with pytest.raises(openai.AuthenticationError) as err:
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert httpx.get(f"{base}/v1/mtplx/snapshot").status_code == 401
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        assert httpx.get(f"{base}/health").status_code == 200  # health checks need no key


def test_allowed_origins_get_cors_answers_before_the_key_check(engine):
    """--allowed-origin: a browser page of that origin may call the API. Its preflight (no key:
    a browser never sends one there) is answered; its request, with the key, gets the origin
    back and may read x-request-id. Another origin gets no CORS grant, and without the option
    no origin does."""
    page = "http://localhost:3000"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    with running_server(create_app(engine, model_id=MODEL, api_key="s3cret", allowed_origins=[page])) as base:
        r = httpx.options(f"{base}/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = httpx.post(f"{base}/v1/chat/completions", json=body,
                       headers={"Origin": page, "Authorization": "Bearer s3cret"}, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        assert httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Origin": page}).status_code == 401
        other = httpx.options(f"{base}/v1/chat/completions", headers={**preflight, "Origin": "http://evil.test"})
        assert "access-control-allow-origin" not in other.headers
        assert other.status_code == 400 and other.json()["error"]["type"] == "invalid_request_error"
        assert other.json()["error"]["code"] == "cors_not_allowed"  # JSON, in the route's shape, naming the origin
        assert "Disallowed CORS origin: 'http://evil.test' is not an allowed origin" in other.json()["error"]["message"]
        other = httpx.options(f"{base}/v1/messages", headers={**preflight, "Origin": "http://evil.test"})
        assert other.status_code == 400 and other.json()["type"] == "error"
    with running_server(create_app(engine, model_id=MODEL)) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Origin": page}, timeout=30)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_an_oversized_body_is_413(engine):
    with running_server(create_app(engine, model_id=MODEL, max_body_bytes=2000)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * 5000}])
        assert err.value.status_code == 413 and err.value.body["code"] == "request_too_large"
        chunked = httpx.post(f"{base}/v1/completions", content=iter([b'{"model": "tiny", "prompt": "', b"z" * 4000]),
                             headers={"content-type": "application/json"})
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"


class HeldExecutor:
    """A hyper width executor that holds the model thread until released (to fill the queue)."""

    def __init__(self):
        self.running, self.release = threading.Event(), threading.Event()

    def plan(self, request):
        return HyperCohortPlan(2, "held")

    def run_cohort(self, plan, singleton):
        self.running.set()
        self.release.wait(30)
        return singleton()


def test_a_full_queue_is_503_with_retry_after(engine):
    gate, held = HyperAdmissionGate(), HeldExecutor()
    gate.install_width_executor(held)
    settings = SchedulerSettings.resolve("hyper", max_queued_requests=1)
    with running_server(create_app(engine, settings, model_id=MODEL, gate=gate)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        ask = lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)  # noqa: E731
        results = []
        workers = [threading.Thread(target=lambda: results.append(ask())) for _ in range(2)]
        workers[0].start()
        assert held.running.wait(10)  # the first request holds the model thread
        workers[1].start()
        assert wait_until(lambda: snapshot(base)["queue_depth"] == 1)  # the second waits
        with pytest.raises(openai.APIStatusError) as err:
            ask()
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
        assert err.value.body["code"] == "queue_full"
        held.release.set()
        for w in workers:
            w.join(30)
        assert len(results) == 2 and all(r.usage.completion_tokens == 3 for r in results)
