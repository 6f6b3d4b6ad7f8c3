"""Plain data that crosses the boundary between relay's pure core and its I/O adapters.

Everything here is a frozen, slotted dataclass or an enum: no behaviour beyond small derived
properties, so that the decision functions in ``relay.core`` are easy to test as tables.

Header names and values stay ``bytes`` as they came off the wire (latin-1 in HTTP/1.1,
RFC 9110 §5.5): the core compares lower-cased names and never needs to decode most values,
and the adapter can serialise the outgoing head without a round trip through ``str``.

The two records made for every request (:class:`RequestHead`, :class:`Forward`) are slotted
but not ``frozen``: a frozen dataclass assigns each field through ``object.__setattr__``,
which costs about 1.3 µs per construction here, a visible share of relay's per-request CPU
budget. Nothing mutates them after construction; treat them as values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

Headers = tuple[tuple[bytes, bytes], ...]


class Kind(enum.Enum):
    """What a forwarded request is for; also the ``kind`` label of request metrics."""

    ENVD = "envd"
    APP = "app"
    MANAGEMENT = "management"


class Framing(enum.Enum):
    """How a message body is delimited on the wire (RFC 9112 §6)."""

    NONE = "none"
    LENGTH = "length"
    CHUNKED = "chunked"


class PoolKey(NamedTuple):
    """Where a forwarded request goes, and an upstream pool's identity (SPEC §4: pooled per
    sandbox id, generation, address and port). A NamedTuple, not a dataclass: it is built and
    hashed in C. Made once with a :class:`Forward`, so a remembered decision remembers it."""

    sandbox_id: str  # "" for the management upstream
    generation: int
    address: str
    port: int


@dataclass(frozen=True, slots=True)
class Target:
    """The sandbox and port a request is for (SPEC §1)."""

    sandbox_id: str
    port: int


@dataclass(slots=True, kw_only=True)
class RequestHead:
    """A parsed request head, as the HTTP parser (llhttp) validated it."""

    method: bytes
    target: bytes
    version: str
    headers: Headers
    peer: str = ""
    tls: bool = False
    # True when llhttp saw ``Connection: upgrade`` together with an ``Upgrade`` field.
    upgrade: bool = False
    # Not part of the value: the decision remembered for this head object, with the memory's
    # epoch it holds for (``relay.decisions``). A kept-alive connection reuses the head of a
    # repeated request (``relay.request_heads``), which then skips the memory's hashed lookup.
    decided: tuple[object, Decision] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """Where a running sandbox is and what its credentials are (SPEC §3).

    Tokens are excluded from ``repr`` and comparisons print nothing secret; use
    :func:`relay.core.routes.public_view` for anything shown to an operator.
    """

    sandbox_id: str
    address: str
    envd_token: str | None = field(default=None, repr=False)
    traffic_token: str | None = field(default=None, repr=False)
    generation: int = 0
    insecure: bool = False
    max_connections: int = 0


CLOSE = True


class Reason(enum.Enum):
    """Every answer relay makes itself: status, metric label and default text in one table.

    The table replaces a ladder of branches each repeating a status, a log call and a
    template (the shape E2B's Go proxy has); ``relay.core.answers`` renders any member.
    """

    CONNECT = (405, "connect", "CONNECT is not supported", CLOSE)
    BAD_VERSION = (505, "bad_version", "HTTP version not supported", CLOSE)
    BAD_TRANSFER_ENCODING = (501, "bad_framing", "Transfer-Encoding other than chunked", CLOSE)
    BAD_REQUEST = (400, "bad_request", "Bad request", CLOSE)
    HEADERS_TOO_LARGE = (431, "headers_too_large", "Request header fields too large", CLOSE)
    HEADER_TIMEOUT = (408, "header_timeout", "The request head was not received in time", CLOSE)
    BAD_TARGET_FORM = (400, "bad_target", "The request target must be in origin-form", CLOSE)
    BAD_PATH = (400, "bad_path", "The request path has a forbidden encoding")
    BAD_UPGRADE = (400, "bad_upgrade", "Only WebSocket upgrades are supported", CLOSE)
    # Plain HTTP to a TLS listener (relay.handshake), answered before any TLS as nginx does
    # ("400 The plain HTTP request was sent to HTTPS port"), so that a client given http://
    # reads why rather than "connection reset".
    PLAIN_HTTP = (
        400,
        "plain_http",
        "The plain HTTP request was sent to the HTTPS port: use https://",
        CLOSE,
    )
    BAD_HOST = (400, "bad_host", "Invalid host")
    BAD_ROUTING_HEADER = (400, "bad_routing_header", "Invalid sandbox routing headers")
    REPEATED_FIELD = (
        400,
        "repeated_field",
        "A header field that must appear once is repeated",
        CLOSE,
    )
    BAD_EXPIRATION = (400, "bad_signature_expiration", "Invalid signature_expiration")
    ENVD_UNAUTHORIZED = (
        401,
        "envd_token",
        "unauthorized access, please provide a valid access token or method signing if supported",
    )
    TRAFFIC_TOKEN_MISSING = (
        403,
        "traffic_token_missing",
        "Sandbox is secured with traffic access token. "
        "Token header 'e2b-traffic-access-token' is missing",
    )
    TRAFFIC_TOKEN_INVALID = (
        403,
        "traffic_token_invalid",
        "Sandbox is secured with traffic access token. "
        "Provided token in header 'e2b-traffic-access-token' is invalid",
    )
    CONTROL_PORT = (
        403,
        "control_port",
        "This port is reserved for the control plane and is not reachable through the sandbox URL",
    )
    CONTROL_PATH = (
        404,
        "control_path",
        "This endpoint is reserved for the control plane and is not reachable through the "
        "sandbox URL",
    )
    NO_TARGET = (
        404,
        "no_target",
        "No sandbox in the request: use the <port>-<sandboxId>.<domain> host or the "
        "E2b-Sandbox-Id and E2b-Sandbox-Port headers",
    )
    SANDBOX_LIMIT = (
        429,
        "sandbox_limit",
        "The sandbox has too many concurrent incoming connections",
    )
    NOT_FOUND = (502, "not_found", "The sandbox was not found")
    # A route that changed (address, generation or a token) under a request still waiting for
    # its answer. Not NOT_FOUND: the sandbox still runs, and E2B's SDKs (2.63+) read "was not
    # found" as SandboxNotRunningException; any other 502 text reads as unreachable.
    ROUTE_CHANGED = (
        502,
        "route_changed",
        "The sandbox's route changed while the request was in flight",
    )
    PORT_CLOSED = (502, "port_closed", "The sandbox is running but port is not open")
    UPSTREAM_ERROR = (502, "upstream_error", "The sandbox answered with a malformed response")
    MANAGEMENT_UNAVAILABLE = (502, "management_unavailable", "The API server is unreachable")
    NOT_READY = (503, "not_ready", "route cache is not ready")
    STALE = (503, "stale", "route cache is stale")
    OVERLOADED = (503, "overloaded", "relay has too many open connections", CLOSE)
    DRAINING = (503, "draining", "relay is shutting down", CLOSE)
    INTERNAL = (500, "internal_error", "relay failed to handle the request", CLOSE)

    def __init__(self, status: int, label: str, text: str, closes: bool = False) -> None:
        self.status = status
        self.label = label
        self.text = text
        # The request's framing or meaning is in doubt, or relay must shed the connection:
        # answer, then close (SPEC §5a), never read another request from it.
        self.closes = closes


@dataclass(frozen=True, slots=True, kw_only=True)
class Reject:
    """An answer relay gives itself instead of forwarding (SPEC §5)."""

    reason: Reason
    detail: str | None = None  # replaces the reason's default text (400s "say which")
    sandbox_id: str | None = None  # echoed as ``sandboxId`` once a route was looked up
    port: int | None = None
    path: str | None = None  # the cleaned path, for the reserved-endpoint 404
    limit: int | None = None  # the per-sandbox connection limit, for 429
    retry_after: int | None = None
    # The sandbox and port the request named, for the access log only (never echoed: a
    # control-path 404 does not say which sandbox it was for). Without it a 401, 403 or 429
    # logged "port": null, and a control-path refusal no sandbox_id (found by review).
    named: Target | None = None
    # A browser's CORS preflight (with an Origin) to the envd port: answered as envd's CORS
    # layer would (``relay.core.answers``), so that the browser sends the actual request and
    # can read relay's refusal of it (SPEC §5); a 2xx is the only preflight answer it accepts.
    envd_preflight: bool = False

    @property
    def status(self) -> int:
        return self.reason.status

    @property
    def message(self) -> str:
        if self.detail is not None:
            return self.detail
        if self.reason is Reason.SANDBOX_LIMIT and self.limit is not None:
            return f"{self.reason.text} (limit: {self.limit})"
        return self.reason.text


@dataclass(slots=True, kw_only=True)
class Forward:
    """A request relay forwards, with everything the adapter needs to write it upstream."""

    kind: Kind
    target: Target | None
    route: Route | None
    method: bytes
    # The request-target sent upstream: the client's raw bytes, minus stripped query pairs.
    path: bytes
    # End-to-end headers to send (hop-by-hop and stripped credentials removed, framing and
    # upgrade fields added), in the client's order.
    headers: Headers
    framing: Framing
    content_length: int
    websocket: bool = False
    # The cleaned path, for logs (never includes the query).
    log_path: str = ""
    # The request's members of its access-log line (``answers.log_members``), made once.
    log_fields: str = ""
    # The request head exactly as written upstream (method, path, headers above): made once
    # with the decision, so a remembered decision also remembers its serialisation.
    wire: bytes
    # The upstream pool it goes to; None for the management upstream (the adapter's address).
    pool_key: PoolKey | None = None
    # The last Unix second at which this decision holds: a signed URL's
    # ``signature_expiration`` (``auth.envd_verdict``). None: it does not depend on the clock.
    expires: int | None = None
    # relay may send it twice (RFC 9110 §9.2.2: an idempotent method, and no body to replay):
    # again on a fresh connection when a reused one closes before answering
    # (relay.forward.UNSAFE_REUSE_IDLE_S).
    replayable: bool = False
    # A browser's CORS preflight to envd: if envd cannot be reached, answered as envd would
    # answer it (``Reject.envd_preflight``), not with the 502.
    envd_preflight: bool = False


Decision = Forward | Reject
