"""Planning the client-facing response head and framing (relay.core.responses)."""

from __future__ import annotations

import pytest

from relay.core.model import Framing
from relay.core.responses import ResponsePlan, interim_head, plan_response, upgrade_head

CL = (b"Content-Length", b"5")
TE = (b"Transfer-Encoding", b"chunked")


def plan(headers: tuple[tuple[bytes, bytes], ...], status: int = 200, **kw: object) -> ResponsePlan:
    method = kw.get("method", b"GET")
    version = kw.get("client_version", "1.1")
    assert isinstance(method, bytes)
    assert isinstance(version, str)
    return plan_response(status, b"OK", headers, method, version, True, False)


@pytest.mark.parametrize(
    ("headers", "status", "kw", "framing", "length"),
    [
        ((CL,), 200, {}, Framing.LENGTH, b"5"),
        ((TE,), 200, {}, Framing.CHUNKED, None),
        ((), 200, {}, Framing.CHUNKED, None),  # close-delimited upstream → chunked to 1.1
        ((), 200, {"client_version": "1.0"}, Framing.NONE, None),
        ((CL,), 200, {"method": b"HEAD"}, Framing.NONE, b"5"),
        ((CL,), 304, {}, Framing.NONE, b"5"),
        ((CL,), 204, {}, Framing.NONE, None),
    ],
)
def test_framing(
    headers: tuple[tuple[bytes, bytes], ...],
    status: int,
    kw: dict[str, object],
    framing: Framing,
    length: bytes | None,
) -> None:
    result = plan(headers, status, **kw)
    assert result.framing is framing
    has_length = b"\r\nContent-Length: " in result.head
    assert has_length is (length is not None)
    if length is not None:
        assert b"\r\nContent-Length: " + length + b"\r\n" in result.head
    assert result.head.count(b"Transfer-Encoding") == (framing is Framing.CHUNKED)


def test_hop_by_hop_and_connection_named_fields_are_dropped() -> None:
    result = plan(
        (
            (b"Connection", b"keep-alive, X-Private"),
            (b"X-Private", b"secret"),
            (b"Keep-Alive", b"timeout=5"),
            (b"Content-Type", b"text/plain"),
            CL,
        )
    )
    assert result.head == (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\n"
    )


def test_http10_client_gets_a_close_delimited_body() -> None:
    result = plan((), client_version="1.0")
    assert not result.keep_alive
    assert result.head.endswith(b"Connection: close\r\n\r\n")


def test_connect_stream_is_recognised_only_when_chunked() -> None:
    ctype = (b"Content-Type", b"application/connect+json")
    assert plan((ctype,)).connect_stream
    assert not plan((ctype, CL)).connect_stream


def test_interim_and_upgrade_heads() -> None:
    assert interim_head(100, b"Continue", ()) == b"HTTP/1.1 100 Continue\r\n\r\n"
    head = upgrade_head(
        b"Switching Protocols", ((b"Upgrade", b"WebSocket"), (b"Sec-WebSocket-Accept", b"x"))
    )
    assert head == (
        b"HTTP/1.1 101 Switching Protocols\r\nSec-WebSocket-Accept: x\r\n"
        b"Connection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    )
