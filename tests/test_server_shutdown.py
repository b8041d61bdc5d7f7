"""Starting and stopping ``mtplx serve`` as an operator does: the real CLI in a subprocess on
127.0.0.1, the real default model, real SIGINT / SIGTERM while requests are in flight.

The promise (docs/server.md, "Shutdown"): a signal stops admission at once and closes the
listener; requests in flight get ``--shutdown-grace-s`` seconds to finish; the ones still
unfinished then end with an error (an SSE ``data: {"error": ...}`` event and ``[DONE]``, or a
503 body); the process exits 0.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from mtplx.server.lifecycle import FLUSH_S
from tests.serve_process import COUNTING, MODEL, serve_env, wait_until

pytestmark = pytest.mark.slow


class Stream(threading.Thread):
    """A streamed /v1/completions request in a thread: ``events`` are (time, payload) with the
    payload a dict or "[DONE]"; ``texting`` is set once a chunk with text arrives."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list[tuple[float, dict | str]] = []
        self.texting = threading.Event()
        self.start()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": COUNTING, "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    payload = data if data == "[DONE]" else json.loads(data)
                    self.events.append((time.monotonic(), payload))
                    if isinstance(payload, dict) and any(c.get("text") for c in payload.get("choices", [])):
                        self.texting.set()

    def payloads(self) -> list:
        return [p for _, p in self.events]


class Whole(threading.Thread):
    """A non-streamed /v1/completions request in a thread; ``response`` and the time it was
    ``answered`` once it returns."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.response: httpx.Response | None = None
        self.answered: float | None = None
        self.start()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": COUNTING, "max_tokens": self.max_tokens, "temperature": 0}
        self.response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)
        self.answered = time.monotonic()


def assert_shutdown_error(error: dict) -> None:
    assert error["type"] == "server_error" and error["code"] == "unavailable"
    assert "shut down" in error["message"]


def test_sigterm_finishes_short_streams_and_ends_long_ones_with_an_error_event(serve):
    grace = 3.0
    server = serve("--scheduler-mode", "ar_batch", "--shutdown-grace-s", str(grace), "--log-level", "info")
    server.wait_ready()
    long = Stream(server.url, max_tokens=4000)
    assert long.texting.wait(30)
    short = Stream(server.url, max_tokens=4)  # decoded beside the long one (ar_batch)
    assert short.texting.wait(30)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)

    time.sleep(0.5)  # uvicorn notices the signal within 0.1 s
    with pytest.raises(httpx.ConnectError):  # the listener is closed: new clients are refused
        httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=5)

    short.join(30)
    *chunks, finish, done = short.payloads()
    assert done == "[DONE]" and finish["choices"][0]["finish_reason"] == "length"
    assert finish["usage"]["completion_tokens"] == 4 and not any("error" in c for c in chunks)
    assert short.events[-1][0] - signalled < grace  # it finished inside the grace period

    long.join(30)
    *chunks, error, done = long.payloads()
    assert done == "[DONE]"
    assert_shutdown_error(error["error"])
    assert any(c.get("choices") and c["choices"][0]["text"] for c in chunks)  # it was generating
    assert long.events[-2][0] - signalled >= grace * 0.95  # cut off only once the grace period ran out

    assert server.wait_exit(grace + FLUSH_S + 15) == 0  # (TimeoutExpired if it hangs)
    assert "Cut off 1 unfinished request(s)" in server.output and "Traceback" not in server.output


def test_sigint_answers_503_to_cut_off_whole_responses_and_to_requests_arriving_while_draining(serve):
    grace = 1.0
    server = serve("--shutdown-grace-s", str(grace), "--log-level", "warning").wait_ready()  # serial
    # a request whose body is still arriving when the signal comes: its handler runs during the drain
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
    late = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    late.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
    running = Whole(server.url, max_tokens=4000)
    wait_until(lambda: server.health()["active_requests"] == 1)  # (the server has read the late head by now)
    queued = Whole(server.url, max_tokens=4)  # serial: it waits behind the running one
    wait_until(lambda: server.health()["queue_depth"] == 1)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGINT)

    time.sleep(0.5)
    late.sendall(body[10:])
    status_line, headers, payload = read_response(late)
    assert status_line.startswith(b"HTTP/1.1 503")
    assert headers[b"retry-after"] == b"1"
    error = json.loads(payload)["error"]
    assert error["code"] == "unavailable" and "shutting down" in error["message"]

    for request in (running, queued):
        request.join(30)
        assert request.response.status_code == 503
        assert_shutdown_error(request.response.json()["error"])
    assert running.answered - signalled >= grace * 0.95  # cut off only once the grace period ran out
    assert server.wait_exit(grace + FLUSH_S + 15) == 0
    assert "Traceback" not in server.output


def read_response(sock: socket.socket) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """Status line, headers (lower-case names) and body of one HTTP/1.1 response with a
    Content-Length, read from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a whole response head: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status_line, *header_lines = head.split(b"\r\n")
    headers = {name.strip().lower(): value.strip() for name, value in (h.split(b":", 1) for h in header_lines)}
    while len(body) < int(headers[b"content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the whole body"
        body += chunk
    return status_line, headers, body


def test_a_port_in_use_fails_at_once_with_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a model path that does not exist: had serve loaded the model before binding, the error would name it
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "mtplx.cli", "serve", "--port", str(port),
                                 "--model", str(tmp_path / "no-such-model")],
                                env=serve_env(tmp_path),
                                capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert result.returncode != 0
    [line] = result.stderr.splitlines()
    assert line == (f"mtplx serve: error: cannot listen on 127.0.0.1:{port}: Address already in use; "
                    "another process is using it (choose another --port)")
    assert took < 30  # interpreter start and imports only (the default model takes longer to load)
