"""Parser differentials: what relay checks against what the guest then acts on (SPEC §1-2, §5a).

relay checks a credential (a signed ``/files`` URL, ``X-Access-Token``, the traffic token) or a
routing form, strips the credential and forwards. In ``strip`` mode envd runs without a token
and trusts whatever relay forwards, so a request relay admits as signed for file A, user U
must reach envd as a request for file A, user U and nothing else. envd reads the query with
Go's ``r.URL.Query()`` and oapi-codegen's binding (``api.gen.go``: exact, case-sensitive names,
a repeated one is a 400), which ``tests.support.envd_file_access.go_url_query`` reproduces; each
forwarded signed URL below is read back that way from the bytes the recording upstream got.

A user's app may read the query with another parser: Rails (``ActionDispatch::QueryParser``,
Rack 2.2's, installed as Rack's default) splits pairs on ``&`` and ``;`` and reads
``signature[]`` or ``[signature]`` as ``signature``; PHP reads ``signature[]`` so too and
drops leading spaces from a name. No spelling of a signature those read may reach an
upstream either (README, "Credential stripping").
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

import pytest

from relay.core.auth import file_signature
from tests.hostile.conftest import ENVD_TOKEN, TRAFFIC_TOKEN, Hostile, exchange
from tests.hostile.recorder import Request
from tests.support.envd_file_access import go_url_query
from tests.support.harness import DOMAIN
from tests.support.rawhttp import request_bytes

A = "/home/user/a.txt"
SPACED = "/tmp/a b.txt"


def q(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def sig(path: str = A, op: str = "read", user: str = "", exp: int | None = None) -> str:
    return q(file_signature(path, op, user, ENVD_TOKEN, exp))


BASE = f"path={q(A)}&signature={sig()}"
EXP = 4102444800  # 2100-01-01: never expired while these tests run
WITH_EXP = f"path={q(A)}&signature={sig(exp=EXP)}&signature_expiration={EXP}"


@dataclass(frozen=True)
class Envd:
    """Forwarded; envd's binding reads exactly this path and username (None: absent)."""

    path: str | None = A
    username: str | None = None
    target_path: str = "/files"


Expect = int | Envd  # an int: relay answers that status and nothing reaches the upstream

