"""The ``ws-echo`` client: WebSocket echo round trips per second over C connections, each
sending one masked frame and waiting for its echo before the next (RFC 6455); and the
handshake the idle holders reuse.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import time
from typing import Any

from bench.client_http import head, nodelay, split


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
