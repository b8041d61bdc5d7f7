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

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          431: "invalid_request_error", 503: "server_error"}


ANTHROPIC_PATHS = ("/v1/messages",)  # routes answering in Anthropic's error shape
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                   429: "rate_limit_error", 431: "invalid_request_error", 503: "overloaded_error"}


def anthropic_type(status: int) -> str:
    return ANTHROPIC_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


class APIError(Exception):
    """An error response: HTTP status, message, and the OpenAI ``type`` / ``param`` / ``code``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers

    def response(self, path: str = "") -> JSONResponse:
        """The error response; in Anthropic's shape on the Anthropic routes."""
        return JSONResponse(error_body(self.message, self.type, self.param, self.code, path, self.status),
                            self.status, headers=self.headers)


def bad_param(param: str, message: str, code: str = "invalid_value") -> APIError:
    """A 400 naming ``param``: its message starts with the parameter's path."""
    return APIError(400, f"{param}: {message}", param=param, code=code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None, path: str = "",
               status: int = 400) -> dict:
    """OpenAI's ``{"error": {message, type, param, code}}``, or on an Anthropic route (``path``)
    Anthropic's ``{"type": "error", "error": {type, message}}``."""
    if is_anthropic(path):
        return {"type": "error", "error": {"type": anthropic_type(status), "message": message}}
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# pydantic's names for the members of a union, as a reader would say them
_UNION_MEMBERS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
                  "list[str]": "a list of strings", "list[int]": "a list of integers",
                  "list[list[int]]": "a list of lists of integers", "list[dict[any,any]]": "a list of objects",
                  "dict[any,any]": "an object"}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """The message and ``param`` of a 400 for a body that failed validation: the first error's
    place in the body (``messages.0.content``) and what was wrong there. A field that takes one
    of several shapes (``stop``: a string or a list of strings) is named with the shapes it takes,
    not by pydantic's name for the first shape it tried (``stop.str``)."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = first.get("loc", ("body", None))[-1]
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return f"the body is not valid JSON: {reason} (at character {where})", None
    locs = [tuple(e.get("loc", ())) for e in errors]
    locs = [l[1:] if l[:1] == ("body",) else l for l in locs]
    loc = locs[0]
    if not loc:
        return f"the body must be a JSON object ({first.get('msg', 'invalid value')})", None
    for cut in range(len(loc) - 1, 0, -1):  # the innermost place where a union's shapes were tried
        shapes = [l[cut] for l in locs if len(l) > cut and l[:cut] == loc[:cut] and _is_shape(l[cut])]
        shapes = list(dict.fromkeys(shapes))
        if _is_shape(loc[cut]) and len(shapes) > 1:
            param = ".".join(str(x) for x in loc[:cut])
            said = [_UNION_MEMBERS.get(t.replace(" ", ""), _literal(t)) for t in shapes]
            return f"{param}: expected {', '.join(said[:-1])} or {said[-1]}", param
    param = ".".join(str(x) for x in loc)
    return f"{param}: {first.get('msg', 'invalid value')}", param


def _is_shape(part) -> bool:
    """Whether a place in pydantic's error location names one of a union's shapes (``str``,
    ``list[str]``, ``literal['auto']``) rather than a field or a list index."""
    return isinstance(part, str) and (part.replace(" ", "") in _UNION_MEMBERS or "[" in part)


def _literal(tag: str) -> str:
    """``literal['auto']`` -> ``'auto'``; other tags as pydantic wrote them."""
    return tag[len("literal["):-1] if tag.startswith("literal[") and tag.endswith("]") else tag


def _is_json(content_type: str) -> bool:
    """Whether a body of this content-type is read as JSON: application/json or application/*+json
    (FastAPI's rule; text/json is not)."""
    kind = content_type.split(";")[0].strip().lower()
    main, _, sub = kind.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        kind = request.headers.get("content-type", "")
        if param is None and not _is_json(kind):  # the body was not read as JSON at all
            message = (f"the body must be JSON sent with content-type: application/json (this request's content-type "
                       f"is {kind or 'missing'!r}; curl -d sends application/x-www-form-urlencoded: add "
                       "-H 'content-type: application/json')")
        return APIError(400, message, param=param, code="invalid_value").response(request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            return APIError(404, message, code="not_found").response(request.url.path)
        code = {405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large"}.get(exc.status_code)
        error = APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers)
        return error.response(request.url.path)

    @app.exception_handler(InvalidParameter)
    async def _param(request: Request, exc: InvalidParameter):
        return APIError(400, str(exc), param=exc.param, code="invalid_value").response(request.url.path)

    @app.exception_handler(QueueFull)
    async def _full(request: Request, exc: QueueFull):
        error = APIError(503, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        return error.response(request.url.path)

    @app.exception_handler(SchedulerStopped)
    async def _stopping(request: Request, exc: SchedulerStopped):  # draining: not the client's fault
        error = APIError(503, str(exc), code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
        return error.response(request.url.path)

    @app.exception_handler(MtplxError)
    async def _user(request: Request, exc: MtplxError):
        return APIError(400, str(exc)).response(request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response(request.url.path)