SIGNED: list[tuple[str, str, str, Expect]] = [
    # (id, method, request-target, expectation)
    ("sdk-form", "GET", f"/files?{BASE}", Envd()),
    ("sdk-form-expiring", "GET", f"/files?{WITH_EXP}", Envd()),
    ("path-repeated-after", "GET", f"/files?{BASE}&path=%2Fetc%2Fpasswd", 401),
    ("path-repeated-before", "GET", f"/files?path=%2Fetc%2Fpasswd&{BASE}", 401),
    ("path-repeated-encoded-name", "GET", f"/files?{BASE}&pa%74h=%2Fetc%2Fpasswd", 401),
    ("path-repeated-empty", "GET", f"/files?{BASE}&path=", 401),
    ("path-repeated-no-value", "GET", f"/files?{BASE}&path", 401),
    # Go's names are case-sensitive and "path " is another name: envd binds neither.
    ("path-upper-case-name", "GET", f"/files?{BASE}&PATH=%2Fetc%2Fpasswd", Envd()),
    ("path-name-with-space", "GET", f"/files?{BASE}&path+=%2Fetc%2Fpasswd", Envd()),
    ("username-added", "GET", f"/files?{BASE}&username=root", 401),
    ("username-encoded-name", "GET", f"/files?{BASE}&%75sername=root", 401),
    # Signed as "" like an absent one (SDK and envd); envd then looks up user "" and
    # refuses (401): no other user is reachable this way.
    ("username-empty", "GET", f"/files?{BASE}&username=", Envd(username="")),
    ("signature-repeated", "GET", f"/files?{BASE}&signature=v1_x", 401),
    ("expiration-repeated", "GET", f"/files?{WITH_EXP}&signature_expiration={EXP}", 401),
    # A pair holding ';' is no pair for Go >= 1.17 (ParseQuery): not verified, not bound.
    ("semicolon-pair-ignored", "GET", f"/files?path=%2Fetc%2Fpasswd;x&{BASE}", Envd()),
    ("semicolon-in-signed-pair", "GET", f"/files?path={q(A)};&signature={sig()}", 401),
    ("semicolon-separator", "GET", f"/files?path={q(A)};signature={sig()}", 401),
    # The pair Go ignores must stay one pair: stripping its signature part must not leave a
    # live "username=root" behind for envd.
    ("semicolon-username-and-signature", "GET", f"/files?{BASE}&username=root;signature=x", Envd()),
    ("semicolon-path-and-signature", "GET", f"/files?{BASE}&path=%2Fetc;signature=x", Envd()),
    # '+' is a space in a query (url.QueryUnescape); %2B is a plus.
    ("plus-is-space", "GET", f"/files?path=%2Ftmp%2Fa+b.txt&signature={sig(SPACED)}", Envd(SPACED)),
    (
        "pct20-is-space",
        "GET",
        f"/files?path=%2Ftmp%2Fa%20b.txt&signature={sig(SPACED)}",
        Envd(SPACED),
    ),
    ("pct2b-is-plus", "GET", f"/files?path=%2Ftmp%2Fa%2Bb.txt&signature={sig(SPACED)}", 401),
    ("raw-slashes-in-value", "GET", f"/files?path={A}&signature={sig()}", Envd()),
    # A malformed escape drops its pair, for Go and relay alike.
    ("bad-escape-repeat-ignored", "GET", f"/files?path=%zz&{BASE}", Envd()),
    ("bad-escape-name-ignored", "GET", f"/files?pa%zzth=x&{BASE}", Envd()),
    ("bad-escape-in-signed-value", "GET", f"/files?path={q(A)}%2&signature={sig()}", 401),
    ("double-encoded-value", "GET", f"/files?path={q(q(A))}&signature={sig()}", 401),
    # The signature covers the string, not the file it resolves to.
    (
        "dot-dot-in-value",
        "GET",
        f"/files?path=%2Fhome%2Fuser%2F..%2Fuser%2Fa.txt&signature={sig()}",
        401,
    ),
    ("dot-in-value", "GET", f"/files?path=%2Fhome%2Fuser%2F.%2Fa.txt&signature={sig()}", 401),
    (
        "double-slash-in-value",
        "GET",
        f"/files?path=%2Fhome%2F%2Fuser%2Fa.txt&signature={sig()}",
        401,
    ),
    ("backslash-in-value", "GET", f"/files?path=%2Fhome%5Cuser%2Fa.txt&signature={sig()}", 401),
    ("nul-in-value", "GET", f"/files?path={q(A)}%00&signature={sig()}", 400),
    ("fragment", "GET", f"/files?{BASE}#frag", 400),
    ("fragment-hides-pair", "GET", f"/files?{BASE}#&path=%2Fetc%2Fpasswd", 400),
    ("encoded-signature-name", "GET", f"/files?path={q(A)}&sig%6Eature={sig()}", Envd()),
    ("read-signature-on-post", "POST", f"/files?{BASE}", 401),
    ("read-signature-on-head", "HEAD", f"/files?{BASE}", 401),
    ("read-signature-on-put", "PUT", f"/files?{BASE}", 401),
    ("signature-on-envs", "GET", f"/envs?{BASE}", 401),
    (
        "signature-on-compose",
        "POST",
        f"/files/compose?path={q(A)}&signature={sig(op='write')}",
        401,
    ),
    # Paths that clean to /files take a signature, and are forwarded as sent: envd's chi
    # router matches the raw path exactly, so none of them reaches a handler but a 404.
    ("trailing-slash", "GET", f"/files/?{BASE}", Envd(target_path="/files/")),
    ("double-slash", "GET", f"//files?{BASE}", Envd(target_path="//files")),
    ("compose-dot-dot", "GET", f"/files/compose/..?{BASE}", Envd(target_path="/files/compose/..")),
    ("encoded-name", "GET", f"/%66iles?{BASE}", Envd(target_path="/%66iles")),
    ("files-semicolon", "GET", f"/files;x?{BASE}", 401),
    ("files-upper", "GET", f"/FILES?{BASE}", 401),
]


def envd_view(seen: Request) -> tuple[str | None, str | None]:
    """The path and username envd binds from the forwarded query (api.gen.go: a repeated
    name is a 400, which relay must never forward)."""
    query = go_url_query(seen.target.partition(b"?")[2].decode("latin-1"))
    for name in ("path", "username", "signature", "signature_expiration"):
        assert len(query.get(name, [])) <= 1, (name, seen.target)
    assert "signature" not in query, seen.target
    assert "signature_expiration" not in query, seen.target
    path, username = query.get("path"), query.get("username")
    return (path[0] if path else None), (username[0] if username else None)


