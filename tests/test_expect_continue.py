"""Found by review: relay refused a request that carried ``Expect: 100-continue`` before its
body had begun, kept the connection, and waited to drop a body the client may never send.

A client that asks ``Expect: 100-continue`` holds its body back until it sees a 100 (RFC 9110
§10.1.1). When relay answers with a refusal (401, 403, 404, 502...) instead, a kept connection
is ambiguous: the client must then send the body it announced, but older Go transports and
OkHttp (its issue #3252) skipped it and sent their next request on the same connection, which
relay took for the body: that request got no answer and whatever followed it was parsed from the
middle of a request. Go's net/http server, E2B's proxy, closes after any answer to such a
request whose body it has not read (``closeAfterReply``, "we can't skip over the unread body
because we don't know if the next bytes on the wire will be the body-following-the-timer or
the subsequent request"); nginx sends the 100 itself before discarding the body. relay now
says ``Connection: close`` and closes (lingering), as for a body past the discard limit.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from relay.core.auth import file_signature
from tests.support.harness import DOMAIN, route, running_relay
from tests.support.rawhttp import Connection
from tests.support.sdk_matrix import _bind_envd_and_app

ENVD = f"49983-sbx.{DOMAIN}"


def post(token: str, expect: str) -> bytes:
    return (
        f"POST /files?path=/f HTTP/1.1\r\nHost: {ENVD}\r\nX-Access-Token: {token}\r\n"
        f"{expect}Content-Length: 10\r\n\r\n"
    ).encode()


async def test_a_refusal_before_an_expected_body_closes_the_connection(tmp_path: Path) -> None:
    async with running_relay(tmp_path, [route("sbx", envd_token="envd-tok")]) as relay:
        conn = await Connection.open(relay.port)
        try:
            await conn.send(post("wrong", "Expect: 100-continue\r\n"))  # the body held back
            answer = await conn.read_response()
            assert answer.status == 401
            assert answer.header("Connection") == "close"
            # A client that then skips its body and sends its next request (older Go, OkHttp) is not
            # answered as if that request were a body: the connection ends instead.
            await conn.send(f"GET /health HTTP/1.1\r\nHost: {ENVD}\r\n\r\n".encode())
            assert await conn.closed_by_peer(2.0)
        finally:
            await conn.close()


async def test_a_refusal_without_the_expectation_keeps_the_connection(tmp_path: Path) -> None:
    """Without the expectation the client sends its body unasked: the connection is kept and
    the body dropped, as before."""
    async with running_relay(tmp_path, [route("sbx", envd_token="envd-tok")]) as relay:
        conn = await Connection.open(relay.port)
        try:
            await conn.send(post("wrong", ""))
            answer = await conn.read_response()
            assert answer.status == 401
            assert answer.header("Connection") != "close"
            await conn.send(b"0123456789" + post("wrong", "") + b"0123456789")
            assert (await conn.read_response()).status == 401  # the same connection
        finally:
            await conn.close()


async def test_a_signed_upload_waiting_for_its_100_reaches_envd(tmp_path: Path) -> None:
    """curl's large upload to a signed URL: the head with ``Expect: 100-continue``, then the
    body only once a 100 came. relay checks the signature on the head and forwards it with the
    expectation; envd's Go server sends the 100 when its handler reads the body (the fake envd
    does so too since it speaks envd's Expect handling), relay passes it on, the body follows.
    Through a relay that answered or dropped the expectation itself, the client would stall or
    see a second 100."""
    envd, app = await _bind_envd_and_app()
    try:
        routes = [route("sbx", envd.host, envd_token="envd-tok")]
        async with running_relay(tmp_path, routes) as relay:
            signature = quote(file_signature("/home/user/up.bin", "write", "", "envd-tok", None))
            conn = await Connection.open(relay.port)
            try:
                await conn.send(
                    f"POST /files?path=%2Fhome%2Fuser%2Fup.bin&signature={signature} HTTP/1.1\r\n"
                    f"Host: {ENVD}\r\nExpect: 100-continue\r\n"
                    "Content-Type: application/octet-stream\r\nContent-Length: 10\r\n\r\n".encode()
                )
                interim = await conn.read_response()
                assert interim.status == 100
                await conn.send(b"0123456789")
                final = await conn.read_response()
                assert final.status == 200, final.body
            finally:
                await conn.close()
        assert envd.host_path("/home/user/up.bin").read_bytes() == b"0123456789"
        (record,) = envd.requests_to("/files")
        assert "signature" not in record.target
        assert record.header_all("expect") == ["100-continue"]
    finally:
        await app.close()
        await envd.close()
