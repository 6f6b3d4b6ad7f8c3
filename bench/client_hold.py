"""The idle holders (``hold-http``, ``hold-ws``): open N keep-alive or WebSocket connections
in batches, report how many are held, then keep them idle until stdin closes (the
orchestrator measures the proxy's RSS meanwhile) or the bound passes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from typing import Any

from bench.client_http import head, split
from bench.client_ws import ws_handshake


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
