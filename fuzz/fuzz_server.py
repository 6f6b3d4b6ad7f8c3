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

import atheris

sys.path.insert(0, __file__.rsplit("/", 1)[0])
with atheris.instrument_imports(include=["relay"]):
    from fakes import LATER, Bugs, FakePool, FakeTransport, client_gone, make_relay

    from relay.server import ClientConnection

import httptools

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


class Responses:
    """Counts the well-framed responses relay wrote to the client."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.count = 0

    def on_headers_complete(self) -> None:
        if self.parser.get_status_code() >= 200:
            self.count += 1


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
    client_gone(conn, relay)
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
