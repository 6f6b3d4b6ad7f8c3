"""envd's HTTP file API for the fake: ``GET /files`` (download) and ``POST /files`` (upload).

Sources: envd ``internal/api/{download,upload,encoding,auth,error}.go``, ``utils/multipart.go``,
the generated parameter binding in ``api.gen.go`` and ``packages/shared/pkg/filesystem/xattr.go``.

Both directions stream: a download is read from disk in chunks (gzip-compressed on the fly when
``Accept-Encoding`` allows it, as envd negotiates), an upload is written to disk as it arrives
(``Content-Encoding: gzip`` decompressed on the fly; multipart parsed incrementally).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email.utils
import hashlib
import hmac
import json
import mimetypes
import os
import posixpath
import re
import stat
import time
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from urllib.parse import quote, unquote_plus

from aiohttp import web
from multidict import CIMultiDictProxy

from tests.support import go_json
from tests.support.connect import ConnectError
from tests.support.fake_server import iter_body
from tests.support.records import RecordHandle
from tests.support.sandbox_fs import (
    USERS,
    SandboxFS,
    SandboxUser,
    go_clean,
    go_errno_text,
    read_metadata,
)

CHUNK = 64 * 1024
READ, WRITE = "read", "write"  # auth.go SigningReadOperation / SigningWriteOperation
SUPPORTED_ENCODINGS = ("gzip",)  # encoding.go SupportedEncodings

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
# The request key under which fake_envd leaves rs/cors's fields for a streamed answer.
CORS_FIELDS = web.RequestKey("cors_fields", list[tuple[str, str]])
_TOKEN_SPECIALS = set('()<>@,;:\\"/[]?=')
_METADATA_PREFIX = "x-metadata-"  # upload.go metadataHeaderPrefix
_XATTR_PREFIX = "user.e2b."
_MAX_METADATA_KEY = 255 - len(_XATTR_PREFIX)
_MAX_METADATA_TOTAL = 4096


# -- answers ------------------------------------------------------------------------------------


def json_error(status: int, message: str) -> web.Response:
    """error.go:9-21 jsonError: int code, Go's JSON Encoder (HTML-escaped, newline), nosniff."""
    return web.Response(
        status=status,
        body=go_json.encode({"code": status, "message": message}),
        headers={
            "Content-Type": "application/json; charset=utf-8",
            "X-Content-Type-Options": "nosniff",
        },
    )


def text_error(status: int, message: str) -> web.Response:
    """Go's http.Error: text/plain, nosniff, trailing newline (parameter binding errors)."""
    return web.Response(
        status=status,
        body=(message + "\n").encode(),
        headers={
            "Content-Type": "text/plain; charset=utf-8",
            "X-Content-Type-Options": "nosniff",
        },
    )


