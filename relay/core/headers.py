"""Header rules: hop-by-hop fields, credential stripping, X-Forwarded-* (SPEC §2, §4).

relay re-frames every message it forwards (SPEC §5a), so the framing fields of the inbound
message (``Content-Length``, ``Transfer-Encoding``) are always dropped and the adapter's
framing is written instead; nothing reaches a peer in the other side's framing.
"""

from __future__ import annotations

from dataclasses import dataclass

from relay.core.model import Framing, Headers

# RFC 9110 §7.6.1 names Connection, Proxy-Connection, Keep-Alive, TE, Transfer-Encoding and
# Upgrade; Proxy-Authenticate/-Authorization are for this hop only (RFC 9110 §11.7), and
# Trailer announces trailers relay does not forward. Content-Length is re-written by relay.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"te",
        b"transfer-encoding",
        b"upgrade",
        b"trailer",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"content-length",
    }
)
# httpoxy (CVE-2016-5385): CGI and what is modelled on it (RFC 3875 §4.1.18: WSGI, PHP,
# Rack) turn a ``Proxy`` request field into the variable ``HTTP_PROXY``, which HTTP clients
# (Go's net/http, curl, Python's requests) read as their outbound proxy: a caller could route
# a sandbox app's own outgoing requests through a host of its choosing. No standard request
# field is named Proxy; nginx's and Apache's advisories drop it at the proxy, and so does
# relay, from every request.
HTTPOXY = b"proxy"
ACCESS_TOKEN = b"x-access-token"
TRAFFIC_TOKEN = b"e2b-traffic-access-token"
CREDENTIALS = frozenset({ACCESS_TOKEN, TRAFFIC_TOKEN})
# What a proxy tells the upstream about the client, dropped from an untrusted peer (SPEC §4).
# Every ``X-Forwarded-*`` field goes, by prefix: besides For/Proto/Host/Port/Prefix, apps
# behind proxies read -Server, -Uri, -Scheme, -Ssl, -Client-Cert (Envoy's XFCC), -User and
# -Email (oauth2-proxy) as facts a proxy vouched for, and more get invented.
FORWARDED = frozenset({b"forwarded", b"x-real-ip"})
FORWARDED_PREFIX = b"x-forwarded-"
_AFTER_FORWARDED_PREFIX = b"x-forwarded."  # b"-" + 1: the first name past every prefixed one
_UNDERSCORE = 0x5F  # ``95 in name`` is a byte scan; ``b"_" in name`` goes through a buffer
# Fields that must appear at most once: two routing ids or two tokens are ambiguous, and
# a verifier and an upstream could each read a different one (SPEC §5a).
SINGLETONS = (b"host", b"e2b-sandbox-id", b"e2b-sandbox-port", ACCESS_TOKEN, TRAFFIC_TOKEN)


def index(headers: Headers) -> dict[bytes, list[bytes]]:
    """Lower-cased name → values in order of appearance."""
    return index_with_names(headers)[0]


def index_with_names(headers: Headers) -> tuple[dict[bytes, list[bytes]], list[bytes]]:
    """The index, and the lower-cased names in header order (so they are lowered once)."""
    out: dict[bytes, list[bytes]] = {}
    names = []
    for name, value in headers:
        key = name.lower()
        names.append(key)
        values = out.get(key)
        if values is None:
            out[key] = [value]
        else:
            values.append(value)
    return out, names


def connection_tokens(values: list[bytes] | None) -> frozenset[bytes]:
    """Lower-cased tokens of all ``Connection`` fields (RFC 9110 §7.6.1)."""
    if not values:
        return frozenset()
    return frozenset(
        token.strip().lower() for value in values for token in value.split(b",") if token.strip()
    )


def fields_size(headers: Headers) -> int:
    """Bytes of the fields' names and values (what a memo keyed by them keeps a copy of)."""
    size = 0
    for name, value in headers:
        size += len(name) + len(value)
    return size


def accepts_websocket(headers: Headers) -> bool:
    """A 101 that completes a WebSocket handshake names it: ``Upgrade: websocket`` and
    ``Connection: upgrade`` (RFC 6455 §4.1, the client's checks of the server's answer).

    relay writes the 101 with its own spelling of these hop-by-hop fields, so it checks them
    itself: a 101 without them is not a WebSocket and is answered 502 instead of being passed
    on looking like one.
    """
    fields = index(headers)
    return b"websocket" in connection_tokens(fields.get(b"upgrade")) and b"upgrade" in (
        connection_tokens(fields.get(b"connection"))
    )


def repeated_singleton(fields: dict[bytes, list[bytes]]) -> bytes | None:
    for name in SINGLETONS:
        values = fields.get(name)
        if values is not None and len(values) > 1:
            return name
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboundRules:
    """What to remove from and add to a request on its way upstream."""

    drop: frozenset[bytes]
    framing: Framing
    content_length: int = 0
    websocket: bool = False
    # Set only for a peer in ``listen.trusted_proxies``: (client ip, scheme, host).
    forwarded_for: tuple[str, str, bytes] | None = None
    # The Host to send when the request had none (HTTP/1.0; relay forwards HTTP/1.1).
    host: bytes | None = None


