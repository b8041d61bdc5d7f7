"""``mtplx serve`` as a user runs it: the real CLI in a subprocess, the real default model
(SmolLM2-135M-Instruct), real text through the official client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from mtplx.loading.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(default_gguf, tmp_path_factory):
    port = free_port()
    env = {**os.environ, "MTPLX_CONFIG": str(tmp_path_factory.mktemp("cfg") / "config.toml")}
    # no --model: the default model (default_gguf makes sure it is fetched)
    proc = subprocess.Popen([sys.executable, "-m", "mtplx.cli", "serve", "--port", str(port), "--scheduler-mode", "hyper", "--log-level", "warning"],
                            env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"mtplx serve exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("mtplx serve did not come up in 180 s")
        time.sleep(0.25)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_real_chat_over_the_cli_server(served, default_gguf):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
    [card] = client.models.list().data
    assert card.id == "SmolLM2-135M-Instruct"
    r = client.chat.completions.create(model=card.id, messages=MESSAGES, max_tokens=8, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text
    tokenizer = Tokenizer.from_gguf(default_gguf)
    assert r.usage.prompt_tokens == len(tokenizer.apply_chat_template(MESSAGES))
    n = r.usage.completion_tokens
    assert 1 <= n <= 8 and r.choices[0].finish_reason == ("length" if n == 8 else "stop")
    stats = r.model_extra["mtplx_stats"]
    assert stats["generation_mode"] == ("mtp" if card.model_extra["mtp_head"] else "ar")
    assert stats["scheduler_lane"] == "serial_b1"

    streamed = client.chat.completions.create(model=card.id, messages=MESSAGES, max_tokens=8, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text

    stop = "Paris"
    cut = client.chat.completions.create(model=card.id, messages=MESSAGES, max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
