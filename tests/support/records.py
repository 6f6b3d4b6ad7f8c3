"""What reached a fake upstream, exactly as it arrived.

Tests use these records to prove what a relay forwarded: the raw request target (so a stripped
``signature`` query parameter is visible), every header in received order with duplicates (so a
credential header that slipped through is visible), and the body size. Records are frozen; the
entry for a request is replaced in place as its body is read, so the list stays in arrival order.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from urllib.parse import parse_qsl

from aiohttp import web

BODY_HEAD_LIMIT = 64 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    arrival: float  # time.monotonic() when the request head was handed to the fake
    method: str
    target: str  # raw request target as received, query included, not decoded
    version: str  # "HTTP/1.1"
    headers: tuple[tuple[str, str], ...]  # received order, duplicates kept, bytes as latin-1
    body_size: int  # bytes of body read so far (after de-chunking, before any decompression)
    body_head: bytes  # the first BODY_HEAD_LIMIT bytes of the body
    body_complete: bool  # True once the body was read to its end
    peer: str

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def raw_query(self) -> str:
        return self.target.partition("?")[2]

    def query(self) -> list[tuple[str, str]]:
        """Decoded query pairs in order, as Go's url.ParseQuery reads them (+ is a space)."""
        return parse_qsl(self.raw_query, keep_blank_values=True)

    def query_names(self) -> set[str]:
        return {name for name, _ in self.query()}

    def header(self, name: str) -> str | None:
        """First value, case-insensitive (Go's Header.Get)."""
        values = self.header_all(name)
        return values[0] if values else None

    def header_all(self, name: str) -> list[str]:
        wanted = name.lower()
        return [value for key, value in self.headers if key.lower() == wanted]

    def has_header(self, name: str) -> bool:
        return bool(self.header_all(name))

    def header_names(self) -> set[str]:
        return {key.lower() for key, _ in self.headers}


class RecordHandle:
    """Tracks one request's body as the handler reads it and republishes its record."""

    def __init__(self, target: list[RequestRecord], index: int, record: RequestRecord) -> None:
        # The list the record went into: after Recorder.clear() it is detached, so a late
        # update can never overwrite a newer request's record.
        self._target = target
        self._index = index
        self._record = record
        self._size = 0
        self._head = bytearray()
        self._complete = False

    @property
    def record(self) -> RequestRecord:
        return self._record

    def feed(self, chunk: bytes) -> None:
        self._size += len(chunk)
        room = BODY_HEAD_LIMIT - len(self._head)
        if room > 0:
            self._head += chunk[:room]

    def eof(self) -> None:
        self._complete = True
        self.publish()

    def publish(self) -> None:
        self._record = dataclasses.replace(
            self._record,
            body_size=self._size,
            body_head=bytes(self._head),
            body_complete=self._complete,
        )
        self._target[self._index] = self._record


class Recorder:
    def __init__(self) -> None:
        self._records: list[RequestRecord] = []

    @property
    def records(self) -> list[RequestRecord]:
        return list(self._records)

    def begin(self, request: web.BaseRequest) -> RecordHandle:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        record = RequestRecord(
            arrival=time.monotonic(),
            method=request.method,
            target=request.raw_path,
            version=f"HTTP/{request.version.major}.{request.version.minor}",
            headers=tuple(
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers
            ),
            body_size=0,
            body_head=b"",
            body_complete=False,
            peer=f"{peer[0]}:{peer[1]}" if peer else "",
        )
        self._records.append(record)
        return RecordHandle(self._records, len(self._records) - 1, record)

    def clear(self) -> None:
        self._records = []
