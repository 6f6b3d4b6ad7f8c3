"""Path rules: one percent-decoding, Go's path.Clean, control paths (SPEC §2, §5a)."""

from __future__ import annotations

import posixpath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.core.model import Reason, Reject
from relay.core.policy import (
    CONTROL_PATHS,
    METHOD_MAX,
    TARGET_MEMO_BYTES,
    SplitTarget,
    clean_path,
    percent_decode_path,
    plain_http_request,
    split_target,
)


@pytest.mark.parametrize(
    ("path", "clean"),
    [
        ("/", "/"),
        ("//init", "/init"),
        ("/a/../init", "/init"),
        ("/../init", "/init"),
        ("/./init/", "/init"),
        ("/init/.", "/init"),
        ("///a//b///", "/a/b"),
        ("/a/b/../../..", "/"),
        ("/files", "/files"),
    ],
)
def test_clean_path_like_go(path: str, clean: str) -> None:
    assert clean_path(path) == clean


@given(st.lists(st.sampled_from(["a", "b", ".", "..", "", "init"]), max_size=8))
def test_clean_path_matches_normpath_without_leading_double_slash(segments: list[str]) -> None:
    path = "/" + "/".join(segments)
    # posixpath keeps a leading "//" (POSIX allows it); Go's Clean and ours do not.
    expected = posixpath.normpath(path)
    if expected.startswith("//"):
        expected = expected[1:]
    assert clean_path(path) == expected


@pytest.mark.parametrize(
    ("raw", "decoded"),
    [
        (b"/a%20b", b"/a b"),
        (b"/a+b", b"/a+b"),
        (b"/%69nit", b"/init"),
        (b"/%", None),
        (b"/%g0", None),
    ],
)
def test_percent_decode(raw: bytes, decoded: bytes | None) -> None:
    assert percent_decode_path(raw) == decoded


@pytest.mark.parametrize(
    "target",
    [b"/a%2fb", b"/a%2Fb", b"/a%5cb", b"/a\\b", b"/a%00", b"/a\x00", b"/a#frag", b"/a?x=%00"],
)
def test_forbidden_encodings_are_400(target: bytes) -> None:
    result = split_target(target)
    assert isinstance(result, Reject)
    assert result.reason is Reason.BAD_PATH


@pytest.mark.parametrize("target", [b"http://x/init", b"*", b"x", b""])
def test_only_origin_form(target: bytes) -> None:
    result = split_target(target)
    assert isinstance(result, Reject)
    assert result.reason is Reason.BAD_TARGET_FORM


@pytest.mark.parametrize(
    ("target", "clean", "query"),
    [
        (b"/files?path=%2Fa", "/files", b"path=%2Fa"),
        (b"/%69nit", "/init", None),
        (b"/a/../b?", "/b", b""),
    ],
)
def test_split(target: bytes, clean: str, query: bytes | None) -> None:
    result = split_target(target)
    assert not isinstance(result, Reject)
    assert result.clean_path == clean
    assert result.raw_query == query


@pytest.mark.parametrize("query", [b"", b"?q="])
def test_only_short_targets_are_remembered(query: bytes) -> None:
    # A remembered target is kept with its split copies: 2,048 targets of 16 KiB would pin
    # ~75 MiB (relay.core.policy.TARGET_MEMO_BYTES).
    short = b"/process.Process/Start" + query
    assert split_target(short) is split_target(short)
    edge = short + b"a" * (TARGET_MEMO_BYTES - len(short))
    assert split_target(edge) is split_target(edge)
    long = edge + b"a"
    first = split_target(long)
    path, _, rest = long.partition(b"?")
    assert first == SplitTarget(path, rest if query else None, path.decode())
    again = split_target(long)
    assert again == first  # split afresh, to the same result
    assert again is not first  # but not remembered


def test_control_paths_are_envds_internal_routes() -> None:
    assert {
        "/init",
        "/freeze",
        "/unfreeze",
        "/collapse",
        "/fsfreeze",
        "/fsthaw",
        "/upgrade",
    } == CONTROL_PATHS


@pytest.mark.parametrize(
    ("first", "verdict"),
    [
        (b"GET / HTTP/1.1\r\n", True),
        (b"GET ", True),
        (b"VERSION-CONTROL /x HTTP/1.1", True),
        (b"UPDATEREDIRECTREF / HTTP/1.1", True),
        (b"\x16\x03\x01\x02\x00", False),  # a ClientHello's record header
        (b"\x16", False),  # told at its first byte
        (b"\x80\x2e\x01", False),  # an SSLv2-style hello
        (b"SSH-2.0-OpenSSH_9.6 Ubuntu", False),
        (b"get / HTTP/1.1", False),
        (b" GET /", False),
        (b"-GET /", False),
        (b"GET\t/", False),
        (b"", None),
        (b"G", None),
        (b"POS", None),
        (b"A" * METHOD_MAX, None),
        (b"A" * (METHOD_MAX + 1), False),
        (b"A" * METHOD_MAX + b" /", True),
    ],
)
def test_plain_http_request_is_told_from_its_method_and_space(
    first: bytes, verdict: bool | None
) -> None:
    assert plain_http_request(first) is verdict


@given(st.binary(max_size=64))
def test_plain_http_request_decides_within_method_max_bytes(first: bytes) -> None:
    """A client is never waited for past METHOD_MAX + 1 bytes; a verdict, once given, holds
    whatever follows."""
    verdict = plain_http_request(first)
    if len(first) > METHOD_MAX:
        assert verdict is not None
    if verdict is not None:
        assert plain_http_request(first + b"more") is verdict
