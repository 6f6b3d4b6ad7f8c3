"""Found by review: an upstream's answer that came before the request body ended was sent to
the client without ``Connection: close``, though relay then closed the connection.

relay cannot keep a client connection whose request body it will not read to its end
(``Respond.response_end``), so it closes it after the answer (lingering, relay.closing). The
client was not told: RFC 9112 §9.6 has a server that will close say so in its last response
("SHOULD send a close connection option"), and RFC 9110 §10.1.1 asks a server answering
before the whole content to "indicate whether it intends to close the connection". Go's
net/http server, which E2B's proxy runs on, sends ``Connection: close`` whenever it will close
after an unread body (closeAfterReply). A client told nothing takes the connection for a
kept one and sends its next request into the close.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from tests.support.harness import DOMAIN, route, running_relay, scripted_upstream

BODY = 8 << 20


async def test_an_answer_before_the_end_of_the_upload_says_the_connection_closes(
    tmp_path: Path,
) -> None:
    async def app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        # A keep-alive answer of its own: the close is relay's decision, not the upstream's.
        writer.write(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 7\r\n\r\ntoo big")
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until relay lets go of this connection
        writer.close()

    async with (
        scripted_upstream(app) as port,
        running_relay(tmp_path, [route("sbx", insecure=True)]) as relay,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(
            f"POST /upload HTTP/1.1\r\nHost: {port}-sbx.{DOMAIN}\r\n"
            f"Content-Length: {BODY}\r\n\r\n".encode()
        )

        async def upload() -> None:
            with contextlib.suppress(ConnectionError):
                for _ in range(BODY // 65536):  # bounded: the announced body, 64 KiB at a time
                    writer.write(b"x" * 65536)
                    await writer.drain()

        sending = asyncio.create_task(upload())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        body = await asyncio.wait_for(reader.readexactly(7), 5)
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sending
        writer.close()
    assert head.startswith(b"HTTP/1.1 413")
    assert body == b"too big"
    fields = [line.lower() for line in head.split(b"\r\n")[1:]]
    assert b"connection: close" in fields, head
