"""Starting and stopping ``mtplx serve``: the listening socket and the graceful drain.

``listen`` claims the port before the model loads, so a port in use fails in a second.
``DrainingServer`` is uvicorn's server with mtplx's shutdown. On SIGINT or SIGTERM it:
1. stops admitting: a request that reaches a handler from now on gets 503 ``unavailable``;
2. closes the listener (new connections are refused) and idle keep-alive connections;
3. lets in-flight requests (queued or running) finish for up to ``grace_s`` seconds;
4. fails the jobs still unfinished with ``SchedulerStopped``: a stream ends with a
   ``data: {"error": ...}`` event and ``data: [DONE]``, a whole response is a 503;
5. gives their handlers ``FLUSH_S`` seconds to send that, then stops the scheduler;
and the process exits 0. A second SIGINT skips the waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import threading

import uvicorn

from mtplx.batching.queue import SchedulerStopped
from mtplx.batching.scheduler import Scheduler
from mtplx.errors import MtplxError
from mtplx.server.security import HEAD_BUFFER_BYTES  # heads up to it reach HeadSizeLimit whole

log = logging.getLogger("uvicorn.error")  # uvicorn configures it: our lines follow --log-level

DEFAULT_SHUTDOWN_GRACE_S = 10.0
FLUSH_S = 2.0  # after the cut-off: time for handlers to send their final error before uvicorn cancels them
BACKLOG = 2048  # uvicorn's default
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``, or an MtplxError saying why not (one line)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise MtplxError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait out TIME_WAIT
    try:
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        hint = "; another process is using it (choose another --port)" if exc.errno == errno.EADDRINUSE else ""
        raise MtplxError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    return sock


def uvicorn_config(app, log_level: str) -> uvicorn.Config:
    """h11 even when httptools is installed: its buffer for a head is the one we set. No
    WebSockets: every request is an HTTP request, which the API key middleware checks."""
    return uvicorn.Config(app, log_level=log_level, http="h11", ws="none",
                          h11_max_incomplete_event_size=HEAD_BUFFER_BYTES, timeout_graceful_shutdown=FLUSH_S)


class DrainingServer(uvicorn.Server):
    """uvicorn's server draining ``scheduler`` for ``grace_s`` seconds on SIGINT/SIGTERM."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace_s: float = DEFAULT_SHUTDOWN_GRACE_S):
        super().__init__(config)
        self.scheduler, self.grace_s = scheduler, grace_s
        self.cut_off = 0  # jobs failed at the end of the grace period
        self.failure: BaseException | None = None  # why the engine cannot go on (``abort``)

    def abort(self, error: BaseException) -> None:
        """The engine cannot go on (a tensor-parallel rank died): fail every unfinished request
        with ``error`` (a 500), refuse new ones and shut down; ``mtplx serve`` then exits
        non-zero. Called from the watchdog's thread."""
        self.failure = error
        self.scheduler.cut_off(error)
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        self.scheduler.stop_admitting()  # at once, not at uvicorn's next 0.1 s tick
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, minus re-raising the signal once shut down (uvicorn >= 0.29 does, which
        would end a cleanly drained process by that signal instead of with exit code 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        """Steps 1-5 of the module docstring (uvicorn's own shutdown does the last one)."""
        self.scheduler.stop_admitting()
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle ones close now, busy ones after their response
        await self._drain()
        await super().shutdown(sockets)  # waits FLUSH_S for the cut-off handlers, then the lifespan stops the scheduler

    async def _drain(self) -> None:
        """Wait until every connection has closed (each in-flight request answered), ``grace_s``
        seconds pass or a second Ctrl+C comes; then cut off the jobs left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        if self.server_state.connections:
            log.info("Draining %d connection(s) for up to %g s", len(self.server_state.connections), self.grace_s)
        while self.server_state.connections and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.cut_off = self.scheduler.cut_off(SchedulerStopped(
            f"the server shut down before this request finished (shutdown grace period {self.grace_s:g} s)"))
        if self.cut_off:
            log.warning("Cut off %d unfinished request(s) after the %g s shutdown grace period",
                        self.cut_off, self.grace_s)
