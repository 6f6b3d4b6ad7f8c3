"""Found by review: an HTTP/1.0 client gets a close-delimited response (relay re-frames a chunked or
unlengthed upstream body that way, core/responses.py). When the upstream dies mid-body, relay
ends the client connection with an orderly close (FIN), which for a close-delimited body *is*
the end of the message: the client takes the truncated body as complete.

RFC 9112 §8: a response with neither chunked coding nor Content-Length "is terminated by
closure of the connection and ... is considered complete unless an error was indicated by the
underlying connection". The only way left to tell the client is an abortive close (RST), as
relay's own contract wants a cut response to be visible (SPEC §3: "so the client sees the
truncation"; respond.py Respond.cut: "close without the terminator so the client sees it").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.wired import DOMAIN, make_wired

HOST = f"3000-sbx.{DOMAIN}"


@pytest.mark.parametrize(
    ("head", "ending"),
    [
        (b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "reset"),
        (b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "fin"),
        (b"Connection: close\r\n\r\nhello", "reset"),
        (b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "revoked"),
    ],
    ids=["chunked-reset", "chunked-fin", "unlengthed-reset", "chunked-revoked"],
)
def test_an_http10_client_sees_a_cut_response_as_cut(
    tmp_path: Path, head: bytes, ending: str
) -> None:
    w = make_wired(tmp_path)
    w.client.data_received(f"GET /x HTTP/1.0\r\nHost: {HOST}\r\n\r\n".encode())
    w.turns.end()
    w.upstream.data_received(b"HTTP/1.1 200 OK\r\n" + head)
    w.turns.end()
    if ending == "revoked":
        w.relay.install_routes({}, "t2")  # SPEC §3: the route is removed mid-response
    elif ending == "fin":
        w.upstream.eof_received()  # mid-chunk-stream: no last chunk
        w.upstream.connection_lost(None)
    else:
        w.upstream.connection_lost(ConnectionResetError(104, "Connection reset by peer"))
    w.turns.end()
    events = w.client_transport.events
    assert events[0][0] == "write"
    assert events[0][1].startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Length" not in events[0][1]  # close-delimited for the client
    assert w.client_transport.data.endswith(b"hello")
    kinds = [kind for kind, _ in events]
    assert "abort" in kinds, f"{kinds}: an orderly close ends a close-delimited body cleanly"
    assert "close" not in kinds
