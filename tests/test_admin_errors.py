"""Malformed requests to the admin port (SPEC §7): answered 400, and logged without the bytes
that were sent, which may carry a credential, and without a traceback."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from tests.support.harness import route, running_relay

SECRET = "admin-bearer-s3cret"


async def _send(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        async with asyncio.timeout(2):
            while chunk := await reader.read(65536):
                out += chunk
        return out
    finally:
        writer.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        # whitespace before the colon (RFC 9112 §5.1): refused, the line quoted
        f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization : Bearer {SECRET}\r\n\r\n",
        f"GET /metrics?token={SECRET} HTTP/9.9\r\nHost: x\r\n\r\n",  # bad version
    ],
)
async def test_a_malformed_admin_request_is_logged_without_its_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, request_bytes: str
) -> None:
    """aiohttp logged each at ERROR with a traceback whose exception quotes the offending
    line, credential included ("Error handling request from 127.0.0.1 ... b'Authorization :
    Bearer admin-bearer-s3cret'"): SPEC §2 "Credentials never appear in a log line"."""
    caplog.set_level(logging.DEBUG)
    async with running_relay(tmp_path, [route("adm", insecure=True)]) as relay:
        assert relay.relay.admin_bound is not None
        answer = await _send(relay.relay.admin_bound[1], request_bytes.encode())
    assert answer.startswith((b"HTTP/1.0 400 ", b"HTTP/1.1 400 ")), answer
    assert SECRET not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
