"""The API key check, the request head and body size limits, CORS for allowed origins, and the
rule for exposed hosts.

With a key set, every route needs it except ``OPEN_PATHS`` (deny by default: a route added
later is protected without anyone remembering to). The key is checked before the body is
read, so a client without it cannot make the server read or parse anything.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mtplx.errors import MtplxError
from mtplx.server.errors import error_body

MIB = 1024 * 1024
DEFAULT_MAX_BODY_BYTES = 16 * MIB  # far above any prompt a context holds; bounds one request's memory
DEFAULT_BODY_TIMEOUT_S = 30.0  # the longest wait for the next piece of a body (a stalled upload is dropped)
MAX_HEAD_BYTES = 16 * 1024  # request line + headers
# h11's buffer for a head still arriving (uvicorn's h11_max_incomplete_event_size): a head up
# to this size reaches HeadSizeLimit whole, however it is cut into reads, and gets its 431;
# beyond it h11 refuses it itself (uvicorn answers 400)
HEAD_BUFFER_BYTES = MIB
# a refused request's body read before the connection closes (see ``drain``)
DRAIN_BYTES = MIB
DRAIN_TIMEOUT_S = 1.0

# Open without a key: load balancers' health checks and Prometheus scrapers. /metrics holds
# only aggregate counters (no prompt or output text, no request ids, no keys), as in vLLM.
# The dashboard's page, script and style (server/dashboard.py) hold no data: the page asks for
# the key and sends it with every request for data. The browser must load them to ask.
PAGE_PATHS = frozenset({"/", "/dashboard", "/dashboard/app.js", "/dashboard/style.css"})
OPEN_PATHS = frozenset({"/health", "/metrics"}) | PAGE_PATHS


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None) -> None:
    """Refuse to bind a non-loopback address without an API key."""
    if not is_loopback(host) and not api_key:
        raise MtplxError(f"--host {host} exposes the server beyond this machine; set --api-key "
                         "(or MTPLX_API_KEY) so only clients holding the key can use it")


def _digest(key: bytes) -> bytes:
    # Comparing fixed-length digests keeps compare_digest's time independent of the key's length too.
    return hashlib.sha256(key).digest()


def offered_keys(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """The keys a request offers: ``Authorization: Bearer KEY`` and ``X-API-Key: KEY`` (raw bytes)."""
    keys = []
    for name, value in headers:
        name = name.lower()
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            keys.append(value[7:].strip())
        elif name == b"x-api-key":
            keys.append(value.strip())
    return keys


class RequireAPIKey:
    """ASGI middleware: with ``api_key`` set, a request to any path outside ``OPEN_PATHS``
    must offer it (see ``offered_keys``), else 401 before its body is read. The key is
    compared in constant time and never logged or echoed."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.expected = _digest(api_key.encode()) if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        # every offered key is compared (no short-circuit), each in constant time
        if sum(hmac.compare_digest(_digest(key), self.expected) for key in offered_keys(scope["headers"])):
            return await self.app(scope, receive, send)
        message = "missing or incorrect API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'"
        await send_error(send, 401, error_body(message, "invalid_request_error", None, "invalid_api_key",
                                               scope["path"], 401),
                         [(b"www-authenticate", b"Bearer")])


class CORS(CORSMiddleware):
    """Starlette's CORS middleware (``serve --allowed-origin``), with a refused preflight (an
    origin, method or header not allowed) answered in the route's error shape, as JSON, rather
    than Starlette's plain-text 400; a refused origin is named, with the option that admits it.
    Allowed preflights and CORS headers on responses are Starlette's."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            headers = Headers(scope=scope)
            if "origin" in headers and "access-control-request-method" in headers:
                response = self.preflight_response(request_headers=headers)
                if response.status_code != 200:
                    response = self._refused(response, headers["origin"], scope["path"])
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def _refused(self, response, origin: str, path: str) -> JSONResponse:
        """Starlette's refusal ("Disallowed CORS origin, method"), in the route's error shape
        and with its CORS headers."""
        message = response.body.decode()
        if not self.is_allowed_origin(origin):
            message += f": {origin!r} is not an allowed origin of this server (mtplx serve --allowed-origin)"
        kept = {k: v for k, v in response.headers.items() if k.startswith("access-control-") or k == "vary"}
        return JSONResponse(error_body(message, "invalid_request_error", None, "cors_not_allowed", path,
                                       response.status_code), response.status_code, headers=kept)


class HeadSizeLimit:
    """ASGI middleware: 431 (and the connection closed) for a request head over ``max_bytes``.
    The HTTP layer buffers a head still arriving up to ``HEAD_BUFFER_BYTES`` (the server's h11
    setting), so a head over ``max_bytes`` reaches this whole whether it came in one read or
    several (with h11's limit at ``max_bytes`` itself, a head cut into reads got h11's 400)."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_HEAD_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = head_bytes(scope)
            if size > self.max_bytes:
                message = (f"the request head (request line and headers) is {size} bytes, over the server's limit "
                           f"of {self.max_bytes} bytes")
                await drain(receive)
                return await send_error(send, 431, error_body(message, "invalid_request_error", None,
                                                              "request_header_fields_too_large", scope["path"], 431),
                                        [(b"connection", b"close")])
        await self.app(scope, receive, send)


async def drain(receive: Receive, limit: int = DRAIN_BYTES, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Read what is left of a request's body before refusing it and closing the connection (up
    to ``limit`` bytes, for at most ``timeout_s``): a socket closed with the client's bytes still
    arriving is reset by the kernel, and the client can lose the error response with it (a 431
    sent while the body of a large head was in flight arrived as 'connection reset by peer')."""
    got = 0
    try:
        async with asyncio.timeout(timeout_s):
            while got < limit:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
                got += len(message.get("body", b""))
    except TimeoutError:
        pass


def head_bytes(scope: Scope) -> int:
    """The size of an HTTP/1.1 request head as sent: request line, header lines, blank line."""
    target = len(scope.get("raw_path") or scope["path"].encode()) + (len(scope["query_string"]) + 1
                                                                       if scope.get("query_string") else 0)
    line = len(scope["method"]) + 1 + target + 1 + len(b"HTTP/1.1") + 2
    return line + sum(len(name) + 2 + len(value) + 2 for name, value in scope["headers"]) + 2


class BodySizeLimit:
    """ASGI middleware: 413 for a body over ``max_bytes`` (by Content-Length up front, else
    while the body streams in); 408 and the connection closed when the next piece of a body
    takes longer than ``timeout_s`` (a body shorter than its Content-Length, a chunked body
    that never ends)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            body = error_body(self._message(), "invalid_request_error", None, "request_too_large", scope["path"], 413)
            return await send_error(send, 413, body)
        seen, complete = 0, False

        async def limited_receive() -> Message:
            nonlocal seen, complete
            if complete:  # after the body: the wait for http.disconnect has no limit
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body stalled: no data for {self.timeout_s:g} s (the body is "
                                         "shorter than its Content-Length, or a chunked body did not end)",
                                    headers={"Connection": "close"}) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, self._message())  # FastAPI passes HTTPException through
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return (f"the request body is larger than the server's limit of {self.max_bytes} bytes "
                f"({self.max_bytes / MIB:g} MiB, set with --max-body-mb)")


async def send_error(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Send a whole JSON error response from ASGI middleware (outside FastAPI's handlers)."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})
