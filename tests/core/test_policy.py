"""Path rules: one percent-decoding, Go's path.Clean, control paths (SPEC §2, §5a)."""

from __future__ import annotations

import posixpath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.core.model import Reason, Reject
from relay.core.policy import CONTROL_PATHS, clean_path, percent_decode_path, split_target


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
