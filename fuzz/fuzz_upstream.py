"""atheris: random bytes from the upstream (a hostile guest), in random-sized reads, through
relay's response path.

A client sends a few fixed requests (GET, HEAD, a POST with a body, a WebSocket upgrade, a
Connect server stream to envd's port); the fake upstream connections (``fakes``) answer them
with the fuzzed bytes, one stream of them across the connections relay uses, in reads whose
sizes, and their interleaving with client reads, upstream EOF and revocation of the route
mid-response, the input chooses. The real ``ClientConnection``, ``Exchange``,
``ResponseReader`` and ``Splice`` run on them, with no event loop (the harness runs the turns).

Input: ``n | control (n bytes) | upstream bytes``. ``control[0]`` picks how many requests and
``control[1:5]`` which; each further control byte is one step (``op & 7``, size ``op >> 3``).

A crash is any exception, a bug relay logs, or a broken invariant:

* what reaches the client is well-framed HTTP/1.1 responses (a strict llhttp parser accepts
  them), at most one final response per request, in order, interim 1xx only before a final
  one and no more of them than that upstream sent; or it ends visibly truncated (a chunked
  body without its last chunk, a Content-Length body short) on a closed connection;
* a relayed body is a prefix of what that exchange's upstream sent (no byte of another
  response, nor one after the response), but for relay's own end of a Connect stream;
* a Connect stream whose upstream did not complete it, yet ends cleanly for the client, ends
  with an end-of-stream envelope at an envelope boundary (SPEC §3);
* a pooled connection is only reused, and only left idle, at the end of its responses: the
  bytes its upstream sent parse as exactly the responses relay read from it;
* once the client is gone, no exchange, splice, in-flight count or owned upstream is left.

    fuzz/.venv/bin/python fuzz/fuzz_upstream.py -max_total_time=60 -max_len=4096 \
        fuzz/corpus/upstream fuzz/seeds-upstream
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import atheris

sys.path.insert(0, __file__.rsplit("/", 1)[0])
with atheris.instrument_imports(include=["relay"]):
    from fakes import (
        LATER,
        Bugs,
        FakePool,
        FakeTransport,
        FakeUpstream,
        client_gone,
        make_relay,
    )
    from invariants import ROUTES
    from upstream_checks import Message, check_client

    from relay import response, response_events
    from relay.core import streams
    from relay.core.streams import EnvelopeTracker
    from relay.forward import Exchange
    from relay.server import ClientConnection


# relay's limits on what a guest sends, at the sizes of fuzzed inputs (a few KiB), so that
# what happens past them is fuzzed too: a response head or trailers too large, an envelope
# over the hold limit (passed through unheld), too many envelopes or frames in one read (no
# longer followed).
response.RESPONSE_HEAD_LIMIT = response_events.RESPONSE_HEAD_LIMIT = 512
EnvelopeTracker.__init__.__defaults__ = (64,)
streams.MAX_ENVELOPES_PER_READ = 16
streams.MAX_FRAMES_PER_READ = 16

HOST = b"Host: 8080-open.e2b.test\r\n"
WS_HEAD = (
    b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
)
CONNECT_BODY = b"\x00\x00\x00\x00\x02{}"
# The requests, each with a target naming its place in the sequence (%d): the method, then
# the request's bytes.
REQUESTS: list[tuple[bytes, bytes]] = [
    (b"GET", b"GET /g%d HTTP/1.1\r\n" + HOST + b"\r\n"),
    (b"HEAD", b"HEAD /h%d HTTP/1.1\r\n" + HOST + b"\r\n"),
    (b"POST", b"POST /p%d HTTP/1.1\r\n" + HOST + b"Content-Length: 5\r\n\r\nhello"),
    (b"WS", b"GET /w%d HTTP/1.1\r\n" + HOST + WS_HEAD + b"\r\n"),
    (
        b"CONNECT",
        b"POST /process.Process/S%d HTTP/1.1\r\nHost: 49983-open.e2b.test\r\n"
        b"Content-Type: application/connect+json\r\nContent-Length: 7\r\n\r\n" + CONNECT_BODY,
    ),
]


class Harness:
    def __init__(self) -> None:
        self.relay = make_relay()
        self.pool: FakePool = self.relay.pool  # type: ignore[assignment]
        self.relay.spawn = self.spawn  # type: ignore[method-assign]
        acquire = self.pool.acquire

        def checked_acquire(key: Any, max_idle_s: float = 0.0) -> FakeUpstream:
            idle = [c for c in self.pool.idle.get(key, []) if not c.closed]
            if idle:
                self.check_idle(idle[-1])  # the one acquire takes (last in, first out)
            return acquire(key, max_idle_s)

        self.pool.acquire = checked_acquire  # type: ignore[method-assign]
        release = self.pool.release

        def answered_release(conn: FakeUpstream) -> None:
            conn.pending = 0  # the requests were answered by the fuzzed bytes (check_idle)
            release(conn)

        self.pool.release = answered_release  # type: ignore[method-assign]
        # Per upstream connection: its bytes, and the methods of the exchanges it served.
        self.sent: dict[int, bytearray] = {}
        self.served: dict[int, list[bytes]] = {}
        # Per exchange: the bytes its upstream sent while it owned the connection.
        self.by_exchange: dict[int, tuple[Exchange, bytearray]] = {}
        self.spliced = bytearray()  # what the upstream sent once its 101 was spliced

    def spawn(self, coro: Any) -> None:
        """A retry's dial, run in the next turn (no loop: the harness runs the turns)."""
        LATER.append(lambda: _run(coro))

    def check_idle(self, conn: FakeUpstream) -> None:
        """An idle connection sits at the end of the responses relay read from it."""
        methods = self.served.get(id(conn), [])
        data = bytes(self.sent.get(id(conn), b""))
        assert methods, "an idle connection that served no exchange"
        assert b"HEAD" not in methods, "a connection reused after a response to HEAD"
        pos, finals = 0, 0
        while pos < len(data) and data[pos:].strip(b"\r\n"):
            message = Message(head_only=False, ours=False)
            pos = message.read(data, pos)
            assert message.complete, ("pooled mid-response", data, methods)
            assert not message.upgrade, data
            assert message.status != 101, data
            if message.status >= 200:
                finals += 1
        assert finals == len(methods), ("pooled with bytes after its response", data, methods)

    def deliver(self, conn: FakeUpstream, data: bytes) -> None:
        owner = conn.owner
        if isinstance(owner, Exchange):
            self.sent.setdefault(id(conn), bytearray()).extend(data)
            key = id(owner)
            if key not in self.by_exchange:
                self.by_exchange[key] = (owner, bytearray())
                self.served.setdefault(id(conn), []).append(owner.head.method)
            self.by_exchange[key][1].extend(data)
        elif owner is not None:
            self.spliced += data  # a WebSocket's (there is at most one upgrade per input)
        conn.data_received(data)

    def turns(self) -> None:
        relay = self.relay
        for _ in range(64):  # bounded: a flood's continuation runs a slice per turn
            relay.outbox.end_turn()
            if not LATER:
                return
            later = LATER[:]
            LATER.clear()
            for callback in later:
                callback()
        relay.outbox.end_turn()

    def idle(self) -> FakeUpstream | None:
        for conns in self.pool.idle.values():
            for conn in conns:
                if not conn.closed:
                    return conn
        return None

    def active(self) -> FakeUpstream | None:
        for conn in reversed(self.pool.made):
            if conn.owner is not None and not conn.closed:
                return conn
        return None


