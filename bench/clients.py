"""The benchmark's Python load clients (everything wrk does not do).

Each subcommand connects to one address (the origin directly, or a proxy), sends requests with
a routing ``Host`` header, prints one JSON object on stdout and exits. Every loop is bounded by
a count and a deadline. Run with uvloop, raw protocols, no HTTP library: the clients should
cost as little CPU as the origin, so that the proxy is what is measured.

  download   GET a 64 MiB body N times; MiB/s per transfer; CRC-32 checked once
  upload     POST a 64 MiB body N times; MiB/s per transfer; the origin echoes count and CRC
  stream     a Connect-style server stream: per-event latency (arrival - send stamp) and
             time to first event
  ws-echo    WebSocket echo round trips/s over C connections for D seconds
  hold-http  open N keep-alive connections, one GET each, then hold them idle until stdin
             closes (or --hold-s passes)
  hold-ws    the same with N WebSocket connections (handshake done, then idle)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import json
import os
import socket
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import httptools
import uvloop

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


# -- download / upload -----------------------------------------------------------------------


class Downloader(asyncio.BufferedProtocol):
    """Reads one Content-Length response into a reused buffer (``recv_into``, no copies), so
    that the client is not what limits a multi-GiB/s transfer."""

    def __init__(self, check: bool) -> None:
        self.buffer = bytearray(1 << 20)
        self.view = memoryview(self.buffer)
        self.check = check
        self.head = b""
        self.status = 0
        self.length = -1
        self.received = 0
        self.crc = 0
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        nodelay(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view

    def buffer_updated(self, nbytes: int) -> None:
        data = self.view[:nbytes]
        if self.length < 0:
            self.head += bytes(data)
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.head[:end].decode("latin-1").split("\r\n")
            self.status = int(lines[0].split()[1])
            fields = dict(line.split(":", 1) for line in lines[1:])
            lengths = [v for k, v in fields.items() if k.lower() == "content-length"]
            self.length = int(lengths[0]) if lengths else 0
            data = memoryview(self.head[end + 4 :])
        self.received += len(data)
        if self.check:
            self.crc = zlib.crc32(data, self.crc)
        if self.received >= self.length and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError("connection closed mid-response"))


async def download(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    host, port = split(args.address)
    rates: list[float] = []
    crc_ok: bool | None = None
    deadline = time.monotonic() + args.timeout_s
    for rep in range(args.reps):
        if time.monotonic() > deadline:
            break
        check = rep == 0  # the first transfer is checked (CRC) and untimed
        _, conn = await loop.create_connection(functools.partial(Downloader, check), host, port)
        assert conn.transport is not None
        start = time.perf_counter()
        conn.transport.write(head("GET", args.path, args.host))
        await asyncio.wait_for(conn.done, max(1.0, deadline - time.monotonic()))
        elapsed = time.perf_counter() - start
        conn.transport.close()
        if conn.status != 200 or conn.received != args.size:
            return {"error": f"status {conn.status}, {conn.received} of {args.size} bytes"}
        if check:
            crc_ok = conn.crc == args.crc if args.crc is not None else None
            if crc_ok is False:
                return {"error": "the downloaded bytes differ from the origin's (CRC-32)"}
            continue
        rates.append(conn.received / MIB / elapsed)
    return {
        "mib_s": statistics.median(rates) if rates else None,
        "mib_s_runs": [round(r, 1) for r in rates],
        "crc_ok": crc_ok,
    }


async def upload(args: argparse.Namespace) -> dict[str, Any]:
    payload = memoryview(os.urandom(MIB) * (args.size // MIB))
    expected_crc = zlib.crc32(payload)
    rates: list[float] = []
    deadline = time.monotonic() + args.timeout_s
    for rep in range(args.reps + 1):
        if time.monotonic() > deadline:
            break
        check = rep == 0  # the first transfer is checked (CRC) and untimed
        conn = await connect(args.address)
        conn.response = Response()
        transport = conn.transport
        assert transport is not None
        start = time.perf_counter()
        fields = [f"Content-Length: {len(payload)}", "Content-Type: application/octet-stream"]
        if check:
            fields.append("X-Bench-Check: 1")
        transport.write(head("POST", args.path, args.host, fields))
        for offset in range(0, len(payload), MIB):
            await conn.can_write.wait()
            if transport.is_closing():
                break
            transport.write(payload[offset : offset + MIB])
        await asyncio.wait_for(conn.response.done, max(1.0, deadline - time.monotonic()))
        elapsed = time.perf_counter() - start
        transport.close()
        body = bytes(conn.response.body).split()
        want = [str(len(payload)).encode(), str(expected_crc if check else 0).encode()]
        if conn.response.status != 200 or body != want:
            return {"error": f"status {conn.response.status}, origin saw {body!r}"}
        rates.append(len(payload) / MIB / elapsed)
    rates = rates[1:]  # the first transfer warms the pools
    return {
        "mib_s": statistics.median(rates) if rates else None,
        "mib_s_runs": [round(r, 1) for r in rates],
        "crc_ok": True,
    }


# -- Connect server stream ---------------------------------------------------------------


class EventSink:
    """Splits a Connect stream body into envelopes and stamps each event's arrival."""

    def __init__(self, latencies: list[float]) -> None:
        self.latencies = latencies
        self.buf = bytearray()
        self.first = 0
        self.events = 0
        self.ended = False

    def __call__(self, data: bytes) -> None:
        now = time.monotonic_ns()
        buf = self.buf
        buf.extend(data)
        while len(buf) >= 5:
            length = int.from_bytes(buf[1:5], "big")
            if len(buf) < 5 + length:
                break
            flags = buf[0]
            payload = bytes(buf[5 : 5 + length])
            del buf[: 5 + length]
            if flags & 0x02:
                self.ended = True
                continue
            event = json.loads(payload)
            if not self.first:
                self.first = now
            self.latencies.append((now - event["t"]) / 1000.0)
            self.events += 1


