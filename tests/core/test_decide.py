"""decide(): the order of checks (SPEC §5a) and the properties that must always hold."""

from __future__ import annotations

import urllib.parse

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.core.auth import file_signature
from relay.core.decide import FeedState, Settings, decide
from relay.core.headers import CREDENTIALS, HOP_BY_HOP
from relay.core.model import Forward, Framing, Headers, Kind, Reason, Reject, RequestHead, Route
from relay.core.policy import CONTROL_PATHS
from relay.core.routes import RouteTable

SETTINGS = Settings(domains=("e2b.test",), management=True)
ROUTE = Route(
    sandbox_id="sbx1",
    address="10.0.0.5",
    envd_token="envd-tok",
    traffic_token="traffic-tok",
    generation=3,
)
TABLE = RouteTable.of({"sbx1": ROUTE})
ENVD_HOST = (b"Host", b"49983-sbx1.e2b.test")
ENVD_TOKEN = (b"X-Access-Token", b"envd-tok")


def head(
    method: bytes = b"GET",
    target: bytes = b"/",
    headers: Headers = (ENVD_HOST,),
    version: str = "1.1",
    peer: str = "192.0.2.1",
) -> RequestHead:
    return RequestHead(method=method, target=target, version=version, headers=headers, peer=peer)


def reason_of(decision: Forward | Reject) -> Reason | Kind:
    return decision.reason if isinstance(decision, Reject) else decision.kind


@pytest.mark.parametrize(
    ("request_head", "expected"),
    [
        pytest.param(head(b"CONNECT", b"x:443"), Reason.CONNECT, id="connect"),
        pytest.param(
            head(b"CONNECT", b"/init", headers=((b"Host", b"a b"),)),
            Reason.CONNECT,
            id="connect-first",
        ),
        pytest.param(head(version="2.0"), Reason.BAD_VERSION, id="http2-text"),
        pytest.param(
            head(headers=(ENVD_HOST, (b"Transfer-Encoding", b"gzip, chunked"))),
            Reason.BAD_TRANSFER_ENCODING,
            id="te-gzip",
        ),
        pytest.param(head(headers=(ENVD_HOST, ENVD_HOST)), Reason.REPEATED_FIELD, id="two-hosts"),
        pytest.param(
            head(headers=(ENVD_HOST, (b"X-Access-Token", b"a"), (b"x-access-token", b"b"))),
            Reason.REPEATED_FIELD,
            id="two-tokens",
        ),
        pytest.param(
            head(target=b"http://49983-sbx1.e2b.test/"), Reason.BAD_TARGET_FORM, id="absolute"
        ),
        pytest.param(head(target=b"/a%2Finit"), Reason.BAD_PATH, id="encoded-slash"),
        pytest.param(
            head(headers=(ENVD_HOST, (b"Upgrade", b"h2c"), (b"Connection", b"Upgrade"))),
            Reason.BAD_UPGRADE,
            id="h2c",
        ),
        pytest.param(
            head(headers=((b"Host", b"0-sbx1.e2b.test"),)), Reason.BAD_HOST, id="port-zero"
        ),
        pytest.param(head(headers=()), Reason.BAD_REQUEST, id="no-host"),
        pytest.param(
            head(headers=((b"Host", b"50090-sbx1.e2b.test"),)),
            Reason.CONTROL_PORT,
            id="control-port",
        ),
        pytest.param(head(target=b"/init"), Reason.CONTROL_PATH, id="init"),
        pytest.param(head(b"POST", b"//%69nit/"), Reason.CONTROL_PATH, id="init-encoded"),
        pytest.param(
            head(headers=((b"Host", b"49983-nope.e2b.test"),)), Reason.NOT_FOUND, id="no-route"
        ),
        pytest.param(head(target=b"/files"), Reason.ENVD_UNAUTHORIZED, id="no-credential"),
        pytest.param(
            head(headers=((b"Host", b"8080-sbx1.e2b.test"),)),
            Reason.TRAFFIC_TOKEN_MISSING,
            id="app-no-token",
        ),
        pytest.param(
            head(headers=((b"Host", b"8080-sbx1.e2b.test"), (b"E2b-Traffic-Access-Token", b"x"))),
            Reason.TRAFFIC_TOKEN_INVALID,
            id="app-bad-token",
        ),
        pytest.param(
            head(
                headers=(
                    (b"Host", b"8080-sbx1.e2b.test"),
                    (b"E2b-Traffic-Access-Token", b"traffic-tok"),
                )
            ),
            Kind.APP,
            id="app-ok",
        ),
        pytest.param(
            head(headers=(ENVD_HOST, (b"X-Access-Token", b"envd-tok"))), Kind.ENVD, id="envd-ok"
        ),
        pytest.param(head(target=b"/health"), Kind.ENVD, id="health-public"),
        pytest.param(head(headers=((b"Host", b"api.e2b.test"),)), Kind.MANAGEMENT, id="management"),
        pytest.param(
            head(
                headers=(
                    (b"Host", b"api.e2b.test"),
                    (b"E2b-Sandbox-Id", b"sbx1"),
                    (b"E2b-Sandbox-Port", b"49983"),
                )
            ),
            Kind.MANAGEMENT,
            id="api-host-ignores-routing-headers",
        ),
        pytest.param(
            head(
                headers=(
                    (b"Host", b"localhost"),
                    (b"E2b-Sandbox-Id", b"sbx1"),
                    (b"E2b-Sandbox-Port", b"49983"),
                    (b"X-Access-Token", b"envd-tok"),
                )
            ),
            Kind.ENVD,
            id="header-form",
        ),
    ],
)
def test_decision_table(request_head: RequestHead, expected: Reason | Kind) -> None:
    assert reason_of(decide(request_head, TABLE, SETTINGS)) == expected


