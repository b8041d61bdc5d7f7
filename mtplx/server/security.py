"""API key checks, the request body size limit, and the rule for exposed hosts."""

from __future__ import annotations

import hmac
import ipaddress
import json

from fastapi import Request
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mtplx.errors import MtplxError
from mtplx.server.errors import APIError, error_body

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


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


def api_key_dependency(api_key: str | None):
    """A FastAPI dependency accepting ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``)."""
    expected = api_key.encode() if api_key else None

    async def require_key(request: Request) -> None:
        if expected is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.strip().encode(), expected):  # constant time
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    return require_key


class BodySizeLimit:
    """ASGI middleware: 413 for a body over ``max_bytes`` (by Content-Length up front, else
    while the body streams in)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(send)
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, self._message())  # FastAPI passes HTTPException through
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"the request body is larger than the server's limit of {self.max_bytes} bytes"

    async def _reject(self, send: Send) -> None:
        body = json.dumps(error_body(self._message(), "invalid_request_error", None, "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
