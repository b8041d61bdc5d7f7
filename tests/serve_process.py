"""``mtplx serve`` as an operator starts it, for the server tests (no tests here): the real CLI
in a subprocess on a free 127.0.0.1 port, its config isolated in a temporary directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
# greedy SmolLM2 keeps counting well past 200 tokens: a request that outlives any grace period
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_env(tmp_path, **extra: str) -> dict[str, str]:
    """The environment without the caller's MTPLX_* settings, the config file in ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTPLX_")}
    return {**env, "MTPLX_CONFIG": str(tmp_path / "config.toml"), **extra}


class ServeProcess:
    """``mtplx serve ARGS`` in a subprocess on a free 127.0.0.1 port (unless ARGS give one),
    its config isolated in ``tmp_path``; stdout and stderr are collected as they come."""

    def __init__(self, tmp_path, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        port_args = () if "--port" in args else ("--port", str(self.port))
        self.proc = subprocess.Popen([sys.executable, "-m", "mtplx.cli", "serve", *port_args, *args],
                                     env=serve_env(tmp_path, **(env or {})), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self._lines)

    def wait_ready(self, timeout: float = 180) -> ServeProcess:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self._reader.join(5)
                pytest.fail(f"mtplx serve exited with {self.proc.returncode}: {self.output}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"mtplx serve did not come up in {timeout} s: {self.output}")
            time.sleep(0.1)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait_exit(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
