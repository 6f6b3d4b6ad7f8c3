"""Properties of the pure core under hostile input (issue 6, fuzzing).

Each property is checked against an independent model where one exists:

* a path is a control path iff Go would see one: ``net/url`` decodes the path once (a bad
  escape is a 400) and E2B's proxy matches after ``path.Clean`` — modelled here with
  ``urllib`` and ``posixpath``, not with relay's own helpers;
* a signed URL verifies iff it is exactly the SDK's signature, unexpired;
* in strip mode no credential is ever forwarded, in any spelling relay strips: the
  ``X-Access-Token`` and ``E2b-Traffic-Access-Token`` fields (any case, and with ``_`` for
  ``-`` as a CGI/WSGI upstream reads them), and the ``signature``/``signature_expiration``
  query parameters as Go's ``Query()`` would read them;
* from a peer that is not a trusted proxy no forwarding field reaches the upstream under any
  name a CGI upstream reads as ``HTTP_FORWARDED``, ``HTTP_X_REAL_IP`` or ``HTTP_X_FORWARDED_*``.

Nothing here may raise on any input: relay runs these functions on every request.
"""

from __future__ import annotations

import posixpath
import re

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from relay.core import auth, headers, policy, target
from relay.core.decide import Settings, body_framing, decide
from relay.core.model import Forward, Framing, Reason, Reject, RequestHead, Route, Target
from relay.core.routes import RouteTable

SETTINGS = Settings(domains=("e2b.test",), management=True)
FORWARD_MODE = Settings(domains=("e2b.test",), management=True, strip=False)
ROUTE = Route(
    sandbox_id="sbx1", address="10.0.0.5", envd_token="envd-tok", traffic_token="traffic-tok"
)
TABLES = (
    RouteTable.of({"sbx1": ROUTE}),
    RouteTable.of({"sbx1": Route(sandbox_id="sbx1", address="10.0.0.5", insecure=True)}),
)
HOSTS = [
    b"49983-sbx1.e2b.test",
    b"8080-sbx1.e2b.test",
    b"50090-sbx1.e2b.test",
    b"sandbox.e2b.test",
    b"localhost",
    b"api.e2b.test",
]
_GO_ESCAPE = re.compile(rb"%(?![0-9a-fA-F]{2})")


# -- an independent model of what a CGI/WSGI upstream reads from a field name ------------------


def cgi_var(name: bytes) -> bytes:
    """RFC 3875 §4.1.18: the meta-variable a field becomes (``-`` and ``_`` fold together)."""
    return b"HTTP_" + name.upper().replace(b"-", b"_")


CGI_CREDENTIALS = frozenset({b"HTTP_X_ACCESS_TOKEN", b"HTTP_E2B_TRAFFIC_ACCESS_TOKEN"})


def cgi_forwarding(name: bytes) -> bool:
    """Whether an upstream reads the field as a proxy's report on the client (SPEC §4)."""
    var = cgi_var(name)
    return var in (b"HTTP_FORWARDED", b"HTTP_X_REAL_IP") or var.startswith(b"HTTP_X_FORWARDED_")


# -- an independent model of what envd (Go) makes of a request-target -------------------------


def go_path(target: bytes) -> str | None:
    """``url.ParseRequestURI(target).Path`` cleaned with ``path.Clean``; None when Go would
    refuse the target (400) or it is not origin-form."""
    if not target.startswith(b"/"):
        return None
    raw = target.partition(b"?")[0]
    if _GO_ESCAPE.search(raw):
        return None  # "invalid URL escape"
    decoded = re.sub(rb"%([0-9a-fA-F]{2})", lambda m: bytes([int(m[1], 16)]), raw)
    cleaned = posixpath.normpath(decoded.decode("latin-1"))
    return "/" + cleaned.lstrip("/")


def go_query_keys(target: bytes) -> list[bytes]:
    """The keys Go's ``Request.URL.Query()`` would see."""
    query = target.partition(b"?")[2]
    return [key for key, _ in auth.go_parse_query(query)]


# -- strategies ------------------------------------------------------------------------------

