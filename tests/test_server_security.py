"""``mtplx serve``'s security promises, against the real CLI in a subprocess on 127.0.0.1 with
the real default model: the API key guards every route but /health and /metrics and never
reaches a log; bodies and header blocks have size limits; an exposed host needs a key; no
request field makes the server open a file.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import stat
import subprocess
import sys
import time
from contextlib import ExitStack

import httpx
import openai
import pytest

from mtplx.cli import build_parser
from mtplx.server.security import HEAD_BUFFER_BYTES, MAX_HEAD_BYTES as MAX_HEADER_BYTES
from mtplx.server.security import DEFAULT_MAX_BODY_BYTES, MIB
from tests.serve_process import COUNTING, MODEL, ServeProcess, serve_env, wait_until

pytestmark = pytest.mark.slow

FILE_KEY = "file-key-7c1f0e2a9b"  # in the config file, overridden by the environment's
KEY = "env-key-4d8b36e1f5"  # MTPLX_API_KEY: the one in force
BODY_LIMIT_MB = 1
MAX_QUEUE = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_gguf):
    tmp = tmp_path_factory.mktemp("secured")
    (tmp / "config.toml").write_text(f'api_key = "{FILE_KEY}"\n')
    served = ServeProcess(tmp, "--max-body-mb", str(BODY_LIMIT_MB), "--max-queue", str(MAX_QUEUE),
                          "--log-level", "debug", env={"MTPLX_API_KEY": KEY}).wait_ready()
    yield served
    served.proc.terminate()
    served.wait_exit(30)


def with_key(**headers) -> dict:
    return {"Authorization": f"Bearer {KEY}", **headers}


def assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401, (response.request.url, response.text)
    if response.request.url.path.startswith("/v1/messages"):  # Anthropic's error shape
        assert response.json()["error"]["type"] == "authentication_error"
    else:
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"


def test_every_route_but_health_and_metrics_needs_the_key(server):
    schema = httpx.get(f"{server.url}/openapi.json", headers=with_key()).json()
    routes = [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops]
    v1 = [r for r in routes if r[1].startswith("/v1/")]
    assert {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
            ("GET", "/v1/mtplx/snapshot")} <= set(v1)
    for method, path in v1 + [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/v1/no-such-route")]:
        url = f"{server.url}{path}"
        assert_401(httpx.request(method, url))
        assert_401(httpx.request(method, url, headers={"Authorization": f"Bearer {FILE_KEY}"}))  # overridden
        assert_401(httpx.request(method, url, headers={"Authorization": f"Bearer {KEY}x"}))
        assert_401(httpx.request(method, url, headers={"Authorization": f"Basic {KEY}"}))
        assert_401(httpx.request(method, url, headers={"X-API-Key": KEY[:-1]}))
        for good in (with_key(), {"X-API-Key": KEY}, {"Authorization": "Bearer wrong", "X-API-Key": KEY}):
            # past the key check: a GET answers, a POST without a body is a 400, an unknown route a 404
            # (read as a stream: the dashboard's live stream never ends by itself)
            with httpx.stream(method, url, headers=good) as response:
                assert response.status_code in (200, 400, 404)
    for path in ("/health", "/metrics"):
        assert httpx.get(f"{server.url}{path}").status_code == 200


def test_the_key_is_checked_before_the_body_is_read(server):
    # a client without the key cannot make the server parse (or even read) anything
    bad_json = httpx.post(f"{server.url}/v1/completions", content=b"{not json")
    assert_401(bad_json)
    too_big = httpx.post(f"{server.url}/v1/completions", content=b"x" * (BODY_LIMIT_MB * MIB + 1))
    assert_401(too_big)


def test_the_official_client_works_with_the_key(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=0)
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=FILE_KEY, max_retries=0).models.list()


def test_the_key_never_reaches_the_logs(server):
    # every way of offering keys, right and wrong (a wrong key that contains the right one included)
    for headers in (with_key(), {"X-API-Key": KEY}, {"Authorization": f"Bearer {KEY}{KEY}"},
                    {"X-API-Key": f"x{KEY}"}, {"Authorization": f"Bearer {FILE_KEY}"}):
        httpx.get(f"{server.url}/v1/models", headers=headers)
        httpx.post(f"{server.url}/v1/completions", headers=headers, json={"model": MODEL, "prompt": 5})
    time.sleep(0.5)  # the access log lines of those requests
    log = server.output
    assert '"GET /v1/models HTTP/1.1" 401' in log and '"GET /v1/models HTTP/1.1" 200' in log  # it is logging
    assert KEY not in log and FILE_KEY not in log


def test_a_body_over_the_limit_is_413(server):
    limit = BODY_LIMIT_MB * MIB
    url = f"{server.url}/v1/completions"
    headers = with_key(**{"Content-Type": "application/json"})
    at_limit = httpx.post(url, content=b"x" * limit, headers=headers)  # read in full, then refused as JSON
    assert at_limit.status_code == 400
    over = httpx.post(url, content=b"x" * (limit + 1), headers=headers)  # refused by its Content-Length
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"
    streamed = httpx.post(url, content=iter([b"x" * limit, b"x"]), headers=headers)  # chunked: counted as it comes
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"


def test_the_default_body_limit_is_16_mib():
    args = build_parser().parse_args(["serve"])
    assert args.max_body_mb * MIB == DEFAULT_MAX_BODY_BYTES == 16 * MIB


def test_requests_beyond_max_queue_get_503_with_retry_after(server):
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, headers=with_key(), timeout=30) as client, ExitStack() as streams:
        def open_stream() -> None:
            assert streams.enter_context(client.stream("POST", "/v1/completions", json=body)).status_code == 200

        open_stream()
        wait_until(lambda: server.health()["active_requests"] == 1)  # serial: it runs, the next ones wait
        for _ in range(MAX_QUEUE):
            open_stream()
        assert server.health()["queue_depth"] == MAX_QUEUE
        full = client.post("/v1/completions", json={**body, "stream": False})
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
    # the streams' clients left: their jobs are cancelled
    wait_until(lambda: server.health()["queue_depth"] == server.health()["active_requests"] == 0)


def test_max_queue_is_also_spelled_max_queued_requests():
    parse = build_parser().parse_args
    assert parse(["serve", "--max-queue", "5"]).max_queued_requests == "5"
    assert parse(["serve", "--max-queued-requests", "5"]).max_queued_requests == "5"


def raw_exchange(port: int, head: bytes, pace: int = 1024) -> bytes:
    """Send ``head`` in ``pace``-byte pieces, stopping once the server answers; return all it
    sent until it closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for i in range(0, len(head), pace):
            sock.sendall(head[i:i + pace])
            if select.select([sock], [], [], 0.005)[0]:
                break  # the server answered early: it refused the head
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply


