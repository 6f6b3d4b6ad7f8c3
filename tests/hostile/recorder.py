"""A recording upstream: a tiny HTTP/1.1 server that keeps every byte relay sent it.

The hostile suite asserts on what reached an upstream *byte for byte*, so this server does not
use an HTTP library that would normalise what it saw: it records the raw bytes of every
connection in arrival order and frames requests with llhttp only to know when to answer.

It runs on its own event loop in a daemon thread, so one instance can serve a relay that lives
for the whole session while each test runs on its own (function-scoped) loop. Readers on the
test side take a :meth:`Recorder.mark` before an attack and look at what arrived after it.

What it answers is chosen by the request path (see :data:`SCRIPTS` and :meth:`_answer`):
``/raw/<name>`` writes a canned, possibly broken, response byte for byte; ``/stream``,
``/connect/...`` and ``/bulk`` stream; anything else gets ``200`` with a short body naming the
request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field

import httptools


@dataclass
class Request:
    """One request as the upstream's strict parser framed it."""

    conn: int
    port: int
    method: bytes = b""
    target: bytes = b""
    version: str = ""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    complete: bool = False

    def header(self, name: bytes) -> list[bytes]:
        return [v for n, v in self.headers if n.lower() == name.lower()]


def envelope(payload: dict[str, object], flags: int = 0) -> bytes:
    """A Connect streaming envelope: flags, big-endian length, JSON payload."""
    data = json.dumps(payload, separators=(",", ":")).encode()
    return bytes([flags]) + len(data).to_bytes(4, "big") + data


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


CONNECT_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
EVENTS = [envelope({"event": {"start": {"pid": 7}}}), envelope({"event": {"data": {"n": 1}}})]