class HttpFailure(Exception):
    """An early answer from inside a handler step."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


# -- parameters and signatures ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class FileParams:
    path: str | None
    username: str | None
    signature: str | None
    signature_expiration: int | None


def bind_file_params(raw_query: str) -> FileParams:
    """api.gen.go binding: each parameter at most once; signature_expiration an integer."""
    query = go_url_query(raw_query)
    values: dict[str, str | None] = {}
    for name in ("path", "username", "signature", "signature_expiration"):
        found = query.get(name)
        if found is not None and len(found) != 1:
            raise HttpFailure(
                text_error(
                    400,
                    f"Invalid format for parameter {name}: "
                    f"multiple values for single value parameter '{name}'",
                )
            )
        values[name] = found[0] if found else None
    expiration = values["signature_expiration"]
    return FileParams(
        path=values["path"],
        username=values["username"],
        signature=values["signature"],
        signature_expiration=None if expiration is None else _parse_go_int64(expiration),
    )


_GO_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def go_url_query(raw_query: str) -> dict[str, list[str]]:
    """Go's ``url.ParseQuery`` as ``r.URL.Query()`` gives it to envd's parameter binding.

    Pairs are split on ``&`` only; a pair holding a ``;`` (Go >= 1.17) or a malformed escape
    (``%`` not followed by two hex digits, in its key or value) is dropped, not kept; ``+`` is
    a space; blank values are kept. Python's ``parse_qs`` keeps both kinds of pair, so a
    repeated ``path`` that envd reads as one value was a 400 here.
    """
    query: dict[str, list[str]] = {}
    for segment in raw_query.split("&"):
        if not segment or ";" in segment:
            continue
        key, _, value = segment.partition("=")
        if _GO_ESCAPE.search(key) or _GO_ESCAPE.search(value):
            continue
        query.setdefault(unquote_plus(key, errors="surrogateescape"), []).append(
            unquote_plus(value, errors="surrogateescape")
        )
    return query


def _parse_go_int64(text: str) -> int:
    # strconv.ParseInt(s, 10, 64) via the runtime's BindStringToObject.
    if re.fullmatch(r"[+-]?[0-9]+", text):
        value = int(text)
        if -(2**63) <= value < 2**63:
            return value
        reason = "value out of range"
    else:
        reason = "invalid syntax"
    raise HttpFailure(
        text_error(
            400,
            "Invalid format for parameter signature_expiration: error binding string parameter: "
            f'strconv.ParseInt: parsing "{text}": {reason}',
        )
    )


def sign(path: str, operation: str, username: str, token: str, expiration: int | None) -> str:
    """auth.go generateSignature: "v1_" + base64 (std, unpadded) of sha256 of the joined parts."""
    parts = [path, operation, username, token]
    if expiration is not None:
        parts.append(str(expiration))
    # Go hashes the query's bytes as decoded, UTF-8 or not (go_url_query keeps them).
    digest = hashlib.sha256(":".join(parts).encode("utf-8", "surrogateescape")).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


def validate_signing(
    token: str | None,
    header_token: str,
    params: FileParams,
    operation: str,
    now: Callable[[], float] = time.time,
) -> str | None:
    """auth.go validateSigning: None when allowed, else the error text (answered as 401)."""
    if token is None:
        return None
    if header_token:
        if hmac.compare_digest(header_token.encode(), token.encode()):
            return None
        return "access token present in header but does not match"
    if params.signature is None:
        return "missing signature query parameter"
    expected = sign(
        params.path or "", operation, params.username or "", token, params.signature_expiration
    )
    if not hmac.compare_digest(expected.encode(), params.signature.encode()):
        return "invalid signature"
    if params.signature_expiration is not None and params.signature_expiration < int(now()):
        return "signature is already expired"
    return None


# -- encodings ----------------------------------------------------------------------------------


def _encoding_with_quality(value: str) -> tuple[str, float]:
    """encoding.go parseEncodingWithQuality."""
    name, _, params = value.strip().partition(";")
    quality = 1.0
    for raw_param in params.split(";") if params else []:
        param = raw_param.strip()
        if param.lower().startswith("q="):
            with contextlib.suppress(ValueError):  # Go ignores an unparsable q
                quality = float(param[2:])
    return name.strip().lower(), quality


def _identity_rejected(encodings: list[tuple[str, float]]) -> bool:
    rejected = explicitly_accepted = wildcard_rejected = False
    for name, quality in encodings:
        if name == "identity":
            rejected |= quality == 0
            explicitly_accepted |= quality != 0
        elif name == "*" and quality == 0:
            wildcard_rejected = True
    return rejected or (wildcard_rejected and not explicitly_accepted)


def negotiate_encoding(header: str) -> str | None:
    """encoding.go parseAcceptEncoding: 'gzip', 'identity', or None when nothing is acceptable."""
    if not header:
        return "identity"
    encodings = [_encoding_with_quality(v) for v in header.split(",")]
    identity_rejected = _identity_rejected(encodings)
    for name, quality in sorted(encodings, key=lambda e: -e[1]):
        if quality == 0:
            continue
        if name == "identity":
            return "identity"
        if name == "*":
            return SUPPORTED_ENCODINGS[0] if identity_rejected else "identity"
        if name in SUPPORTED_ENCODINGS:
            return name
    return None if identity_rejected else "identity"


def identity_acceptable(header: str) -> bool:
    return not header or not _identity_rejected(
        [_encoding_with_quality(v) for v in header.split(",")]
    )


async def decoded_body(chunks: AsyncIterator[bytes], encoding: str) -> AsyncIterator[bytes]:
    """encoding.go getDecompressedBody: gzip (concatenated members allowed) or identity."""
    if encoding == "identity":
        async for chunk in chunks:
            yield chunk
        return
    decompressor = zlib.decompressobj(wbits=31)
    async for chunk in chunks:
        data = chunk
        while data:
            out = decompressor.decompress(data)
            if out:
                yield out
            data = decompressor.unused_data
            if decompressor.eof:
                decompressor = zlib.decompressobj(wbits=31)
            else:
                data = b""
    tail = decompressor.flush()
    if tail:
        yield tail


# -- header helpers -----------------------------------------------------------------------------


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


def _parse_media_type(value: str) -> tuple[str, dict[str, str]]:
    message = Message()
    message["content-type"] = value
    params = {k.lower(): v for k, v in message.get_params(failobj=[], header="content-type")[1:]}
    return message.get_content_type() if value.strip() else "", params


def _disposition_params(value: str) -> dict[str, str]:
    message = Message()
    message["content-disposition"] = value
    pairs = message.get_params(failobj=[], header="content-disposition")[1:]
    return {k.lower(): email.utils.collapse_rfc2231_value(v) for k, v in pairs}


# -- multipart ----------------------------------------------------------------------------------


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


# -- the API ------------------------------------------------------------------------------------


class FilesApi:
    def __init__(
        self,
        fs: SandboxFS,
        access_token: str | None,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._fs = fs
        self._token = access_token
        self._now = now
        self.workdir: str | None = None

    async def download(self, request: web.BaseRequest, record: RecordHandle) -> web.StreamResponse:
        try:
            return await self._download(request)
        except HttpFailure as failure:
            return failure.response

    async def upload(self, request: web.BaseRequest, record: RecordHandle) -> web.StreamResponse:
        try:
            return await self._upload(request, record)
        except HttpFailure as failure:
            return failure.response

    # -- shared steps ---------------------------------------------------------------------------

    def _check_signing(self, request: web.BaseRequest, operation: str) -> FileParams:
        params = bind_file_params(request.raw_path.partition("?")[2])
        header_token = request.headers.get("X-Access-Token", "")
        error = validate_signing(self._token, header_token, params, operation, self._now)
        if error is not None:
            raise HttpFailure(json_error(401, error))
        return params

    def _user(self, params: FileParams) -> SandboxUser:
        # execcontext.ResolveDefaultUsername: a present (even empty) username is used as is.
        username = "user" if params.username is None else params.username
        user = USERS.get(username)
        if user is None:
            raise HttpFailure(
                json_error(
                    401, f"error looking up user '{username}': user: unknown user {username}"
                )
            )
        return user

    def _resolve(self, path: str, user: SandboxUser, context: str) -> str:
        try:
            return self._fs.resolve(path, user, self.workdir)
        except ConnectError as exc:
            raise HttpFailure(json_error(400, f"{context}: {exc.message}")) from exc

    # -- download -------------------------------------------------------------------------------

    async def _download(self, request: web.BaseRequest) -> web.StreamResponse:
        params = self._check_signing(request, READ)
        path, user = params.path or "", self._user(params)
        resolved = self._resolve(path, user, f"error expanding and resolving path '{path}'")
        host, st = self._existing_file(resolved)
        accept = request.headers.get("Accept-Encoding", "")
        encoding = negotiate_encoding(accept)
        if encoding is None:
            raise HttpFailure(
                json_error(
                    406,
                    "error parsing Accept-Encoding: no acceptable encoding found, "
                    "supported: [gzip]",
                )
            )
        conditional = any(
            request.headers.get(h)
            for h in ("Range", "If-Modified-Since", "If-None-Match", "If-Range")
        )
        if conditional:
            if not identity_acceptable(accept):
                raise HttpFailure(
                    json_error(
                        406, "identity encoding not acceptable for Range or conditional request"
                    )
                )
            encoding = "identity"
        # rs/cors's fields come first; download.go's Set("Vary", ...) then replaces its Vary.
        headers = dict(request.get(CORS_FIELDS, []))
        headers |= {
            "Vary": "Accept-Encoding",
            "Content-Disposition": content_disposition(posixpath.basename(go_clean(resolved))),
        }
        if encoding == "gzip":
            headers["Content-Encoding"] = "gzip"
            headers["Content-Type"] = type_by_extension(path) or "application/octet-stream"
            return await _send_gzip(request, host, headers)
        return await _serve_content(request, path, host, st, headers)

    def _existing_file(self, resolved: str) -> tuple[Path, os.stat_result]:
        host = self._fs.host(resolved)
        try:
            st = os.stat(host)
        except FileNotFoundError as exc:
            raise HttpFailure(json_error(404, f"path '{resolved}' does not exist")) from exc
        except OSError as exc:
            raise HttpFailure(
                json_error(
                    500,
                    f"error checking if path exists '{resolved}': stat {resolved}: "
                    f"{go_errno_text(exc)}",
                )
            ) from exc
        if stat.S_ISDIR(st.st_mode):
            raise HttpFailure(json_error(400, f"path '{resolved}' is a directory"))
        return host, st

    # -- upload ---------------------------------------------------------------------------------

    async def _upload(self, request: web.BaseRequest, record: RecordHandle) -> web.StreamResponse:
        params = self._check_signing(request, WRITE)
        # upload.go:287-306: the body's encoding is checked before the user is looked up.
        content_encoding = _content_encoding(request.headers.get("Content-Encoding", ""))
        user = self._user(params)
        metadata = _metadata_headers(request.headers)
        error = _validate_metadata(metadata)
        if error:
            raise HttpFailure(json_error(400, f"invalid metadata: {error}"))
        content_type = request.headers.get("Content-Type", "")
        media_type, media_params = _parse_media_type(content_type)
        body = decoded_body(iter_body(request, record), content_encoding)
        if media_type == "application/octet-stream":
            entries = await self._raw_upload(params, user, body, metadata, request)
        elif media_type.startswith("multipart/"):
            boundary = media_params.get("boundary")
            if not boundary:
                raise HttpFailure(
                    json_error(
                        500,
                        "error parsing multipart form: no multipart boundary param in Content-Type",
                    )
                )
            reader = MultipartReader(body, boundary)
            entries = await self._multipart_upload(params, user, reader, metadata, request)
        else:
            raise HttpFailure(
                json_error(
                    400,
                    f"unsupported content type: {content_type}, "
                    "expected multipart/form-data or application/octet-stream",
                )
            )
        # upload.go writes json.Marshal(paths) without a Content-Type, so Go sniffs text/plain.
        return web.Response(
            status=200,
            body=json.dumps(entries, separators=(",", ":")).encode(),
            headers={"Content-Type": "text/plain; charset=utf-8"},
        )

    async def _raw_upload(
        self,
        params: FileParams,
        user: SandboxUser,
        body: AsyncIterator[bytes],
        metadata: dict[str, str],
        request: web.BaseRequest,
    ) -> list[dict[str, object]]:
        if params.path is None:
            raise HttpFailure(
                json_error(400, "path query parameter is required for raw body upload")
            )
        file_path = self._resolve(params.path, user, "error resolving path")
        await self._write_file(file_path, body, metadata, request)
        return [self._upload_entry(file_path)]

    async def _multipart_upload(
        self,
        params: FileParams,
        user: SandboxUser,
        reader: MultipartReader,
        metadata: dict[str, str],
        request: web.BaseRequest,
    ) -> list[dict[str, object]]:
        entries: list[dict[str, object]] = []
        try:
            while (headers := await reader.next_part()) is not None:
                disposition = _disposition_params(headers.get("content-disposition", ""))
                if disposition.get("name") != "file":
                    continue  # upload.go handlePart: only "file" parts are files
                file_path = self._part_path(params, user, disposition, entries)
                await self._write_file(file_path, _part_body(reader), metadata, request)
                entries.append(self._upload_entry(file_path))
        except MultipartError as exc:
            raise HttpFailure(json_error(500, f"error reading form: {exc}")) from exc
        return entries

    def _part_path(
        self,
        params: FileParams,
        user: SandboxUser,
        disposition: dict[str, str],
        done: list[dict[str, object]],
    ) -> str:
        """upload.go resolvePath: the ``path`` parameter, else the part's full filename."""
        if params.path is not None:
            wanted = params.path
        elif "filename" in disposition:
            wanted = disposition["filename"]
        else:
            raise HttpFailure(
                json_error(
                    400,
                    "error getting multipart custom part file name: "
                    "filename not found in Content-Disposition header",
                )
            )
        file_path = self._resolve(wanted, user, "error resolving path")
        uploaded = [str(e["path"]) for e in done]
        if file_path in uploaded:
            message = (
                f"you cannot upload multiple files to the same path '{file_path}' in one "
                "upload request, only the first specified file was uploaded"
            )
            others = [p for p in uploaded if p != file_path]
            if len(others) > 1:
                message += f", also the following files were uploaded: {', '.join(others)}"
            raise HttpFailure(json_error(400, message))
        return file_path

    async def _write_file(
        self,
        file_path: str,
        body: AsyncIterator[bytes],
        metadata: dict[str, str],
        request: web.BaseRequest,
    ) -> None:
        """upload.go processFile: parents, truncate-and-write streamed, then metadata."""
        try:
            self._fs.ensure_dirs(posixpath.dirname(go_clean(file_path)))
        except ConnectError as exc:
            raise HttpFailure(
                json_error(500, f"error ensuring directories: {exc.message}")
            ) from exc
        host = self._fs.host(file_path)
        if host.is_dir():
            raise HttpFailure(json_error(400, f"path is a directory: {file_path}"))
        try:
            fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        except OSError as exc:
            raise HttpFailure(
                json_error(500, f"error opening file: open {file_path}: {go_errno_text(exc)}")
            ) from exc
        try:
            await _write_all(fd, body, request)
            _write_metadata(fd, metadata)
        finally:
            os.close(fd)

    def _upload_entry(self, file_path: str) -> dict[str, object]:
        # api.gen.go EntryInfo field order: metadata (omitempty), name, path, type.
        entry: dict[str, object] = {}
        persisted = read_metadata(self._fs.host(file_path))
        if persisted:
            entry["metadata"] = dict(sorted(persisted.items()))
        entry |= {"name": posixpath.basename(file_path), "path": file_path, "type": "file"}
        return entry