def test_a_header_block_over_the_limit_is_refused(server):
    def request(header_bytes: int) -> bytes:
        return (b"GET /v1/models HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
                b"Authorization: Bearer " + KEY.encode() + b"\r\nX-Padding: " + b"p" * header_bytes + b"\r\n\r\n")

    assert raw_exchange(server.port, request(MAX_HEADER_BYTES // 2)).startswith(b"HTTP/1.1 200")
    # a head sent in 1 KiB pieces reaches the size check whole: the API's 431, naming the limit
    refused = raw_exchange(server.port, request(4 * MAX_HEADER_BYTES))
    assert refused.startswith(b"HTTP/1.1 431") and f"limit of {MAX_HEADER_BYTES} bytes".encode() in refused
    # past the HTTP layer's buffer for a head still arriving, h11 refuses it itself
    refused = raw_exchange(server.port, request(2 * HEAD_BUFFER_BYTES), pace=64 * 1024)
    assert refused.startswith(b"HTTP/1.1 400") and refused.endswith(b"Invalid HTTP request received.")


def test_no_request_field_makes_the_server_open_a_file(server, tmp_path, default_gguf):
    # A FIFO: if the server ever opened it for reading it would block there (and the request
    # hang), and a writer could then open it; with no reader, opening it for writing fails (ENXIO).
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)

    def has_reader() -> bool:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:
            assert exc.errno == errno.ENXIO
            return False
        return True

    paths = [str(fifo), str(default_gguf), str(default_gguf.parent), "../../../../etc/passwd", f"file://{fifo}"]
    url = f"{server.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "Hi"}]
    for path in paths:
        r = httpx.post(url, headers=with_key(), timeout=10,
                       json={"model": path, "messages": messages, "max_tokens": 1})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # every other place a path could hide: fields we ignore, stop strings, the message itself
    extras = {name: str(fifo) for name in ("head", "tokenizer", "chat_template", "lora", "adapter", "user",
                                           "model_path", "response_format_file")}
    r = httpx.post(url, headers=with_key(), timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": str(fifo)}], "max_tokens": 1,
                         "stop": [str(fifo)], **extras})
    assert r.status_code == 200
    models = httpx.get(f"{server.url}/v1/models", headers=with_key()).json()["data"]
    assert [m["id"] for m in models] == [MODEL]  # nothing else was loaded
    assert stat.S_ISFIFO(fifo.stat().st_mode) and not has_reader()


def test_an_exposed_host_without_a_key_is_refused_before_loading(tmp_path):
    # the model path does not exist: had serve loaded it first, the error would be about it
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "mtplx.cli", "serve", "--host", "0.0.0.0",
                             "--model", str(tmp_path / "no-such-model")],
                            env=serve_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    [line] = result.stderr.splitlines()
    assert line.startswith("mtplx serve: error: --host 0.0.0.0 exposes the server beyond this machine; set --api-key")
    assert time.monotonic() - started < 30
