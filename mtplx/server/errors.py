"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from mtplx.batching.queue import QueueFull, SchedulerStopped
from mtplx.errors import InvalidParameter, MtplxError

log = logging.getLogger("mtplx.server")

RETRY_AFTER_S = 1  # what a client told "queue full" should wait before retrying

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}


class APIError(Exception):
    """An error response: HTTP status, message, and the OpenAI ``type`` / ``param`` / ``code``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status,
                            headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request body")
        return APIError(400, message, param=param, code="invalid_value").response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            return APIError(404, message, code="not_found").response()
        code = {405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    @app.exception_handler(InvalidParameter)
    async def _param(request: Request, exc: InvalidParameter):
        return APIError(400, str(exc), param=exc.param, code="invalid_value").response()

    @app.exception_handler(QueueFull)
    async def _full(request: Request, exc: QueueFull):
        return APIError(503, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}).response()

    @app.exception_handler(SchedulerStopped)
    async def _stopping(request: Request, exc: SchedulerStopped):  # draining: not the client's fault
        return APIError(503, str(exc), code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}).response()

    @app.exception_handler(MtplxError)
    async def _user(request: Request, exc: MtplxError):
        return APIError(400, str(exc)).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()
