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
    from invariants import ROUTES, frame_ends

    from relay import response, response_events
    from relay.core import streams
    from relay.core.streams import CLOSE_GOING_AWAY, EnvelopeTracker, close_frame
    from relay.forward import Exchange
    from relay.server import ClientConnection

import httptools

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


class Message:
    """One response as a strict llhttp parser reads it, fed a byte at a time so that where
    it ends is known."""

    def __init__(self, head_only: bool, *, ours: bool = True) -> None:
        self.ours = ours  # relay wrote it: a parse error is a crash (else: the guest's error)
        self.error = False
        self.parser = httptools.HttpResponseParser(self)
        if not ours:
            # The upstream's bytes, read as relay reads them: a bare LF ends a line
            # (relay.response, RFC 9112 §2.2); relay's own output must not have one.
            self.parser.set_dangerous_leniencies(lenient_optional_cr_before_lf=True)
        self.head_only = head_only
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = bytearray()
        self.head_done = False
        self.complete = False
        self.upgrade = False

    def on_header(self, name: bytes, value: bytes) -> None:
        # The first of repeated fields, as relay (and Go's Header.Get) reads them.
        self.headers.setdefault(name.lower(), value)

    def on_headers_complete(self) -> None:
        self.head_done = True
        self.status = self.parser.get_status_code()
        if self.head_only and self.status >= 200:
            self.complete = True  # an answer to HEAD ends at its head (RFC 9110 §9.3.2)

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True

    def read(self, data: bytes, pos: int) -> int:
        """Feed from ``pos`` until the message completes; returns where it ended, or
        len(data) if it did not. A parse error is a crash (relay wrote a broken message)."""
        view = memoryview(data)
        while pos < len(data):
            try:
                self.parser.feed_data(view[pos : pos + 1])
            except httptools.HttpParserUpgrade:
                self.upgrade = True
                return pos + 1
            except httptools.HttpParserError:
                if self.ours:
                    raise
                self.error = True
                return len(data)
            pos += 1
            if self.complete:
                return pos
        return pos

    @property
    def chunked(self) -> bool:
        return b"chunked" in self.headers.get(b"transfer-encoding", b"").lower()

    @property
    def connect_stream(self) -> bool:
        """What relay follows as a Connect server stream (relay.core.responses)."""
        kind = self.headers.get(b"content-type", b"").lower()
        return self.chunked and kind.startswith(b"application/connect+json")

    @property
    def close_delimited(self) -> bool:
        return (
            b"transfer-encoding" not in self.headers
            and b"content-length" not in self.headers
            and not self.head_only
            and self.status not in (204, 304)
        )


def responses(
    data: bytes, head_only: bool, *, one: bool = False, ours: bool = True
) -> tuple[list[Message], int]:
    """The messages (interim and final) at the start of ``data``, the last one possibly
    incomplete, and where they end; ``one``: up to the first final one. A final answer to
    HEAD is read as its head only. After a 101, the rest is not HTTP."""
    out: list[Message] = []
    pos = 0
    while pos < len(data):
        message = Message(head_only, ours=ours)
        pos = message.read(data, pos)
        out.append(message)
        if message.upgrade or message.status == 101 or not message.complete:
            break
        if one and message.status >= 200:
            break
    return out, pos


def envelopes_end(body: bytes) -> bool:
    """Whether a Connect body is whole envelopes up to an end-of-stream one (SPEC §3)."""
    pos = 0
    while len(body) - pos >= 5:
        size = int.from_bytes(body[pos + 1 : pos + 5], "big")
        if len(body) - pos < 5 + size:
            return False
        if body[pos] & 0x02:
            return True
        pos += 5 + size
    return False


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

    LAST[:] = [bytes(transport.out), client]  # for a look at a crash (fuzz/README)
    # A FIN after a cut answer is as visible as a close: relay half-closes when the client
    # may still be sending (a lingering close, RFC 9112 §9.6), e.g. a request whose head was
    # put aside unparsed while others queued (relay.slices) when the answer before it was cut.
    check_client(bytes(transport.out), methods, transport.closed or transport.eof, h)


