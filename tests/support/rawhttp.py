"""A tiny HTTP/1.1 client over raw asyncio streams, for tests that care about bytes and timing.

Responses are framed with httptools (llhttp), so the client is strict about what relay sends;
each body chunk is stamped with its arrival time so that streaming tests can prove that data
arrived while the upstream was still producing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import httptools


@dataclass
class Response:
    status: int = 0
    reason: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    chunks: list[tuple[float, bytes]] = field(default_factory=list)
    complete: bool = False
    keep_alive: bool = False

    @property
    def body(self) -> bytes:
        return b"".join(chunk for _, chunk in self.chunks)

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        for n, v in self.headers:
            if n.lower() == key:
                return v.decode("latin-1")
        return None

    def json(self) -> object:
        import json

        return json.loads(self.body)


class _Collector:
    def __init__(self, head_request: bool) -> None:
        self.responses: list[Response] = []
        self.current = Response()
        self.head_request = head_request
        self.parser = httptools.HttpResponseParser(self)

    def on_status(self, reason: bytes) -> None:
        self.current.reason = reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.current.status = self.parser.get_status_code()
        self.current.keep_alive = self.parser.should_keep_alive()
        status = self.current.status
        if self.head_request and not (100 <= status < 200 and status != 101):
            # llhttp cannot be told a response answers HEAD; a fresh parser takes the next one
            # (Connection feeds a HEAD response's head alone, so that it gets the bytes after).
            # An interim (1xx) answer is not the HEAD's: llhttp ends it itself (found by
            # review: a 100 before it was taken for the answer, and the answer for a body).
            self._done()
            self.head_request = False
            self.parser = httptools.HttpResponseParser(self)

    def on_body(self, body: bytes) -> None:
        self.current.chunks.append((time.monotonic(), body))

    def on_message_complete(self) -> None:
        if not self.head_request or 100 <= self.current.status < 200:
            self._done()

    def _done(self) -> None:
        self.current.complete = True
        self.responses.append(self.current)
        self.current = Response()


class Connection:
    """One client connection; ``send`` raw bytes, ``read_response`` parsed answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._collector = _Collector(head_request=False)
        self._held = b""  # a HEAD response's head, until its end has arrived
        self.eof = False

    @classmethod
    async def open(cls, port: int, host: str = "127.0.0.1") -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def read_response(self, timeout: float = 5.0, *, head: bool = False) -> Response:
        """The next complete response; raises TimeoutError, or returns an incomplete one at EOF."""
        self._collector.head_request = head
        deadline = time.monotonic() + timeout
        while not self._collector.responses:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no complete response")
            if self.eof:
                return self._collector.current
            data = await asyncio.wait_for(self.reader.read(65536), remaining)
            if not data:
                self.eof = True
                held, self._held = self._held, b""
                if held:  # a HEAD answer's head cut by EOF: what there is of it (found by review)
                    self._collector.parser.feed_data(held)
                continue
            self._feed(data)
        return self._collector.responses.pop(0)

    def _feed(self, data: bytes) -> None:
        """Feed llhttp; a HEAD response's head alone, as llhttp would take the next response
        that arrives in the same read for its content (RFC 9110 §9.3.2: it has none; a test
        failed this way when relay's answer and the next one came in one read, under load)."""
        collector = self._collector
        while collector.head_request:  # (still, after an interim answer's head)
            held = self._held + data
            end = held.find(b"\r\n\r\n") + 4
            if end < 4:
                self._held = held
                return
            self._held, data = b"", held[end:]
            collector.parser.feed_data(held[:end])  # a HEAD answer's end makes a fresh parser
        if data:
            with contextlib.suppress(httptools.HttpParserUpgrade):
                collector.parser.feed_data(data)

    @property
    def partial(self) -> Response:
        """The response being received (for streaming tests)."""
        return self._collector.current

    async def pump(self, timeout: float) -> bool:
        """Read what arrives within ``timeout``; False at EOF."""
        try:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
        except TimeoutError:
            return True
        if not data:
            self.eof = True
            return False
        self._feed(data)
        return True

    async def closed_by_peer(self, timeout: float = 2.0) -> bool:
        try:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
        return data == b""

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            await self.writer.wait_closed()


def request_bytes(
    method: str,
    target: str,
    host: str,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    lines.extend(f"{n}: {v}" for n, v in headers or [])
    if body and not any(
        n.lower() in ("content-length", "transfer-encoding") for n, _ in headers or []
    ):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def request(
    port: int,
    method: str,
    target: str,
    host: str,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    timeout: float = 5.0,
) -> Response:
    conn = await Connection.open(port)
    try:
        await conn.send(request_bytes(method, target, host, headers, body))
        return await conn.read_response(timeout, head=method == "HEAD")
    finally:
        await conn.close()