def lenient_names(raw_query: bytes) -> set[str]:
    """The names other parsers read in a query: pairs split on '&' and ';' (Rails, Rack 2,
    Go < 1.17, Perl's CGI), leading brackets or spaces dropped and a name cut at its first
    bracket (Rails' normalize_params: ``[signature]``, ``signature[]``; PHP: `` signature``)."""
    names = set()
    for part in re.split(rb"[&;]", raw_query):
        key = urllib.parse.unquote_plus(part.partition(b"=")[0].decode("latin-1"))
        match = re.match(r"[\[\] ]*([^\[\]]*)", key)
        assert match is not None
        names.add(match.group(1).strip().lower())
    return names


async def forwarded(hostile: Hostile, raw: bytes) -> Request:
    """The one request the upstream got for ``raw`` (the recorder answers it 200)."""
    mark = hostile.recorder.mark()
    response, _ = await exchange(hostile.port, raw, linger=0)
    assert response.status == 200, (raw, response.status, response.body)
    (seen,) = await hostile.recorder.wait_for(mark, 1)
    return seen


async def refused(hostile: Hostile, raw: bytes, status: int, *, head: bool = False) -> None:
    mark = hostile.recorder.mark()
    response, _ = await exchange(hostile.port, raw, head=head, linger=0)
    assert response.status == status, (raw, response.status, response.body)
    assert await hostile.recorder.nothing_since(mark, settle=0.02), raw


@pytest.mark.parametrize(
    ("method", "target", "expect"), [c[1:] for c in SIGNED], ids=[c[0] for c in SIGNED]
)
async def test_a_signed_url_reaches_envd_as_signed(
    hostile: Hostile, method: str, target: str, expect: Expect
) -> None:
    raw = request_bytes(method, target, hostile.envd)
    if isinstance(expect, int):
        await refused(hostile, raw, expect, head=method == "HEAD")
        return
    seen = await forwarded(hostile, raw)
    assert seen.target.partition(b"?")[0] == expect.target_path.encode()
    assert envd_view(seen) == (expect.path, expect.username)
    assert not lenient_names(seen.target.partition(b"?")[2]) & {
        "signature",
        "signature_expiration",
    }, seen.target


SIGNATURE = sig()
# (id, query) sent to an app port: no parser named above may find a signature in what the
# app gets.
SPELLINGS: list[tuple[str, str]] = [
    ("plain", f"a=1&signature={SIGNATURE}"),
    ("upper-case", f"a=1&SIGNATURE={SIGNATURE}"),
    ("encoded-name", f"a=1&%73ignature={SIGNATURE}"),
    ("semicolon-after", f"a=1;signature={SIGNATURE}"),
    ("semicolon-before", f"signature={SIGNATURE};a=1"),
    ("semicolon-expiration", f"a=1;signature_expiration={EXP}"),
    ("encoded-semicolon-is-data", f"a=1%3Bsignature%3D{SIGNATURE}"),
    ("amp-entity", f"a=1&amp;signature={SIGNATURE}"),
    ("rails-array", f"a=1&signature[]={SIGNATURE}"),
    ("rails-array-encoded", f"a=1&signature%5B%5D={SIGNATURE}"),
    ("rails-hash", f"a=1&signature[v]={SIGNATURE}"),
    ("rails-leading-bracket", f"a=1&[signature]={SIGNATURE}"),
    ("php-leading-space", f"a=1&+signature={SIGNATURE}"),
    ("php-leading-space-encoded", f"a=1&%20signature={SIGNATURE}"),
]


@pytest.mark.parametrize("query", [c[1] for c in SPELLINGS], ids=[c[0] for c in SPELLINGS])
async def test_no_spelling_of_a_signature_reaches_an_app(hostile: Hostile, query: str) -> None:
    seen = await forwarded(hostile, request_bytes("GET", f"/page?{query}", hostile.app))
    assert not lenient_names(seen.target.partition(b"?")[2]) & {
        "signature",
        "signature_expiration",
    }, seen.target
    # What is kept is the client's own pairs, untouched: the "a=1" of the '&' ones.
    if "&" in query:
        assert seen.target.startswith(b"/page?a=1"), seen.target


async def test_a_pair_go_ignores_is_dropped_whole_not_cut(hostile: Hostile) -> None:
    """Cut at its ';', ``username=root;signature=x`` would become ``username=root``: a pair
    Go >= 1.17 ignored when relay verified the URL (signed for the default user) made live
    for envd, which runs without a token in strip mode and would act as root."""
    target = f"/files?{BASE}&username=root;signature=x&x=1"
    seen = await forwarded(hostile, request_bytes("GET", target, hostile.envd))
    assert seen.target == f"/files?path={q(A)}&x=1".encode()
    assert envd_view(seen) == (A, None)


