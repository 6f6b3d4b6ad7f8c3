"""Writing an upload of envd's ``POST /files`` to disk: the body streamed into the file, and the
``X-Metadata-*`` headers kept as ``user.e2b.*`` extended attributes.

Sources: envd ``internal/api/upload.go`` (processFile, extractMetadataHeaders) and
``packages/shared/pkg/filesystem/xattr.go``.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import AsyncIterator, Mapping

from aiohttp import web
from multidict import CIMultiDictProxy

from tests.support.envd_file_access import HttpFailure, json_error
from tests.support.sandbox_fs import go_errno_text

_METADATA_PREFIX = "x-metadata-"  # upload.go metadataHeaderPrefix
_XATTR_PREFIX = "user.e2b."
_MAX_METADATA_KEY = 255 - len(_XATTR_PREFIX)
_MAX_METADATA_TOTAL = 4096


async def write_all(fd: int, body: AsyncIterator[bytes], request: web.BaseRequest) -> None:
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


def metadata_headers(headers: CIMultiDictProxy[str]) -> dict[str, str]:
    """upload.go extractMetadataHeaders: lower-cased keys, the first value of each header."""
    metadata: dict[str, str] = {}
    for name, value in headers.items():
        if name.lower().startswith(_METADATA_PREFIX):
            key = name[len(_METADATA_PREFIX) :].lower()
            if key:
                metadata.setdefault(key, value)
    return metadata


def validate_metadata(metadata: Mapping[str, str]) -> str | None:
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


def write_metadata(fd: int, metadata: Mapping[str, str]) -> None:
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
