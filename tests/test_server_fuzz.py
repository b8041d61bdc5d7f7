"""Generated requests thrown at a running server: never a 500, never a hang, always the OpenAI
error shape for a refusal, and a valid request right after still succeeds (issue 5, point 1)."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtplx.server.app import create_app
from tests.test_server_harness import running_server, tiny_text_engine

MODEL = "tiny"
VALID = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=8)
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "presence_penalty", "frequency_penalty", "seed", "stop", "stream", "stream_options", "n",
          "logprobs", "tools", "depth", "generation_mode", "draft_policy", "user", "tool_choice", "response_format",
          "top_logprobs", "parallel_tool_calls"]
# the Anthropic and Responses routes' own fields
ROUTE_FIELDS = {"/v1/messages": ["system", "stop_sequences", "tool_choice", "tools", "messages", "max_tokens",
                                 "stream", "thinking"],
                "/v1/responses": ["input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
                                  "previous_response_id", "stream"]}
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x", ""]),
                                           "content": st.one_of(st.text(max_size=20), values)}), max_size=3)


@st.composite
def chat_bodies(draw):
    """A valid request with some fields replaced by anything JSON can carry."""
    body = dict(VALID)
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[field] = draw(messages if field == "messages" else values)
    if draw(st.booleans()):
        body.pop(draw(st.sampled_from(sorted(body))), None)
    return body


@pytest.fixture(scope="module")
def url():
    engine = tiny_text_engine(head="repeat", context=512)
    with running_server(create_app(engine, model_id=MODEL)) as base:
        yield base


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and error["message"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=chat_bodies(), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_generated_requests_never_get_a_500(url, body, path):
    if path == "/v1/completions":
        body = {**{k: v for k, v in body.items() if k != "messages"}, "prompt": body.get("prompt", "hi")}
    with httpx.Client(timeout=30) as http:
        r = http.post(url + path, content=json.dumps(body, allow_nan=True),
                      headers={"content-type": "application/json"})
        _check(r)
        after = http.post(url + "/v1/chat/completions", json=VALID)
        assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] is not None


tool_like = st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]), "name": st.text(max_size=6),
                                   "function": values, "input_schema": values, "parameters": values})


@st.composite
def route_bodies(draw, path: str):
    body = {"model": MODEL, "max_tokens": 4, "max_output_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "input": "hi", "temperature": 0}
    for field in draw(st.lists(st.sampled_from(ROUTE_FIELDS[path]), max_size=4, unique=True)):
        body[field] = draw(st.lists(tool_like, max_size=2) if field == "tools" else values)
    return body


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), path=st.sampled_from(sorted(ROUTE_FIELDS)))
def test_generated_anthropic_and_responses_requests_never_get_a_500(url, data, path):
    body = data.draw(route_bodies(path))
    with httpx.Client(timeout=30) as http:
        r = http.post(url + path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            error = r.json()["error"]
            assert error["message"] and error["type"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64))
def test_garbage_bodies_are_400_in_the_openai_shape(url, raw):
    with httpx.Client(timeout=30) as http:
        r = http.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        _check(r)
        assert http.get(url + "/health").status_code == 200