def _run(coro: Any) -> None:
    try:
        coro.send(None)
    except StopIteration:
        return
    raise AssertionError("a dial awaited: the fake pool never waits")


HARNESS = Harness()
LAST: list[bytes] = []
logging.getLogger("relay").addHandler(Bugs())
logging.getLogger("relay").setLevel(logging.ERROR)
logging.getLogger("relay").propagate = False


def test_one_input(data: bytes) -> None:
    if not data:
        return
    h = HARNESS
    relay = h.relay
    h.pool.reset()
    h.sent.clear()
    h.served.clear()
    h.by_exchange.clear()
    h.spliced.clear()
    relay.install_routes(dict(ROUTES), "fuzz")  # back, if the last input deleted it
    n = data[0]
    control, upstream = data[1 : 1 + n], data[1 + n :]
    count = 1 + (control[0] % 4 if control else 0)
    kinds = [REQUESTS[(control[1 + i] if 1 + i < len(control) else i) % 5] for i in range(count)]
    methods = [kind[0] for kind in kinds]
    client = b"".join(request % i for i, (_, request) in enumerate(kinds))
    ops = control[1 + count :]

    transport = FakeTransport()
    conn = ClientConnection(relay, tls=False)
    conn.connection_made(transport)  # type: ignore[arg-type]
    sent = 0  # of the client's bytes
    taken = 0  # of the upstream's bytes

    def upstream_read(size: int) -> None:
        nonlocal taken
        target = h.active()
        if target is None or not target.reading or taken >= len(upstream):
            return
        piece = upstream[taken : taken + size]
        taken += len(piece)
        h.deliver(target, piece)

    for op in ops:
        if transport.closed:
            break
        kind, arg = op & 7, op >> 3
        if kind <= 1:
            upstream_read(1 + arg * arg // 4)
        elif kind == 2:
            # The client's socket buffer fills, or drains: relay pauses or resumes reading
            # the upstream (backpressure, SPEC §4).
            if transport.paused:
                transport.paused = False
                conn.resume_writing()
            else:
                transport.paused = True
                conn.pause_writing()
        elif kind == 3 and sent < len(client):
            piece = client[sent : sent + 1 + arg * 4]
            sent += len(piece)
            conn.data_received(piece)
        elif kind == 4:
            # The upstream closes: the connection in use, or (odd) an idle pooled one.
            target = h.active() if arg % 2 == 0 else h.idle()
            if target is not None:
                target.eof_received()
                target.connection_lost(h.pool)
        elif kind == 5:
            if arg % 2 == 0:
                relay.revoke(frozenset({"open"}))  # its route changed (a new generation)
            else:  # or it went: the feed deleted it (SPEC §3)
                relay.install_routes({k: v for k, v in ROUTES.items() if k != "open"}, "fuzz")
        elif kind == 6 and sent < len(client):
            conn.data_received(client[sent:])
            sent = len(client)
        elif kind == 7:
            upstream_read(len(upstream))
        h.turns()
    if transport.paused and not transport.closed:
        transport.paused = False
        conn.resume_writing()
        h.turns()
    # The rest: the client's requests, then the upstream's bytes as they are asked for.
    if not transport.closed and sent < len(client):
        conn.data_received(client[sent:])
        h.turns()
    for _ in range(8):
        if transport.closed or taken >= len(upstream) or h.active() is None:
            break
        assert h.active().reading, "an upstream left unread: the client is not paused"  # type: ignore[union-attr]
        upstream_read(len(upstream))
        h.turns()
    # The upstreams end (a response still open is then complete, or cut), and so does a
    # retry's fresh connection, which gets nothing.
    for _ in range(4):
        target = h.active()
        if target is None:
            break
        target.eof_received()
        target.connection_lost(h.pool)
        h.turns()
    # What is left idle must be reusable (the next client would get it).
    for idle in list(h.pool.idle.values()):
        for pooled in idle:
            if not pooled.closed:
                h.check_idle(pooled)
    h.turns()
    client_gone(conn, relay)
    for made in h.pool.made:
        assert made.owner is None or made.closed, ("an upstream still owned", made.owner)

    LAST[:] = [bytes(transport.out), client]  # a crash from fuzz/crashes/, replayed under pdb
    # A FIN after a cut answer is as visible as a close: relay half-closes when the client
    # may still be sending (a lingering close, RFC 9112 §9.6), e.g. a request whose head was
    # put aside unparsed while others queued (relay.slices) when the answer before it was cut.
    check_client(
        bytes(transport.out),
        methods,
        transport.closed or transport.eof,
        h.by_exchange.values(),
        bytes(h.spliced),
    )


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
