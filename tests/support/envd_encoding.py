"""envd's ``/files`` content codings: ``Accept-Encoding`` negotiation for downloads and
``Content-Encoding`` decoding for uploads (gzip, concatenated members allowed).

Source: envd ``internal/api/encoding.go``.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import AsyncIterator

from tests.support.envd_file_access import HttpFailure, json_error

SUPPORTED_ENCODINGS = ("gzip",)  # encoding.go SupportedEncodings


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


def parse_content_encoding(header: str) -> str:
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
