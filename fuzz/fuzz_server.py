"""atheris: random bytes, in random-sized reads, through relay's client protocol.

The real ``ClientConnection`` (llhttp framing, limits, pipelining, refusals) and the real
``Exchange`` run on a fake transport, with an in-memory upstream pool whose connections parse
what relay writes to them with a strict llhttp request parser and answer each complete
request with one of ``ANSWERS``; released connections are reused, as relay's pool does. No
socket and no event loop: between reads the harness delivers the upstream answers, as the
loop would.

A crash is any exception, a bug logged by relay, or a broken invariant:

* everything relay writes upstream is well-framed HTTP/1.1 (a strict parser accepts it),
  carries no credential (strip mode) and never names a control path on envd's port;
* everything relay writes to the client is well-framed responses, no more than requests;
* once the connection is gone, no exchange is left registered.

    fuzz/.venv/bin/python fuzz/fuzz_server.py -max_total_time=30 fuzz/corpus/server
"""

from __future__ import annotations

import contextlib
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import atheris

with atheris.instrument_imports(include=["relay"]):
    from relay import response, server, slices
    from relay.config import parse
    from relay.core import headers as header_rules
    from relay.core import policy
    from relay.outbox import Outbox
    from relay.runtime import Relay
    from relay.server import ClientConnection
    from relay.upstreams import PoolKey

import httptools

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from invariants import ENVD_PORT, ROUTES, go_path

# What the fake upstreams answer, chosen per input: well-formed, odd, broken, cut short.
ANSWERS: list[tuple[bytes, bool]] = [  # (bytes, then the upstream closes)
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-T: 1\r\n\r\n", False),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", False),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil close", True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\ncut", True),
    (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n7\r\n\x00\x00\x00\x00\x02{}\r\n3\r\n\x00\x00\x00\r\n",
        True,
    ),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n\r\n", False),
    (b"HTTP/1.1 000 Zero\r\n\r\n", False),
    (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
        b"\x82\x05hello",
        False,
    ),
    (b"garbage\r\n\r\n", False),
]


class Bugs(logging.Handler):
    """relay logs a bug at ERROR level (never shows it to the client): that is a crash."""

    def emit(self, record: logging.LogRecord) -> None:
        raise AssertionError(f"relay logged an error: {record.getMessage()}")


class FakeTransport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False
        self.eof = False  # write_eof() was called: uvloop raises on any later write

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
        self.fields: list[tuple[bytes, bytes]] = []
        self.url = b""
        self.parser = httptools.HttpRequestParser(self)
        self.reader: Any = None  # relay's ResponseReader for this connection, as upstreams.py

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
        pass

    def resume_reading(self) -> None:
        pass

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

    def reset(self) -> None:
        self.made.clear()
        self.idle.clear()

    def acquire(self, key: PoolKey) -> FakeUpstream:
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

    def purge(self, sandbox_id: str) -> int:
        return 0

    def sweep(self) -> None:
        pass

    def close_all(self) -> None:
        pass


class Responses:
    """Counts the well-framed responses relay wrote to the client."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.count = 0

    def on_headers_complete(self) -> None:
        if self.parser.get_status_code() >= 200:
            self.count += 1


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


RELAY = make_relay()
logging.getLogger("relay").addHandler(Bugs())
logging.getLogger("relay").setLevel(logging.ERROR)
logging.getLogger("relay").propagate = False


def test_one_input(data: bytes) -> None:
    relay = RELAY
    pool: FakePool = relay.pool  # type: ignore[assignment]
    pool.reset()
    transport = FakeTransport()
    conn = ClientConnection(relay, tls=False)
    conn.connection_made(transport)  # type: ignore[arg-type]
    step = 1 + (sum(data) % 61)  # read sizes vary with the input, deterministically
    if sum(data) % 5 == 0:
        step = len(data) or 1  # one read: a dense one, sliced when it is not the first
    answer, then_close = ANSWERS[(sum(data) // 61) % len(ANSWERS)]
    requests = 0
    for start in range(0, len(data), step):
        if transport.closed:
            break
        conn.data_received(data[start : start + step])
        # The event loop's turns: held writes go out, upstreams answer the requests they
        # have in full, until nothing moves.
        moved = True
        while moved:
            relay.outbox.end_turn()
            moved = bool(LATER)
            later = LATER[:]
            LATER.clear()
            for callback in later:
                callback()
            for upstream in list(pool.made):
                while upstream.pending and upstream.owner is not None and not upstream.closed:
                    moved = True
                    upstream.pending -= 1
                    owner = upstream.owner
                    owner.upstream_data(answer)
                    if then_close and upstream.owner is owner:
                        upstream.closed = True
                        upstream.owner = None
                        owner.upstream_eof()
                        owner.upstream_lost(None)
        # Counted once the turns ran: a sliced read's rest is parsed in a later turn (LATER).
        requests = conn.requests
    relay.outbox.end_turn()
    conn.connection_lost(None)
    for callback in LATER:
        callback()  # continuations after the loss find nothing to do
    LATER.clear()
    relay.outbox.end_turn()
    assert not relay.live, relay.live
    assert not relay.inflight, relay.inflight
    assert not relay.connections
    if b"HEAD" in data:
        return  # answers to HEAD have no body: a plain response parser cannot frame them
    responses = Responses()
    with contextlib.suppress(httptools.HttpParserUpgrade):
        responses.parser.feed_data(bytes(transport.out))
    # One answer per request, plus at most one refusal of what could not be parsed.
    assert responses.count <= requests + 1, (responses.count, requests)
    assert b"HTTP/1.1 0 " not in transport.out


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
