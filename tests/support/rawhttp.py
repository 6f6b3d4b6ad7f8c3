"""A tiny HTTP/1.1 client over raw asyncio streams, for tests that care about bytes and timing.

Responses are framed with httptools (llhttp), so the client is strict about what relay sends;
each body chunk is stamped with its arrival time so that streaming tests can prove that data
arrived while the upstream was still producing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
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


class _Sent:
    """Which of the requests sent are HEADs, in order, read off the bytes as they are sent
    (an answer to HEAD has no content, and llhttp cannot tell that from the answer alone).
    Bytes that are not HTTP (a refused request's garbage, a WebSocket's frames) end the
    record: the answers after them are read as they come, or as ``read_response(head=)``
    says."""

    def __init__(self) -> None:
        self.heads: collections.deque[bool] = collections.deque()
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.heads.append(self.parser.get_method() == b"HEAD")

    def feed(self, data: bytes) -> None:
        if self.parser is None:
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self.parser = None


class _Collector:
    def __init__(self, sent: _Sent) -> None:
        self.responses: list[Response] = []
        self.current = Response()
        self.sent = sent
        self.forced = False  # read_response(head=True): the next final answer is a HEAD's
        self.parser = httptools.HttpResponseParser(self)

    @property
    def head_request(self) -> bool:
        heads = self.sent.heads
        return self.forced or bool(heads and heads[0])

    @property
    def head_behind(self) -> bool:
        """A HEAD's answer is due after the one being read."""
        return any(itertools.islice(self.sent.heads, 1, None))

    def on_status(self, reason: bytes) -> None:
        self.current.reason = reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.current.status = self.parser.get_status_code()
        self.current.keep_alive = self.parser.should_keep_alive()
        if self.head_request and not self._interim:
            # llhttp cannot be told a response answers HEAD; a fresh parser takes the next one
            # (Connection feeds a HEAD response's head alone, so that it gets the bytes after).
            # An interim (1xx) answer is not the HEAD's: llhttp ends it itself (found by
            # review: a 100 before it was taken for the answer, and the answer for a body).
            self._done()
            self.parser = httptools.HttpResponseParser(self)

    def on_body(self, body: bytes) -> None:
        self.current.chunks.append((time.monotonic(), body))

    def on_message_complete(self) -> None:
        if not self.head_request or self._interim:
            self._done()

    @property
    def _interim(self) -> bool:
        return 100 <= self.current.status < 200 and self.current.status != 101

    def _done(self) -> None:
        if not self._interim:  # the answer to the oldest request sent
            self.forced = False
            if self.sent.heads:
                self.sent.heads.popleft()
        self.current.complete = True
        self.responses.append(self.current)
        self.current = Response()


class Connection:
    """One client connection; ``send`` raw bytes, ``read_response`` parsed answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._sent = _Sent()
        self._collector = _Collector(self._sent)
        self._held = b""  # a HEAD response's head, until its end has arrived
        self.eof = False

    @classmethod
    async def open(cls, port: int, host: str = "127.0.0.1") -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self._sent.feed(data)
        self.writer.write(data)
        await self.writer.drain()

    async def read_response(self, timeout: float = 5.0, *, head: bool = False) -> Response:
        """The next complete response; raises TimeoutError, or returns an incomplete one at EOF.
        ``head``: it answers a HEAD, whatever was sent (HEADs sent with ``send`` are known)."""
        self._collector.forced = head
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
        failed this way when relay's answer and the next one came in one read, under load).
        While a HEAD's answer is due after the current one, a byte at a time: llhttp does not
        say where an answer ended, and the HEAD's may follow in the same read."""
        collector = self._collector
        while data:
            if collector.head_request:  # (still, after an interim answer's head)
                held = self._held + data
                end = held.find(b"\r\n\r\n") + 4
                if end < 4:
                    self._held = held
                    return
                self._held, data = b"", held[end:]
                collector.parser.feed_data(held[:end])  # a HEAD answer's end: a fresh parser
                continue
            step = 1 if collector.head_behind else len(data)
            try:
                collector.parser.feed_data(data[:step])
            except httptools.HttpParserUpgrade:
                return  # what follows a 101 is not HTTP
            data = data[step:]

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
