"""How an upstream response is passed to the client: its head and its framing (SPEC §4).

relay re-frames every response (SPEC §5a): the upstream's framing fields are dropped and the
client gets ``Content-Length`` when the upstream gave one, else chunked coding (HTTP/1.1) or a
close-delimited body (HTTP/1.0). Hop-by-hop fields and the fields the upstream's
``Connection`` names are removed (RFC 9110 §7.6.1).

This is on the per-request hot path, so the head is planned in one pass over the upstream's
fields and serialised with a single join.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from relay.core.headers import HOP_BY_HOP, connection_tokens
from relay.core.model import Framing, Headers

CONNECT_TYPE = b"application/connect+json"
# Connection options that name no field: nothing more to remove when these are all it says.
_PLAIN_OPTIONS = frozenset({b"keep-alive", b"close", b"upgrade"})
_PLAIN_VALUES = frozenset({b"keep-alive", b"close", b"upgrade"})
_STATUS_LINES: dict[tuple[int, bytes], bytes] = {}


@dataclass(slots=True)
class ResponsePlan:
    head: bytes  # status line and fields, ready to write to the client
    framing: Framing  # how relay frames the body towards the client
    keep_alive: bool  # whether the client connection may carry another request
    connect_stream: bool  # a chunked Connect server stream: follow its envelopes
    ends_at_head: bool  # the response to HEAD: no body follows its head
    length: int = -1  # the body's Content-Length when framing is LENGTH


def status_line(status: int, reason: bytes) -> bytes:
    key = (status, reason)
    line = _STATUS_LINES.get(key)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, reason)
        if len(_STATUS_LINES) < 256:  # a guest may invent reasons: keep the cache bounded
            _STATUS_LINES[key] = line
    return line


def serialise_head(status: int, reason: bytes, fields: list[tuple[bytes, bytes]]) -> bytes:
    parts = [status_line(status, reason)]
    for name, value in fields:
        parts.append(name + b": " + value + b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def end_to_end(headers: Headers) -> tuple[list[tuple[bytes, bytes]], dict[bytes, bytes]]:
    """The fields to pass on, and the framing-relevant ones relay read on the way.

    The second value maps ``content-length``, ``transfer-encoding`` and ``content-type`` to
    their (first) values when present.
    """
    out: list[tuple[bytes, bytes]] = []
    seen: dict[bytes, bytes] = {}
    connection: list[bytes] | None = None
    for name, value in headers:
        low = name.lower()
        if low in HOP_BY_HOP:
            if low == b"connection":
                connection = [value] if connection is None else [*connection, value]
            elif low not in seen:
                seen[low] = value
            continue
        if low == b"content-type" and low not in seen:
            seen[low] = value
        out.append((name, value))
    if connection is not None and any(v.lower() not in _PLAIN_VALUES for v in connection):
        named = connection_tokens(connection) - _PLAIN_OPTIONS
        if named:
            out = [pair for pair in out if pair[0].lower() not in named]
            if b"content-type" in named:
                seen.pop(b"content-type", None)
    return out, seen


@functools.lru_cache(maxsize=1024)
def plan_response(
    status: int,
    reason: bytes,
    headers: Headers,
    method: bytes,
    client_version: str,
    keep_alive: bool,
    websocket: bool,
) -> ResponsePlan:
    """The client-facing head and framing of a final (non-1xx, non-101) response.

    Memoised (bounded): an upstream repeats the same heads (an app's static answers, envd's
    stream heads), and planning one costs more than hashing it. The plan is shared, so
    nothing may mutate it.
    """
    out, seen = end_to_end(headers)
    length = seen.get(b"content-length")
    ends_at_head = method == b"HEAD"
    if ends_at_head or status in (204, 304):
        framing = Framing.NONE
        if length is not None and status != 204:
            out.append((b"Content-Length", length))  # the size a GET would have (RFC 9110 §8.6)
    elif length is not None and b"transfer-encoding" not in seen:
        framing = Framing.LENGTH
        out.append((b"Content-Length", length))
    elif client_version == "1.1":
        framing = Framing.CHUNKED
        out.append((b"Transfer-Encoding", b"chunked"))
    else:
        framing = Framing.NONE  # HTTP/1.0 client: the body ends when the connection closes
        keep_alive = False
    if websocket:
        keep_alive = False  # the client asked to leave HTTP; do not keep it in HTTP
    if not keep_alive:
        out.append((b"Connection", b"close"))
    content_type = seen.get(b"content-type")
    connect_stream = (
        framing is Framing.CHUNKED
        and content_type is not None
        and content_type.lower().startswith(CONNECT_TYPE)
    )
    return ResponsePlan(
        head=serialise_head(status, reason, out),
        framing=framing,
        keep_alive=keep_alive,
        connect_stream=connect_stream,
        ends_at_head=ends_at_head,
        # llhttp admitted the value: digits only, one value (a list of equal values included).
        length=int(length.split(b",")[0]) if framing is Framing.LENGTH and length else -1,
    )


def interim_head(status: int, reason: bytes, headers: Headers) -> bytes:
    """A 1xx interim response passed to an HTTP/1.1 client (RFC 9110 §15.2)."""
    return serialise_head(status, reason, end_to_end(headers)[0])


def upgrade_head(reason: bytes, headers: Headers) -> bytes:
    """The 101 of a WebSocket handshake (RFC 6455 §4.2.2), in relay's own spelling of the
    upgrade fields, which are hop-by-hop and re-added (RFC 9110 §7.8)."""
    out = end_to_end(headers)[0]
    out.append((b"Connection", b"Upgrade"))
    out.append((b"Upgrade", b"websocket"))
    return serialise_head(101, reason, out)