async def _part_body(reader: MultipartReader) -> AsyncIterator[bytes]:
    while chunk := await reader.read_chunk():
        yield chunk


async def _write_all(fd: int, body: AsyncIterator[bytes], request: web.BaseRequest) -> None:
    written_any = False
    try:
        async for chunk in body:
            written_any = True
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
    except zlib.error as exc:
        if not written_any:
            raise HttpFailure(
                json_error(
                    400,
                    "error decompressing request body: failed to create gzip reader: "
                    "gzip: invalid header",
                )
            ) from exc
        raise HttpFailure(json_error(500, f"error writing file: {exc}")) from exc
    except OSError as exc:
        if exc.errno == 28:  # ENOSPC → 507
            message = "not enough disk space available"
            if request.content_length:
                message = f"attempted to write {request.content_length} bytes: {message}"
            raise HttpFailure(json_error(507, message)) from exc
        raise HttpFailure(json_error(500, f"error writing file: {go_errno_text(exc)}")) from exc


def _content_encoding(header: str) -> str:
    """encoding.go parseContentEncoding (first header value)."""
    if not header:
        return "identity"
    name = _encoding_with_quality(header)[0]
    if name == "identity" or name in SUPPORTED_ENCODINGS:
        return name
    raise HttpFailure(
        json_error(
            400,
            f"error decompressing request body: unsupported Content-Encoding: {header}, "
            "supported: [gzip]",
        )
    )


