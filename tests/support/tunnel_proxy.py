"""A loopback HTTP CONNECT proxy that resolves one test domain, for SDK processes only.

The SDK's Host form dials ``https://49983-<id>.<domain>``. SDK 2.52+ resolves names in native
code (pyqwest/reqwest), so no Python-level resolver patch reaches it, and the machine's DNS and
``/etc/hosts`` are not ours to change. Every SDK version and ``urllib`` can be given an HTTP
proxy instead (``HTTPS_PROXY``, or the SDK's ``proxy`` option): a proxied HTTPS request never
resolves its host locally but sends ``CONNECT host:443`` to the proxy. This proxy answers those
for ``*.<domain>`` (and the bare domain), port 443 only, by opening a tunnel to one fixed address
(relay's TLS listener on 127.0.0.1); it refuses every other CONNECT with 403 and anything that is
not a CONNECT with 405, so nothing else on the machine or the internet is reachable through it.
TLS is end to end between the client and relay: the proxy only copies bytes.

``tunnels`` lists the authorities it opened, ``refused`` the requests it turned away (as
``"<METHOD> <target>"``), so a test can prove which traffic went through it.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Self

_HEAD_LIMIT = 8192
_HEAD_TIMEOUT_S = 10.0


class TunnelProxy:
    def __init__(
        self, domain: str, target: tuple[str, int], *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.domain = domain.lower().rstrip(".")
        self.target = target
        self._host = host
        self._requested_port = port
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.tunnels: list[str] = []
        self.refused: list[str] = []

    @property
    def port(self) -> int:
        assert self._server is not None, "proxy not started"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    async def start(self) -> Self:
        self._server = await asyncio.start_server(
            self._accept, self._host, self._requested_port, reuse_address=True
        )
        return self

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 1.0)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def allows(self, authority: str) -> bool:
        host, sep, port = authority.rpartition(":")
        if not sep or port != "443":
            return False
        host = host.lower().rstrip(".")
        return host == self.domain or host.endswith("." + self.domain)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except TimeoutError:
            pass
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(_HEAD_TIMEOUT_S):
            head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > _HEAD_LIMIT:
            await _answer(writer, 431, "Request Header Fields Too Large")
            return
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self.refused.append(request_line)
            await _answer(writer, 400, "Bad Request")
            return
        method, authority, _ = parts
        if method != "CONNECT":
            self.refused.append(f"{method} {authority}")
            await _answer(writer, 405, "Method Not Allowed")
            return
        if not self.allows(authority):
            self.refused.append(f"CONNECT {authority}")
            await _answer(writer, 403, "Forbidden")
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            await _answer(writer, 502, "Bad Gateway")
            return
        self._writers.add(up_writer)
        self.tunnels.append(authority.lower())
        try:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._writers.discard(up_writer)
            up_writer.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction; pass the half-close on, so TLS close_notify/EOF reach the peer."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if not writer.transport.is_closing() and writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError, RuntimeError):
        # RuntimeError: uvloop refuses write_eof on a transport the other side just closed.
        writer.transport.abort()


async def _answer(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    body = f"{status} {reason}: this proxy only tunnels to the test domain\n".encode()
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    with contextlib.suppress(ConnectionError):
        await writer.drain()
