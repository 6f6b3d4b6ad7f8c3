"""How an upstream response is passed to the client: its head and its framing (SPEC §4).

relay re-frames every response (SPEC §5a): the upstream's framing fields are dropped and the
client gets ``Content-Length`` when the upstream gave one, else chunked coding (HTTP/1.1) or a
close-delimited body (HTTP/1.0). Hop-by-hop fields and the fields the upstream's
``Connection`` names are removed (RFC 9110 §7.6.1).

This is on the per-request hot path, so the head is planned in one pass over the upstream's
fields and serialised with a single join.
"""

from __future__ import annotations

from dataclasses import dataclass

from relay.core.headers import HOP_BY_HOP, connection_tokens, fields_size
from relay.core.model import Framing, Headers

CONNECT_TYPE = b"application/connect+json"
# Connection options that name no field: nothing more to remove when these are all it says.
_PLAIN_OPTIONS = frozenset({b"keep-alive", b"close", b"upgrade"})
_PLAIN_VALUES = frozenset({b"keep-alive", b"close", b"upgrade"})
_STATUS_LINES: dict[tuple[int, bytes], bytes] = {}
# End-to-end fields whose (first) value planning reads (end_to_end).
_NOTED = frozenset({b"content-type", b"date"})
# A guest may invent reasons: at most 256 lines, of reasons no longer than this (the longest
# registered one, "Network Authentication Required", has 31 bytes), so at most ~80 KB. With
# any length (up to the 64 KiB response head) the 256 lines and keys could hold 32 MiB.
_STATUS_LINE_REASON = 64


@dataclass(slots=True)
class ResponsePlan:
    head: bytes  # status line and fields, ready to write to the client
    framing: Framing  # how relay frames the body towards the client
    keep_alive: bool  # whether the client connection may carry another request
    connect_stream: bool  # a chunked Connect server stream: follow its envelopes
    ends_at_head: bool  # the response to HEAD: no body follows its head
    length: int = -1  # the body's Content-Length when framing is LENGTH
    unrelayable: str = ""  # why the response cannot be relayed (answered 502), if it cannot
    # The upstream sent no Date: relay adds one when it writes the head (with_date).
    dateless: bool = False


def status_line(status: int, reason: bytes) -> bytes:
    key = (status, reason)
    line = _STATUS_LINES.get(key)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, reason)
        if len(_STATUS_LINES) < 256 and len(reason) <= _STATUS_LINE_REASON:
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

    The second value maps ``content-length``, ``transfer-encoding``, ``content-type`` and
    ``date`` to their (first) values when present.
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
        if low in _NOTED and low not in seen:
            seen[low] = value
        out.append((name, value))
    if connection is not None and any(v.lower() not in _PLAIN_VALUES for v in connection):
        named = connection_tokens(connection) - _PLAIN_OPTIONS
        if named:
            out = [pair for pair in out if pair[0].lower() not in named]
            for noted in _NOTED & named:
                seen.pop(noted, None)
    return out, seen