def request_headers(
    headers: Headers,
    names: list[bytes],
    fields: dict[bytes, list[bytes]],
    rules: OutboundRules,
) -> Headers:
    """The end-to-end request fields to send upstream, in the client's order.

    ``names`` are the lower-cased names of ``headers`` (from :func:`index_with_names`).

    From a peer that is not a trusted proxy, ``Forwarded``, ``X-Real-IP`` and every
    ``X-Forwarded-*`` field are dropped (SPEC §4). From a trusted proxy they are kept and
    this hop is added (:func:`_with_forwarded`).

    Underscore spellings: a name that relay drops is also dropped when spelled with ``_``
    for any ``-`` (``X_Forwarded_For``, ``X_Access_Token``, ``E2b_Traffic_Access_Token``,
    ``Transfer_Encoding``...). RFC 9110 §5.1 makes them different fields, but CGI and what
    is modelled on it (WSGI, PHP, Rack) fold ``-`` and ``_`` into one ``HTTP_*`` variable
    (RFC 3875 §4.1.18), so to such an upstream ``X_Forwarded_For: 6.6.6.6`` is a client
    address and ``X_Access_Token`` a credential. Only the spellings of what relay drops
    anyway go; any other name with ``_`` passes untouched (SPEC §2 "everything else passes";
    nginx instead ignores every such name by default, ``underscores_in_headers off``).

    - Credentials: relay checks only the ``-`` spelling, and in ``strip`` mode no credential
      may reach an upstream (SPEC §2), so no spelling of one may either. In ``forward`` mode
      ``X_Access_Token`` is passed on like ``X-Access-Token``; the traffic token, relay's
      own, goes in every spelling in either mode.
    - Forwarding fields: dropped in these spellings even from a trusted proxy. A proxy
      writes them with ``-``; an underscore spelling is a client's that the proxy passed on
      without recognising it, and a CGI upstream would merge it into the
      ``X-Forwarded-For`` relay writes.
    """
    drop = rules.drop
    connection = fields.get(b"connection")
    if connection is not None:
        # Host is what relay routed on and is preserved (SPEC §4): naming it in Connection
        # does not make the upstream see a request without it.
        drop = drop | (connection_tokens(connection) - {b"host"})
    if rules.forwarded_for is None:
        drop = drop | FORWARDED
        # Per field: one set lookup, a bytes comparison (names in [prefix, after) are those
        # starting with the prefix; no slice is allocated) and a byte scan; names with an
        # underscore (rare) take _kept_folded.
        prefix, after = FORWARDED_PREFIX, _AFTER_FORWARDED_PREFIX
        out = [
            pair
            for pair, key in zip(headers, names, strict=True)
            if key not in drop
            and (key < prefix or key >= after)
            and (_UNDERSCORE not in key or _kept_folded(key, drop))
        ]
    else:
        out = [
            pair
            for pair, key in zip(headers, names, strict=True)
            if key not in drop and (_UNDERSCORE not in key or _kept_folded(key, drop))
        ]
        out = _with_forwarded(out, fields, rules.forwarded_for)
    if rules.host is not None:
        out.insert(0, (b"Host", rules.host))
    if rules.framing is Framing.LENGTH:
        out.append((b"Content-Length", str(rules.content_length).encode()))
    elif rules.framing is Framing.CHUNKED:
        out.append((b"Transfer-Encoding", b"chunked"))
    elif b"content-length" in fields:
        # No body, and the client said so with ``Content-Length: 0`` (a validated length of
        # zero is the only one framed NONE): said again. Without any framing field the
        # message is the same (RFC 9112 §6.3), but a user agent normally sends the 0 (RFC 9110
        # §8.6), apps read it (Python's http.server handlers: int(headers["Content-Length"]))
        # and servers that want a length answer 411; E2B's proxy (Go's transport,
        # transfer.go shouldSendContentLength) sends it too.
        out.append((b"Content-Length", b"0"))
    if rules.websocket:
        out.append((b"Connection", b"Upgrade"))
        out.append((b"Upgrade", b"websocket"))
    return tuple(out)


def _kept_folded(key: bytes, drop: frozenset[bytes]) -> bool:
    """Whether a lower-cased name containing ``_`` is kept: its ``-`` spelling is neither
    dropped nor a forwarding field (see :func:`request_headers`)."""
    folded = key.replace(b"_", b"-")
    return not (folded in drop or folded in FORWARDED or folded.startswith(FORWARDED_PREFIX))


def _with_forwarded(
    out: list[tuple[bytes, bytes]],
    fields: dict[bytes, list[bytes]],
    forwarded_for: tuple[str, str, bytes],
) -> list[tuple[bytes, bytes]]:
    """Behind a trusted proxy: append this hop to X-Forwarded-For and keep the proxy's
    X-Forwarded-Proto/-Host, filling them from this hop when the proxy did not set them."""
    client, scheme, host = forwarded_for
    out = [(n, v) for n, v in out if n.lower() != b"x-forwarded-for"]
    prior = b", ".join(fields.get(b"x-forwarded-for", []))
    out.append((b"X-Forwarded-For", (prior + b", " if prior else b"") + client.encode()))
    if b"x-forwarded-proto" not in fields:
        out.append((b"X-Forwarded-Proto", scheme.encode()))
    if b"x-forwarded-host" not in fields and host:
        out.append((b"X-Forwarded-Host", host))
    return out


def serialise_request(method: bytes, target: bytes, headers: Headers) -> bytes:
    """An HTTP/1.1 request head; relay always speaks HTTP/1.1 upstream."""
    lines = [method + b" " + target + b" HTTP/1.1"]
    lines.extend(name + b": " + value for name, value in headers)
    return b"\r\n".join(lines) + b"\r\n\r\n"
