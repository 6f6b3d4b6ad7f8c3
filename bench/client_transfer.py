"""The transfer clients: ``download`` (GET a large body N times into a reused buffer) and
``upload`` (POST one N times); MiB/s per timed transfer, the first transfer checked by CRC-32
and not timed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import time
import zlib
from typing import Any

from bench.client_http import MIB, Response, connect, head, nodelay, split


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
