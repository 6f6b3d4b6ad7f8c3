"""``decide(head, ...) → Forward | Reject``: the one place where the order of checks lives.

SPEC §5a fixes the precedence when several refusals apply::

    CONNECT (405) → framing (400/431/501/505) → target (400) → control port (403) /
    control path (404) → route lookup (502; 503 while the table is not ready or stale) →
    credentials (401/403) → per-sandbox limit (429)

Everything before the route lookup depends on the request alone, so those answers reveal
nothing about which sandboxes exist. Request-target form, path encoding and Upgrade checks
belong to "framing": they are properties of the message, not of its destination.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

from relay.core import answers, auth, headers, policy, target
from relay.core.model import (
    Decision,
    Forward,
    Framing,
    Kind,
    PoolKey,
    Reason,
    Reject,
    RequestHead,
    Route,
    Target,
)
from relay.core.routes import Network, RouteTable

STALE_RETRY_AFTER_S = 5
NOT_READY_RETRY_AFTER_S = 2
_HTTP_VERSIONS = frozenset({"1.1", "1.0"})
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS"})  # that relay may send twice (Forward)


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """The slice of the configuration that decisions depend on."""

    domains: tuple[str, ...] = ("sandbox.localhost",)
    envd_port: int = 49983
    denied_ports: frozenset[int] = frozenset({50090})
    strip: bool = True  # upstream.credentials == "strip"
    management: bool = False  # a management upstream is configured
    management_host: bytes = b""  # its authority, the Host of an HTTP/1.0 request without one
    trusted_proxies: tuple[Network, ...] = ()

    # What every forwarded request loses: hop-by-hop fields, the httpoxy ``Proxy`` field, and
    # credentials in strip mode.
    drop: frozenset[bytes] = frozenset()

    def __post_init__(self) -> None:
        # Longest domain first, so that the most specific configured domain wins.
        ordered = tuple(sorted({d.lower().rstrip(".") for d in self.domains}, key=len))
        object.__setattr__(self, "domains", ordered[::-1])
        drop = headers.HOP_BY_HOP | {headers.HTTPOXY}
        if self.strip:
            drop |= headers.CREDENTIALS
        object.__setattr__(self, "drop", drop)


@dataclass(frozen=True, slots=True)
class FeedState:
    """What the route feed says about the table's freshness (SPEC §3, Staleness)."""

    ready: bool = True
    stale: bool = False


def body_framing(version: str, fields: dict[bytes, list[bytes]]) -> tuple[Framing, int] | Reject:
    """RFC 9112 §6: llhttp already refused CL with TE and differing lengths; relay also refuses
    every coding but exactly ``chunked`` and any Transfer-Encoding in HTTP/1.0."""
    te = fields.get(b"transfer-encoding")
    if te is not None:
        if version == "1.0":
            return Reject(reason=Reason.BAD_REQUEST, detail="Transfer-Encoding in HTTP/1.0")
        if len(te) != 1 or te[0].strip().lower() != b"chunked":
            return Reject(reason=Reason.BAD_TRANSFER_ENCODING)
        return Framing.CHUNKED, 0
    cl = fields.get(b"content-length")
    if cl is not None:
        # llhttp already admits digits only and one value; checked again so that decide()
        # is total on any input (RFC 9112 §6.3: an invalid length is unrecoverable).
        if len(cl) != 1 or not cl[0].strip().isdigit() or len(cl[0].strip()) > 18:
            return Reject(reason=Reason.BAD_REQUEST, detail="Invalid Content-Length")
        length = int(cl[0])
        return (Framing.LENGTH, length) if length else (Framing.NONE, 0)
    return Framing.NONE, 0


def websocket_upgrade(
    head: RequestHead, fields: dict[bytes, list[bytes]], framing: Framing
) -> bool | Reject:
    """True for a WebSocket handshake (RFC 6455 §4.1); other upgrades are refused (h2c...)."""
    upgrade = fields.get(b"upgrade")
    if upgrade is None:
        return False
    if len(upgrade) != 1 or upgrade[0].strip().lower() != b"websocket":
        return Reject(reason=Reason.BAD_UPGRADE)
    if b"upgrade" not in headers.connection_tokens(fields.get(b"connection")):
        if head.upgrade:
            # llhttp took it for an upgrade all the same (it reads ``Proxy-Connection`` as
            # ``Connection``) and parses nothing after the head: forwarded as a plain request,
            # its body stayed behind as the "WebSocket's" first bytes and the app waited for
            # it for ever (found by review).
            return Reject(
                reason=Reason.BAD_UPGRADE, detail="An upgrade must be named in Connection"
            )
        return False  # a stray Upgrade field: dropped as hop-by-hop, not an upgrade
    if head.method != b"GET" or framing is not Framing.NONE:
        return Reject(
            reason=Reason.BAD_UPGRADE, detail="A WebSocket handshake is a GET without body"
        )
    if head.version != "1.1":
        # RFC 6455 §4.2.1: "an HTTP/1.1 or higher GET request"; RFC 9110 §7.8: Upgrade in an
        # HTTP/1.0 request MUST be ignored (an HTTP/1.0 intermediary may have passed on the
        # client's Connection and Upgrade without knowing them, then read the frames as
        # HTTP). Refused, as E2B's SDKs and browsers always send HTTP/1.1: forwarded as an
        # HTTP/1.1 handshake, it turned the connection into a WebSocket.
        return Reject(reason=Reason.BAD_UPGRADE, detail="A WebSocket handshake needs HTTP/1.1")
    return True


