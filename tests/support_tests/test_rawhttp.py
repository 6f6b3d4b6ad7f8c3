"""The raw test client itself: what it parses is what relay's byte-level tests assert on."""

from __future__ import annotations

import asyncio

from tests.support.rawhttp import Connection

HEAD_ANSWER = b"HTTP/1.1 404 Not Found\r\nContent-Length: 27\r\n\r\n"
NEXT_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"


async def answering(data: bytes, pieces: int) -> tuple[asyncio.Server, int, asyncio.Event]:
    """A server that answers a connection with ``data``, in ``pieces`` writes; the event is
    set when it has closed the connection."""
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read(1)
            step = -(-len(data) // pieces)
            for start in range(0, len(data), step):
                writer.write(data[start : start + step])
                await writer.drain()
                await asyncio.sleep(0.01)
            await reader.read()
        finally:
            writer.close()
            await writer.wait_closed()
            closed.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], closed


async def test_head_answer_and_the_next_in_one_read() -> None:
    """A HEAD response's Content-Length announces no content (RFC 9110 §9.3.2): the response
    after it, in the same read or cut anywhere, is the next response, not the HEAD's body (a
    hostile test timed out under CPU load, when relay's two answers came in one read)."""
    for pieces in (1, 2, 3, 7):
        server, port, closed = await answering(HEAD_ANSWER + NEXT_ANSWER, pieces)
        async with server:
            conn = await Connection.open(port)
            try:
                await conn.send(b"x")
                head = await conn.read_response(timeout=2, head=True)
                after = await conn.read_response(timeout=2)
            finally:
                await conn.close()
                await closed.wait()
        assert (head.status, head.body) == (404, b""), pieces
        assert (after.status, after.body, after.complete) == (200, b"hello", True), pieces


async def test_an_interim_answer_before_the_head_answer() -> None:
    """Found by review: a 1xx before a HEAD's answer was taken for it, and the answer then
    for a body. The 1xx is read as a response of its own, as for any other request."""
    interim = b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>\r\n\r\n"
    for pieces in (1, 2, 3):
        server, port, closed = await answering(interim + HEAD_ANSWER + NEXT_ANSWER, pieces)
        async with server:
            conn = await Connection.open(port)
            try:
                await conn.send(b"x")
                first = await conn.read_response(timeout=2, head=True)
                head = await conn.read_response(timeout=2, head=True)
                after = await conn.read_response(timeout=2)
            finally:
                await conn.close()
                await closed.wait()
        assert first.status == 103, pieces
        assert (head.status, head.body) == (404, b""), pieces
        assert (after.status, after.body) == (200, b"hello"), pieces


async def test_a_head_answer_after_another_in_one_read() -> None:
    """A HEAD pipelined behind a GET: its answer may come in the read that ends the GET's, and
    before read_response is called for it. The client knows it answers HEAD from what it sent
    (found by review: read_response(head=True) came too late, and the next answer was taken
    for the HEAD answer's body)."""
    sent = b"".join(
        b"%s / HTTP/1.1\r\nHost: x\r\n\r\n" % method for method in (b"GET", b"HEAD", b"GET")
    )
    for pieces in (1, 2, 3, 7):
        server, port, closed = await answering(NEXT_ANSWER + HEAD_ANSWER + NEXT_ANSWER, pieces)
        async with server:
            conn = await Connection.open(port)
            try:
                await conn.send(sent)
                answers = [await conn.read_response(timeout=2) for _ in range(3)]
            finally:
                await conn.close()
                await closed.wait()
        assert [(a.status, a.body) for a in answers] == [
            (200, b"hello"),
            (404, b""),
            (200, b"hello"),
        ], pieces


async def test_a_head_answer_cut_by_eof_is_what_there_is_of_it() -> None:
    """Found by review: bytes held for a HEAD answer's head were dropped at EOF."""
    server, port, closed = await answering(b"HTTP/1.1 404 Not Found\r\nContent-Le", 1)
    async with server:
        conn = await Connection.open(port)
        try:
            await conn.send(b"x")
            conn.writer.write_eof()
            partial = await conn.read_response(timeout=2, head=True)
        finally:
            await conn.close()
            await closed.wait()
    assert (partial.reason, partial.complete) == (b"Not Found", False)
