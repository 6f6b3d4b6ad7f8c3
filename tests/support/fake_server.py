"""The part every fake upstream shares: an aiohttp low-level server on 127.0.0.1, recording,
in-flight tracking and abrupt connection aborts.

The low-level ``web.Server`` (no router) lets each fake answer unknown paths and methods the way
the real server does (Go's net/http + chi for envd) instead of aiohttp's defaults. Two server
options matter for fidelity:

- ``auto_decompress=False``: envd reads ``Content-Encoding: gzip`` upload bodies itself
  (envd ``internal/api/encoding.go getDecompressedBody``); the fake must see the raw bytes, and the
  record must count the bytes that crossed the wire.
- ``handler_cancellation=True``: when the client (or a relay) drops the connection, the handler is
  cancelled, as envd's request context is; a stream then stops at once instead of at its next
  write.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Self

from aiohttp import web

from tests.support.records import Recorder, RecordHandle, RequestRecord


class FakeServer:
    """Base of the fakes: ``async with Fake(...) as fake``, or ``start()`` and ``close()``."""

    # How long an idle kept-alive client connection stays open (aiohttp's own default).
    keepalive_timeout_s = 3630.0

    def __init__(
        self, *, host: str = "127.0.0.1", port: int = 0, keepalive_timeout_s: float | None = None
    ) -> None:
        if keepalive_timeout_s is not None:
            self.keepalive_timeout_s = keepalive_timeout_s
        self._host = host
        self._requested_port = port
        self._recorder = Recorder()
        self._live: set[asyncio.Transport] = set()
        self._runner: web.ServerRunner | None = None
        self._port: int | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> Self:
        server = web.Server(
            self._serve,
            handler_cancellation=True,
            auto_decompress=False,
            keepalive_timeout=self.keepalive_timeout_s,
        )
        # A short shutdown timeout: close() aborts live streams first, so nothing should linger.
        runner = web.ServerRunner(server, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._requested_port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        address = runner.addresses[0]
        self._port = int(address[1])
        return self

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        await self._before_close()
        self.break_streams()
        await runner.cleanup()
        await self._after_close()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _before_close(self) -> None:
        """Hook: stop background work before the listener closes."""

    async def _after_close(self) -> None:
        """Hook: release resources after the listener closed."""

    # -- addresses ------------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        assert self._port is not None, "server not started"
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    # -- records --------------------------------------------------------------------------------

    @property
    def records(self) -> list[RequestRecord]:
        """Every request that reached this fake, in arrival order."""
        return self._recorder.records

    def requests_to(self, path_prefix: str) -> list[RequestRecord]:
        """Records whose path (target without query) starts with ``path_prefix``."""
        return [r for r in self._recorder.records if r.path.startswith(path_prefix)]

    def clear_records(self) -> None:
        self._recorder.clear()

    # -- faults ---------------------------------------------------------------------------------

    @property
    def live_exchanges(self) -> int:
        """Requests being handled right now (streams included)."""
        return len(self._live)

    def break_streams(self, *, reset: bool = True) -> int:
        """End every connection with a request in flight, abruptly.

        This is what a sandbox dying mid-stream looks like to a relay: no end-of-stream frame, no
        last chunk, the connection just goes: with a TCP RST (SO_LINGER 0) by default, or with a
        plain FIN when ``reset`` is false. Returns how many connections were ended.
        """
        transports = list(self._live)
        for transport in transports:
            if reset:
                abort_with_reset(transport)
            else:
                transport.close()
        return len(transports)

    # -- serving --------------------------------------------------------------------------------

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        handle = self._recorder.begin(request)
        transport = request.transport
        if transport is not None:
            self._live.add(transport)
        try:
            response = await self._handle(request, handle)
            if isinstance(response, web.WebSocketResponse) or response.prepared:
                return response
            if _expects_continue(request) and not request.get(_CONTINUED, False):
                # Go's server (envd's): a handler that answers an Expect: 100-continue request
                # without reading its body sent no 100, so the client may be holding the body
                # back; the answer goes at once and the connection closes after it (server.go,
                # closeAfterReply) instead of waiting for a body that may never come (aiohttp
                # would linger 10 s reading it before its close).
                response.force_close()
                await response.prepare(request)
                await response.write_eof()
                if transport is not None:
                    transport.close()  # after what was written: a FIN, not a reset
                return response
            # Count what the handler left unread, as Go's server also reads (and discards)
            # the rest of a body before reusing the connection.
            await drain_body(request, handle)
            return response
        finally:
            if transport is not None:
                self._live.discard(transport)
            handle.publish()

    async def _handle(self, request: web.BaseRequest, record: RecordHandle) -> web.StreamResponse:
        """Answer one request. Read the body only through ``iter_body``/``read_body``."""
        raise NotImplementedError


def abort_with_reset(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


_CONTINUED = web.RequestKey("continued", bool)


def _expects_continue(request: web.BaseRequest) -> bool:
    return (
        request.version >= (1, 1)
        and request.headers.get("Expect", "").lower() == "100-continue"
        # Go's server only expects a body it was told of (req.ContentLength != 0).
        and (bool(request.content_length) or "Transfer-Encoding" in request.headers)
    )


async def iter_body(request: web.BaseRequest, record: RecordHandle) -> AsyncIterator[bytes]:
    """The request body as it arrives, counted into the record.

    A request that asked ``Expect: 100-continue`` gets its ``100 Continue`` when the body is
    first read, as Go's server (envd's) sends it (server.go expectContinueReader); aiohttp's
    low-level server never sends one, so a client holding its body back waited for ever.
    """
    if _expects_continue(request) and not request.get(_CONTINUED, False):
        request[_CONTINUED] = True
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's own expect handler: the head is next
    async for chunk in request.content.iter_any():
        record.feed(chunk)
        yield chunk
    record.eof()


async def read_body(request: web.BaseRequest, record: RecordHandle) -> bytes:
    return b"".join([chunk async for chunk in iter_body(request, record)])


async def drain_body(request: web.BaseRequest, record: RecordHandle) -> None:
    async for _ in iter_body(request, record):
        pass