path_atoms = st.sampled_from(
    [
        b"/",
        b"//",
        b".",
        b"..",
        b"/.",
        b"/..",
        b"%2e",
        b"%2E",
        b"%2e%2e",
        b"%252e",
        b"%2f",
        b"%2F",
        b"%5c",
        b"\\",
        b"init",
        b"INIT",
        b"%69nit",
        b"in%69t",
        b"freeze",
        b"upgrade",
        b"files",
        b"health",
        b";",
        b";x=1",
        b"?",
        b"?a=1&",
        b"#",
        b"%00",
        b"\x00",
        b"%",
        b"%z",
        b"%zz",
        b"%%",
        b"+",
        b"%20",
        b"a",
        b"\xff",
    ]
)
targets = st.one_of(
    st.lists(path_atoms, max_size=10).map(lambda parts: b"/" + b"".join(parts)),
    st.binary(max_size=60),
    st.binary(max_size=40).map(lambda b: b"/" + b),
)
credential_names = st.sampled_from(
    [
        b"X-Access-Token",
        b"E2b-Traffic-Access-Token",
        b"x-access-token",
        b"X_Access_Token",
        b"e2b-traffic_access-token",
    ]
).flatmap(
    lambda name: st.lists(st.booleans(), min_size=len(name), max_size=len(name)).map(
        lambda upper: bytes(
            c - 32 if u and 97 <= c <= 122 else c for c, u in zip(name, upper, strict=True)
        )
    )
)
field_names = st.one_of(
    credential_names,
    st.sampled_from(
        [
            b"Host",
            b"host",
            b"Connection",
            b"Upgrade",
            b"Content-Length",
            b"Transfer-Encoding",
            b"E2b-Sandbox-Id",
            b"E2b-Sandbox-Port",
            b"Forwarded",
            b"X-Forwarded-For",
            b"X-Forwarded-Server",
            b"x-forwarded-client-cert",
            b"X_Forwarded_For",
            b"X-Forwarded_Proto",
            b"X-Forwarded",
            b"X-Real-IP",
            b"X_Real_Ip",
            b"Transfer_Encoding",
            b"X_Other",
            b"Keep-Alive",
            b"TE",
            b"Trailer",
            b"Proxy-Authorization",
            b"Proxy",
            b"pRoXy",
            b"Authorization",
            b"X-Other",
        ]
    ),
    st.binary(min_size=1, max_size=12),
)
field_values = st.one_of(
    st.sampled_from(
        [
            b"envd-tok",
            b"traffic-tok",
            b"sbx1",
            b"49983",
            b"8080",
            b"50090",
            b"chunked",
            b" chunked ",
            b"Chunked",
            b"gzip, chunked",
            b"5",
            b"x-access-token, e2b-traffic-access-token",
            b"upgrade",
            b"Upgrade, Host",
            b"websocket",
            b"h2c",
            b"close",
        ]
    ),
    st.binary(max_size=16),
)
query_keys = st.sampled_from(
    [
        b"signature",
        b"Signature",
        b"SIGNATURE",
        b"signature_expiration",
        b"sig%6eature",
        b"%73ignature",
        b"signature%5fexpiration",
        b"signature%5Fexpiration",
        b"signature+",
        b"signature%00",
        b"signature%",
        b"path",
        b"username",
        b"x",
    ]
)
query_values = st.one_of(
    st.sampled_from([b"", b"1", b"v1_abc", b"%2f", b"%zz", b"a+b"]), st.binary(max_size=8)
)


@st.composite
def queries(draw: st.DrawFn) -> bytes:
    pairs = draw(st.lists(st.tuples(query_keys, query_values), max_size=6))
    seps = draw(
        st.lists(
            st.sampled_from([b"&", b"&&", b";", b"&="]), min_size=len(pairs), max_size=len(pairs)
        )
    )
    out = b""
    for (key, value), sep in zip(pairs, seps, strict=True):
        out += (sep if out else b"") + key + b"=" + value.replace(b"&", b"%26")
    return out


@st.composite
def heads(draw: st.DrawFn) -> RequestHead:
    host = draw(st.one_of(st.sampled_from(HOSTS), st.binary(max_size=30)))
    fields = draw(st.lists(st.tuples(field_names, field_values), max_size=8))
    path = draw(st.one_of(st.sampled_from([b"/files", b"/health", b"/", b"/init"]), targets))
    query = draw(st.one_of(st.none(), queries()))
    return RequestHead(
        method=draw(st.sampled_from([b"GET", b"POST", b"PUT", b"HEAD", b"CONNECT", b"OPTIONS"])),
        target=path + (b"?" + query if query is not None else b""),
        version=draw(st.sampled_from(["1.1", "1.0", "0.9", "2.0"])),
        headers=((b"Host", host), *fields),
        peer=draw(st.sampled_from(["192.0.2.1", "", "::1", "not-an-ip"])),
    )


# -- target parsing and path cleaning --------------------------------------------------------