def _metadata_headers(headers: CIMultiDictProxy[str]) -> dict[str, str]:
    """upload.go extractMetadataHeaders: lower-cased keys, the first value of each header."""
    metadata: dict[str, str] = {}
    for name, value in headers.items():
        if name.lower().startswith(_METADATA_PREFIX):
            key = name[len(_METADATA_PREFIX) :].lower()
            if key:
                metadata.setdefault(key, value)
    return metadata


def _validate_metadata(metadata: Mapping[str, str]) -> str | None:
    """xattr.go ValidateMetadata."""
    total = 0
    for key, value in metadata.items():
        if len(key) > _MAX_METADATA_KEY:
            return f"metadata key {json.dumps(key)} exceeds {_MAX_METADATA_KEY} bytes"
        for label, text in (("key", key), (f"value for key {json.dumps(key)}", value)):
            for offset, char in enumerate(text.encode("utf-8", "surrogateescape")):
                if not 0x20 <= char <= 0x7E:
                    return (
                        f"metadata {label} contains non-printable-ASCII byte 0x{char:02x} "
                        f"at offset {offset}"
                    )
        total += len(_XATTR_PREFIX) + len(key) + len(value)
    if total > _MAX_METADATA_TOTAL:
        return f"total metadata size {total} exceeds {_MAX_METADATA_TOTAL} bytes"
    return None


def _write_metadata(fd: int, metadata: Mapping[str, str]) -> None:
    """xattr.go WriteMetadata: replace the user.e2b.* set; a filesystem without xattrs is fine."""
    try:
        for name in os.listxattr(fd):
            if name.startswith(_XATTR_PREFIX) and name[len(_XATTR_PREFIX) :] not in metadata:
                os.removexattr(fd, name)
        for key, value in metadata.items():
            os.setxattr(fd, _XATTR_PREFIX + key, value.encode())
    except OSError as exc:
        if exc.errno not in (95,):  # EOPNOTSUPP/ENOTSUP: upload.go logs and continues
            raise HttpFailure(
                json_error(500, f"error writing file metadata: {go_errno_text(exc)}")
            ) from exc


async def _send_gzip(
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


async def _serve_content(
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