def _peer_trusted(peer: str, trusted: tuple[Network, ...]) -> bool:
    if not trusted or not peer:
        return False
    try:
        ip = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(ip in net for net in trusted)


def decide(
    head: RequestHead,
    table: RouteTable,
    settings: Settings,
    *,
    feed: FeedState = FeedState(),
    now: int = 0,
    inflight: Mapping[str, int] | None = None,
) -> Decision:
    # -- CONNECT: never an L4 tunnel, wherever it points.
    if head.method == b"CONNECT":
        return Reject(reason=Reason.CONNECT)
    # -- framing
    if head.version not in _HTTP_VERSIONS:
        return Reject(reason=Reason.BAD_VERSION)
    fields, names = headers.index_with_names(head.headers)
    framing = body_framing(head.version, fields)
    if isinstance(framing, Reject):
        return framing
    repeated = headers.repeated_singleton(fields)
    if repeated is not None:
        return Reject(
            reason=Reason.REPEATED_FIELD, detail=f"Header {repeated.decode()} must appear once"
        )
    split = policy.split_target(head.target)
    if isinstance(split, Reject):
        return split
    websocket = websocket_upgrade(head, fields, framing[0])
    if isinstance(websocket, Reject):
        return websocket
    # -- target
    host_values = fields.get(b"host")
    if host_values is None:
        if head.version == "1.1":
            return Reject(reason=Reason.BAD_REQUEST, detail="Missing Host header")  # RFC 9112 §3.2
        from_host = None
    else:
        well_formed, from_host = target.host_target(host_values[0], settings.domains)
        if not well_formed:
            return Reject(reason=Reason.BAD_HOST, detail="Invalid Host header")
    found = target.combine(
        from_host, fields.get(b"e2b-sandbox-id"), fields.get(b"e2b-sandbox-port")
    )
    if isinstance(found, Reject):
        return found
    rules = headers.OutboundRules(
        drop=settings.drop,
        framing=framing[0],
        content_length=framing[1],
        websocket=websocket,
        forwarded_for=(
            (head.peer, "https" if head.tls else "http", host_values[0] if host_values else b"")
            if settings.trusted_proxies and _peer_trusted(head.peer, settings.trusted_proxies)
            else None
        ),
    )
    if found is None:
        if not settings.management:
            return Reject(reason=Reason.NO_TARGET)
        path = _outbound_path(split, settings.strip)
        if host_values is None:
            rules = dataclasses.replace(rules, host=settings.management_host or b"localhost")
        return _forward(head, Kind.MANAGEMENT, None, None, path, fields, names, rules, split)
    # -- control port / control path
    if found.port in settings.denied_ports:
        return Reject(reason=Reason.CONTROL_PORT, named=found)
    is_envd = found.port == settings.envd_port
    preflight = is_envd and _preflight(head, fields, framing[0])
    if is_envd and split.clean_path in policy.CONTROL_PATHS:  # any method (SPEC §2)
        return Reject(reason=Reason.CONTROL_PATH, path=split.clean_path, named=found)
    # Refusals from here on do not depend on a credential, which a preflight never carries:
    # the actual request gets them too, readable, once its preflight is answered as envd would.
    cors = preflight and b"origin" in fields
    # -- route lookup
    if not feed.ready:
        return Reject(
            reason=Reason.NOT_READY,
            retry_after=NOT_READY_RETRY_AFTER_S,
            named=found,
            envd_preflight=cors,
        )
    if feed.stale:
        return Reject(
            reason=Reason.STALE, retry_after=STALE_RETRY_AFTER_S, named=found, envd_preflight=cors
        )
    route = table.routes.get(found.sandbox_id)
    if route is None:
        return Reject(
            reason=Reason.NOT_FOUND, sandbox_id=found.sandbox_id, named=found, envd_preflight=cors
        )
    # -- credentials
    path = _outbound_path(split, settings.strip)
    expires: int | None = None
    if is_envd:
        tokens = fields.get(headers.ACCESS_TOKEN)
        refused, expires = auth.envd_verdict(
            auth.EnvdRequest(
                method=head.method,
                clean_path=split.clean_path,
                raw_query=split.raw_query,
                # An empty header is no header, as to envd (Go's Header.Get gives "" for
                # both): /health and a signed URL pass with one (found by review).
                access_token=tokens[0] if tokens and tokens[0].strip(b" \t") else None,
                preflight=preflight,
            ),
            route,
            now,
        )
    else:
        refused = auth.check_traffic(fields.get(headers.TRAFFIC_TOKEN), route)
        # The traffic token is for relay alone and is removed in either credentials mode.
        if not settings.strip:
            rules = dataclasses.replace(rules, drop=rules.drop | {headers.TRAFFIC_TOKEN})
    if refused is not None:
        return dataclasses.replace(refused, sandbox_id=route.sandbox_id, named=found)
    # -- per-sandbox limit
    limit = route.max_connections
    if limit and inflight is not None and inflight.get(route.sandbox_id, 0) >= limit:
        return Reject(
            reason=Reason.SANDBOX_LIMIT,
            sandbox_id=route.sandbox_id,
            limit=route.max_connections,
            named=found,
            envd_preflight=cors,
        )
    if host_values is None:
        rules = dataclasses.replace(rules, host=_sandbox_host(found, route, settings))
    kind = Kind.ENVD if is_envd else Kind.APP
    forward = _forward(head, kind, found, route, path, fields, names, rules, split, expires)
    forward.envd_preflight = cors
    return forward


