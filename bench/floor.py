"""The floor: the least a proxy written in Python on uvloop can cost, as a bench column.

    python -m bench.floor --listen 127.0.0.1:18098 --upstream 127.0.0.1:18082

A byte forwarder and nothing else: each accepted connection gets its own upstream
connection, and every read is written to the other side as it is, with transport-level
backpressure both ways. No HTTP parsing, no routing, no auth, no pooling, no logging, no
metrics — none of what relay must do. Whatever relay measures above this column is relay's
own work; whatever this column measures above nginx is the price of CPython + uvloop's wake-up
path on this machine, which no amount of work on relay's code can remove.

It has one upstream (the Python origin: streams, uploads, WebSockets), so the bench runs it only
on the workloads that origin serves (``bench.plan``: ``Workload.floor``).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from typing import cast

import uvloop


def split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class Side(asyncio.Protocol):
    """One end of a forwarded connection; ``peer`` is the other end."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: Side | None = None
        self.early: list[bytes] = []  # client bytes that came before the upstream connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast("asyncio.Transport", transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.early.append(data)
            return
        peer.transport.write(data)

    def eof_received(self) -> bool:
        peer = self.peer
        if peer is not None and peer.transport is not None and peer.transport.can_write_eof():
            peer.transport.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.close()

    # Backpressure: a full write buffer on this side stops reading on the other.
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class Downstream(Side):
    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self.upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self.dial())

    async def dial(self) -> None:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(Side, *self.upstream)
        except OSError:
            self.transport.close()
            return
        up.peer, self.peer = self, up
        if self.transport.is_closing():
            assert up.transport is not None
            up.transport.close()
            return
        for data in self.early:
            self.data_received(data)
        self.early = []


async def serve(listen: tuple[str, int], upstream: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Downstream(upstream), *listen, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="host:port")
    parser.add_argument("--upstream", required=True, help="host:port")
    args = parser.parse_args()
    uvloop.run(serve(split(args.listen), split(args.upstream)))


if __name__ == "__main__":
    main()
