"""How the fake envd answers a Connect call, as connect-go's handlers do: the codec check (415),
``Connect-Timeout-Ms``, a unary answer or a stream of envelopes ending in the end-of-stream
envelope, and connect-go's error shapes for each.

The services (``envd_process``, ``envd_filesystem``) see only a ``Call`` and JSON messages; this
is the part between them and HTTP (Connect protocol, connectrpc.com/docs/protocol).
"""

from __future__ import annotations

import asyncio
import inspect
import json

from aiohttp import web

from tests.support import envd_cors
from tests.support.connect import (
    STREAM_CONTENT_TYPE,
    ConnectError,
    JSONDict,
    decode_single_envelope,
    encode_json,
    end_stream_envelope,
    envelope,
)
from tests.support.envd_rpc import Call, StreamMethod, UnaryMethod, keepalive_interval
from tests.support.fake_server import read_body
from tests.support.records import RecordHandle
from tests.support.sandbox_fs import SandboxUser

_UNARY_CONTENT_TYPES = ("application/json", "application/json; charset=utf-8")


class ConnectHandler:
    """The Connect methods of the fake's services, by path ("/process.Process/Start")."""

    def __init__(self, unary: dict[str, UnaryMethod], streams: dict[str, StreamMethod]) -> None:
        self._unary = unary
        self._streams = streams
        # The connections of live streams (FakeEnvd.break_streams cuts them mid-envelope).
        self.stream_transports: set[asyncio.Transport] = set()

    def serves(self, method: str) -> bool:
        return method in self._unary or method in self._streams

    async def serve(
        self, request: web.BaseRequest, record: RecordHandle, method: str, user: SandboxUser
    ) -> web.StreamResponse:
        content_type = request.headers.get("Content-Type", "")
        streaming = method in self._streams
        wanted = (STREAM_CONTENT_TYPE,) if streaming else _UNARY_CONTENT_TYPES
        if content_type.lower() not in wanted:
            # connect-go answers an unsupported codec or protocol with 415.
            return web.Response(status=415, headers={"Accept-Post": ", ".join(wanted)})
        body = await read_body(request, record)
        try:
            call = _call(request, method, user)
        except ConnectError as error:
            if streaming:
                return _end_only(content_type, error)
            return _unary_error(content_type, error)
        if streaming:
            return await self._serve_stream(request, call, content_type, body)
        return await self._serve_unary(call, content_type, body)

    async def _serve_unary(self, call: Call, content_type: str, body: bytes) -> web.Response:
        try:
            message = _decode_json(body)
            async with asyncio.timeout(call.timeout_s):
                outcome = self._unary[call.method](call, message)
                result = await outcome if inspect.isawaitable(outcome) else outcome
        except ConnectError as error:
            return _unary_error(content_type, error)
        except TimeoutError:
            return _unary_error(
                content_type, ConnectError("deadline_exceeded", "context deadline exceeded")
            )
        # connect-go echoes the request Content-Type and advertises the compressors it has.
        return web.Response(
            status=200,
            body=encode_json(result),
            headers={"Content-Type": content_type, "Accept-Encoding": "gzip"},
        )

    async def _serve_stream(
        self, request: web.BaseRequest, call: Call, content_type: str, body: bytes
    ) -> web.StreamResponse:
        # Streams always answer 200; failures travel in the end-of-stream envelope.
        response = web.StreamResponse(
            status=200,
            headers={"Content-Type": content_type, "Connect-Accept-Encoding": "gzip"},
        )
        response.headers.extend(envd_cors.actual_fields(request))
        response.enable_chunked_encoding()
        await response.prepare(request)
        transport = request.transport
        if transport is not None:
            self.stream_transports.add(transport)
        try:
            return await self._run_stream(response, call, body)
        finally:
            if transport is not None:
                self.stream_transports.discard(transport)

    async def _run_stream(
        self, response: web.StreamResponse, call: Call, body: bytes
    ) -> web.StreamResponse:
        async def send(message: JSONDict) -> None:
            await response.write(envelope(message))  # one envelope, one chunk, flushed

        error: ConnectError | None = None
        try:
            flags, message = decode_single_envelope(body)
            if flags & 0x01:
                raise ConnectError("internal", "received compressed message without compression")
            async with asyncio.timeout(call.timeout_s):
                await self._streams[call.method](call, message, send)
        except ConnectError as exc:
            error = exc
        except TimeoutError:
            # connect-go put Connect-Timeout-Ms on the handler context.
            error = ConnectError("deadline_exceeded", "context deadline exceeded")
        except json.JSONDecodeError as exc:
            error = ConnectError("invalid_argument", f"unmarshal message: {exc}")
        except ConnectionResetError:
            return response  # the client went away mid-stream; envd just stops sending
        try:
            await response.write(end_stream_envelope(error))
            await response.write_eof()
        except ConnectionResetError:
            pass
        return response


def _call(request: web.BaseRequest, method: str, user: SandboxUser) -> Call:
    timeout_header = request.headers.get("Connect-Timeout-Ms")
    timeout_s: float | None = None
    if timeout_header is not None:
        # connect-go: at most 10 digits; start.go reads the same header for the process deadline.
        if not timeout_header.isdigit() or len(timeout_header) > 10:
            raise ConnectError(
                "invalid_argument", f"protocol error: invalid timeout {timeout_header!r}"
            )
        timeout_s = int(timeout_header) / 1000 or None
    return Call(
        method=method,
        headers=request.headers,
        user=user,
        timeout_s=timeout_s,
        keepalive_s=keepalive_interval(request.headers.get("Keepalive-Ping-Interval")),
    )


def _decode_json(body: bytes) -> JSONDict:
    if not body:
        return {}
    try:
        message = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ConnectError("invalid_argument", f"unmarshal message: {exc}") from exc
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "unmarshal message: not a JSON object")
    return message


def _unary_error(content_type: str, error: ConnectError) -> web.Response:
    return web.Response(
        status=error.http_status,
        body=encode_json(error.to_json()),
        headers={"Content-Type": "application/json"},
    )


def _end_only(content_type: str, error: ConnectError) -> web.Response:
    """A stream that fails before its first message: 200 and only the end-of-stream envelope."""
    return web.Response(
        status=200,
        body=end_stream_envelope(error),
        headers={"Content-Type": content_type or STREAM_CONTENT_TYPE},
    )


def connect_error_answer(request: web.BaseRequest, error: ConnectError) -> web.Response:
    """connect.ErrorWriter as the authn middleware uses it: stream-shaped or unary-shaped."""
    content_type = request.headers.get("Content-Type", "")
    if content_type.lower().startswith(STREAM_CONTENT_TYPE):
        return _end_only(content_type, error)
    return _unary_error(content_type, error)