async def stream(args: argparse.Namespace) -> dict[str, Any]:
    latencies: list[float] = []
    firsts: list[float] = []
    deadline = time.monotonic() + args.timeout_s
    request = b"\x00\x00\x00\x00\x02{}"
    for _ in range(args.reps):
        if time.monotonic() > deadline:
            break
        conn = await connect(args.address)
        sink = EventSink(latencies)
        conn.response = Response(sink)
        assert conn.transport is not None
        sent = time.monotonic_ns()
        conn.transport.write(
            head(
                "POST",
                "/stream",
                args.host,
                [
                    "Content-Type: application/connect+json",
                    "Connect-Protocol-Version: 1",
                    f"Content-Length: {len(request)}",
                ],
            )
            + request
        )
        await asyncio.wait_for(conn.response.done, max(1.0, deadline - time.monotonic()))
        conn.transport.close()
        if conn.response.status != 200 or not sink.ended or sink.events != args.events:
            return {
                "error": f"status {conn.response.status}, {sink.events} events, "
                f"end-of-stream {sink.ended}"
            }
        firsts.append((sink.first - sent) / 1000.0)
    return {
        "events": len(latencies),
        "latency_us": {
            "p50": percentile(latencies, 50),
            "p90": percentile(latencies, 90),
            "p99": percentile(latencies, 99),
            "max": max(latencies) if latencies else None,
        },
        "first_event_us": statistics.median(firsts) if firsts else None,
        "first_event_runs_us": [round(f, 1) for f in firsts],
    }


# -- WebSocket -------------------------------------------------------------------------------


def ws_handshake(host: str, path: str = "/ws") -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return head(
        "GET",
        path,
        host,
        [
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
        ],
    )


def masked_frame(payload: bytes, opcode: int = 0x1) -> bytes:
    key = os.urandom(4)
    n = len(payload)
    masked = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
    assert n < 126
    return bytes([0x80 | opcode, 0x80 | n]) + key + masked