def test_precedence_control_path_before_lookup() -> None:
    # A control path is refused the same way whether or not the sandbox exists.
    for host in (b"49983-sbx1.e2b.test", b"49983-nope.e2b.test"):
        result = decide(head(target=b"/init", headers=((b"Host", host),)), TABLE, SETTINGS)
        assert isinstance(result, Reject)
        assert result.reason is Reason.CONTROL_PATH
        assert result.path == "/init"
        assert result.sandbox_id is None


def test_no_management_upstream_is_404() -> None:
    result = decide(
        head(headers=((b"Host", b"api.e2b.test"),)), TABLE, Settings(domains=("e2b.test",))
    )
    assert reason_of(result) is Reason.NO_TARGET


@pytest.mark.parametrize(
    ("feed", "reason"),
    [(FeedState(ready=False), Reason.NOT_READY), (FeedState(stale=True), Reason.STALE)],
)
def test_feed_state_is_503_with_retry_after(feed: FeedState, reason: Reason) -> None:
    result = decide(head(target=b"/health"), TABLE, SETTINGS, feed=feed)
    assert isinstance(result, Reject)
    assert result.reason is reason
    assert result.status == 503
    assert result.retry_after


def test_sandbox_limit() -> None:
    limited = RouteTable.of(
        {"sbx1": Route(sandbox_id="sbx1", address="10.0.0.5", insecure=True, max_connections=2)}
    )
    ok = decide(head(), limited, SETTINGS, inflight={"sbx1": 1})
    assert isinstance(ok, Forward)
    refused = decide(head(), limited, SETTINGS, inflight={"sbx1": 2})
    assert isinstance(refused, Reject)
    assert refused.status == 429
    assert refused.message == "The sandbox has too many concurrent incoming connections (limit: 2)"


def test_strip_mode_forwards_without_credentials_and_signature() -> None:
    from relay.core.auth import file_signature

    sig = urllib.parse.quote(file_signature("/a", "read", "", "envd-tok", None), safe="")
    target = f"/files?path=%2Fa&signature={sig}&x=1".encode()
    result = decide(head(target=target), TABLE, SETTINGS)
    assert isinstance(result, Forward)
    assert result.path == b"/files?path=%2Fa&x=1"
    assert result.framing is Framing.NONE