# -- header differentials ------------------------------------------------------------------

TOKEN = ("X-Access-Token", ENVD_TOKEN)
HEADERS: list[tuple[str, str, list[tuple[str, str]], int]] = [
    # (id, target, extra fields, status: 200 = forwarded without any credential field)
    ("token", "/envs", [TOKEN], 200),
    ("token-trailing-whitespace", "/envs", [("X-Access-Token", ENVD_TOKEN + " \t")], 200),
    ("token-leading-whitespace", "/envs", [("X-Access-Token", " \t " + ENVD_TOKEN)], 200),
    ("token-twice", "/envs", [TOKEN, TOKEN], 400),
    ("token-twice-other-case", "/envs", [TOKEN, ("x-access-token", ENVD_TOKEN)], 400),
    ("token-twice-first-wrong", "/envs", [("X-Access-Token", "x"), TOKEN], 400),
    ("token-comma-joined", "/envs", [("X-Access-Token", f"{ENVD_TOKEN}, {ENVD_TOKEN}")], 401),
    ("token-comma-first", "/envs", [("X-Access-Token", f"{ENVD_TOKEN},x")], 401),
    ("token-empty", "/envs", [("X-Access-Token", "")], 401),
    ("token-underscores-only", "/envs", [("X_Access_Token", ENVD_TOKEN)], 401),
    ("token-underscores-beside", "/envs", [TOKEN, ("X_Access_Token", "other")], 200),
    ("token-in-query-only", f"/envs?X-Access-Token={ENVD_TOKEN}", [], 401),
    ("token-as-bearer", "/envs", [("Authorization", f"Bearer {ENVD_TOKEN}")], 401),
    ("token-as-traffic-token", "/envs", [("E2b-Traffic-Access-Token", ENVD_TOKEN)], 401),
    ("wrong-token-on-health", "/health", [("X-Access-Token", "x")], 401),
    ("wrong-token-beside-signature", f"/files?{BASE}", [("X-Access-Token", "x")], 401),
    ("empty-token-beside-signature", f"/files?{BASE}", [("X-Access-Token", "")], 200),
]


@pytest.mark.parametrize(
    ("target", "extra", "status"), [c[1:] for c in HEADERS], ids=[c[0] for c in HEADERS]
)
async def test_access_token_fields(
    hostile: Hostile, target: str, extra: list[tuple[str, str]], status: int
) -> None:
    raw = request_bytes("GET", target, hostile.envd, extra)
    if status != 200:
        await refused(hostile, raw, status)
        return
    seen = await forwarded(hostile, raw)
    names = {name.lower().replace(b"_", b"-") for name, _ in seen.headers}
    assert not names & {b"x-access-token", b"e2b-traffic-access-token"}, seen.headers


async def test_obs_folded_token_is_refused(hostile: Hostile) -> None:
    """RFC 9112 §5.2: obs-fold in a request is refused (llhttp), never unfolded into a token."""
    raw = (
        f"GET /envs HTTP/1.1\r\nHost: {hostile.envd}\r\nX-Access-Token: {ENVD_TOKEN[:4]}\r\n"
        f" {ENVD_TOKEN[4:]}\r\n\r\n"
    ).encode()
    await refused(hostile, raw, 400)


TRAFFIC: list[tuple[str, list[tuple[str, str]], int]] = [
    ("traffic-token", [("E2b-Traffic-Access-Token", TRAFFIC_TOKEN)], 200),
    ("traffic-twice", [("E2b-Traffic-Access-Token", TRAFFIC_TOKEN)] * 2, 400),
    ("traffic-comma", [("E2b-Traffic-Access-Token", f"{TRAFFIC_TOKEN}, x")], 403),
    ("traffic-underscores", [("E2b_Traffic_Access_Token", TRAFFIC_TOKEN)], 403),
    ("traffic-as-envd-token", [("X-Access-Token", TRAFFIC_TOKEN)], 403),
    (
        "traffic-and-underscores",
        [("E2b-Traffic-Access-Token", TRAFFIC_TOKEN), ("e2b_traffic_access_token", "x")],
        200,
    ),
]