def check_client(out: bytes, methods: list[bytes], closed: bool, h: Harness) -> None:
    exchanges = {
        int(ex.head.target.rstrip(b"/").split(b"/")[-1].lstrip(b"ghpwS")): (ex, bytes(sent))
        for ex, sent in h.by_exchange.values()
    }
    pos = 0
    for i, method in enumerate(methods):
        if pos >= len(out):
            break
        head_only = method == b"HEAD"
        messages, consumed = responses(out[pos:], head_only, one=True)
        upstream = exchanges.get(i)
        theirs = (
            responses(upstream[1], head_only, one=True, ours=False)[0]
            if upstream is not None
            else []
        )
        interims_sent = sum(1 for m in theirs if m.head_done and 100 <= m.status < 200)
        finals = [m for m in messages if m.status >= 200 or m.upgrade]
        interims = [m for m in messages if m.head_done and 100 <= m.status < 200]
        assert len(interims) <= interims_sent, ("a 1xx the upstream did not send", i)
        pos += consumed
        last = messages[-1]
        if last.upgrade or last.status == 101:
            assert method == b"WS", ("a 101 to a request that asked for no upgrade", i)
            assert upstream is not None
            check_splice(out[pos:], bytes(upstream[1] + h.spliced))
            return  # the rest is WebSocket frames
        if not last.complete:
            # Cut: visibly, on a connection that is closed; and nothing after it.
            assert closed, ("a response left incomplete on an open connection", i)
            assert last.head_done, ("a response head cut short", i, out)
            assert pos == len(out)
            return
        assert len(finals) == 1, (i, out)
        final = finals[0]
        if (
            upstream is not None
            and not upstream[0].reason.startswith(("upstream:", "internal"))
            and theirs
        ):
            their_final = next((m for m in theirs if m.head_done and m.status >= 200), None)
            if their_final is not None and their_final.status == final.status:
                body, origin = bytes(final.body), bytes(their_final.body)
                if not origin.startswith(body):
                    # Only relay's own end of a Connect stream may follow the upstream's bytes
                    # (relay follows any chunked connect+json response, whatever the request).
                    assert final.connect_stream, (i, body, origin)
                    assert _own_end(body, origin), (i, body, origin)
            tracker = upstream[0]._tracker
            if (
                final.connect_stream
                and (their_final is None or not their_final.complete)
                # A stream no longer followed has its end taken on trust (relay.upstream_side)
                and (tracker is None or tracker.following)
            ):
                assert envelopes_end(bytes(final.body)), ("a cut stream without its end", i)
    assert not out[pos:].strip(b"\r\n") or pos >= len(out), ("bytes after the responses", out[pos:])


def check_splice(relayed: bytes, theirs: bytes) -> None:
    """After a 101 the client gets what the upstream sent after it, as it came, and at most a
    Close frame of relay's own (a revocation), at a frame boundary (RFC 6455 §5.5.1)."""
    messages, pos = responses(theirs, head_only=False, ours=False)
    assert messages, theirs
    assert messages[-1].upgrade, ("spliced, but the upstream's 101 was not one", theirs)
    after = theirs[pos:]
    if after.startswith(relayed):
        return
    going_away = close_frame(CLOSE_GOING_AWAY)
    assert relayed.endswith(going_away), ("bytes the upstream did not send", relayed, after)
    frames = relayed[: -len(going_away)]
    assert after.startswith(frames), (relayed, after)
    assert len(frames) in frame_ends(after), ("a Close frame inside a frame", relayed, after)


def _own_end(body: bytes, origin: bytes) -> bool:
    """``body`` is a prefix of ``origin`` and then one "unavailable" end-of-stream envelope."""
    for k in range(len(body) - 5, -1, -1):
        if (
            body[k] == 0x02
            and int.from_bytes(body[k + 1 : k + 5], "big") == len(body) - k - 5
            and origin.startswith(body[:k])
            and b"unavailable" in body[k:]
        ):
            return True
    return False


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
