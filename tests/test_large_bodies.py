"""100 MiB each way through a real relay process, byte-exact, with bounded memory."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.harness import DOMAIN, RelayProcess, relay_process, route
from tests.support.rawhttp import request_bytes

SIZE = 100 * 1024 * 1024
BLOCK = bytes(range(256)) * 256  # 64 KiB, deterministic


def vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


@pytest.fixture
async def bulk() -> AsyncIterator[tuple[TestServer, dict[str, str]]]:
    received: dict[str, str] = {}

    async def download(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = SIZE
        await response.prepare(request)
        for _ in range(SIZE // len(BLOCK)):
            await response.write(BLOCK)
        return response

    async def upload(request: web.Request) -> web.Response:
        digest = hashlib.sha256()
        total = 0
        async for chunk in request.content.iter_any():
            digest.update(chunk)
            total += len(chunk)
        received["sha256"] = digest.hexdigest()
        received["size"] = str(total)
        received["te"] = request.headers.get("Transfer-Encoding", "")
        return web.json_response({"size": total})

    app = web.Application(client_max_size=0)
    app.router.add_get("/files", download)
    app.router.add_post("/files", upload)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server, received
    await server.close()


def expected_sha256() -> str:
    digest = hashlib.sha256()
    for _ in range(SIZE // len(BLOCK)):
        digest.update(BLOCK)
    return digest.hexdigest()


async def _download(relay: RelayProcess, host: str) -> tuple[str, int]:
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(request_bytes("GET", "/files?path=%2Fbig", host, [("Connection", "close")]))
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"Content-Length: %d" % SIZE in head
    digest = hashlib.sha256()
    total = 0
    while chunk := await reader.read(1 << 18):
        digest.update(chunk)
        total += len(chunk)
    writer.close()
    return digest.hexdigest(), total


async def _upload(relay: RelayProcess, host: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(
        request_bytes(
            "POST",
            "/files?path=%2Fup",
            host,
            [("Transfer-Encoding", "chunked"), ("Connection", "close")],
        )
    )
    for _ in range(SIZE // len(BLOCK)):
        writer.write(b"%x\r\n" % len(BLOCK) + BLOCK + b"\r\n")
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return answer


@pytest.mark.slow
async def test_100_mib_each_way_with_bounded_memory(
    tmp_path: Path, bulk: tuple[TestServer, dict[str, str]]
) -> None:
    server, received = bulk
    host = f"{server.port}-bulk.{DOMAIN}"
    with relay_process(tmp_path, [route("bulk", insecure=True)]) as relay:
        assert relay.proc is not None
        baseline = vm_kib(relay.proc.pid, "VmRSS")
        sha, size = await asyncio.wait_for(_download(relay, host), 60)
        answer = await asyncio.wait_for(_upload(relay, host), 60)
        peak = vm_kib(relay.proc.pid, "VmHWM")
    assert (sha, size) == (expected_sha256(), SIZE)
    assert answer.startswith(b"HTTP/1.1 200")
    assert received == {"sha256": expected_sha256(), "size": str(SIZE), "te": "chunked"}
    growth_mib = (peak - baseline) / 1024
    print(f"relay RSS growth: {growth_mib:.1f} MiB")
    assert growth_mib < 50, f"relay RSS grew by {growth_mib:.1f} MiB"
