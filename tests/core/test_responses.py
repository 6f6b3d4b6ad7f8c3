"""Planning the client-facing response head and framing (relay.core.responses)."""

from __future__ import annotations

import pytest

from relay.core import responses
from relay.core.model import Framing
from relay.core.responses import (
    PLAN_MEMO_BYTES,
    PLAN_MEMO_FIELDS,
    ResponsePlan,
    interim_head,
    plan_response,
    status_line,
    upgrade_head,
)

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


@pytest.mark.parametrize(
    "connection", [((b"Connection", b"Upgrade"),), ()], ids=["listed", "not-listed"]
)
def test_a_426s_upgrade_is_not_relayed(connection: tuple[tuple[bytes, bytes], ...]) -> None:
    """README "Decisions": Upgrade is dropped from every response but a 101's, listed in
    Connection or not (RFC 9110 §7.6.1 names it among the fields an intermediary removes
    either way), as E2B's proxy (Go's ReverseProxy) does; a 426's names a protocol for the
    guest's connection to relay, which relay does not take up."""
    result = plan((*connection, (b"Upgrade", b"h2c"), CL), status=426)
    assert b"Upgrade" not in result.head
    assert result.head.endswith(b"\r\nContent-Length: 5\r\n\r\n")


def test_http10_client_gets_a_close_delimited_body() -> None:
    result = plan((), client_version="1.0")
    assert not result.keep_alive
    assert result.head.endswith(b"Connection: close\r\n\r\n")


def test_an_http10_connection_kept_alive_says_so() -> None:
    """RFC 9112 §9.3: an HTTP/1.0 connection persists only when both sides say so; without
    the answer's keep-alive the client takes it for the last (found by review)."""
    result = plan((CL,), client_version="1.0")
    assert result.keep_alive
    assert result.head.endswith(b"Content-Length: 5\r\nConnection: keep-alive\r\n\r\n")
    assert b"Connection" not in plan((CL,)).head  # HTTP/1.1 persists by default


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


def tiny_fields(count: int) -> tuple[tuple[bytes, bytes], ...]:
    """``count`` distinct short fields: the most Python objects per byte of head."""
    return tuple((b"x%d" % i, b"v") for i in range(count))


def sized(fields: int, size: int) -> tuple[tuple[bytes, bytes], ...]:
    """``fields`` fields of exactly ``size`` bytes of names and values, with the reason "OK"
    (what ``plan_response`` counts)."""
    others = (CL, *tiny_fields(fields - 2))
    used = len(b"OK") + sum(len(n) + len(v) for n, v in others) + len(b"X-Pad")
    assert size >= used
    return (*others, (b"X-Pad", b"p" * (size - used)))


@pytest.mark.parametrize(
    "headers",
    [
        # The review's probe: ~7,000 tiny fields under the 64 KiB response head limit; each
        # remembered plan kept ~1 MB of field objects alive.
        (*tiny_fields(7000), CL),
        sized(PLAN_MEMO_FIELDS + 1, 300),  # one field too many
        sized(3, PLAN_MEMO_BYTES + 1),  # one byte too many
    ],
    ids=["7000-fields", "fields", "bytes"],
)
def test_a_head_too_large_to_remember_is_planned_every_time(
    headers: tuple[tuple[bytes, bytes], ...],
) -> None:
    first = plan(headers)
    assert first.framing is Framing.LENGTH
    assert first.length == 5
    assert first.head.count(b"\r\n") == len(headers) + 2  # every field passed on
    again = plan(headers)
    assert again == first  # planned afresh, to the same plan
    assert again is not first  # but not remembered


def test_an_ordinary_head_up_to_the_limits_is_remembered() -> None:
    nginx = ((b"Server", b"nginx"), (b"Content-Type", b"text/plain"), CL)
    for headers in (nginx, sized(PLAN_MEMO_FIELDS, PLAN_MEMO_BYTES)):
        first = plan(headers)
        assert plan(headers) is first


def test_status_lines_remembered_only_for_short_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    # A guest may send any reason, up to the 64 KiB response head: 256 long ones would pin
    # 32 MiB. A fresh memory, so that what other tests left in it does not matter.
    monkeypatch.setattr(responses, "_STATUS_LINES", {})
    assert status_line(299, b"Fine") is status_line(299, b"Fine")
    long = b"R" * 65
    assert status_line(299, long) == b"HTTP/1.1 299 " + long + b"\r\n"
    assert status_line(299, long) is not status_line(299, long)


@pytest.mark.parametrize(
    ("fields", "relayable"),
    [
        (((b"Transfer-Encoding", b"chunked"),), True),
        (((b"transfer-encoding", b" Chunked "),), True),
        (((b"Transfer-Encoding", b", chunked,"),), True),  # empty elements (RFC 9110 §5.6.1)
        (((b"Transfer-Encoding", b"gzip"),), False),
        (((b"Transfer-Encoding", b"gzip, chunked"),), False),
        (((b"Transfer-Encoding", b"chunked, gzip"),), False),
        (((b"Transfer-Encoding", b"gzip"), (b"Transfer-Encoding", b"chunked")), False),
        (((b"Transfer-Encoding", b"chunked"), (b"Transfer-Encoding", b"chunked")), False),
    ],
)
def test_only_a_chunked_transfer_coding_is_relayed(
    fields: tuple[tuple[bytes, bytes], ...], relayable: bool
) -> None:
    """RFC 9112 §6.1/§6.3: relay drops Transfer-Encoding and re-frames; any coding but a
    single chunked would reach the client still coded, unannounced (answered 502)."""
    got = plan(fields)
    assert (got.unrelayable == "") is relayable
    assert (got.framing is Framing.CHUNKED) is relayable
    assert plan(fields, method=b"HEAD").unrelayable == ""  # no body follows: nothing to decode


@pytest.mark.parametrize(
    ("headers", "dateless"),
    [
        ((CL,), True),
        ((CL, (b"Date", b"Sun, 06 Nov 1994 08:49:37 GMT")), False),
        ((CL, (b"date", b"x")), False),
        # A Date the upstream's Connection names is not passed on: relay's goes instead.
        ((CL, (b"Date", b"x"), (b"Connection", b"Date")), True),
    ],
)
def test_a_response_without_a_date_is_planned_for_one(
    headers: tuple[tuple[bytes, bytes], ...], dateless: bool
) -> None:
    # RFC 9110 §6.6.1: a recipient that forwards a response without Date appends one.
    planned = plan(headers)
    assert planned.dateless is dateless
    dated = responses.with_date(planned.head, b"Mon, 07 Dec 2026 20:00:00 GMT")
    assert dated.startswith(b"HTTP/1.1 200 OK\r\nDate: Mon, 07 Dec 2026 20:00:00 GMT\r\n")
    assert dated.endswith(planned.head.partition(b"\r\n")[2])


@pytest.mark.parametrize("value", [b"0005", b"5 ", b"5\t", b"000000000000000000000005"])
@pytest.mark.parametrize(("status", "method"), [(200, b"GET"), (200, b"HEAD"), (304, b"GET")])
def test_the_content_length_written_is_relays_own_number(
    value: bytes, status: int, method: bytes
) -> None:
    """relay re-frames every response (SPEC §5a): the Content-Length it writes is its own
    decimal, as for a request. llhttp admits leading zeros and trailing whitespace (OWS,
    RFC 9110 §5.5), which went to the client as the guest wrote them (found by review; nginx
    writes its own number too)."""
    got = plan(((b"Content-Length", value),), status, method=method)
    assert b"\r\nContent-Length: 5\r\n" in got.head
    if status == 200 and method == b"GET":
        assert got.length == 5