@settings(max_examples=1000)
@given(targets)
def test_split_target_is_total_and_cleans_like_go(raw: bytes) -> None:
    result = policy.split_target(raw)
    if isinstance(result, Reject):
        assert result.status == 400
        return
    cleaned = result.clean_path
    assert cleaned.startswith("/")
    assert "//" not in cleaned
    assert not {".", ".."} & set(cleaned.split("/"))
    assert policy.clean_path(cleaned) == cleaned  # idempotent
    assert (
        result.raw_path + (b"?" + result.raw_query if result.raw_query is not None else b"") == raw
    )
    for forbidden in (b"#", b"\x00", b"%00"):
        assert forbidden not in raw
    assert b"\\" not in result.raw_path
    assert b"%2f" not in result.raw_path.lower()
    assert b"%5c" not in result.raw_path.lower()
    assert go_path(raw) == cleaned


@settings(max_examples=300)
@given(st.text(max_size=40))
def test_clean_path_matches_posixpath(path: str) -> None:
    expected = "/" + posixpath.normpath("/" + path).lstrip("/")
    assert policy.clean_path("/" + path) == expected


@settings(max_examples=300)
@given(st.binary(max_size=40))
def test_percent_decoding_matches_urllib_or_refuses(raw: bytes) -> None:
    decoded = policy.percent_decode_path(raw)
    if _GO_ESCAPE.search(raw):
        assert decoded is None
    else:
        import urllib.parse

        assert decoded == urllib.parse.unquote_to_bytes(raw)


@settings(max_examples=500)
@given(
    st.binary(max_size=80), st.lists(st.sampled_from(["e2b.test", "a.e2b.test", "x"]), max_size=3)
)
def test_host_parsing_is_total(value: bytes, domains: list[str]) -> None:
    ordered = tuple(sorted(domains, key=len, reverse=True))
    well_formed, found = target.host_target(value, ordered)
    assert isinstance(well_formed, bool)
    if isinstance(found, Target):
        assert 1 <= found.port <= 65535
        assert re.fullmatch("[a-z0-9]{1,64}", found.sandbox_id)


# -- decide: total, and never a path to the control surface ----------------------------------


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(heads())
def test_decide_is_total_and_safe(head: RequestHead) -> None:
    for table in TABLES:
        for mode in (SETTINGS, FORWARD_MODE):
            result = decide(head, table, mode, now=1_700_000_000, inflight={"sbx1": 0})
            assert isinstance(result, (Forward, Reject))
            if not isinstance(result, Forward):
                continue
            assert head.method != b"CONNECT"
            assert head.version in ("1.1", "1.0")
            if result.target is not None:
                assert result.target.port not in mode.denied_ports
                if result.target.port == mode.envd_port:
                    # What envd will make of the forwarded target is never a control path.
                    assert go_path(result.path) not in policy.CONTROL_PATHS
            names = [n.lower() for n, _ in result.headers]
            # Hop-by-hop fields only as relay's own framing and upgrade fields.
            own = {b"content-length", b"transfer-encoding", b"connection", b"upgrade"}
            assert not (set(names) & (headers.HOP_BY_HOP - own))
            assert names.count(b"content-length") + names.count(b"transfer-encoding") <= 1
            assert not any(map(cgi_forwarding, names))  # no trusted proxies configured
            assert b"HTTP_PROXY" not in map(cgi_var, names)  # httpoxy (CVE-2016-5385)
            if result.target is not None and result.target.port != mode.envd_port:
                # relay's own, in either mode
                assert b"HTTP_E2B_TRAFFIC_ACCESS_TOKEN" not in map(cgi_var, names)
            if mode.strip:
                assert not (set(map(cgi_var, names)) & CGI_CREDENTIALS)
                for key in go_query_keys(result.path):
                    assert key.lower() not in auth.STRIPPED_PARAMS, result.path


dot_prefixes = st.sampled_from(
    [b"", b"/", b"./", b"../", b"%2e/", b"%2E%2e/", b"a/../", b"a/%2e%2e/", b";x/../", b"//"]
)
tails = st.sampled_from(
    [
        b"",
        b"/",
        b"/.",
        b"//",
        b"/./",
        b"?x=1",
        b"?/../a",
        b"/..",
        b"/a/..",
        b"/%2e",
        b";",
        b"%2f",
        b"#",
        b"\\",
        b"%00",
        b"%",
    ]
)