def test_forward_mode_keeps_credentials() -> None:
    forward = Settings(domains=("e2b.test",), strip=False)
    result = decide(head(headers=(ENVD_HOST, (b"X-Access-Token", b"envd-tok"))), TABLE, forward)
    assert isinstance(result, Forward)
    assert (b"X-Access-Token", b"envd-tok") in result.headers


def test_hop_by_hop_and_connection_named_fields_are_dropped() -> None:
    fields = (
        ENVD_HOST,
        (b"X-Access-Token", b"envd-tok"),
        (b"Connection", b"keep-alive, X-Secret-Hop"),
        (b"X-Secret-Hop", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"TE", b"trailers"),
        (b"Authorization", b"Basic dXNlcjo="),
        (b"User-Agent", b"connectrpc/0.11.1"),
        (b"X-Forwarded-For", b"1.2.3.4"),
        (b"Content-Length", b"3"),
    )
    result = decide(head(b"POST", b"/process.Process/List", fields), TABLE, SETTINGS)
    assert isinstance(result, Forward)
    names = [n.lower() for n, _ in result.headers]
    assert names == [b"host", b"authorization", b"user-agent", b"content-length"]
    assert result.headers[-1] == (b"Content-Length", b"3")


def test_the_httpoxy_proxy_field_never_reaches_an_upstream() -> None:
    """CVE-2016-5385: a CGI-style app reads ``Proxy`` as HTTP_PROXY, its outbound proxy."""
    for mode in (SETTINGS, Settings(domains=("e2b.test",), strip=False)):
        for host in (ENVD_HOST, (b"Host", b"8080-sbx1.e2b.test")):
            fields = (
                host,
                (b"X-Access-Token", b"envd-tok"),
                (b"E2b-Traffic-Access-Token", b"traffic-tok"),
                (b"PROXY", b"http://192.0.2.66:3128"),
                (b"proxy", b"http://192.0.2.66:3128"),
                (b"Proxy-Status", b"kept"),  # RFC 9209, a real field: only "Proxy" goes
            )
            result = decide(head(headers=fields), TABLE, mode)
            assert isinstance(result, Forward)
            names = [n.lower() for n, _ in result.headers]
            assert b"proxy" not in names
            assert b"proxy-status" in names


def test_trusted_proxy_sets_x_forwarded() -> None:
    import ipaddress

    trusted = Settings(
        domains=("e2b.test",), trusted_proxies=(ipaddress.ip_network("192.0.2.0/24"),)
    )
    fields = (ENVD_HOST, (b"X-Access-Token", b"envd-tok"), (b"X-Forwarded-For", b"203.0.113.9"))
    result = decide(head(headers=fields), TABLE, trusted)
    assert isinstance(result, Forward)
    assert (b"X-Forwarded-For", b"203.0.113.9, 192.0.2.1") in result.headers
    assert (b"X-Forwarded-Proto", b"http") in result.headers


def test_websocket_upgrade_is_forwarded_with_upgrade_fields() -> None:
    fields = (
        (b"Host", b"8080-sbx1.e2b.test"),
        (b"E2b-Traffic-Access-Token", b"traffic-tok"),
        (b"Connection", b"Upgrade"),
        (b"Upgrade", b"websocket"),
        (b"Sec-WebSocket-Key", b"dGhlIHNhbXBsZSBub25jZQ=="),
    )
    result = decide(head(headers=fields), TABLE, SETTINGS)
    assert isinstance(result, Forward)
    assert result.websocket
    assert result.headers[-2:] == ((b"Connection", b"Upgrade"), (b"Upgrade", b"websocket"))
    assert all(n.lower() != b"e2b-traffic-access-token" for n, _ in result.headers)


class _Upgrade:
    """llhttp's verdict on a request head: does it stop at an upgrade?"""

    upgrade = False