# Canned responses: ``(bytes to write, close afterwards)``. Most are broken on purpose.
SCRIPTS: dict[str, tuple[bytes, bool]] = {
    "bad-status": (b"HTTP/1.1 abc OK\r\nContent-Length: 0\r\n\r\n", True),
    "status-000": (b"HTTP/1.1 000 Zero\r\nContent-Length: 4\r\n\r\nzero", True),
    "status-099": (b"HTTP/1.1 099 Low\r\nContent-Length: 3\r\n\r\nlow", True),
    "status-600": (b"HTTP/1.1 600 High\r\nContent-Length: 4\r\n\r\nhigh", True),
    "garbage": (b"this is not http\r\n\r\n", True),
    "http09": (b"<html>no status line</html>", True),
    "cl-te": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n",
        True,
    ),
    "te-cl": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n",
        True,
    ),
    "two-cl": (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", True),
    # Equal values: RFC 9110 §8.6 lets a recipient take the one value or refuse; llhttp refuses.
    "two-cl-equal": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok", True),
    # Protocols llhttp reads in a status line besides HTTP (not HTTP: refused, as Go's client does).
    "rtsp-status": (b"RTSP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
    "ice-status": (b"ICE/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
    # HTTP/1.0 and Transfer-Encoding: faulty framing, the connection closes after it (RFC 9112
    # §6.1). Beside it, an HTTP/1.0 response kept alive with a Content-Length, and HTTP/1.1.
    "http10-chunked": (
        b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n0\r\n\r\n",
        False,
    ),
    "http10-length": (
        b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok",
        False,
    ),
    "http11-chunked": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        False,
    ),
    "obs-fold": (b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 0\r\n\r\n", True),
    "bare-lf": (b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok", True),
    # Bare LF line ends in one place each, and a bare CR (never a line end, RFC 9112 §2.2).
    "bare-lf-status": (b"HTTP/1.1 200 OK\nX-A: a\r\nContent-Length: 2\r\n\r\nok", False),
    "bare-lf-field": (b"HTTP/1.1 200 OK\r\nX-A: a\nContent-Length: 2\r\n\r\nok", False),
    "bare-lf-end": (b"HTTP/1.1 200 OK\r\nX-A: a\r\nContent-Length: 2\r\n\nok", False),
    "bare-lf-chunked": (
        b"HTTP/1.1 200 OK\nX-A: a\nTransfer-Encoding: chunked\n\n2\r\nok\r\n0\r\nX-T: t\n\n",
        False,
    ),
    "bare-lf-interim": (
        b"HTTP/1.1 103 Early Hints\nX-A: a\n\nHTTP/1.1 200 OK\nContent-Length: 2\n\nok",
        False,
    ),
    # Heads relay reads as RFC 9110/9112 say and writes its own way (test_response_heads.py).
    "interim-length": (
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\nContent-Length: 3\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        False,
    ),
    "no-content-length": (b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello", False),
    "connection-listed": (
        b"HTTP/1.1 200 OK\r\nConnection: X-Secret, Set-Cookie\r\nX-Secret: s\r\n"
        b"Set-Cookie: a=1\r\nKeep-Alive: timeout=5\r\nX-Kept: k\r\nContent-Length: 2\r\n\r\nok",
        False,
    ),
    "no-reason": (b"HTTP/1.1 200\r\nContent-Length: 2\r\n\r\nok", False),
    "http10-status": (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", True),
    "length-spelled": (b"HTTP/1.1 200 OK\r\nContent-Length: 0002\t\r\n\r\nok", False),
    "bare-cr": (b"HTTP/1.1 200 OK\rX-A: a\r\nContent-Length: 2\r\n\r\nok", True),
    "cr-in-value": (b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 2\r\n\r\nok", True),
    "nul-header": (b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n", True),
    "big-header": (
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"b" * (100 * 1024) + b"\r\nContent-Length: 2\r\n\r\nok",
        True,
    ),
    "many-headers": (
        b"HTTP/1.1 200 OK\r\n"
        + b"".join(b"X-%d: v\r\n" % i for i in range(12000))
        + b"Content-Length: 2\r\n\r\nok",
        True,
    ),
    "close-mid-cl": (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part", True),
    "close-mid-chunked": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n3\r\nab",
        True,
    ),
    "close-before-status": (b"", True),
    "close-mid-head": (b"HTTP/1.1 200 OK\r\nContent-Le", True),
    "bad-chunk": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nZZZ\r\n",
        True,
    ),
    "unsolicited-101": (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
        b"\x81\x05hello",
        False,
    ),
    "garbage-after": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokGARBAGE\r\n\r\n", False),
    "second-response": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nX-Injected: yes\r\n\r\nevil",
        False,
    ),
    "connect-boundary": (CONNECT_HEAD + b"".join(chunk(e) for e in EVENTS), True),
    "connect-mid-envelope": (
        CONNECT_HEAD + b"".join(chunk(e) for e in EVENTS) + chunk(EVENTS[1][:7]),
        True,
    ),
    "connect-mid-chunk": (
        CONNECT_HEAD + b"".join(chunk(e) for e in EVENTS) + b"%x\r\n" % 40 + b"\x00\x00",
        True,
    ),
    "connect-mid-big-envelope": (
        CONNECT_HEAD
        + chunk(EVENTS[0])
        + chunk(b"\x00" + (1 << 20).to_bytes(4, "big") + b"x" * (300 * 1024)),
        True,
    ),
    # Reason phrases with control characters (RFC 9112 §4 allows HTAB, SP, VCHAR, obs-text).
    "reason-nul": (b"HTTP/1.1 200 O\x00K\r\nContent-Length: 2\r\n\r\nok", False),
    "reason-esc": (b"HTTP/1.1 200 \x1b[2J\x1b[31mOK\r\nContent-Length: 2\r\n\r\nok", False),
    "reason-del": (b"HTTP/1.1 404 Not\x7fFound\r\nContent-Length: 2\r\n\r\nok", False),
    "reason-interim": (
        b"HTTP/1.1 103 Early\x08Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        False,
    ),
    "reason-obs-text": (b"HTTP/1.1 200 Tr\xe8s\tbien\r\nContent-Length: 2\r\n\r\nok", False),
    "ok": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
}


class _Conn:
    """Server side of one connection: records bytes, frames requests, answers them."""

    def __init__(self, recorder: Recorder, conn_id: int, port: int) -> None:
        self.recorder = recorder
        self.id = conn_id
        self.port = port
        self.current: Request | None = None
        self.ready: list[Request] = []
        self.upgraded = False
        self.parser = httptools.HttpRequestParser(self)

    # llhttp callbacks
    def on_message_begin(self) -> None:
        self.current = Request(self.id, self.port)
        self.recorder.add_request(self.current)

    def on_url(self, url: bytes) -> None:
        assert self.current is not None
        self.current.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.current is not None
        self.current.method = self.parser.get_method()
        self.current.version = self.parser.get_http_version()

    def on_body(self, body: bytes) -> None:
        assert self.current is not None
        self.current.body += body

    def on_message_complete(self) -> None:
        assert self.current is not None
        self.current.complete = True
        self.ready.append(self.current)

    def feed(self, data: bytes) -> bool:
        """False when the upstream must stop reading (parse error or upgrade)."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.upgraded = True
            if self.current is not None:
                self.current.complete = True
                self.ready.append(self.current)
        except httptools.HttpParserError as exc:
            self.recorder.errors.append(f"conn {self.id}: {exc}")
            return False
        return True


class Recorder:
    """The recording upstream. Listens on several loopback ports, one per role."""

    def __init__(self, roles: dict[str, str] | None = None) -> None:
        # role -> bind address; the port is chosen by the kernel.
        self.roles = roles or {"envd": "127.0.0.1", "app": "127.0.0.1"}
        self.ports: dict[str, int] = {}
        self.chunks: list[tuple[float, int, int, bytes]] = []  # (time, conn, port, data)
        self.requests: list[Request] = []
        self.connections: list[tuple[float, int]] = []  # (time, port)
        self.errors: list[str] = []
        self.bulk_written = 0  # bytes the /bulk handler managed to hand to its socket
        self.endless_written = 0  # bytes of an endless head or trailer handed to the socket
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._next_id = 0

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> Recorder:
        self._thread = threading.Thread(target=self._run, name="recorder", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("recording upstream did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        servers = []
        for role, host in self.roles.items():
            server = await asyncio.start_server(self._serve, host, 0, reuse_address=True)
            self.ports[role] = server.sockets[0].getsockname()[1]
            servers.append(server)
        self._started.set()
        await self._stop.wait()
        for server in servers:
            server.close()
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()

    # -- recording (called on the recorder's thread) ------------------------------------
    def add_request(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = writer.get_extra_info("sockname")[1]
        with self._lock:
            self._next_id += 1
            conn = _Conn(self, self._next_id, port)
            self.connections.append((time.monotonic(), port))
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                with self._lock:
                    self.chunks.append((time.monotonic(), conn.id, port, data))
                if conn.upgraded:
                    continue  # bytes after an upgrade are recorded, never parsed
                if not conn.feed(data):
                    break
                while conn.ready:
                    request = conn.ready.pop(0)
                    if not await self._answer(request, writer):
                        return
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, request: Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection must close."""
        path, _, query = request.target.partition(b"?")
        params = dict(p.partition(b"=")[::2] for p in query.split(b"&") if p)
        if path.startswith(b"/raw/"):
            name = path[len(b"/raw/") :].decode()
            data, close = SCRIPTS[name]
            writer.write(data)
            await writer.drain()
            return not close
        if path == b"/stream":
            n, interval = int(params.get(b"n", b"5")), float(params.get(b"interval", b"0.05"))
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(n):
                writer.write(chunk(b"event %d\n" % i))
                await writer.drain()
                await asyncio.sleep(interval)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        if path == b"/bulk":
            return await self._bulk(writer, int(params.get(b"mib", b"512")))
        if path == b"/endless-head":
            return await self._endless(writer, b"HTTP/1.1 200 OK\r\nX-Endless: ")
        if path == b"/endless-trailer":
            return await self._endless(
                writer,
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-T: ",
            )
        body = b"%s %s %d" % (request.method, request.target, len(request.body))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        return True

    async def _endless(self, writer: asyncio.StreamWriter, start: bytes) -> bool:
        """A response head or trailer line that never ends (up to 64 MiB): relay must cut it."""
        self.endless_written = 0
        writer.write(start)
        for _ in range(1024):
            writer.write(b"e" * 65536)
            await writer.drain()  # raises once relay has closed the connection
            with self._lock:
                self.endless_written += 65536
        return False

    async def _bulk(self, writer: asyncio.StreamWriter, mib: int) -> bool:
        """A large response written with backpressure; counts what the socket accepted."""
        block = bytes(range(256)) * 256
        total = mib * 1024 * 1024
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        sent = 0
        while sent < total:
            writer.write(block)
            await writer.drain()  # blocks while relay does not read: that is the point
            sent += len(block)
            with self._lock:
                self.bulk_written = sent
        return True

    # -- reading (called from tests) ------------------------------------------------------
    def mark(self) -> tuple[int, int, int]:
        with self._lock:
            return len(self.chunks), len(self.requests), len(self.connections)

    def bytes_since(self, mark: tuple[int, int, int]) -> bytes:
        with self._lock:
            return b"".join(data for _, _, _, data in self.chunks[mark[0] :])

    def requests_since(self, mark: tuple[int, int, int]) -> list[Request]:
        with self._lock:
            return list(self.requests[mark[1] :])

    def connections_since(self, mark: tuple[int, int, int]) -> int:
        with self._lock:
            return len(self.connections) - mark[2]

    async def wait_for(
        self, mark: tuple[int, int, int], complete: int, timeout: float = 5.0
    ) -> list[Request]:
        """Wait until ``complete`` requests have fully arrived since ``mark``."""
        deadline = time.monotonic() + timeout
        while True:
            done = [r for r in self.requests_since(mark) if r.complete]
            if len(done) >= complete or time.monotonic() > deadline:
                return self.requests_since(mark)
            await asyncio.sleep(0.01)

    async def nothing_since(self, mark: tuple[int, int, int], settle: float = 0.05) -> bool:
        """True when no byte and no connection reached the upstream since ``mark``."""
        await asyncio.sleep(settle)
        return self.bytes_since(mark) == b"" and self.connections_since(mark) == 0
