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
from typing import AsyncIterator, Callable, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from mtplx.batching.job import Delta, Done, Failed, Job, JobResult
from mtplx.batching.queue import SchedulerStopped
from mtplx.batching.scheduler import Scheduler
from mtplx.cache.block_manager import OutOfBlocks
from mtplx.engine.llm_engine import Request as EngineRequest
from mtplx.errors import InvalidParameter, MtplxError
from mtplx.server.errors import RETRY_AFTER_S, APIError, error_body


def submit(scheduler: Scheduler, request: EngineRequest, request_id: str, events: asyncio.Queue,
           index: int = 0, deltas: bool = True, choices: int = 1, group: str = "") -> Job:
    """Queue a job for ``request``; its events (without the Deltas when ``deltas`` is False)
    arrive on ``events`` as ``(index, event)``."""
    loop = asyncio.get_running_loop()

    def emit(event) -> None:
        if not deltas and isinstance(event, Delta):
            return
        try:
            loop.call_soon_threadsafe(events.put_nowait, (index, event))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    job = Job(request, emit, request_id=request_id, choice=index, choices=choices, group=group or request_id)
    scheduler.submit(job)  # QueueFull becomes a 503 in server/errors.py
    return job


def submit_all(scheduler: Scheduler, requests: list[EngineRequest], request_id: str,
               deltas: bool = True) -> tuple[list[Job], asyncio.Queue]:
    """One job per request (n completions), request ids ``request_id``, ``request_id-1``, ...;
    if one cannot be queued, those already queued are cancelled."""
    events: asyncio.Queue = asyncio.Queue()
    jobs: list[Job] = []
    try:
        for i, request in enumerate(requests):
            jobs.append(submit(scheduler, request, request_id if i == 0 else f"{request_id}-{i}", events, i, deltas,
                               len(requests), request_id))
    except BaseException:
        for job in jobs:
            job.cancel()
        raise
    return jobs, events


async def whole_results(http: Request, scheduler: Scheduler, requests: list[EngineRequest],
                        request_id: str) -> list[JobResult] | None:
    """Run the requests to the end; their results in order, or None if the client left first.
    A failed job raises its APIError (the others are cancelled)."""
    jobs, events = submit_all(scheduler, requests, request_id, deltas=False)
    results: dict[int, JobResult] = {}
    gone = asyncio.ensure_future(_client_gone(http))
    try:
        while len(results) < len(jobs):
            ended = asyncio.ensure_future(events.get())  # Done or Failed
            await asyncio.wait((ended, gone), return_when=asyncio.FIRST_COMPLETED)
            if not ended.done():  # nobody will read this response
                ended.cancel()
                return None
            index, event = ended.result()
            if isinstance(event, Failed):
                raise _as_api_error(event.error, jobs[index].request_id)
            results[index] = event.result
        return [results[i] for i in range(len(jobs))]
    finally:
        for job in jobs:  # the client left (or an error): stop at the next cycle boundary; no effect once ended
            job.cancel()
        gone.cancel()


async def whole_response(http: Request, scheduler: Scheduler, requests: list[EngineRequest], request_id: str,
                         build: Callable[[list[JobResult]], dict]) -> JSONResponse:
    results = await whole_results(http, scheduler, requests, request_id)
    if results is None:
        return JSONResponse(error_body("client disconnected", "invalid_request_error"), 499)
    return JSONResponse(build(results))


async def _client_gone(http: Request) -> None:
    """Return when the client disconnects. The body has been read, so the next ASGI message
    is ``http.disconnect`` (sent when the connection closes)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


class StreamEncoder(Protocol):
    """Turns job events into SSE text for one protocol (OpenAI, Anthropic, Responses)."""

    def start(self) -> list[str]: ...

    def delta(self, index: int, event: Delta) -> list[str]: ...

    def done(self, index: int, result: JobResult) -> list[str]: ...

    def end(self) -> list[str]: ...

    def error(self, error: APIError) -> list[str]: ...


def stream_response(scheduler: Scheduler, requests: list[EngineRequest], request_id: str,
                    encoder: StreamEncoder) -> StreamingResponse:
    jobs, events = submit_all(scheduler, requests, request_id)

    def cancel_all() -> None:
        for job in jobs:
            job.cancel()

    # The background task also cancels jobs whose stream never started (client gone first).
    return StreamingResponse(_relay(jobs, events, encoder), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(cancel_all))


async def _relay(jobs: list[Job], events: asyncio.Queue, encoder: StreamEncoder) -> AsyncIterator[str]:
    """The encoder's start, each job's deltas and end as they come, then the encoder's end;
    a failed job ends the stream with the encoder's error event."""
    try:
        for line in encoder.start():
            yield line
        pending = len(jobs)
        while pending:
            index, event = await events.get()
            if isinstance(event, Delta):
                lines = encoder.delta(index, event)
            elif isinstance(event, Done):
                pending -= 1
                lines = encoder.done(index, event.result)
            else:
                for line in encoder.error(_as_api_error(event.error, jobs[index].request_id)):
                    yield line
                return
            for line in lines:
                yield line
        for line in encoder.end():
            yield line
    finally:
        for job in jobs:
            job.cancel()  # the client went away (or we are done): stop at the next cycle boundary


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
