"""The benchmark's Python origin: the upstreams nginx cannot play.

One uvloop process, raw asyncio protocols framed by llhttp (``httptools``), so that the origin
costs little CPU next to the proxy under test:

* ``POST /upload``: reads the whole request body, then answers ``200`` with the byte count and,
  when the request has ``X-Bench-Check: 1``, the CRC-32 of what it received
  (``<count> <crc32>``, else ``<count> 0``), so the client can check every byte once.
* ``POST /stream``: a Connect-style server stream (``application/connect+json``, chunked). It
  emits ``--events`` envelopes, one every ``--interval-ms`` milliseconds, each carrying
  ``{"i": n, "t": <time.monotonic_ns() just before the write>}``, then an end-of-stream
  envelope. ``CLOCK_MONOTONIC`` is system-wide, so the client computes arrival minus send.
* ``GET /ws`` with ``Upgrade: websocket``: RFC 6455 echo (text/binary frames echoed unmasked,
  ping answered with pong, close echoed).
* ``GET /small``, ``GET /files``, ``GET /blob``: fallbacks for when nginx is absent (the nginx
  origin serves them faster when present).

Usage: ``python -m bench.origin --listen 127.0.0.1:18082 [--listen ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import signal
import socket
import sys
import time
import zlib

import httptools
import uvloop

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC11B85"
SMALL_BODY = b"hello, world\n"
BLOB_SIZE = 64 * 1024 * 1024
BLOB_PIECE = 1024 * 1024
CONNECT_TYPE = b"application/connect+json"


def blob_pattern() -> bytes:
    """The 64 MiB download body: a repeating 251-byte pattern (a prime, so misaligned
    slices or dropped bytes change the CRC)."""
    unit = bytes(range(251))
    reps = BLOB_SIZE // len(unit) + 1
    return (unit * reps)[:BLOB_SIZE]


def envelope(flags: int, payload: bytes) -> bytes:
    return bytes([flags]) + len(payload).to_bytes(4, "big") + payload


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Origin(asyncio.Protocol):
    def __init__(self, settings: argparse.Namespace, blob: memoryview) -> None:
        self.settings = settings
        self.blob = blob
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.ws_key = b""
        self.upload_bytes = 0
        self.upload_crc = 0
        self.check = False
        self.ws = False
        self.ws_buf = b""
        self.write_ok: asyncio.Event | None = None
        self.task: asyncio.Task[None] | None = None

    # -- asyncio
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.ws:
            self.ws_data(data)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self.start_ws(data[exc.args[0] :])
        except httptools.HttpParserError:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.task is not None:
            self.task.cancel()
        if self.write_ok is not None:
            self.write_ok.set()

    def pause_writing(self) -> None:
        if self.write_ok is None:
            self.write_ok = asyncio.Event()
        self.write_ok.clear()

    def resume_writing(self) -> None:
        if self.write_ok is not None:
            self.write_ok.set()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def write(self, data: bytes | memoryview) -> None:
        if self.transport is not None:
            self.transport.write(data)

    # -- llhttp
    def on_message_begin(self) -> None:
        self.url = b""
        self.ws_key = b""
        self.upload_bytes = 0
        self.upload_crc = 0
        self.check = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"sec-websocket-key":
            self.ws_key = value
        elif lower == b"x-bench-check":
            self.check = True

    def on_headers_complete(self) -> None:
        pass

    def on_body(self, body: bytes) -> None:
        self.upload_bytes += len(body)
        if self.check:  # only when asked: the CRC costs origin CPU
            self.upload_crc = zlib.crc32(body, self.upload_crc)

    def on_message_complete(self) -> None:
        if self.parser.should_upgrade():
            return  # answered in start_ws
        path = self.url.partition(b"?")[0]
        if path == b"/upload":
            body = b"%d %d" % (self.upload_bytes, self.upload_crc)
            self.respond(b"200 OK", body)
        elif path == b"/stream":
            self.task = asyncio.get_running_loop().create_task(self.stream())
        elif path in (b"/small", b"/files"):
            self.respond(b"200 OK", SMALL_BODY)
        elif path == b"/blob":
            self.task = asyncio.get_running_loop().create_task(self.send_blob())
        else:
            self.respond(b"404 Not Found", b"not found\n")

    def respond(self, status: bytes, body: bytes, ctype: bytes = b"text/plain") -> None:
        self.write(
            b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
            % (status, ctype, len(body), body)
        )

    # -- streaming responses
    async def send_blob(self) -> None:
        self.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
            b"Content-Length: %d\r\n\r\n" % len(self.blob)
        )
        for start in range(0, len(self.blob), BLOB_PIECE):
            if self.transport is None:
                return
            if self.write_ok is not None:
                await self.write_ok.wait()
            self.write(self.blob[start : start + BLOB_PIECE])

    async def stream(self) -> None:
        self.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        interval = self.settings.interval_ms / 1000.0
        for i in range(self.settings.events):
            if self.transport is None:
                return
            payload = b'{"i":%d,"t":%d}' % (i, time.monotonic_ns())
            self.write(chunk(envelope(0, payload)))
            await asyncio.sleep(interval)
        self.write(chunk(envelope(2, b"{}")) + b"0\r\n\r\n")

    # -- WebSocket echo (RFC 6455)
    def start_ws(self, tail: bytes) -> None:
        accept = base64.b64encode(hashlib.sha1(self.ws_key + WS_GUID).digest())
        self.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n" % accept
        )
        self.ws = True
        if tail:
            self.ws_data(tail)

    def ws_data(self, data: bytes) -> None:
        buf = self.ws_buf + data if self.ws_buf else data
        pos, n = 0, len(buf)
        out = []
        while n - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            length = b1 & 0x7F
            hlen = 2
            if length == 126:
                hlen = 4
                if n - pos < hlen:
                    break
                length = int.from_bytes(buf[pos + 2 : pos + 4], "big")
            elif length == 127:
                hlen = 10
                if n - pos < hlen:
                    break
                length = int.from_bytes(buf[pos + 2 : pos + 10], "big")
            masked = b1 & 0x80
            mlen = 4 if masked else 0
            total = hlen + mlen + length
            if n - pos < total:
                break
            payload = buf[pos + hlen + mlen : pos + total]
            if masked:
                key = buf[pos + hlen : pos + hlen + 4]
                payload = unmask(payload, key)
            opcode = b0 & 0x0F
            if opcode == 0x9:  # ping -> pong
                out.append(frame(0xA, payload))
            elif opcode == 0x8:  # close -> echo close, then close
                out.append(frame(0x8, payload[:2]))
                self.write(b"".join(out))
                self.close()
                return
            elif opcode != 0xA:
                out.append(frame(b0 & 0x0F, payload, fin=bool(b0 & 0x80)))
            pos += total
        self.ws_buf = buf[pos:]
        if out:
            self.write(out[0] if len(out) == 1 else b"".join(out))


def unmask(payload: bytes, key: bytes) -> bytes:
    n = len(payload)
    if not n:
        return payload
    reps = (n + 3) // 4
    mask = int.from_bytes((key * reps)[:n], "big")
    return (int.from_bytes(payload, "big") ^ mask).to_bytes(n, "big")


def frame(opcode: int, payload: bytes, *, fin: bool = True) -> bytes:
    b0 = (0x80 if fin else 0) | opcode
    n = len(payload)
    if n < 126:
        return bytes([b0, n]) + payload
    if n < 65536:
        return bytes([b0, 126]) + n.to_bytes(2, "big") + payload
    return bytes([b0, 127]) + n.to_bytes(8, "big") + payload


async def main(settings: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    blob = memoryview(blob_pattern())
    servers = []
    for address in settings.listen:
        host, _, port = address.rpartition(":")
        servers.append(
            await loop.create_server(
                lambda: Origin(settings, blob), host, int(port), backlog=4096, reuse_address=True
            )
        )
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    print(json.dumps({"ready": settings.listen}), flush=True)
    await stop.wait()
    for server in servers:
        server.close()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", action="append", required=True, help="host:port")
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--interval-ms", type=float, default=1.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    uvloop.run(main(parse_args(sys.argv[1:])))