# Remembered plans (``plan_response``): dropped whenever they number ``PLAN_MEMORY``, and
# only for heads of at most ``PLAN_MEMO_FIELDS`` fields and ``PLAN_MEMO_BYTES`` bytes of
# reason, names and values. An entry keeps the upstream's field tuple (~130 B of objects
# per field) and the planned head (a copy of the bytes), so ~1 KB + ~130 B per field + ~2 B
# per byte: ~2 KB for a common head (8 fields, 300 B), ~13 KB at worst within these limits,
# so at most ~13 MiB. Unlimited, a 64 KiB head of 7,000 tiny fields cost ~1 MB per entry,
# ~1 GB in all. Apps send 5-20 fields; a head beyond either limit is planned every time.
PLAN_MEMORY = 1024
PLAN_MEMO_FIELDS = 32
PLAN_MEMO_BYTES = 4096
# status, reason, fields, request method, client version, keep-alive, websocket
PlanKey = tuple[int, bytes, Headers, bytes, str, bool, bool]
_PLANS: dict[PlanKey, ResponsePlan] = {}


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

    Memoised (bounded, see ``PLAN_MEMORY``): an upstream repeats the same heads (an app's
    static answers, envd's stream heads), and planning one costs more than hashing it. The
    plan is shared, so nothing may mutate it.
    """
    key: PlanKey = (status, reason, headers, method, client_version, keep_alive, websocket)
    if len(headers) > PLAN_MEMO_FIELDS:
        # Never remembered, so not looked for: the lookup would only hash every field.
        return _plan(key)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(key)
        # Measured once, on a miss (a loop over at most PLAN_MEMO_FIELDS fields, a small
        # share of planning): a remembered head is never measured again.
        if len(reason) + fields_size(headers) <= PLAN_MEMO_BYTES:
            if len(_PLANS) >= PLAN_MEMORY:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def _plan(key: PlanKey) -> ResponsePlan:
    status, reason, headers, method, client_version, keep_alive, websocket = key
    out, seen = end_to_end(headers)
    length = seen.get(b"content-length")
    # relay's own number (re-framed, SPEC §5a): llhttp admitted one value of digits (no list),
    # with any leading zeros and trailing OWS the guest wrote (found by review: written on).
    size = -1 if length is None else int(length)
    ends_at_head = method == b"HEAD"
    if ends_at_head or status in (204, 304):
        framing = Framing.NONE
        if size >= 0 and status != 204:
            out.append((b"Content-Length", b"%d" % size))  # as a GET's (RFC 9110 §8.6)
    elif size >= 0 and b"transfer-encoding" not in seen:
        framing = Framing.LENGTH
        out.append((b"Content-Length", b"%d" % size))
    elif b"transfer-encoding" in seen and not only_chunked(headers):
        # RFC 9112 §6.3: with a final coding other than chunked the body runs to the close,
        # still in that coding. relay drops Transfer-Encoding (hop-by-hop) and would hand the
        # client coded bytes it cannot tell apart from the content: refused, as SPEC §5a
        # refuses such a request.
        return ResponsePlan(
            head=b"",
            framing=Framing.NONE,
            keep_alive=False,
            connect_stream=False,
            ends_at_head=False,
            unrelayable="upstream: Transfer-Encoding other than chunked",
        )
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
    elif client_version == "1.0":
        # An HTTP/1.0 connection persists only when both sides say so (RFC 9112 §9.3, RFC 2068
        # §19.7.1): without it the client takes this answer as the last and may wait for the
        # close, while relay keeps the connection (found by review).
        out.append((b"Connection", b"keep-alive"))
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
        length=size if framing is Framing.LENGTH else -1,
        dateless=b"date" not in seen,
    )


def with_date(head: bytes, date: bytes) -> bytes:
    """``head`` with a Date field after its status line. RFC 9110 §6.6.1: a recipient with a
    clock that forwards a response without Date MUST append one (nginx, Envoy and Go's
    server, E2B's proxy, all do). Not in the remembered plan: the clock is the adapter's."""
    cut = head.index(b"\r\n") + 2
    return b"".join((head[:cut], b"Date: ", date, b"\r\n", head[cut:]))


def only_chunked(headers: Headers) -> bool:
    """The response's transfer codings, over all its Transfer-Encoding fields, are exactly
    ``chunked`` (RFC 9112 §6.1): the only coding relay decodes and re-applies. Empty list
    elements do not count (RFC 9110 §5.6.1); chunked twice does (§6.1 forbids it; nginx
    answers such a response 502 too)."""
    codings = [
        coding.strip().lower()
        for name, value in headers
        if name.lower() == b"transfer-encoding"
        for coding in value.split(b",")
    ]
    return [coding for coding in codings if coding] == [b"chunked"]


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