def _preflight(head: RequestHead, fields: dict[bytes, list[bytes]], framing: Framing) -> bool:
    """A CORS preflight as rs/cors (envd's) tells one: OPTIONS with a non-empty
    Access-Control-Request-Method; and, as the Fetch standard sends it, no body."""
    if head.method != b"OPTIONS" or framing is not Framing.NONE:
        return False
    # The first value only, as envd reads it (Go's Header.Get; rs/cors tests it non-empty):
    # an empty first and a second would be a preflight here and a request to envd's handlers
    # there (found by review).
    values = fields.get(b"access-control-request-method")
    return bool(values and values[0].strip(b" \t"))


def _sandbox_host(found: Target, route: Route, settings: Settings) -> bytes:
    """The Host sent for an HTTP/1.0 request that had none (routed by its E2b-Sandbox-*
    headers): relay forwards HTTP/1.1, which must have one (RFC 9112 §3.2; Go's net/http,
    envd's, answers 400 without; found by review). The name the Host form would have used,
    so that an app that checks its Host (a dev server's allowed hosts) sees its public one."""
    if settings.domains:
        return f"{found.port}-{found.sandbox_id}.{settings.domains[0]}".encode("latin-1")
    address = f"[{route.address}]" if ":" in route.address else route.address
    return f"{address}:{found.port}".encode("latin-1")


def _outbound_path(split: policy.SplitTarget, strip: bool) -> bytes:
    """The request-target sent upstream: the client's raw bytes, in ``strip`` mode minus the
    ``signature``/``signature_expiration`` pairs. They are removed on every port, not only
    on envd's: a signed file URL is a bearer credential, and no credential reaches a guest
    (SPEC §2). An app that wants a parameter literally named ``signature`` must rename it."""
    if split.raw_query is None:
        return split.raw_path
    if not strip or (b"signature" not in split.raw_query.lower() and b"%" not in split.raw_query):
        return split.raw_path + b"?" + split.raw_query
    query = auth.strip_signature_params(split.raw_query)
    return split.raw_path + (b"?" + query if query else b"")


def _forward(
    head: RequestHead,
    kind: Kind,
    found: Target | None,
    route: Route | None,
    path: bytes,
    fields: dict[bytes, list[bytes]],
    names: list[bytes],
    rules: headers.OutboundRules,
    split: policy.SplitTarget,
    expires: int | None = None,
) -> Forward:
    outbound = headers.request_headers(head.headers, names, fields, rules)
    sandbox_id, port = (found.sandbox_id, found.port) if found is not None else (None, None)
    method = head.method.decode("latin-1")
    return Forward(
        kind=kind,
        target=found,
        route=route,
        method=head.method,
        path=path,
        headers=outbound,
        wire=headers.serialise_request(head.method, path, outbound),
        framing=rules.framing,
        content_length=rules.content_length,
        websocket=rules.websocket,
        log_path=split.clean_path,
        log_fields=answers.log_members(sandbox_id, port, method, split.clean_path),
        pool_key=(
            PoolKey(route.sandbox_id, route.generation, route.address, port)
            if route is not None and port is not None
            else None
        ),
        expires=expires,
        replayable=rules.framing is Framing.NONE and head.method in _IDEMPOTENT,
    )
