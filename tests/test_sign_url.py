"""`relay sign-url` makes the URL the SDK makes (notes/e2b-protocol.md §7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.__main__ import main, sign_url


def test_download_url_with_expiration_matches_the_sdk() -> None:
    url = sign_url(
        "https://49983-ixk3q7abcdefghij.e2b.app",
        "/tmp/data file+x.bin",
        "read",
        "root",
        "tok_abc123",
        300,
        now=1700000000,
    )
    assert url == (
        "https://49983-ixk3q7abcdefghij.e2b.app/files?path=%2Ftmp%2Fdata%20file%2Bx.bin"
        "&username=root&signature=v1_SRhL60TVQeC0ll%2FBQnxdy2x%2F32Or4sNjA4Ub8Z%2FLg5Y"
        "&signature_expiration=1700000300"
    )


def test_upload_url_without_expiration_matches_the_sdk() -> None:
    url = sign_url(
        "https://49983-ixk3q7abcdefghij.e2b.app",
        "/home/user/a.txt",
        "write",
        "",
        "tok_abc123",
        None,
        now=0,
    )
    assert url == (
        "https://49983-ixk3q7abcdefghij.e2b.app/files?path=%2Fhome%2Fuser%2Fa.txt"
        "&signature=v1_uCrcoNgu3g9Gdg%2BxTDLOVd%2BvRVbvno0vextglsmzm3U"
    )


def test_cli_reads_the_token_from_a_route(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "routes.json").write_text(
        '{"routes": [{"sandbox_id": "abc", "address": "127.0.0.1", "envd_token": "tok_abc123"}]}'
    )
    (tmp_path / "relay.toml").write_text('[routes]\nfile = "routes.json"\n')
    code = main(
        [
            "sign-url",
            "--url",
            "http://localhost:8080",
            "--path",
            "/home/user/a.txt",
            "--op",
            "write",
            "--sandbox",
            "abc",
            "--config",
            str(tmp_path / "relay.toml"),
        ]
    )
    assert code == 0
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith("signature=v1_uCrcoNgu3g9Gdg%2BxTDLOVd%2BvRVbvno0vextglsmzm3U")
    )
    assert (
        main(
            [
                "sign-url",
                "--url",
                "http://x",
                "--sandbox",
                "nope",
                "--config",
                str(tmp_path / "relay.toml"),
            ]
        )
        == 1
    )


@pytest.mark.parametrize("content", [None, b"", b"\n", b"\xff\xfe"])
def test_an_unusable_token_file_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None
) -> None:
    """A missing or non-UTF-8 --token-file ended sign-url in a traceback (exit 1), and an
    empty one signed with an empty token, where an empty --token-env is refused."""
    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_bytes(content)
    args = ["sign-url", "--url", "http://x", "--path", "/a", "--token-file", str(token_file)]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("relay: "), captured.err
    assert captured.err.count("\n") == 1, captured.err


@pytest.mark.parametrize(
    "url",
    [
        "49983-x.sandbox.localhost:8080",
        "",
        "ftp://49983-x.sandbox.localhost",
        "http://",
        "http://[::1",
    ],
)
def test_a_url_without_scheme_and_host_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    """--url without http(s)://host printed a URL with no host at all ("/files?path=..."; a
    bare host reads as a path to urljoin) and exited 0: the URL an operator checks with is
    not the SDK's, which always joins onto its http(s) envd URL."""
    token_file = tmp_path / "token"
    token_file.write_text("tok")
    args = ["sign-url", "--url", url, "--path", "/a", "--token-file", str(token_file)]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("relay: --url"), captured.err