@pytest.mark.parametrize(
    "connection",
    [b"Proxy-Connection: upgrade", b"Connection: upgrade", b"Connection: keep-alive"],
)
def test_an_upgrade_llhttp_stops_at_is_a_handshake_or_refused(connection: bytes) -> None:
    # llhttp parses nothing after an upgrade's head: forwarded as a plain request, its body
    # would never follow it (found by review with Proxy-Connection, which llhttp reads as
    # Connection).
    raw = (
        b"GET / HTTP/1.1\r\nHost: 8080-sbx1.e2b.test\r\n"
        + connection
        + (b"\r\nUpgrade: websocket\r\nE2b-Traffic-Access-Token: traffic-tok\r\n\r\n")
    )
    verdict = _Upgrade()
    try:
        httptools.HttpRequestParser(verdict).feed_data(raw)
    except httptools.HttpParserUpgrade:
        verdict.upgrade = True
    name, _, value = connection.partition(b": ")
    fields = (
        (b"Host", b"8080-sbx1.e2b.test"),
        (name, value),
        (b"Upgrade", b"websocket"),
        (b"E2b-Traffic-Access-Token", b"traffic-tok"),
    )
    request_head = RequestHead(
        method=b"GET", target=b"/", version="1.1", headers=fields, upgrade=verdict.upgrade
    )
    result = decide(request_head, TABLE, SETTINGS)
    if verdict.upgrade:
        assert (isinstance(result, Forward) and result.websocket) or (
            isinstance(result, Reject) and result.reason is Reason.BAD_UPGRADE
        )
    else:
        assert isinstance(result, Forward)
        assert not result.websocket


# -- properties -----------------------------------------------------------------------------

names = st.sampled_from(
    [
        b"X-Access-Token",
        b"x-access-token",
        b"E2B-TRAFFIC-ACCESS-TOKEN",
        b"e2b-traffic-access-token",
        b"Authorization",
        b"Host",
        b"E2b-Sandbox-Id",
        b"E2b-Sandbox-Port",
        b"Connection",
        b"Upgrade",
        b"Content-Length",
        b"Transfer-Encoding",
        b"X-Other",
        b"Cookie",
    ]
)
values = st.one_of(
    st.sampled_from(
        [
            b"envd-tok",
            b"traffic-tok",
            b"sbx1",
            b"49983",
            b"8080",
            b"chunked",
            b"5",
            b"x-access-token",
            b"upgrade",
            b"websocket",
            b"49983-sbx1.e2b.test",
        ]
    ),
    st.binary(max_size=12),
)
query_keys = st.sampled_from(
    ["signature", "signature_expiration", "path", "username", "x", "SIGNATURE", "sig%6eature"]
)


@st.composite
def requests(draw: st.DrawFn) -> RequestHead:
    headers = tuple(draw(st.lists(st.tuples(names, values), max_size=8)))
    host = draw(
        st.sampled_from(
            [b"49983-sbx1.e2b.test", b"8080-sbx1.e2b.test", b"localhost", b"api.e2b.test"]
        )
    )
    query = "&".join(
        f"{k}={urllib.parse.quote(draw(st.text(max_size=8)), safe='')}"
        for k in draw(st.lists(query_keys, max_size=5))
    )
    path = draw(st.sampled_from(["/files", "/health", "/process.Process/Start", "/"]))
    target = (path + ("?" + query if query else "")).encode()
    method = draw(st.sampled_from([b"GET", b"POST", b"PUT", b"HEAD"]))
    return head(method, target, ((b"Host", host), *headers))


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_no_credential_reaches_the_upstream_in_strip_mode(request_head: RequestHead) -> None:
    insecure = RouteTable.of({"sbx1": Route(sandbox_id="sbx1", address="10.0.0.5", insecure=True)})
    for table in (TABLE, insecure):
        result = decide(request_head, table, SETTINGS)
        if not isinstance(result, Forward):
            continue
        for name, _ in result.headers:
            assert name.lower() not in CREDENTIALS
        query = result.path.partition(b"?")[2]
        for pair in query.split(b"&"):
            key = urllib.parse.unquote_to_bytes(pair.partition(b"=")[0]).lower()
            assert key not in (b"signature", b"signature_expiration")
        # Hop-by-hop fields only appear as relay's own framing and upgrade fields.
        own = {b"content-length", b"transfer-encoding", b"connection", b"upgrade"}
        names_out = [n.lower() for n, _ in result.headers]
        assert not set(names_out) & (HOP_BY_HOP - own)
        if b"transfer-encoding" in names_out:
            assert result.headers[-1] == (b"Transfer-Encoding", b"chunked")
            assert names_out.count(b"transfer-encoding") == 1


