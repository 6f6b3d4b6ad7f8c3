"""Answers relay writes itself outside a forwarded exchange's usual path (SPEC §5, §7): past
``listen.max_connections``, and when an exchange's own request breaks mid-body."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support.harness import route, running_relay

ORIGIN = b"Origin: https://app.example\r\n"


async def _exchange(port: int, parts: list[bytes], wait_s: float = 2.0) -> bytes:
    """Send ``parts`` (a pause between them), then read until relay closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.1)
        out = b""
        async with asyncio.timeout(wait_s):
            while data := await reader.read(65536):
                out += data
        return out
    finally:
        writer.close()


async def test_an_overload_503_answers_a_head_with_no_content_and_cors(tmp_path: Path) -> None:
    """The 503 past listen.max_connections is an answer to a parsed request: a HEAD gets no
    content (RFC 9110 §9.3.2) and a request with an Origin gets Access-Control-Allow-Origin
    (SPEC §5), as every other answer of relay's. It was written without the request's head:
    a HEAD got the JSON body and a browser's fetch an opaque network error."""
    overrides = {"listen": {"max_connections": 1}}
    async with running_relay(tmp_path, [route("held", insecure=True)], overrides) as relay:
        _, holder = await asyncio.open_connection("127.0.0.1", relay.port)
        try:
            await asyncio.sleep(0.05)
            answer = await _exchange(
                relay.port, [b"HEAD / HTTP/1.1\r\nHost: x\r\n" + ORIGIN + b"\r\n"]
            )
        finally:
            holder.close()
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer
    assert b"\r\nRetry-After: " in head
    assert b"\r\nAccess-Control-Allow-Origin: *" in head, head
    assert content == b"", content