@settings(max_examples=500)
@given(
    prefix=st.lists(dot_prefixes, max_size=4),
    control=st.sampled_from(sorted(policy.CONTROL_PATHS)),
    encode=st.lists(st.booleans(), min_size=9, max_size=9),
    tail=tails,
    method=st.sampled_from([b"GET", b"POST", b"DELETE", b"PROPFIND", b"HEAD"]),
)
def test_whatever_go_reads_as_a_control_path_is_refused(
    prefix: list[bytes], control: str, encode: list[bool], tail: bytes, method: bytes
) -> None:
    name = "".join(f"%{ord(c):02x}" if e else c for c, e in zip(control[1:], encode, strict=False))
    raw = b"/" + b"".join(prefix) + name.encode() + tail
    reserved = go_path(raw) in policy.CONTROL_PATHS
    for host in (b"49983-sbx1.e2b.test", b"49983-ghost.e2b.test"):
        head = RequestHead(
            method=method,
            target=raw,
            version="1.1",
            headers=((b"Host", host), (b"X-Access-Token", b"envd-tok")),
        )
        result = decide(head, TABLES[0], SETTINGS)
        if reserved:
            assert isinstance(result, Reject), raw
            assert result.reason in (Reason.CONTROL_PATH, Reason.BAD_PATH), (raw, result)
            assert result.sandbox_id is None  # before the lookup: no existence signal
        else:
            assert not (isinstance(result, Reject) and result.reason is Reason.CONTROL_PATH), raw


# -- framing ---------------------------------------------------------------------------------


@settings(max_examples=500)
@given(
    version=st.sampled_from(["1.1", "1.0"]),
    te=st.one_of(st.none(), st.lists(field_values, min_size=1, max_size=3)),
    cl=st.one_of(st.none(), st.lists(field_values, min_size=1, max_size=2)),
)
def test_body_framing_is_total_and_strict(
    version: str, te: list[bytes] | None, cl: list[bytes] | None
) -> None:
    fields: dict[bytes, list[bytes]] = {}
    if te is not None:
        fields[b"transfer-encoding"] = te
    if cl is not None:
        fields[b"content-length"] = cl
    result = body_framing(version, fields)
    if isinstance(result, Reject):
        return
    framing, length = result
    if framing is Framing.CHUNKED:
        assert te is not None
        assert len(te) == 1
        assert version == "1.1"
        assert te[0].strip().lower() == b"chunked"
    elif te is not None:
        raise AssertionError("a Transfer-Encoding must be chunked or refused")
    if framing is Framing.LENGTH:
        assert cl is not None
        assert len(cl) == 1
        assert int(cl[0]) == length > 0


# -- signatures ------------------------------------------------------------------------------

tokens = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=20)
query_text = st.text(max_size=12)


@settings(max_examples=400)
@given(
    path=query_text,
    username=query_text,
    token=tokens,
    other=tokens,
    exp=st.one_of(st.none(), st.integers(min_value=0, max_value=2**63 - 1)),
    now=st.integers(min_value=0, max_value=2**40),
    get=st.booleans(),
)
def test_only_the_sdk_signature_verifies(
    path: str, username: str, token: str, other: str, exp: int | None, now: int, get: bool
) -> None:
    import urllib.parse

    op = "read" if get else "write"
    signature = auth.file_signature(path, op, username, token, exp)
    params = {"path": path, "username": username, "signature": signature}
    if exp is not None:
        params["signature_expiration"] = str(exp)
    query = urllib.parse.urlencode(params).encode()
    request = auth.EnvdRequest(
        method=b"GET" if get else b"POST", clean_path="/files", raw_query=query, access_token=None
    )
    route = Route(sandbox_id="s", address="10.0.0.1", envd_token=token)
    verdict = auth.check_envd(request, route, now)
    assert (verdict is None) == (exp is None or exp >= now)
    # Another token, the other operation, or a tampered signature never verify.
    assume(other != token)
    assert (
        auth.check_envd(request, Route(sandbox_id="s", address="10.0.0.1", envd_token=other), now)
        is not None
    )
    flipped = auth.EnvdRequest(
        method=b"POST" if get else b"GET", clean_path="/files", raw_query=query, access_token=None
    )
    assert auth.check_envd(flipped, route, now) is not None
    tampered = query.replace(b"signature=v1_", b"signature=v1_A", 1)
    assert (
        auth.check_envd(
            auth.EnvdRequest(
                method=request.method, clean_path="/files", raw_query=tampered, access_token=None
            ),
            route,
            now,
        )
        is not None
    )


