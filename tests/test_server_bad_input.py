"""Bad input stays bad: what an outsider throws at the server gets a 4xx naming the field (or,
for a body that never arrives, a 408 and a closed connection), never a 200 or a 500."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from mtplx.server.app import create_app
from tests.test_server_harness import running_server, tiny_text_engine

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]
BODY_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def url():
    engine = tiny_text_engine(head="repeat", context=512)
    with running_server(create_app(engine, model_id=MODEL, body_timeout_s=BODY_TIMEOUT_S)) as base:
        yield base


def post(url: str, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30)


def assert_400(response: httpx.Response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param.split(".")[-1] in error["message"] and all(w in error["message"] for w in words), error


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0, **fields}


@pytest.mark.parametrize("role", ["wizard", "bogus", "", "USER"])
def test_an_unknown_role_is_400_naming_the_message(url, role):
    r = post(url, "/v1/chat/completions", chat(messages=[*HI, {"role": role, "content": "x"}]))
    assert_400(r, "messages.1.role", "'user'", "'assistant'", "'tool'")


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_null_content_is_400_except_on_an_assistant_turn_with_tool_calls(url, role):
    extra = {"tool_call_id": "call_1"} if role == "tool" else {}
    r = post(url, "/v1/chat/completions", chat(messages=[{"role": role, "content": None, **extra}]))
    assert_400(r, "messages.0.content", "null")


def test_a_tool_message_needs_its_tool_call_id(url):
    r = post(url, "/v1/chat/completions", chat(messages=[*HI, {"role": "tool", "content": "42"}]))
    assert_400(r, "messages.1.tool_call_id")


@pytest.mark.parametrize("field, value", [("max_tokens", True), ("max_tokens", 2.5), ("max_tokens", "3"),
                                          ("max_completion_tokens", False), ("n", True), ("seed", 1.5),
                                          ("temperature", True), ("top_k", True)])
def test_numbers_are_strict_booleans_and_strings_are_not_numbers(url, field, value):
    if field == "top_k":
        assert_400(post(url, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2, field: value}),
                   field)
    else:
        assert_400(post(url, "/v1/chat/completions", chat(**{field: value})), field)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_token_limit_beyond_the_context_is_400(url, field):
    body = chat(**{field: 10**12})
    body.pop("max_tokens") if field != "max_tokens" else None
    assert_400(post(url, "/v1/chat/completions", body), field, "context is 512 tokens", "at most")
    # the largest limit that fits is served, one more is not
    room = int(post(url, "/v1/chat/completions", body).json()["error"]["message"].rsplit(" ", 1)[1])
    assert_400(post(url, "/v1/chat/completions", {**body, field: room + 1}), field)
    ok = post(url, "/v1/chat/completions", {**body, field: room})
    assert ok.status_code == 200 and 0 < ok.json()["usage"]["completion_tokens"] <= room
    assert_400(post(url, "/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 510}), "max_tokens")


def test_max_completion_tokens_is_the_newer_name_of_max_tokens(url):
    r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_completion_tokens": 3,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", '
                             b'"content": "a\\ud800b"}]}', "messages.0.content"),
    ("/v1/chat/completions", b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", '
                             b'"content": [{"type": "text", "text": "\\udfff"}]}]}', "messages.0.content.0.text"),
    ("/v1/chat/completions", b'{"model": "tiny", "max_tokens": 2, "stop": ["\\ud800"], "messages": '
                             b'[{"role": "user", "content": "hi"}]}', "stop.0"),
    ("/v1/completions", b'{"model": "tiny", "max_tokens": 2, "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/messages", b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", '
                     b'"content": "a\\ud800b"}]}', "messages.0.content"),
])
def test_a_lone_utf16_surrogate_is_400_naming_where_it_is(url, path, body, param):
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in error["message"] and "surrogate" in error["message"]
    assert (error["type"] == "invalid_request_error") and (path == "/v1/messages" or error["param"] == param)
    # a surrogate pair (an astral character) is valid text
    assert post(url, path, body.replace(b"\\ud800b", b"\\ud83d\\ude00").replace(b"\\udfff", b"x")
                .replace(b'"\\ud800"', b'"zz"')).status_code == 200


def raw(url: str, data: bytes, wait_s: float = 10) -> tuple[bytes, float]:
    """Send ``data`` in one write; return what the server sent until it closed, and how long it took."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply, time.monotonic() - start


def test_a_100_kb_head_in_pieces_is_431_too(url):
    """A head cut into reads (here two writes 50 ms apart) reaches the size check whole: 431, not
    the HTTP layer's 400 (its buffer for a head still arriving is HEAD_BUFFER_BYTES), and the
    body is read before the connection closes, so the reply arrives rather than a reset."""
    body = json.dumps(chat()).encode()
    data = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\nX-Padding: " + b"p" * 100_000 + b"\r\n\r\n" + body)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data[:40_000])
        time.sleep(0.05)
        sock.sendall(data[40_000:])
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 431") and b"16384 bytes" in reply, reply[:200]


def test_a_100_kb_head_in_one_write_is_431_and_the_connection_closes(url):
    body = json.dumps(chat()).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n")
    reply, _ = raw(url, head + b"X-Padding: " + b"p" * 100_000 + b"\r\n\r\n" + body)
    assert reply.startswith(b"HTTP/1.1 431") and b"16384 bytes" in reply  # and recv saw the close
    small, _ = raw(url, head + b"Connection: close\r\n\r\n" + body)
    assert small.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("framing", ["short content-length", "unfinished chunked"])
def test_a_body_that_never_arrives_times_out_with_408_and_a_closed_connection(url, framing):
    if framing == "short content-length":
        data = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b"Content-Length: 500\r\n\r\n" + b'{"model": "tiny"')
    else:
        data = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n10\r\n" + b'{"model": "tiny"' + b"\r\n")
    reply, took = raw(url, data)
    assert reply.startswith(b"HTTP/1.1 408") and b"stalled" in reply, reply
    assert BODY_TIMEOUT_S <= took < BODY_TIMEOUT_S + 5


@pytest.mark.parametrize("parameters, where", [
    ({"type": "objekt"}, "type"),
    ({"type": "object", "properties": {"city": {"type": 5}}}, "properties/city/type"),
    ({"type": "object", "required": "city"}, "required"),
    ("not a schema", None),
])
def test_a_tool_schema_that_is_not_json_schema_is_400(url, parameters, where):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    r = post(url, "/v1/chat/completions", chat(tools=tools))
    assert_400(r, "tools.0.function.parameters", *(("JSON Schema",) if where is None else (where,)))


@pytest.mark.parametrize("tools, tool_choice, param", [
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools.0.function.name"),
    ([{"type": "retrieval"}], None, "tools.0"),
    ("f", None, "tools"),
    ([{"type": "function", "function": {"name": "f"}}] * 2, None, "tools"),
    ([{"type": "function", "function": {"name": "f"}}], {"type": "function", "function": {"name": "g"}},
     "tool_choice"),
    ([{"type": "function", "function": {"name": "f"}}], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_and_tool_choices_are_400(url, tools, tool_choice, param):
    assert_400(post(url, "/v1/chat/completions", chat(tools=tools, tool_choice=tool_choice)), param)
