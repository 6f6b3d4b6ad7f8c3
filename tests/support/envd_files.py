"""envd's HTTP file API for the fake: ``GET /files`` (download) and ``POST /files`` (upload).

Sources: envd ``internal/api/{download,upload}.go``. The handlers run envd's steps in envd's
order (signature, encoding, user, path, then the transfer), so that each failure gets envd's
answer; the steps live in ``envd_file_access`` (parameters, signatures, errors),
``envd_encoding``, ``envd_multipart``, ``envd_download`` and ``envd_upload``.

Both directions stream: a download is read from disk in chunks (gzip-compressed on the fly when
``Accept-Encoding`` allows it, as envd negotiates), an upload is written to disk as it arrives
(``Content-Encoding: gzip`` decompressed on the fly; multipart parsed incrementally).
"""

from __future__ import annotations

import json
import os
import posixpath
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web

from tests.support.connect import ConnectError
from tests.support.envd_download import (
    content_disposition,
    send_gzip,
    serve_content,
    type_by_extension,
)
from tests.support.envd_encoding import (
    decoded_body,
    identity_acceptable,
    negotiate_encoding,
    parse_content_encoding,
)
from tests.support.envd_file_access import (
    READ,
    WRITE,
    FileParams,
    HttpFailure,
    bind_file_params,
    json_error,
    validate_signing,
)
from tests.support.envd_multipart import (
    MultipartError,
    MultipartReader,
    disposition_params,
    parse_media_type,
    part_body,
)
from tests.support.envd_upload import (
    metadata_headers,
    validate_metadata,
    write_all,
    write_metadata,
)
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

# The request key under which fake_envd leaves rs/cors's fields for a streamed answer.
CORS_FIELDS = web.RequestKey("cors_fields", list[tuple[str, str]])


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
            return await send_gzip(request, host, headers)
        return await serve_content(request, path, host, st, headers)

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
        content_encoding = parse_content_encoding(request.headers.get("Content-Encoding", ""))
        user = self._user(params)
        metadata = metadata_headers(request.headers)
        error = validate_metadata(metadata)
        if error:
            raise HttpFailure(json_error(400, f"invalid metadata: {error}"))
        content_type = request.headers.get("Content-Type", "")
        media_type, media_params = parse_media_type(content_type)
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
                disposition = disposition_params(headers.get("content-disposition", ""))
                if disposition.get("name") != "file":
                    continue  # upload.go handlePart: only "file" parts are files
                file_path = self._part_path(params, user, disposition, entries)
                await self._write_file(file_path, part_body(reader), metadata, request)
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
            await write_all(fd, body, request)
            write_metadata(fd, metadata)
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
