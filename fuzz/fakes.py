"""The fakes the atheris harnesses share: a client transport, upstream connections that parse
what relay writes to them with a strict llhttp request parser, and a pool of them; and a
``Relay`` wired to that pool with no event loop.

Import it from within ``atheris.instrument_imports(include=["relay"])``: relay's modules are
first imported here. Importing it also sets relay's slicing thresholds to the sizes of fuzzed
inputs (see below).
"""

from __future__ import annotations

import logging
import tempfile
import traceback
from pathlib import Path
from typing import Any

import httptools
from invariants import ENVD_PORT, ROUTES, go_path

from relay import response, server, slices
from relay.config_parse import parse
from relay.core import headers as header_rules
from relay.core import policy
from relay.outbox import Outbox
from relay.runtime import Relay
from relay.server import ClientConnection
from relay.upstreams import PoolKey


class Bugs(logging.Handler):
    """relay logs a bug at ERROR level (never shows it to the client): that is a crash."""

    def emit(self, record: logging.LogRecord) -> None:
        # With the logged exception's own traceback: the one raised here shows only the log call.
        trace = "".join(traceback.format_exception(*record.exc_info)) if record.exc_info else ""
        raise AssertionError(f"relay logged an error: {record.getMessage()}\n{trace}")


class FakeTransport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False
        self.eof = False  # write_eof() was called: uvloop raises on any later write
        self.paused = False  # a harness told relay the client's buffer is full

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("192.0.2.1", 40000) if name == "peername" else default

    def write(self, data: bytes) -> None:
        assert not self.eof, "relay wrote to a client after half-closing it"
        if not self.closed:
            self.out += data

    def writelines(self, parts: list[bytes]) -> None:
        for part in parts:
            self.write(part)

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0  # every write is taken at once (relay.closing reads it at a close)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Wire:
    """The far end of a fake upstream connection: what relay's outbox sends arrives here."""

    def __init__(self, upstream: FakeUpstream) -> None:
        self.upstream = upstream

    def write(self, data: bytes) -> None:
        self.upstream.receive(data)

    def writelines(self, parts: list[bytes]) -> None:
        self.upstream.receive(b"".join(parts))

    def is_closing(self) -> bool:
        return self.upstream.closed


class FakeUpstream:
    """An upstream connection: checks what relay writes, answers complete requests. Writes
    go through relay's outbox, as ``UpstreamConnection``'s do."""

    def __init__(self, key: PoolKey, outbox: Outbox) -> None:
        self.key = key
        self.outbox = outbox
        self.wire = Wire(self)
        self.owner: Any = None
        self.uses = 1
        self.closed = False
        self.write_paused = False  # as UpstreamConnection: never over a high-water mark here
        self.transport = self
        self.pending = 0
        self.upgraded = False
        self.reading = True  # relay did not pause reading it (a harness then delivers nothing)
        self.fields: list[tuple[bytes, bytes]] = []
        self.url = b""
        self.parser = httptools.HttpRequestParser(self)
        self.reader: Any = None  # relay's ResponseReader for this connection, as upstream_conn.py

    def drop_reader(self) -> None:
        reader, self.reader = self.reader, None
        if reader is not None:
            reader.parser = None

    # what relay calls
    def write(self, data: bytes) -> None:
        assert not self.closed, "relay wrote to a closed upstream connection"
        self.outbox.write(self.wire, data)

    def writelines(self, parts: list[bytes]) -> None:
        assert not self.closed, "relay wrote to a closed upstream connection"
        self.outbox.writelines(self.wire, parts)

    def receive(self, data: bytes) -> None:
        if self.upgraded:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.upgraded = True  # a WebSocket handshake: bytes after it are frames

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    # what the loop calls, as on UpstreamConnection (relay.upstream_conn)
    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.owner is not None:
            self.owner.upstream_data(data)
        else:
            self.close()  # an idle connection must not talk

    def eof_received(self) -> None:
        self.outbox.flush()
        if self.owner is not None and not self.closed:
            self.owner.upstream_eof()

    def connection_lost(self, pool: FakePool) -> None:
        self.closed = True
        pool.forget(self)
        owner, self.owner = self.owner, None
        if owner is not None:
            owner.upstream_lost(None)
        self.drop_reader()

    def close(self) -> None:
        self.outbox.flush()  # as UpstreamConnection.close: what was written goes out first
        self.closed = True
        self.drop_reader()

    def is_closing(self) -> bool:
        return self.closed

    # llhttp callbacks: the request as the upstream sees it
    def on_message_begin(self) -> None:
        self.url, self.fields = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        names = {name.lower() for name, _ in self.fields}
        assert not names & header_rules.CREDENTIALS, self.fields
        if self.key.port == ENVD_PORT:
            assert go_path(self.url) not in policy.CONTROL_PATHS, self.url

    def on_message_complete(self) -> None:
        self.pending += 1


