"""From a validated engine request to an HTTP response: submit a job, relay its events.

Events cross from the model thread to the event loop with ``call_soon_threadsafe``. A client
that goes away cancels its job the moment the server sees the connection close (a stream:
Starlette stops the body and the job is cancelled; a whole response: a watcher waits for the
ASGI ``http.disconnect``); the scheduler stops it at the next cycle boundary and frees its KV
blocks. The job's request id is the response's ``id``, so a failed request's log line and the
500 its client gets name the same request.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from mtplx.batching.job import Delta, Done, Failed, Job
from mtplx.batching.queue import SchedulerStopped
from mtplx.batching.scheduler import Scheduler
from mtplx.cache.block_manager import OutOfBlocks
from mtplx.engine.llm_engine import Request as EngineRequest
from mtplx.errors import InvalidParameter, MtplxError
from mtplx.server.errors import RETRY_AFTER_S, APIError, error_body
from mtplx.server.protocol import ResponseShape, usage


def submit(scheduler: Scheduler, request: EngineRequest, request_id: str,
           deltas: bool = True) -> tuple[Job, asyncio.Queue]:
    """Queue a job for ``request``; its events (without the Deltas when ``deltas`` is False)
    arrive on the returned asyncio queue."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(event) -> None:
        if not deltas and isinstance(event, Delta):
            return
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    job = Job(request, emit, request_id=request_id)
    scheduler.submit(job)  # QueueFull becomes a 503 in server/errors.py
    return job, events


async def whole_response(http: Request, scheduler: Scheduler, request: EngineRequest, shape: ResponseShape):
    job, events = submit(scheduler, request, shape.id, deltas=False)
    ended = asyncio.ensure_future(events.get())  # Done or Failed
    gone = asyncio.ensure_future(_client_gone(http))
    try:
        await asyncio.wait((ended, gone), return_when=asyncio.FIRST_COMPLETED)
        if not ended.done():  # nobody will read this response
            return JSONResponse(error_body("client disconnected", "invalid_request_error"), 499)
        event = ended.result()
        if isinstance(event, Failed):
            raise _as_api_error(event.error, job.request_id)
        return JSONResponse(shape.whole(event.result))
    finally:
        job.cancel()  # the client left (or an error): stop at the next cycle boundary; no effect once ended
        ended.cancel()
        gone.cancel()


async def _client_gone(http: Request) -> None:
    """Return when the client disconnects. The body has been read, so the next ASGI message
    is ``http.disconnect`` (sent when the connection closes)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def stream_response(scheduler: Scheduler, request: EngineRequest, shape: ResponseShape,
                    include_usage: bool) -> StreamingResponse:
    job, events = submit(scheduler, request, shape.id)
    # The background task also cancels a job whose stream never started (client gone first).
    return StreamingResponse(_sse(job, events, shape, include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(job.cancel))


async def _sse(job: Job, events: asyncio.Queue, shape: ResponseShape, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks: a role chunk (chat), content chunks, a finish chunk, the usage chunk when
    asked for, then [DONE]. The last chunk before [DONE] carries ``usage`` and ``mtplx_stats``."""
    try:
        if shape.chat:
            yield _data(shape.chunk("", role=True))
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                if event.text or shape.return_token_ids:
                    yield _data(shape.chunk(event.text, event.token_ids))
            elif isinstance(event, Done):
                result = event.result
                if include_usage:
                    yield _data(shape.chunk(None if shape.chat else "", [], result.finish_reason))
                    yield _data(shape.usage_chunk(result))
                else:
                    yield _data(shape.chunk(None if shape.chat else "", [], result.finish_reason,
                                            usage=usage(result), mtplx_stats=result.stats))
                break
            elif isinstance(event, Failed):
                err = _as_api_error(event.error, job.request_id)
                yield _data(error_body(err.message, err.type, err.param, err.code))
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # the client went away (or we are done): stop at the next cycle boundary


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _as_api_error(error: BaseException, request_id: str) -> APIError:
    """The response for a job that failed: 400 for the client's mistakes, 503 for capacity or
    shutdown, else a 500 ``server_error`` naming the request (its log line names it too)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidParameter):
        return APIError(400, str(error), param=error.param, code="invalid_value")
    if isinstance(error, (OutOfBlocks, SchedulerStopped)):  # capacity, not the client's fault
        return APIError(503, str(error), code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(error, MtplxError):
        return APIError(400, str(error))
    return APIError(500, f"internal error in request {request_id}: {type(error).__name__}: {error}",
                    type="server_error", code="internal_error")
