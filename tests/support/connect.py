"""Connect protocol (JSON codec, HTTP/1.1) as envd and the E2B SDK speak it, for tests.

Wire facts (notes/e2b-protocol.md §4; connect-go `protocol_connect.go`; connectrpc-py
`_envelope.py`):

- Unary: ``POST /<package.Service>/<Method>``, ``Content-Type: application/json``, the body is
  the JSON message; success is 200 with a JSON body, failure is a non-200 status with
  ``{"code": "<connect code>", "message": ...}``.
- Server stream: ``Content-Type: application/connect+json``; the request body and the response
  body are sequences of envelopes ``flags:u8 | length:u32 big-endian | JSON``. The response is
  always 200; it ends with an end-of-stream envelope (flag 0x02) whose payload is ``{}`` or
  ``{"error": {"code": ..., "message": ...}}``.

The client half here is deliberately a raw asyncio TCP client rather than aiohttp: tests use it
to see exactly when each envelope arrives, the exact end frame, and whether the chunked body was
terminated properly (a relay that cuts a stream must not look like a clean end).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple, Self

JSONDict = dict[str, Any]

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02

UNARY_CONTENT_TYPE = "application/json"
STREAM_CONTENT_TYPE = "application/connect+json"

# Connect code -> HTTP status for unary errors (connect protocol spec, "Error Codes"; the same
# table is in connectrpc-py `_protocol.py`, quoted in notes §4).
CODE_TO_STATUS: Mapping[str, int] = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}

_HEADER = struct.Struct(">BI")


class ConnectError(Exception):
    """A Connect error: a code from CODE_TO_STATUS and a human message."""

    def __init__(self, code: str, message: str) -> None:
        if code not in CODE_TO_STATUS:
            raise ValueError(f"not a Connect code: {code!r}")
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return CODE_TO_STATUS[self.code]

    def to_json(self) -> JSONDict:
        return {"code": self.code, "message": self.message}


def encode_json(payload: Mapping[str, Any]) -> bytes:
    """Compact JSON, the shape connect-go's protojson produces (no spaces, UTF-8)."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def envelope(payload: Mapping[str, Any], flags: int = 0) -> bytes:
    """One Connect envelope around a JSON message."""
    body = encode_json(payload)
    return _HEADER.pack(flags, len(body)) + body


def end_stream_envelope(error: ConnectError | None = None) -> bytes:
    """The end-of-stream envelope: ``{}`` on success, ``{"error": {...}}`` on failure."""
    return envelope({} if error is None else {"error": error.to_json()}, FLAG_END_STREAM)


class EnvelopeDecoder:
    """Incremental envelope decoder: feed bytes as they arrive, get whole envelopes out."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Add bytes; return every envelope now complete as (flags, raw JSON payload)."""
        self._buffer += data
        complete: list[tuple[int, bytes]] = []
        while len(self._buffer) >= _HEADER.size:
            flags, length = _HEADER.unpack_from(self._buffer)
            end = _HEADER.size + length
            if len(self._buffer) < end:
                break
            complete.append((flags, bytes(self._buffer[_HEADER.size : end])))
            del self._buffer[:end]
        return complete

    @property
    def pending(self) -> int:
        """Bytes of an incomplete envelope still buffered (non-zero at EOF = truncated frame)."""
        return len(self._buffer)


def decode_single_envelope(body: bytes) -> tuple[int, JSONDict]:
    """A request body that must hold exactly one envelope (a server-stream request)."""
    decoder = EnvelopeDecoder()
    frames = decoder.feed(body)
    if len(frames) != 1 or decoder.pending:
        raise ConnectError("invalid_argument", "expected exactly one request envelope")
    flags, raw = frames[0]
    return flags, json.loads(raw) if raw else {}


# --------------------------------------------------------------------------------------------
# Raw HTTP/1.1 client
# --------------------------------------------------------------------------------------------


class Frame(NamedTuple):
    """One envelope as the client saw it."""

    arrival: float  # time.monotonic() when the bytes completing it were read
    flags: int
    payload: JSONDict

    @property
    def is_end(self) -> bool:
        return bool(self.flags & FLAG_END_STREAM)


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseHead:
    status: int
    reason: str
    version: str
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        """First value of a header (case-insensitive), like Go's Header.Get."""
        wanted = name.lower()
        return next((v for k, v in self.headers if k.lower() == wanted), None)

    def header_all(self, name: str) -> list[str]:
        wanted = name.lower()
        return [v for k, v in self.headers if k.lower() == wanted]


@dataclass(frozen=True, slots=True, kw_only=True)
class UnaryResult:
    head: ResponseHead
    body: bytes

    @property
    def status(self) -> int:
        return self.head.status

    def json(self) -> JSONDict:
        parsed = json.loads(self.body)
        assert isinstance(parsed, dict)
        return parsed


class BodyTruncatedError(Exception):
    """The connection ended before the response body was complete."""


Headers = Mapping[str, str] | Sequence[tuple[str, str]]


def _header_pairs(headers: Headers | None) -> list[tuple[str, str]]:
    if headers is None:
        return []
    if isinstance(headers, Mapping):
        return list(headers.items())
    return list(headers)


