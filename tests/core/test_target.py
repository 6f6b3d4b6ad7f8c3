"""Which sandbox a request is for (SPEC §1)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.core.model import Reason, Reject, Target
from relay.core.target import (
    API_HOST,
    HOST_MEMO_BYTES,
    ApiHost,
    find_target,
    host_target,
    normalise_host,
    parse_port,
    target_from_host,
)

DOMAINS = ("e2b.example.com", "sandbox.localhost")
ONE_LABEL = "Invalid host: only one label may precede the domain e2b.example.com"


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("49983-abc123.e2b.example.com", Target("abc123", 49983)),
        (
            "49983-i7iwe280qistx84jtsi8q-685e4066.e2b.example.com",
            Target("i7iwe280qistx84jtsi8q", 49983),
        ),
        ("8080-abc.sandbox.localhost", Target("abc", 8080)),
        ("1-a.e2b.example.com", Target("a", 1)),
        ("65535-a.e2b.example.com", Target("a", 65535)),
        ("sandbox.e2b.example.com", None),
        ("api.e2b.example.com", API_HOST),
        ("e2b.example.com", None),
        ("localhost", None),
        ("other.org", None),
        ("49983-abc.other.org", None),
        ("foo-bar.e2b.example.com", None),
    ],
)
def test_host_form(host: str, expected: Target | ApiHost | None) -> None:
    assert target_from_host(host, DOMAINS) == expected


@pytest.mark.parametrize(
    "host",
    [
        "0-abc.e2b.example.com",
        "049983-abc.e2b.example.com",
        "65536-abc.e2b.example.com",
        "99999999999-abc.e2b.example.com",
        "49983-.e2b.example.com",
        "49983-ABC.e2b.example.com".lower().replace("abc", "a_b"),
        "49983-" + "a" * 65 + ".e2b.example.com",
        "49983-x.y.e2b.example.com",
        "api.x.e2b.example.com",
    ],
)
def test_bad_host_is_400(host: str) -> None:
    result = target_from_host(host, DOMAINS)
    assert isinstance(result, Reject)
    assert result.status == 400


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        (b"49983-ABC.E2B.example.com", "49983-abc.e2b.example.com"),
        (b"49983-abc.e2b.example.com.", "49983-abc.e2b.example.com"),
        (b"49983-abc.e2b.example.com:443", "49983-abc.e2b.example.com"),
        (b"49983-abc.e2b.example.com.:8443", "49983-abc.e2b.example.com"),
        (b"[::1]:8080", "[::1]"),
        (b"127.0.0.1", "127.0.0.1"),
        (b"host:", "host"),
        (b"a b", None),
        (b"::1", None),
        (b"host:80x", None),
        (b"\xff", None),
        (b"", None),
        (b"[::1", None),
        # RFC 3986 §3.2.2: the brackets hold an IPv6 address, not any run of hex digits,
        # colons and dots (found by review: these were hosts, "no sandbox", not 400).
        (b"[::ffff:1.2.3.4]:8080", "[::ffff:1.2.3.4]"),
        (b"[0:0::1]", "[0:0::1]"),
        (b"[:]", None),
        (b"[1.2.3.4]:80", None),
        (b"[::1::2]", None),
        (b"[12345::]", None),
    ],
)
def test_normalise_host(raw: bytes, normal: str | None) -> None:
    assert normalise_host(raw) == normal


@pytest.mark.parametrize(
    ("text", "port"),
    [
        ("1", 1),
        ("49983", 49983),
        ("0", None),
        ("01", None),
        ("+1", None),
        ("1 ", None),
        ("٣", None),
    ],
)
def test_parse_port(text: str, port: int | None) -> None:
    assert parse_port(text) == port


def test_headers_alone() -> None:
    assert find_target("relay.internal", [b"abc"], [b"49983"], DOMAINS) == Target("abc", 49983)


@pytest.mark.parametrize(
    ("ids", "ports"),
    [
        ([b"abc"], None),
        (None, [b"49983"]),
        ([b"ABC"], [b"49983"]),  # the header id is not lower-cased
        ([b"abc"], [b"0"]),
        ([b"abc"], [b"x"]),
        ([b"abc", b"abc"], [b"49983"]),
        ([b""], [b"49983"]),
    ],
)
def test_bad_headers_are_400(ids: list[bytes] | None, ports: list[bytes] | None) -> None:
    result = find_target("sandbox.e2b.example.com", ids, ports, DOMAINS)
    assert isinstance(result, Reject)
    assert result.status == 400


def test_routing_headers_are_ignored_on_the_api_host() -> None:
    # SDK 2.25 sends them on its control-plane connect call (E2B PR #1272).
    assert find_target("api.e2b.example.com", [b"abc"], [b"49983"], DOMAINS) is None
    assert find_target("api.e2b.example.com", [b"abc"], None, DOMAINS) is None


def test_host_and_headers_must_agree() -> None:
    host = "49983-abc.e2b.example.com"
    assert find_target(host, [b"abc"], [b"49983"], DOMAINS) == Target("abc", 49983)
    for ids, ports in (([b"xyz"], [b"49983"]), ([b"abc"], [b"8080"])):
        result = find_target(host, ids, ports, DOMAINS)
        assert isinstance(result, Reject)
        assert result.status == 400


def test_most_specific_domain_wins() -> None:
    domains = ("example.com", "e2b.example.com")
    ordered = tuple(sorted(domains, key=len, reverse=True))
    assert target_from_host("49983-abc.e2b.example.com", ordered) == Target("abc", 49983)


def test_only_hosts_as_long_as_a_host_name_are_remembered() -> None:
    # A remembered Host is kept as its key: 4,096 Host values of 16 KiB would pin ~64 MiB
    # (relay.core.target.HOST_MEMO_BYTES).
    prefix, suffix = b"49983-abc-", b".e2b.example.com:49983"
    edge = prefix + b"x" * (HOST_MEMO_BYTES - len(prefix) - len(suffix)) + suffix
    assert host_target(edge, DOMAINS) == (True, Target("abc", 49983))
    assert host_target(edge, DOMAINS) is host_target(edge, DOMAINS)
    labels = b"a." * (HOST_MEMO_BYTES // 2) + b"e2b.example.com"
    for value, answer in [
        (prefix + b"x" + edge[len(prefix) :], Target("abc", 49983)),
        (labels, Reject(reason=Reason.BAD_HOST, detail=ONE_LABEL)),
    ]:
        first = host_target(value, DOMAINS)
        assert first == (True, answer)
        again = host_target(value, DOMAINS)
        assert again == first  # parsed afresh, to the same answer
        assert again is not first  # but not remembered


@given(
    host=st.one_of(st.none(), st.text(max_size=80)),
    ids=st.one_of(st.none(), st.lists(st.binary(max_size=70), max_size=3)),
    ports=st.one_of(st.none(), st.lists(st.binary(max_size=8), max_size=3)),
)
def test_target_parsing_never_raises(
    host: str | None, ids: list[bytes] | None, ports: list[bytes] | None
) -> None:
    normal = normalise_host(host.encode("utf-8", "surrogatepass")) if host is not None else None
    result = find_target(normal, ids or None, ports or None, DOMAINS)
    assert result is None or isinstance(result, (Target, Reject))
    if isinstance(result, Target):
        assert 1 <= result.port <= 65535
        assert result.sandbox_id.isalnum()
