"""The answers relay makes itself (SPEC §5)."""

from __future__ import annotations

import json

import pytest

from relay.core.answers import answer_bytes, render
from relay.core.model import Reason, Reject


def test_json_answer() -> None:
    answer = render(Reject(reason=Reason.NOT_FOUND, sandbox_id="abc"))
    assert answer.status == 502
    assert json.loads(answer.body) == {
        "code": 502,
        "message": "The sandbox was not found",
        "sandboxId": "abc",
    }
    assert (b"Content-Type", b"application/json; charset=utf-8") in answer.headers
    assert not any(name == b"Access-Control-Allow-Origin" for name, _ in answer.headers)


def test_port_closed_names_the_port() -> None:
    body = json.loads(render(Reject(reason=Reason.PORT_CLOSED, sandbox_id="a", port=3000)).body)
    assert body == {
        "code": 502,
        "message": "The sandbox is running but port is not open",
        "sandboxId": "a",
        "port": 3000,
    }


def test_reserved_path_answer() -> None:
    body = json.loads(render(Reject(reason=Reason.CONTROL_PATH, path="/init")).body)
    assert body == {
        "code": 404,
        "message": "This endpoint is reserved for the control plane and is not reachable "
        "through the sandbox URL",
        "path": "/init",
    }


def test_cors_on_errors_with_origin() -> None:
    answer = render(Reject(reason=Reason.CONNECT), ((b"Origin", b"https://x"),))
    assert (b"Access-Control-Allow-Origin", b"*") in answer.headers


def test_retry_after() -> None:
    answer = render(Reject(reason=Reason.STALE, retry_after=5))
    assert (b"Retry-After", b"5") in answer.headers
    assert json.loads(answer.body) == {"code": 503, "message": "route cache is stale"}


@pytest.mark.parametrize(
    ("headers", "html"),
    [
        (
            (
                (b"Sec-Fetch-Mode", b"navigate"),
                (b"Accept", b"text/html,application/xhtml+xml,*/*;q=0.8"),
            ),
            True,
        ),
        (((b"Sec-Fetch-Mode", b"navigate"), (b"Accept", b"application/json")), False),
        (((b"Sec-Fetch-Mode", b"cors"), (b"Accept", b"text/html")), False),
        (((b"Accept", b"text/html"),), False),
        (
            ((b"Sec-Fetch-Mode", b"navigate"), (b"Accept", b"text/html;q=0.1, application/json")),
            False,
        ),
    ],
)
def test_html_for_browser_page_loads(headers: tuple[tuple[bytes, bytes], ...], html: bool) -> None:
    answer = render(Reject(reason=Reason.NOT_FOUND, sandbox_id="<script>"), headers)
    content_type = dict(answer.headers)[b"Content-Type"]
    assert content_type.startswith(b"text/html") is html
    if html:
        assert b"<script>" not in answer.body
        assert b"The sandbox was not found" in answer.body


def test_sandbox_limit_message() -> None:
    body = json.loads(render(Reject(reason=Reason.SANDBOX_LIMIT, sandbox_id="a", limit=3)).body)
    assert body["message"] == "The sandbox has too many concurrent incoming connections (limit: 3)"
    assert body["connectionLimit"] == 3


@pytest.mark.parametrize(("close", "head_only"), [(False, False), (True, False), (True, True)])
def test_answer_bytes_frames_the_answer(close: bool, head_only: bool) -> None:
    answer = render(Reject(reason=Reason.NOT_FOUND, sandbox_id="abc"))
    raw = answer_bytes(answer, close=close, head_only=head_only)
    head, sep, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert sep
    assert lines[0] == b"HTTP/1.1 502 Bad Gateway"
    fields = [tuple(line.split(b": ", 1)) for line in lines[1:]]
    assert fields[: len(answer.headers)] == list(answer.headers)
    # Content-Length is the answer's length even when a HEAD answer leaves the body out.
    assert (b"Content-Length", str(len(answer.body)).encode()) in fields
    assert ((b"Connection", b"close") in fields) is close
    assert body == (b"" if head_only else answer.body)
