"""multipart/form-data for envd's ``POST /files``: the part headers and an incremental reader.

Sources: Go's ``mime/multipart`` (``NextPart``, ``Part.Read``) and ``mime.ParseMediaType`` as
envd's ``internal/api/upload.go`` and ``utils/multipart.go`` use them. The body is parsed as it
arrives, never held whole.
"""

from __future__ import annotations

import email.utils
from collections.abc import AsyncIterator
from email.message import Message

# -- headers ------------------------------------------------------------------------------------


def parse_media_type(value: str) -> tuple[str, dict[str, str]]:
    message = Message()
    message["content-type"] = value
    params = {k.lower(): v for k, v in message.get_params(failobj=[], header="content-type")[1:]}
    return message.get_content_type() if value.strip() else "", params


def disposition_params(value: str) -> dict[str, str]:
    message = Message()
    message["content-disposition"] = value
    pairs = message.get_params(failobj=[], header="content-disposition")[1:]
    return {k.lower(): email.utils.collapse_rfc2231_value(v) for k, v in pairs}


# -- the reader ---------------------------------------------------------------------------------


class MultipartError(Exception):
    pass


class MultipartReader:
    """Incremental multipart/form-data reader (Go's mime/multipart NextPart + Read)."""

    def __init__(self, chunks: AsyncIterator[bytes], boundary: str) -> None:
        self._chunks = chunks
        self._delimiter = b"\r\n--" + boundary.encode()
        # A leading CRLF makes the first boundary look like every later one.
        self._buffer = bytearray(b"\r\n")
        self._eof = False
        self._started = False
        self._in_part = False
        self._done = False

    async def _fill(self) -> None:
        if self._eof:
            raise MultipartError("multipart: unexpected EOF")
        try:
            self._buffer += await anext(self._chunks)
        except StopAsyncIteration:
            self._eof = True

    async def _skip_to_delimiter(self) -> None:
        while (index := self._buffer.find(self._delimiter)) < 0:
            del self._buffer[: max(0, len(self._buffer) - len(self._delimiter))]
            await self._fill()
        del self._buffer[: index + len(self._delimiter)]

    async def next_part(self) -> dict[str, str] | None:
        """Headers of the next part (lower-case names), or None after the closing boundary."""
        if self._done:
            return None
        if not self._started:
            self._started = True
            await self._skip_to_delimiter()  # the preamble
        while self._in_part:  # the rest of an unread part
            await self.read_chunk()
        while len(self._buffer) < 2:
            await self._fill()
        if self._buffer[:2] == b"--":
            self._done = True
            return None
        while (end := self._buffer.find(b"\r\n")) < 0:
            await self._fill()
        del self._buffer[: end + 2]  # transport padding after the boundary
        if self._buffer[:2] == b"\r\n":
            del self._buffer[:2]
            headers: dict[str, str] = {}
        else:
            while (end := self._buffer.find(b"\r\n\r\n")) < 0:
                await self._fill()
            headers = {}
            for line in self._buffer[:end].decode("utf-8", "replace").split("\r\n"):
                name, _, value = line.partition(":")
                headers.setdefault(name.strip().lower(), value.strip())
            del self._buffer[: end + 4]
        self._in_part = True
        return headers

    async def read_chunk(self) -> bytes:
        """Next piece of the current part's body; b'' at its end."""
        if not self._in_part:
            return b""
        while True:
            index = self._buffer.find(self._delimiter)
            if index >= 0:
                if index == 0:
                    del self._buffer[: len(self._delimiter)]
                    self._in_part = False
                    return b""
                data = bytes(self._buffer[:index])
                del self._buffer[:index]
                return data
            safe = len(self._buffer) - len(self._delimiter) + 1
            if safe > 0:
                data = bytes(self._buffer[:safe])
                del self._buffer[:safe]
                return data
            await self._fill()


async def part_body(reader: MultipartReader) -> AsyncIterator[bytes]:
    while chunk := await reader.read_chunk():
        yield chunk
