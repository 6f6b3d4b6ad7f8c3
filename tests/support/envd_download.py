"""The answer of envd's ``GET /files``: the file streamed from disk, gzip-compressed on the fly
when negotiated, else through the part of Go's ``http.ServeContent`` envd relies on (type,
Last-Modified, one Range, 304).

Sources: envd ``internal/api/download.go``, Go's ``net/http`` (``ServeContent``,
``DetectContentType``) and ``mime`` (``TypeByExtension``, ``FormatMediaType``).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import mimetypes
import os
import posixpath
import re
import zlib
from collections.abc import AsyncGenerator
from pathlib import Path
from urllib.parse import quote

from aiohttp import web

CHUNK = 64 * 1024

# Go's mime package built-in table (mime/type.go builtinTypesLower); other extensions fall back
# to the host's table, as Go reads /etc/mime.types.
_GO_MIME_TYPES = {
    ".avif": "image/avif",
    ".css": "text/css; charset=utf-8",
    ".gif": "image/gif",
    ".htm": "text/html; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".jpeg": "image/jpeg",
    ".jpg": "image/jpeg",
    ".js": "text/javascript; charset=utf-8",
    ".json": "application/json",
    ".mjs": "text/javascript; charset=utf-8",
    ".pdf": "application/pdf",
    ".png": "image/png",
    ".svg": "image/svg+xml",
    ".wasm": "application/wasm",
    ".webp": "image/webp",
    ".xml": "text/xml; charset=utf-8",
}
_TOKEN_SPECIALS = set('()<>@,;:\\"/[]?=')


def _is_token(value: str) -> bool:
    return bool(value) and all(0x20 < ord(c) < 0x7F and c not in _TOKEN_SPECIALS for c in value)


def content_disposition(filename: str) -> str:
    """mime.FormatMediaType("inline", {"filename": …}) as download.go sets it."""
    if not filename.isascii():
        return "inline; filename*=utf-8''" + quote(filename, safe="!#$&+-.^_`|~")
    if _is_token(filename):
        return f"inline; filename={filename}"
    escaped = filename.replace("\\", "\\\\").replace('"', '\\"')
    return f'inline; filename="{escaped}"'


def type_by_extension(path: str) -> str:
    ext = posixpath.splitext(path)[1].lower()
    if not ext:
        return ""
    if ext in _GO_MIME_TYPES:
        return _GO_MIME_TYPES[ext]
    guessed = mimetypes.types_map.get(ext, "")
    return guessed + "; charset=utf-8" if guessed.startswith("text/") else guessed


def sniff_content_type(head: bytes) -> str:
    """A small part of Go's http.DetectContentType: text vs binary."""
    if b"\x00" in head:
        return "application/octet-stream"
    try:
        head.decode()
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:  # a split multi-byte sequence at the end is still text
            return "application/octet-stream"
    return "text/plain; charset=utf-8"


async def send_gzip(
    request: web.BaseRequest, host: Path, headers: dict[str, str]
) -> web.StreamResponse:
    """download.go gzip branch: compress while reading; the length is unknown, so chunked."""
    response = web.StreamResponse(status=200, headers=headers)
    response.enable_chunked_encoding()
    await response.prepare(request)
    compressor = zlib.compressobj(6, zlib.DEFLATED, 31)  # Go's gzip.DefaultCompression
    async with contextlib.aclosing(_read_file(host, 0, None)) as chunks:
        async for chunk in chunks:
            if out := compressor.compress(chunk):
                await response.write(out)
    await response.write(compressor.flush())
    await response.write_eof()
    return response


async def serve_content(
    request: web.BaseRequest,
    name: str,
    host: Path,
    st: os.stat_result,
    headers: dict[str, str],
) -> web.StreamResponse:
    """The part of Go's http.ServeContent envd relies on: type, Last-Modified, one Range, 304."""
    size = st.st_size
    modified = email.utils.formatdate(int(st.st_mtime), usegmt=True)
    headers["Last-Modified"] = modified
    since = request.headers.get("If-Modified-Since")
    if since and request.headers.get("If-None-Match") is None:
        parsed = email.utils.parsedate_to_datetime(since) if _is_http_date(since) else None
        if parsed is not None and int(st.st_mtime) <= parsed.timestamp():
            return web.Response(
                status=304, headers={"Last-Modified": modified, "Vary": "Accept-Encoding"}
            )
    sniffed = type_by_extension(name)
    if not sniffed:
        async with contextlib.aclosing(_read_file(host, 0, 512)) as probe:
            sniffed = sniff_content_type(b"".join([chunk async for chunk in probe]))
    headers["Content-Type"] = sniffed
    headers["Accept-Ranges"] = "bytes"
    start, end, status = 0, size, 200
    try:
        byte_range = _single_range(request.headers.get("Range", ""), size)
    except _UnsatisfiableRangeError:
        return web.Response(
            status=416,
            body=b"invalid range: failed to overlap\n",
            headers={
                "Content-Range": f"bytes */{size}",
                "Content-Type": "text/plain; charset=utf-8",
            },
        )
    if byte_range is not None:
        start, end = byte_range
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    response = web.StreamResponse(status=status, headers=headers)
    response.content_length = end - start
    await response.prepare(request)
    async with contextlib.aclosing(_read_file(host, start, end - start)) as chunks:
        async for chunk in chunks:
            await response.write(chunk)
    await response.write_eof()
    return response


async def _read_file(host: Path, start: int, length: int | None) -> AsyncGenerator[bytes, None]:
    """The file in CHUNK-sized pieces, read off the event loop: never the whole file at once."""
    # Opened on the loop (a quick call): opened in a thread, a handler cancelled meanwhile (its
    # client left) never got the file object, and it leaked (a ResourceWarning, an error here).
    source = open(host, "rb")  # noqa: ASYNC230, SIM115 - closed in the finally below
    try:
        if start:
            await asyncio.to_thread(source.seek, start)
        remaining = length
        while remaining is None or remaining > 0:
            size = CHUNK if remaining is None else min(CHUNK, remaining)
            chunk = await asyncio.to_thread(source.read, size)
            if not chunk:
                return
            if remaining is not None:
                remaining -= len(chunk)
            yield chunk
    finally:
        source.close()


def _is_http_date(value: str) -> bool:
    try:
        email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return False
    return True


class _UnsatisfiableRangeError(Exception):
    pass


def _single_range(header: str, size: int) -> tuple[int, int] | None:
    """One ``bytes=a-b`` range → (start, end exclusive); several ranges are served whole."""
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if not match or not any(match.groups()):
        return None
    first, last = match.groups()
    if not first:
        length = min(int(last), size)
        if not length:
            raise _UnsatisfiableRangeError
        return size - length, size
    start = int(first)
    if start >= size:
        raise _UnsatisfiableRangeError
    end = min(int(last) + 1, size) if last else size
    return (start, end) if end > start else None
