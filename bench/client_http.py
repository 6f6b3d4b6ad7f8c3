"""What the benchmark's load clients (``bench.clients``) share: the address and socket set-up,
a percentile, a minimal HTTP/1.1 response reader over httptools and the client connection that
feeds it, and a request head.

Raw asyncio protocols, no HTTP library: a client should cost as little CPU as the origin, so
that the proxy is what is measured.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import httptools

MIB = 1024 * 1024


def split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# -- a minimal HTTP/1.1 response reader ---------------------------------------------------


class Response:
    """Callbacks for httptools.HttpResponseParser; body chunks go to ``sink``."""

    def __init__(self, sink: Callable[[bytes], None] | None = None) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.sink = sink
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink(body)
        else:
            self.body += body

    def on_message_complete(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


class HttpConn(asyncio.Protocol):
    """A client connection that feeds whatever arrives to the current :class:`Response`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.can_write = asyncio.Event()
        self.can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        nodelay(transport)

    def data_received(self, data: bytes) -> None:
        if self.response is not None:
            try:
                self.response.parser.feed_data(data)
            except httptools.HttpParserError as exc:
                if not self.response.done.done():
                    self.response.done.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.can_write.set()
        if not self.lost.done():
            self.lost.set_result(None)
        if self.response is not None and not self.response.done.done():
            self.response.done.set_exception(ConnectionError("connection closed mid-response"))

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()


async def connect(address: str) -> HttpConn:
    loop = asyncio.get_running_loop()
    host, port = split(address)
    _, conn = await loop.create_connection(HttpConn, host, port)
    return conn


def head(method: str, path: str, host: str, extra: list[str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *(extra or [])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