def _request_head(
    method_path: str, host: str, port: int, content_type: str, headers: Headers | None
) -> list[tuple[str, str]]:
    pairs = _header_pairs(headers)
    names = {k.lower() for k, _ in pairs}
    defaults = [
        ("Host", f"{host}:{port}"),
        ("Content-Type", content_type),
        ("Connect-Protocol-Version", "1"),
    ]
    return [(k, v) for k, v in defaults if k.lower() not in names] + pairs


def _serialize_head(method: str, target: str, pairs: Sequence[tuple[str, str]]) -> bytes:
    lines = [f"{method} {target} HTTP/1.1"] + [f"{k}: {v}" for k, v in pairs]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _read_head(reader: asyncio.StreamReader) -> ResponseHead:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    version, status, *reason = lines[0].split(" ", 2)
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
    return ResponseHead(
        status=int(status),
        reason=reason[0] if reason else "",
        version=version,
        headers=tuple(headers),
    )


async def _iter_body(reader: asyncio.StreamReader, head: ResponseHead) -> AsyncIterator[bytes]:
    """Yield body bytes as they arrive; raise BodyTruncatedError if the framing is cut short."""
    if (head.header("Transfer-Encoding") or "").lower() == "chunked":
        while True:
            try:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    await _read_trailers(reader)
                    return
                data = await reader.readexactly(size)
                await reader.readexactly(2)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                raise BodyTruncatedError("chunked body ended before its last chunk") from exc
            yield data
    length = head.header("Content-Length")
    if length is not None:
        remaining = int(length)
        while remaining:
            data = await reader.read(min(remaining, 65536))
            if not data:
                raise BodyTruncatedError(f"{remaining} bytes of the body missing")
            remaining -= len(data)
            yield data
        return
    while data := await reader.read(65536):
        yield data


async def _read_trailers(reader: asyncio.StreamReader) -> None:
    while (await reader.readuntil(b"\r\n")) != b"\r\n":
        pass


class ConnectStream:
    """A server-streaming call over its own TCP connection.

    ``async with ConnectStream(...) as s``: ``s.head`` is the response head; iterate ``s`` for
    frames (the end-of-stream frame included). After iteration, ``s.clean_end`` says whether
    the HTTP body was properly terminated (last chunk received) and ``s.end`` is the end frame
    if one arrived.
    """

    def __init__(
        self,
        host: str,
        port: int,
        method_path: str,
        request: Mapping[str, Any],
        headers: Headers | None = None,
        *,
        chunked: bool = True,
    ) -> None:
        self._host = host
        self._port = port
        self._method_path = method_path
        self._request = request
        self._headers = headers
        self._chunked = chunked
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.head: ResponseHead | None = None
        self.frames: list[Frame] = []
        self.end: Frame | None = None
        self.clean_end = False
        self.truncated_bytes = 0

    async def __aenter__(self) -> Self:
        self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
        body = envelope(self._request)
        pairs = _request_head(
            self._method_path, self._host, self._port, STREAM_CONTENT_TYPE, self._headers
        )
        if self._chunked:
            # SDK 2.52 sends even a single request envelope chunked (notes §2.2).
            pairs.append(("Transfer-Encoding", "chunked"))
            payload = _chunk(body) + b"0\r\n\r\n"
        else:
            pairs.append(("Content-Length", str(len(body))))
            payload = body
        self._writer.write(_serialize_head("POST", self._method_path, pairs) + payload)
        await self._writer.drain()
        self.head = await _read_head(self._reader)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    def __aiter__(self) -> AsyncIterator[Frame]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[Frame]:
        assert self._reader is not None, "use `async with`"
        assert self.head is not None
        decoder = EnvelopeDecoder()
        try:
            async for data in _iter_body(self._reader, self.head):
                arrival = time.monotonic()
                for flags, raw in decoder.feed(data):
                    frame = Frame(arrival, flags, json.loads(raw) if raw else {})
                    self.frames.append(frame)
                    if frame.is_end:
                        self.end = frame
                    yield frame
        except BodyTruncatedError:
            self.truncated_bytes = decoder.pending
            return
        self.truncated_bytes = decoder.pending
        self.clean_end = decoder.pending == 0


async def stream(
    host: str,
    port: int,
    method_path: str,
    request: Mapping[str, Any],
    headers: Headers | None = None,
) -> AsyncIterator[Frame]:
    """Frames of a server-streaming call, (arrival, flags, payload), end frame included.

    Raises ConnectError if the response is not a 200 Connect stream (e.g. a proxy refusal).
    """
    async with ConnectStream(host, port, method_path, request, headers) as call:
        assert call.head is not None
        if call.head.status != 200:
            raise ConnectError("unknown", f"HTTP {call.head.status} {call.head.reason}")
        async for frame in call:
            yield frame


async def unary(
    host: str,
    port: int,
    method_path: str,
    request: Mapping[str, Any],
    headers: Headers | None = None,
) -> UnaryResult:
    """One unary call; the result holds the status, headers and body whatever the status."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        body = encode_json(request)
        pairs = _request_head(method_path, host, port, UNARY_CONTENT_TYPE, headers)
        pairs.append(("Content-Length", str(len(body))))
        writer.write(_serialize_head("POST", method_path, pairs) + body)
        await writer.drain()
        head = await _read_head(reader)
        chunks = [data async for data in _iter_body(reader, head)]
        return UnaryResult(head=head, body=b"".join(chunks))
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
