"""envd credentials: the SDK's v1 file signatures (notes/e2b-protocol.md §6-7) and tokens."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.core.auth import (
    SIGNED_PARAMS,
    EnvdRequest,
    check_envd,
    check_traffic,
    file_signature,
    go_parse_query,
    go_query_unescape,
    signed_params,
    strip_signature_params,
)
from relay.core.model import Reason, Route
from tests.support.envd_file_access import go_url_query

# notes/e2b-protocol.md §7: computed with the 2.52.0 SDK's get_signature, cross-checked
# with openssl. (path, op, user, token, absolute expiration, signature)
VECTORS = [
    (
        "/home/user/hello.txt",
        "read",
        "user",
        "tok_abc123",
        None,
        "v1_wjASD7E7LCVMmLXqVXaR5warW2XdFG6+T1qhLrMzjCI",
    ),
    (
        "/home/user/hello.txt",
        "write",
        "",
        "tok_abc123",
        None,
        "v1_kPg0JxqtpNb14hTBFZVJsUMptbZZdKvtu/+4rEPjXMM",
    ),
    (
        "/tmp/data file.bin",
        "read",
        "root",
        "2f1c9e0d-envd-token",
        1700000300,
        "v1_eAr1xeTBoMrf7ysk8VK39XM5VmNrMHXs5rMYWLem1gI",
    ),
    ("", "write", "user", "secret", 1700000060, "v1_+paKCBR3cmi0EsFlcDnCJ1CNnNbFTTPvNkZ2NyvoJec"),
    (
        "/home/user/report.csv",
        "read",
        "",
        "3f9a1c0b7e2d4a6f8b1c3d5e7f90a2b4c6d8e0f1a3b5c7d9e1f2a4b6c8d0e2f4",
        1750003600,
        "v1_qUpYU+PQm5IlmxmjWMtsZMEKotFYU0xUzSzxu3z8pXE",
    ),
]


@pytest.mark.parametrize(
    ("path", "op", "user", "token", "exp", "expected"), VECTORS, ids=[f"v{i + 1}" for i in range(5)]
)
def test_signature_vectors(
    path: str, op: str, user: str, token: str, exp: int | None, expected: str
) -> None:
    assert file_signature(path, op, user, token, exp) == expected


def _quote(value: str) -> str:
    from urllib.parse import quote

    return quote(value, safe="")


def _request(
    vector: int,
    *,
    method: bytes | None = None,
    extra: str = "",
    token_header: bytes | None = None,
    path: str = "/files",
) -> tuple[EnvdRequest, Route]:
    p, op, user, token, exp, sig = VECTORS[vector]
    parts = []
    if p:
        parts.append(f"path={_quote(p)}")
    if user:
        parts.append(f"username={_quote(user)}")
    parts.append(f"signature={_quote(sig)}")
    if exp is not None:
        parts.append(f"signature_expiration={exp}")
    query = "&".join(parts) + extra
    request = EnvdRequest(
        method=method or (b"GET" if op == "read" else b"POST"),
        clean_path=path,
        raw_query=query.encode(),
        access_token=token_header,
    )
    return request, Route(sandbox_id="sbx", address="10.0.0.2", envd_token=token)


@pytest.mark.parametrize("vector", range(5))
def test_signed_url_accepted(vector: int) -> None:
    request, route = _request(vector)
    assert check_envd(request, route, now=1700000000) is None


def test_the_sdk_url_of_the_notes_verifies() -> None:
    # notes §7: download_url("/tmp/data file+x.bin", user="root", use_signature_expiration=300)
    query = (
        b"path=%2Ftmp%2Fdata%20file%2Bx.bin&username=root&"
        b"signature=v1_SRhL60TVQeC0ll%2FBQnxdy2x%2F32Or4sNjA4Ub8Z%2FLg5Y&"
        b"signature_expiration=1700000300"
    )
    request = EnvdRequest(method=b"GET", clean_path="/files", raw_query=query, access_token=None)
    route = Route(sandbox_id="ixk3q7abcdefghij", address="10.0.0.2", envd_token="tok_abc123")
    assert check_envd(request, route, now=1700000000) is None
    assert check_envd(request, route, now=1700000300) is None  # exp == now is still valid
    rejected = check_envd(request, route, now=1700000301)
    assert rejected is not None
    assert rejected.reason is Reason.ENVD_UNAUTHORIZED


def test_tampered_path_is_rejected() -> None:
    request, route = _request(0)
    tampered = EnvdRequest(
        method=request.method,
        clean_path="/files",
        raw_query=(request.raw_query or b"").replace(b"hello", b"hellx"),
        access_token=None,
    )
    assert check_envd(tampered, route, now=0) is not None


def test_another_sandboxs_token_is_rejected() -> None:
    request, _ = _request(0)
    other = Route(sandbox_id="other", address="10.0.0.3", envd_token="tok_other")
    result = check_envd(request, other, now=0)
    assert result is not None
    assert result.status == 401


def test_operation_mismatch_is_rejected() -> None:
    request, route = _request(0, method=b"POST")  # a read signature used for an upload
    assert check_envd(request, route, now=0) is not None


def test_expired_is_rejected() -> None:
    request, route = _request(2)
    result = check_envd(request, route, now=1700000301)
    assert result is not None
    assert result.reason is Reason.ENVD_UNAUTHORIZED


@pytest.mark.parametrize(
    "extra", ["&path=%2Fetc%2Fpasswd", "&signature=v1_x", "&username=root", "&path=%2Fhome"]
)
def test_duplicated_parameter_is_rejected(extra: str) -> None:
    request, route = _request(2 if "username" in extra else 0, extra=extra)
    result = check_envd(request, route, now=0)
    assert result is not None
    assert result.status == 401


def test_duplicated_expiration_is_rejected() -> None:
    request, route = _request(2, extra="&signature_expiration=1700000300")
    result = check_envd(request, route, now=0)
    assert result is not None
    assert result.status == 401


@pytest.mark.parametrize(
    "exp", ["abc", "-1", "1.5", "", "99999999999999999999", "9223372036854775808"]
)
def test_non_integer_expiration_is_400(exp: str) -> None:
    request = EnvdRequest(
        method=b"GET",
        clean_path="/files",
        raw_query=f"path=%2Fa&signature=v1_x&signature_expiration={exp}".encode(),
        access_token=None,
    )
    route = Route(sandbox_id="s", address="10.0.0.2", envd_token="t")
    result = check_envd(request, route, now=0)
    assert result is not None
    assert result.reason is Reason.BAD_EXPIRATION
    assert result.status == 400


def test_wrong_header_beside_a_valid_signature_is_401() -> None:
    request, route = _request(0, token_header=b"not-the-token")
    result = check_envd(request, route, now=0)
    assert result is not None
    assert result.reason is Reason.ENVD_UNAUTHORIZED


def test_right_header_is_enough() -> None:
    request = EnvdRequest(
        method=b"POST", clean_path="/process.Process/Start", raw_query=None, access_token=b"t"
    )
    route = Route(sandbox_id="s", address="10.0.0.2", envd_token="t")
    assert check_envd(request, route, now=0) is None


@pytest.mark.parametrize(
    ("method", "path", "ok"),
    [
        (b"GET", "/health", True),
        (b"HEAD", "/health", False),
        (b"POST", "/health", False),
        (b"GET", "/files", False),  # no signature, no header
        (b"POST", "/process.Process/Start", False),
    ],
)
def test_no_credential(method: bytes, path: str, ok: bool) -> None:
    request = EnvdRequest(method=method, clean_path=path, raw_query=None, access_token=None)
    route = Route(sandbox_id="s", address="10.0.0.2", envd_token="t")
    assert (check_envd(request, route, now=0) is None) is ok


def test_signature_only_on_files() -> None:
    request, route = _request(0, path="/envs")
    assert check_envd(request, route, now=0) is not None


def test_insecure_route_skips_checks() -> None:
    request = EnvdRequest(method=b"POST", clean_path="/x", raw_query=None, access_token=b"junk")
    route = Route(sandbox_id="s", address="10.0.0.2", insecure=True)
    assert check_envd(request, route, now=0) is None


@pytest.mark.parametrize(
    ("raw", "decoded"),
    [(b"a+b", b"a b"), (b"%2Fx", b"/x"), (b"%zz", None), (b"%2", None), (b"plain", b"plain")],
)
def test_go_query_unescape(raw: bytes, decoded: bytes | None) -> None:
    assert go_query_unescape(raw) == decoded


def test_go_parse_query_drops_semicolons_and_bad_escapes() -> None:
    assert go_parse_query(b"a=1;b=2&c=%zz&d=x+y&e") == [(b"d", b"x y"), (b"e", b"")]


@pytest.mark.parametrize(
    ("query", "kept"),
    [
        (b"path=%2Fa&signature=v1_x&signature_expiration=5&x=1", b"path=%2Fa&x=1"),
        (b"signature=a&SIGNATURE=b&sig%6eature=c&z=1", b"z=1"),
        (b"signature_expiration", b""),
        (b"a=1&b=2", b"a=1&b=2"),
        # Spellings other parsers read as a signature (Rails: ';', brackets; PHP: spaces).
        (b"a=1;signature=b&c=1", b"c=1"),
        (b"signature[]=a&%5Bsignature%5D=b&+signature=c&sig%6Eature[x]=d&z=1", b"z=1"),
        (b"signatures=1&signature_x=2&x;y", b"signatures=1&signature_x=2&x;y"),
        # Dropped whole: cut at its ';', the pair Go ignored would become username=root.
        (b"username=root;signature=x&x=1", b"x=1"),
    ],
)
def test_strip_signature_params(query: bytes, kept: bytes) -> None:
    assert strip_signature_params(query) == kept


def test_traffic_token() -> None:
    route = Route(sandbox_id="s", address="10.0.0.2", envd_token="t", traffic_token="tt")
    missing = check_traffic(None, route)
    assert missing is not None
    assert missing.reason is Reason.TRAFFIC_TOKEN_MISSING
    wrong = check_traffic([b"nope"], route)
    assert wrong is not None
    assert wrong.reason is Reason.TRAFFIC_TOKEN_INVALID
    assert check_traffic([b"tt"], route) is None
    public = Route(sandbox_id="s", address="10.0.0.2", envd_token="t")
    assert check_traffic(None, public) is None


@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                [b"path", b"pa%74h", b"username", b"signature", b"x", b"sig+nature", b"%zz"]
            ),
            st.binary(max_size=12),
            st.sampled_from([b"=", b""]),
        ),
        max_size=6,
    )
)
def test_signed_params_are_what_go_would_read(pairs: list[tuple[bytes, bytes, bytes]]) -> None:
    raw = b"&".join(k + sep + v for k, v, sep in pairs)
    expected: dict[bytes, list[bytes]] = {}
    for key, value in go_parse_query(raw):
        if key in SIGNED_PARAMS:
            expected.setdefault(key, []).append(value)
    assert signed_params(raw) == expected


# Pairs a client may add to a signed URL: repeated, encoded, ';'-joined or malformed names
# and values, and spellings of a signature other parsers read (review G).
NOISE = [
    "path=%2Fetc%2Fpasswd",
    "path=",
    "username=root",
    "username=",
    "pa%74h=%2Fetc",
    "PATH=%2Fetc",
    "path+=%2Fetc",
    "username=root;signature=x",
    "path=%2Fetc;signature_expiration=1",
    "x=1;signature=y",
    "path=%2Fetc;x",
    "signature[]=x",
    "+signature=x",
    "sig%6Eature=x",
    "signature_expiration=1",
    "%zz=1",
    "path=%zz",
    "username=%2",
    "x=1",
    "",
]


@settings(max_examples=300)
@given(
    user=st.sampled_from(["", "user", "root"]),
    exp=st.sampled_from([None, 10, 99]),
    noise=st.lists(st.sampled_from(NOISE), max_size=4),
    order=st.randoms(use_true_random=False),
    joiner=st.lists(st.sampled_from(["&", ";"]), min_size=8, max_size=8),
)
def test_what_relay_verifies_is_what_envd_binds(
    user: str,
    exp: int | None,
    noise: list[str],
    order: random.Random,
    joiner: list[str],
) -> None:
    """In strip mode envd has no token and binds the forwarded query as Go does: whatever
    relay admits as signed must reach it with exactly the path and username (present or
    not) that the signature covered, one of each at most, and no signature."""
    signature = _quote(file_signature("/a b", "read", user, "tok", exp))
    pairs = ["path=%2Fa+b", f"signature={signature}", *noise]
    if user:
        pairs.append(f"username={user}")
    if exp is not None:
        pairs.append(f"signature_expiration={exp}")
    order.shuffle(pairs)
    query = pairs[0] + "".join(j + p for j, p in zip(joiner, pairs[1:], strict=False))
    request = EnvdRequest(
        method=b"GET", clean_path="/files", raw_query=query.encode(), access_token=None
    )
    route = Route(sandbox_id="s", address="10.0.0.2", envd_token="tok")
    if check_envd(request, route, now=10) is not None:
        return
    verified = signed_params(query.encode())
    bound = go_url_query(strip_signature_params(query.encode()).decode("latin-1"))
    for name in ("path", "username"):
        assert len(bound.get(name, [])) <= 1, (query, bound)
        relay_saw = verified.get(name.encode())
        envd_sees = bound.get(name)
        assert (relay_saw is None) == (envd_sees is None), (name, query, bound)
        if relay_saw is not None and envd_sees is not None:
            assert relay_saw[0] == envd_sees[0].encode("latin-1"), (name, query, bound)
    assert "signature" not in bound
    assert "signature_expiration" not in bound