class WsConn(asyncio.Protocol):
    """An echo client: after the 101, send one frame, wait for its echo, repeat."""

    def __init__(self, host: str, frame: bytes, echo_size: int, counter: list[int]) -> None:
        self.host = host
        self.frame = frame
        self.echo_size = echo_size
        self.counter = counter
        self.transport: asyncio.Transport | None = None
        self.upgraded: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.buf = b""
        self.pending = 0
        self.running = False
        self.stop = False
        self.bad = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        nodelay(transport)
        transport.write(ws_handshake(self.host))  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if not self.upgraded.done():
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            if not self.buf.startswith(b"HTTP/1.1 101"):
                self.upgraded.set_exception(
                    ConnectionError(self.buf[: self.buf.find(b"\r\n")].decode("latin-1"))
                )
                return
            data = self.buf[end + 4 :]
            self.buf = b""
            self.upgraded.set_result(None)
        if not self.running:
            self.buf += data
            return
        self.pending += len(data)
        while self.pending >= self.echo_size:
            self.pending -= self.echo_size
            self.counter[0] += 1
            if not self.stop and self.transport is not None:
                self.transport.write(self.frame)

    def start(self) -> None:
        self.running = True
        if self.transport is not None:
            self.transport.write(self.frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.upgraded.done():
            self.upgraded.set_exception(ConnectionError("closed before the handshake"))
        elif not self.stop:
            self.bad = "closed mid-run"


async def ws_echo(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    host, port = split(args.address)
    payload = b"x" * args.payload
    frame = masked_frame(payload)
    echo_size = 2 + len(payload)
    counter = [0]
    conns: list[WsConn] = []
    for _ in range(args.connections):
        _, conn = await loop.create_connection(
            lambda: WsConn(args.host, frame, echo_size, counter), host, port
        )
        conns.append(conn)
    await asyncio.wait_for(asyncio.gather(*(c.upgraded for c in conns)), 10)
    for conn in conns:
        conn.start()
    await asyncio.sleep(args.warmup_s)
    start_count, start = counter[0], time.perf_counter()
    await asyncio.sleep(args.duration_s)
    count, elapsed = counter[0] - start_count, time.perf_counter() - start
    for conn in conns:
        conn.stop = True
    await asyncio.sleep(0.05)
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()
    bad = [c.bad for c in conns if c.bad]
    out: dict[str, Any] = {"round_trips_s": count / elapsed, "round_trips": count}
    if bad:
        out["error"] = f"{len(bad)} connection(s): {bad[0]}"
    return out


# -- idle holders ------------------------------------------------------------------------


class Holder(asyncio.Protocol):
    def __init__(self, request: bytes, expect: bytes) -> None:
        self.request = request
        self.expect = expect
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.ready: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self.ready.done():
            return
        self.buf += data
        if self.expect == b"101":
            if b"\r\n\r\n" in self.buf:
                self.ready.set_result(self.buf.startswith(b"HTTP/1.1 101"))
        elif self.buf.endswith(b"hello, world\n"):
            self.ready.set_result(self.buf.startswith(b"HTTP/1.1 200"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.ready.done():
            self.ready.set_result(False)


async def hold(args: argparse.Namespace, websocket: bool) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    host, port = split(args.address)
    if websocket:
        request, expect = ws_handshake(args.host), b"101"
    else:
        request, expect = head("GET", "/small", args.host), b"200"
    holders: list[Holder] = []
    failures: list[str] = []
    started = time.monotonic()
    for offset in range(0, args.count, args.batch):
        batch = []
        for _ in range(min(args.batch, args.count - offset)):
            try:
                _, holder = await loop.create_connection(
                    lambda: Holder(request, expect), host, port
                )
            except OSError as exc:
                failures.append(f"connect: {exc}")
                continue
            batch.append(holder)
        results = await asyncio.wait_for(asyncio.gather(*(h.ready for h in batch)), args.timeout_s)
        failures.extend("bad answer" for ok in results if not ok)
        holders.extend(batch)
    open_now = sum(1 for h in holders if h.transport is not None)
    print(
        json.dumps(
            {
                "held": open_now,
                "failures": len(failures),
                "first_failure": failures[0] if failures else None,
                "open_s": round(time.monotonic() - started, 2),
            }
        ),
        flush=True,
    )
    # Hold until the orchestrator closes our stdin (or the bound passes).
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(reader.read(), args.hold_s)
    still_open = sum(1 for h in holders if h.transport is not None)
    for h in holders:
        if h.transport is not None:
            h.transport.abort()
    return {"still_open_at_end": still_open}


# -- command line ------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", required=True, help="host:port to connect to")
        p.add_argument("--host", required=True, help="Host header")
        p.add_argument("--timeout-s", type=float, default=60.0)

    p = sub.add_parser("download")
    common(p)
    p.add_argument("--path", default="/blob")
    p.add_argument("--size", type=int, default=64 * MIB)
    p.add_argument("--crc", type=int, default=None)
    p.add_argument("--reps", type=int, default=5)
    p = sub.add_parser("upload")
    common(p)
    p.add_argument("--path", default="/upload")
    p.add_argument("--size", type=int, default=64 * MIB)
    p.add_argument("--reps", type=int, default=4)
    p = sub.add_parser("stream")
    common(p)
    p.add_argument("--events", type=int, default=1000)
    p.add_argument("--reps", type=int, default=3)
    p = sub.add_parser("ws-echo")
    common(p)
    p.add_argument("--connections", type=int, default=1)
    p.add_argument("--payload", type=int, default=32)
    p.add_argument("--warmup-s", type=float, default=0.5)
    p.add_argument("--duration-s", type=float, default=3.0)
    for name in ("hold-http", "hold-ws"):
        p = sub.add_parser(name)
        common(p)
        p.add_argument("--count", type=int, required=True)
        p.add_argument("--batch", type=int, default=250)
        p.add_argument("--hold-s", type=float, default=120.0)
    return parser.parse_args(argv)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    command = args.command
    if command == "download":
        return await download(args)
    if command == "upload":
        return await upload(args)
    if command == "stream":
        return await stream(args)
    if command == "ws-echo":
        return await ws_echo(args)
    return await hold(args, websocket=command == "hold-ws")


if __name__ == "__main__":
    arguments = parse_args(sys.argv[1:])
    try:
        result = uvloop.run(main(arguments))
    except (OSError, TimeoutError, httptools.HttpParserError, ConnectionError) as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
