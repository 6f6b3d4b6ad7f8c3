"""Heads seen before: what llhttp made of a request or a response head, by its bytes.

Clients and upstreams repeat their heads byte for byte: an SDK sends the same request line,
Host and token on every call, and an upstream's response heads change at most once a second
(``Date``). llhttp reports a head through one call into Python per field, line and event, so
a head parsed once is remembered with what llhttp reported for it, and the next read that
holds exactly those bytes is replayed from memory instead (``relay.server`` for requests,
``relay.response`` for responses; each says which reads qualify).

Why this is safe: llhttp is a pure function of its input and of where it starts. A head is
remembered only when llhttp parsed it from the start of a message, in a read that was that
head (plus, for a response, exactly its body) and nothing more, and ended the message at the
read's end, ready for another (keep-alive: after a message that closes the connection llhttp
refuses what follows, and a replay would not). It is replayed only for a read with the same
bytes, again at the start of a message. The results do not depend on which connection or
peer sent the bytes, and relay's own checks (size limits, routing, auth) run on a replayed
head exactly as on a parsed one. A line ended by a bare CR or LF is never remembered (llhttp
reads an upstream's bare LF as a line end, ``relay.response_events``, so it could end the head
there, before the first empty CRLF line where the remembered key ends); it refuses one in a
request.

Bounded like the decision memo (``relay.decisions``): each memo is dropped whole when it holds
``KNOWN_HEADS`` heads, and a head longer than ``KNOWN_HEAD_BYTES`` or with more than
``KNOWN_FIELDS`` fields is never remembered. An entry holds its key and the field tuples
(~130 B of objects per field), so at most about 1,024 entries of 6 KiB per memo. A peer that
sends ever-new heads only costs one dictionary lookup and one insertion per head. Besides the
memos, each connection keeps the last head it replayed (one entry within the same bounds, also
on an idle pooled upstream connection), so that a repeated read is compared, not hashed.
"""

from __future__ import annotations

from typing import NamedTuple, TypeVar

from relay.core.model import Headers

KNOWN_HEADS = 1024
KNOWN_HEAD_BYTES = 2048
KNOWN_FIELDS = 32

V = TypeVar("V")


class KnownRequest(NamedTuple):
    """A request head without a body, as llhttp reported it."""

    method: bytes
    target: bytes
    version: str
    headers: Headers
    keep_alive: bool
    size: int  # what listen.max_header_bytes is checked against (SPEC §5a)


class KnownResponse(NamedTuple):
    """A whole response of ``length`` body bytes (Content-Length), as llhttp reported it."""

    status: int
    reason: bytes
    headers: Headers
    keep: bool
    length: int


REQUESTS: dict[bytes, KnownRequest] = {}
RESPONSES: dict[bytes, KnownResponse] = {}


def remember(memo: dict[bytes, V], key: bytes, value: V, fields: int) -> None:
    """Keep ``value`` for the head ``key`` (already checked: at most KNOWN_HEAD_BYTES long,
    parsed whole by llhttp from a message start), unless it is too large or has odd lines."""
    if fields > KNOWN_FIELDS or not key.count(b"\n") == key.count(b"\r") == key.count(b"\r\n"):
        return
    if len(memo) >= KNOWN_HEADS:
        memo.clear()
    memo[key] = value