@pytest.mark.parametrize(("extra", "status"), [c[1:] for c in TRAFFIC], ids=[c[0] for c in TRAFFIC])
async def test_traffic_token_fields(
    hostile: Hostile, extra: list[tuple[str, str]], status: int
) -> None:
    raw = request_bytes("GET", "/page", hostile.host("app", "sbx"), extra)
    if status != 200:
        await refused(hostile, raw, status)
        return
    seen = await forwarded(hostile, raw)
    names = {name.lower().replace(b"_", b"-") for name, _ in seen.headers}
    assert not names & {b"x-access-token", b"e2b-traffic-access-token"}, seen.headers


# -- routing differentials -----------------------------------------------------------------


# (id, Host, routing fields, status: 200 = forwarded to sbx's envd with its Host untouched).
# Fields: "Id=v; Port=v" for E2b-Sandbox-Id/-Port ("id"/"port" lower-case, "Id_" with
# underscores); @E@ and @A@ stand for the recorder's envd and app ports.
ROUTING: list[tuple[str, str, str, int]] = [
    ("host-form", "@E@-sbx.@D@", "", 200),
    ("host-upper-case", "@E@-SBX.@U@", "", 200),
    ("header-form", "sandbox.@D@", "Id=sbx; Port=@E@", 200),
    ("host-and-headers-agree", "@E@-sbx.@D@", "Id=sbx; Port=@E@", 200),
    # The two forms name different sandboxes, or ports: neither is picked.
    ("host-sbx-header-open", "@E@-sbx.@D@", "Id=open; Port=@E@", 400),
    ("host-open-header-sbx", "@E@-open.@D@", "Id=sbx; Port=@E@", 400),
    ("host-envd-header-app", "@E@-sbx.@D@", "Id=sbx; Port=@A@", 400),
    ("host-app-header-envd", "@A@-sbx.@D@", "Id=sbx; Port=@E@", 400),
    ("port-twice", "sandbox.@D@", "Id=sbx; Port=@E@; Port=@E@", 400),
    ("port-twice-differing", "sandbox.@D@", "Id=sbx; Port=@A@; port=@E@", 400),
    ("surrounding-whitespace", "sandbox.@D@", "Id=sbx \t; Port=\t@E@ ", 200),
    ("port-comma", "sandbox.@D@", "Id=sbx; Port=@E@,@A@", 400),
    ("port-leading-zero", "sandbox.@D@", "Id=sbx; Port=0@E@", 400),
    ("port-plus", "sandbox.@D@", "Id=sbx; Port=+@E@", 400),
    ("port-inner-space", "sandbox.@D@", "Id=sbx; Port=@E@ 1", 400),
    ("port-decimal", "sandbox.@D@", "Id=sbx; Port=@E@.0", 400),
    ("id-twice", "sandbox.@D@", "Id=sbx; id=open; Port=@E@", 400),
    ("id-upper-case", "sandbox.@D@", "Id=SBX; Port=@E@", 400),
    ("id-dotted", "sandbox.@D@", "Id=sbx.open; Port=@E@", 400),
    ("id-underscore-spelling", "sandbox.@D@", "Id_=sbx; Port=@E@", 400),
    ("host-two-labels", "@E@-open.@E@-sbx.@D@", "", 400),
    ("host-userinfo", "x@@E@-sbx.@D@", "", 400),
    ("host-with-path", "@E@-sbx.@D@/x", "", 400),
]
FIELD_NAMES = {
    "Id": "E2b-Sandbox-Id",
    "id": "e2b-sandbox-id",
    "Id_": "E2b_Sandbox_Id",
    "Port": "E2b-Sandbox-Port",
    "port": "e2b-sandbox-port",
}


async def test_routing_forms_that_disagree_route_nowhere(hostile: Hostile) -> None:
    ports = hostile.recorder.ports

    def fill(text: str) -> str:
        for mark, value in (("@E@", ports["envd"]), ("@A@", ports["app"])):
            text = text.replace(mark, str(value))
        return text.replace("@D@", DOMAIN).replace("@U@", DOMAIN.upper())

    for name, host_text, fields, status in ROUTING:
        host = fill(host_text)
        extra = [
            (FIELD_NAMES[key], fill(value))
            for key, _, value in (item.partition("=") for item in fields.split("; "))
            if key
        ]
        raw = request_bytes("GET", "/envs", host, [*extra, TOKEN])
        if status != 200:
            await refused(hostile, raw, status)
            continue
        seen = await forwarded(hostile, raw)
        assert seen.port == ports["envd"], name
        assert seen.header(b"host") == [host.encode()], name