segments = st.sampled_from(["", ".", "..", "a", "%2e", "%2E%2e", "init", "%69nit", "INIT", "%252e"])


def independent_clean(raw: str) -> str:
    """Decode once and clean with the standard library, as a cross-check of policy.py."""
    import posixpath

    decoded = urllib.parse.unquote_to_bytes(raw.partition("?")[0]).decode("latin-1")
    cleaned = posixpath.normpath(decoded)
    return "/" + cleaned.lstrip("/") if cleaned.startswith("//") else cleaned


@settings(max_examples=500)
@given(
    prefix=st.lists(segments, max_size=5),
    control=st.sampled_from(sorted(CONTROL_PATHS)),
    encode_at=st.integers(min_value=0, max_value=8),
    suffix=st.sampled_from(["", "/", "/.", "//", "?x=1", "/..", "/../init"]),
    method=st.sampled_from([b"GET", b"POST", b"DELETE", b"OPTIONS", b"PATCH"]),
    host=st.sampled_from([b"49983-sbx1.e2b.test", b"49983-ghost.e2b.test"]),
)
def test_any_path_cleaning_to_a_control_path_is_refused_before_the_lookup(
    prefix: list[str], control: str, encode_at: int, suffix: str, method: bytes, host: bytes
) -> None:
    name = control[1:]
    if encode_at < len(name):
        name = name[:encode_at] + f"%{ord(name[encode_at]):02X}" + name[encode_at + 1 :]
    raw = "/" + "/".join([*prefix, name]) + suffix
    request_head = head(method, raw.encode(), ((b"Host", host), (b"X-Access-Token", b"envd-tok")))
    result = decide(request_head, TABLE, SETTINGS)
    if independent_clean(raw) in CONTROL_PATHS:
        assert isinstance(result, Reject), raw
        assert result.reason is Reason.CONTROL_PATH, (raw, result)
        assert result.sandbox_id is None
    else:
        assert not (isinstance(result, Reject) and result.reason is Reason.CONTROL_PATH), raw


# -- Found by review (2026-12-01): header values as llhttp hands them over ---------------------


def _parsed_head(raw: bytes) -> RequestHead:
    """The head as relay's request parser (llhttp) delivers it: values keep the spaces and tabs
    after them, and bytes 0x80-0xFF (obs-text) pass."""
    seen = _Fields()
    httptools.HttpRequestParser(seen).feed_data(raw)
    return head(target=seen.url, headers=tuple(seen.headers))


class _Fields:
    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))


@pytest.mark.parametrize(
    ("sandbox_id", "port"),
    [
        pytest.param(b"sbx1\xa0", b"49983", id="id-nbsp-after"),
        pytest.param(b"\xa0sbx1", b"49983", id="id-nbsp-before"),
        pytest.param(b"sbx1\x85", b"49983", id="id-nel-after"),
        pytest.param(b"sbx1", b"49983\xa0", id="port-nbsp-after"),
        pytest.param(b"sbx1", b"\x8549983", id="port-nel-before"),
    ],
)
def test_routing_headers_with_obs_text_are_refused(sandbox_id: bytes, port: bytes) -> None:
    """SPEC §1.2: the values must be ^[a-z0-9]{1,64}$ and 1-65535. str.strip() of the latin-1
    text took NBSP and NEL too, so "sbx1\\xa0" named sandbox sbx1."""
    decision = decide(
        _parsed_head(
            b"GET /health HTTP/1.1\r\nHost: sandbox.e2b.test\r\nE2b-Sandbox-Id: "
            + sandbox_id
            + b"\r\nE2b-Sandbox-Port: "
            + port
            + b"\r\nX-Access-Token: envd-tok\r\n\r\n"
        ),
        TABLE,
        SETTINGS,
    )
    assert isinstance(decision, Reject)
    assert decision.reason is Reason.BAD_ROUTING_HEADER