@settings(max_examples=1000)
@given(
    method=st.sampled_from([b"GET", b"POST", b"PUT"]),
    path=st.sampled_from(["/files", "/health", "/", "/init"]),
    query=st.one_of(st.none(), queries(), st.binary(max_size=60)),
    token=st.one_of(st.none(), field_values),
    now=st.integers(min_value=-(2**63), max_value=2**64),
)
def test_envd_checks_are_total(
    method: bytes, path: str, query: bytes | None, token: bytes | None, now: int
) -> None:
    request = auth.EnvdRequest(method=method, clean_path=path, raw_query=query, access_token=token)
    verdict = auth.check_envd(request, ROUTE, now)
    if verdict is None:
        # Only the token, the public health probe, or a signature can let a request through.
        signed = path == "/files" and method in (b"GET", b"POST") and query is not None
        assert token == b"envd-tok" or (
            token is None and ((path == "/health" and method == b"GET") or signed)
        )
    else:
        assert verdict.status in (400, 401)


@settings(max_examples=500)
@given(st.one_of(queries(), st.binary(max_size=80)))
def test_stripping_leaves_no_signature_for_go(query: bytes) -> None:
    stripped = auth.strip_signature_params(query)
    assert auth.strip_signature_params(stripped) == stripped
    for key, _ in auth.go_parse_query(stripped):
        assert key.lower() not in auth.STRIPPED_PARAMS
    # What is kept is the client's pairs, untouched and in order (a subsequence).
    rest = iter(query.split(b"&"))
    assert not stripped or all(any(seg == s for s in rest) for seg in stripped.split(b"&"))


# -- header policy ---------------------------------------------------------------------------


@settings(max_examples=400)
@given(
    fields=st.lists(st.tuples(field_names, field_values), max_size=10),
    framing=st.sampled_from(list(Framing)),
    websocket=st.booleans(),
    strip=st.booleans(),
)
@example(
    fields=[(b"Connection", b"close, Host")], framing=Framing.NONE, websocket=False, strip=True
)
def test_request_headers_policy(
    fields: list[tuple[bytes, bytes]], framing: Framing, websocket: bool, strip: bool
) -> None:
    head = ((b"Host", b"h"), *fields)
    index, names = headers.index_with_names(head)
    drop = headers.HOP_BY_HOP | (headers.CREDENTIALS if strip else frozenset())
    rules = headers.OutboundRules(drop=drop, framing=framing, content_length=7, websocket=websocket)
    out = headers.request_headers(head, names, index, rules)
    out_names = [n.lower() for n, _ in out]
    if strip:
        assert not set(map(cgi_var, out_names)) & CGI_CREDENTIALS
    assert not any(map(cgi_forwarding, out_names))
    expected_framing = {
        # A client's Content-Length with no body to frame is a 0 (decide.body_framing),
        # forwarded as such.
        Framing.NONE: [(b"Content-Length", b"0")] if b"content-length" in index else [],
        Framing.LENGTH: [(b"Content-Length", b"7")],
        Framing.CHUNKED: [(b"Transfer-Encoding", b"chunked")],
    }[framing]
    framing_out = [(n, v) for n, v in out if n.lower() in (b"content-length", b"transfer-encoding")]
    assert framing_out == expected_framing
    assert (b"upgrade" in out_names) == websocket
    # Everything else is the client's fields minus the dropped ones, in order, untouched.
    named = {
        token.strip().lower()
        for name, value in head
        if name.lower() == b"connection"
        for token in value.split(b",")
    }
    gone = drop | headers.FORWARDED | (named - {b"host"})

    def kept(name: bytes) -> bool:
        low = name.lower()
        return not (low in gone or low.replace(b"_", b"-") in gone or cgi_forwarding(name))

    added = len(expected_framing) + (2 if websocket else 0)
    assert list(out[: len(out) - added]) == [p for p in head if kept(p[0])]
    # Host is what relay routed on: it reaches the upstream whatever Connection says (SPEC §4).
    assert (b"Host", b"h") in out


# X-Forwarded-* fields that are not on any fixed list: relay drops the prefix (SPEC §4).
UNLISTED_FORWARDED = [
    b"X-Forwarded-Server",
    b"X-Forwarded-Uri",
    b"X-Forwarded-Scheme",
    b"X-Forwarded-Ssl",
    b"X-Forwarded-Client-Cert",
    b"X-Forwarded-User",
    b"X-Forwarded-Email",
    b"x-forwarded-anything-new",
    b"X-Forwarded-",
]
UNDERSCORE_FORWARDED = [
    b"X_Forwarded_For",
    b"x_forwarded_proto",
    b"X-Forwarded_Host",
    b"X_Forwarded-Port",
    b"X_Forwarded_User",
    b"X_Real_IP",
    b"x-real_ip",
]
STRIP = headers.HOP_BY_HOP | headers.CREDENTIALS


