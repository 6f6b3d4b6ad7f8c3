"""A chunked response re-framed for the client (relay/respond.py): every chunk size line is
right, from the table of small sizes (``CHUNK_HEADS``) and past it."""

from __future__ import annotations

from pathlib import Path

import httptools
import pytest

from relay.respond import CHUNK_HEADS
from tests.support.wired import REQUEST, make_wired


class Body:
    def __init__(self) -> None:
        self.body = b""
        self.done = False

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = True


@pytest.mark.parametrize("size", [1, 15, 16, len(CHUNK_HEADS) - 1, len(CHUNK_HEADS), 70_000])
def test_chunks_reach_the_client_well_framed(tmp_path: Path, size: int) -> None:
    wired = make_wired(tmp_path)
    wired.client.data_received(REQUEST)
    wired.turns.end()
    payload = bytes(i % 251 for i in range(size))
    # The head in a read of its own: a larger read that holds a head is fed in slices
    # (relay.response), each re-chunked, and the 70,000-byte size line would not be written.
    wired.upstream.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    wired.turns.end()
    wired.upstream.data_received(b"%x\r\n%s\r\n" % (size, payload))
    wired.turns.end()
    wired.upstream.data_received(b"0\r\n\r\n")
    wired.turns.end()
    sent = wired.client_transport.data
    assert b"\r\n%x\r\n" % size in sent
    got = Body()
    httptools.HttpResponseParser(got).feed_data(sent)
    assert got.done
    assert got.body == payload