@pytest.mark.parametrize(
    ("host", "field", "kind"),
    [
        pytest.param(b"49983-sbx1.e2b.test", b"X-Access-Token: envd-tok \t", Kind.ENVD, id="envd"),
        pytest.param(
            b"8080-sbx1.e2b.test", b"E2b-Traffic-Access-Token: traffic-tok ", Kind.APP, id="app"
        ),
    ],
)
def test_a_token_followed_by_whitespace_is_the_token(host: bytes, field: bytes, kind: Kind) -> None:
    """RFC 9110 §5.5: the spaces and tabs after a value are not part of it (Go's textproto,
    envd's and E2B's proxy's, trims them). The right token with them was refused 401/403."""
    decision = decide(
        _parsed_head(b"GET /x HTTP/1.1\r\nHost: " + host + b"\r\n" + field + b"\r\n\r\n"),
        TABLE,
        SETTINGS,
    )
    assert isinstance(decision, Forward)
    assert decision.kind is kind
    assert not any(n.lower() in CREDENTIALS for n, _ in decision.headers)


@pytest.mark.parametrize(
    ("headers", "settings_", "host"),
    [
        pytest.param(
            ((b"E2b-Sandbox-Id", b"sbx1"), (b"E2b-Sandbox-Port", b"49983"), ENVD_TOKEN),
            SETTINGS,
            b"49983-sbx1.e2b.test",
            id="envd",
        ),
        pytest.param(
            ((b"E2b-Sandbox-Id", b"sbx1"), (b"E2b-Sandbox-Port", b"3000")),
            Settings(domains=(), management=True),
            b"10.0.0.5:3000",
            id="app-no-domain",
        ),
        pytest.param(
            (),
            Settings(domains=("e2b.test",), management=True, management_host=b"api:3000"),
            b"api:3000",
            id="management",
        ),
    ],
)
def test_http10_without_host_is_forwarded_with_one(
    headers: Headers, settings_: Settings, host: bytes
) -> None:
    """relay forwards HTTP/1.1, which must have a Host (RFC 9112 §3.2; Go's net/http answers 400
    "missing required Host header"). An HTTP/1.0 request routed by its headers had none."""
    traffic_free = RouteTable.of({"sbx1": Route(sandbox_id="sbx1", address="10.0.0.5")})
    table = TABLE if host.startswith(b"49983") else traffic_free
    decision = decide(head(target=b"/health", headers=headers, version="1.0"), table, settings_)
    assert isinstance(decision, Forward)
    assert decision.wire.startswith(b"GET /health HTTP/1.1\r\nHost: " + host + b"\r\n")
    assert [n for n, _ in decision.headers].count(b"Host") == 1


SIGNED = (
    b"/files?path=%2Fa&signature=" + file_signature("/a", "read", "", "envd-tok", None).encode()
)


@pytest.mark.parametrize("target", [b"/health", SIGNED])
def test_an_empty_access_token_is_no_token(target: bytes) -> None:
    """envd reads X-Access-Token with Go's Header.Get, which gives "" for an empty header and
    for none: /health is open and a signed URL's signature is checked. relay refused 401."""
    empty = head(target=target, headers=(ENVD_HOST, (b"X-Access-Token", b"")))
    absent = head(target=target, headers=(ENVD_HOST,))
    assert reason_of(decide(empty, TABLE, SETTINGS)) is Kind.ENVD
    assert reason_of(decide(absent, TABLE, SETTINGS)) is Kind.ENVD
    assert reason_of(decide(head(target=b"/envs", headers=empty.headers), TABLE, SETTINGS)) is (
        Reason.ENVD_UNAUTHORIZED
    )