def _outbound(
    fields: list[tuple[bytes, bytes]],
    drop: frozenset[bytes] = STRIP,
    forwarded_for: tuple[str, str, bytes] | None = None,
) -> list[tuple[bytes, bytes]]:
    head = ((b"Host", b"h"), *fields, (b"User-Agent", b"t"))
    index, names = headers.index_with_names(head)
    rules = headers.OutboundRules(drop=drop, framing=Framing.NONE, forwarded_for=forwarded_for)
    return list(headers.request_headers(head, names, index, rules))


@pytest.mark.parametrize("name", UNLISTED_FORWARDED + UNDERSCORE_FORWARDED)
def test_untrusted_peer_loses_every_x_forwarded_field(name: bytes) -> None:
    out = _outbound([(name, b"spoofed"), (b"X-Forwarded-For", b"6.6.6.6")])
    assert out == [(b"Host", b"h"), (b"User-Agent", b"t")]


@pytest.mark.parametrize("name", UNLISTED_FORWARDED)
def test_trusted_proxy_keeps_its_x_forwarded_fields(name: bytes) -> None:
    out = _outbound(
        [(name, b"edge"), (b"X-Forwarded-For", b"203.0.113.9")],
        forwarded_for=("10.0.0.1", "https", b"h"),
    )
    assert (name, b"edge") in out
    assert (b"X-Forwarded-For", b"203.0.113.9, 10.0.0.1") in out


@pytest.mark.parametrize("name", UNDERSCORE_FORWARDED)
def test_trusted_proxy_does_not_pass_on_underscore_spellings(name: bytes) -> None:
    # A CGI upstream would merge X_Forwarded_For into the X-Forwarded-For relay writes.
    out = _outbound([(name, b"6.6.6.6")], forwarded_for=("10.0.0.1", "http", b"h"))
    assert out == [
        (b"Host", b"h"),
        (b"User-Agent", b"t"),
        (b"X-Forwarded-For", b"10.0.0.1"),
        (b"X-Forwarded-Proto", b"http"),
        (b"X-Forwarded-Host", b"h"),
    ]


@pytest.mark.parametrize(
    "name",
    [
        b"X_Access_Token",
        b"x-access_token",
        b"E2b_Traffic_Access_Token",
        b"e2b-traffic_access-token",
    ],
)
def test_underscore_spellings_of_credentials_are_stripped(name: bytes) -> None:
    assert _outbound([(name, b"envd-tok")]) == [(b"Host", b"h"), (b"User-Agent", b"t")]


def test_underscore_spelling_follows_the_dash_spelling_in_forward_mode() -> None:
    # credentials = "forward": X-Access-Token is passed on for envd to check, and so is the
    # underscore spelling; the traffic token is relay's own and goes in either spelling.
    forward = headers.HOP_BY_HOP | {headers.TRAFFIC_TOKEN}
    fields = [(b"X_Access_Token", b"a"), (b"E2b_Traffic_Access_Token", b"b")]
    assert _outbound(fields, drop=forward) == [
        (b"Host", b"h"),
        (b"X_Access_Token", b"a"),
        (b"User-Agent", b"t"),
    ]


def test_other_underscore_names_and_near_misses_pass_untouched() -> None:
    fields = [
        (b"X_Custom", b"1"),
        (b"X-Forwarded", b"2"),  # not an X-Forwarded-* field
        (b"X-Forwardedfor", b"3"),
        (b"X-Forwarded.For", b"3"),  # "." sorts right after "-"
        (b"X-Forwarded,", b"3"),  # "," right before
        (b"My-X-Forwarded-For", b"4"),
        (b"Transfer_Encodings", b"5"),
    ]
    assert _outbound(fields) == [(b"Host", b"h"), *fields, (b"User-Agent", b"t")]


def test_underscore_spellings_of_hop_by_hop_fields_are_dropped() -> None:
    fields = [(b"Transfer_Encoding", b"chunked"), (b"Proxy_Authorization", b"x"), (b"X_Hop", b"1")]
    out = _outbound([*fields, (b"Connection", b"x-hop")])
    assert out == [(b"Host", b"h"), (b"User-Agent", b"t")]