class FakePool:
    """Hands out a new connection when none is idle and keeps released ones, as
    ``relay.upstreams.Pool`` does, so that one connection (its request parser here, relay's
    response reader and llhttp parser there) carries exchange after exchange."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.made: list[FakeUpstream] = []
        self.idle: dict[PoolKey, list[FakeUpstream]] = {}
        self.opened = 0  # read at accept (Relay.admit); relay is never near its limit here

    def reset(self) -> None:
        self.made.clear()
        self.idle.clear()

    def acquire(self, key: PoolKey, max_idle_s: float = 0.0) -> FakeUpstream:
        # No clock here: an idle connection is never older than max_idle_s (Pool.acquire).
        idle = self.idle.get(key, [])
        while idle:
            conn = idle.pop()
            if not conn.closed:
                conn.uses += 1
                return conn
        conn = FakeUpstream(key, self.outbox)
        self.made.append(conn)
        return conn

    def release(self, conn: FakeUpstream) -> None:
        assert conn.pending == 0, "a connection went back to the pool with a request unanswered"
        conn.owner = None
        if not conn.closed:
            self.idle.setdefault(conn.key, []).append(conn)

    async def connect(self, key: PoolKey) -> FakeUpstream:
        """A dial (a retry on a fresh connection): never waits, never fails."""
        conn = FakeUpstream(key, self.outbox)
        self.made.append(conn)
        return conn

    def forget(self, conn: FakeUpstream) -> None:
        idle = self.idle.get(conn.key, [])
        if conn in idle:
            idle.remove(conn)

    def purge(self, sandbox_id: str) -> int:
        closed = 0
        for key in [k for k in self.idle if k.sandbox_id == sandbox_id]:
            for conn in self.idle.pop(key):
                conn.close()
                closed += 1
        return closed

    def sweep(self) -> None:
        pass

    def close_oldest_idle(self, most: int) -> int:
        return 0

    def close_all(self) -> None:
        pass


def make_relay() -> Relay:
    tmp = Path(tempfile.mkdtemp(prefix="relay-fuzz-"))
    (tmp / "routes.json").write_text('{"routes": []}')
    config = parse(
        {
            "listen": {"max_header_bytes": 2048},
            "routing": {"domains": ["e2b.test"]},
            "routes": {"file": str(tmp / "routes.json")},
            "upstream": {"envd_port": ENVD_PORT},
        },
        base_dir=tmp,
    )
    relay = Relay(config)
    relay.install_routes(dict(ROUTES), "fuzz")
    relay.pool = FakePool(relay.outbox)  # type: ignore[assignment]
    # No loop: the harness ends each turn itself and runs what was left for the next turn
    # (LATER: a dense read's continuation). Every small write held: ordering fuzzed.
    relay.outbox.bind(LATER.append, busy=0)
    return relay


# Dense reads (relay.slices) at the sizes of fuzzed inputs: a read of more than 4 heads and
# body pieces yields a turn, and later reads of its connection are fed in slices of 64 bytes
# and up, so that slicing and its continuations are fuzzed too (a few KiB per input).
LATER: list[Any] = []
server.YIELD_EVENTS = 4
server.FLOOD_SLICE = slices.FLOOD_SLICE = 64
slices.FLOOD_SLICE_MAX = 256
# Upstream answers are read in slices from 16 bytes (relay.response): each answer's head read
# is, and so is the 101's tail past a slice.
response.FLOOD_SLICE = 16
response.FLOOD_SLICE_MAX = 32


def client_gone(conn: ClientConnection, relay: Relay) -> None:
    """The client connection is lost: its continuations run and find nothing to do, and no
    exchange, in-flight count or connection is left registered."""
    conn.connection_lost(None)
    for callback in LATER:
        callback()
    LATER.clear()
    relay.outbox.end_turn()
    assert not relay.live, relay.live
    assert not relay.inflight, relay.inflight
    assert not relay.connections
