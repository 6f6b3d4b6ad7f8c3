"""The fake envd's HTTP side: /health, /files, auth, control paths, routing answers, records."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import time
from urllib.parse import quote

import aiohttp
import pytest

from tests.support.connect import unary
from tests.support.envd_encoding import negotiate_encoding
from tests.support.envd_file_access import sign
from tests.support.fake_envd import CONTROL_PATHS, UNAUTHORIZED, FakeEnvd
from tests.support_tests.conftest import TOKEN


async def raw_exchange(envd: FakeEnvd, request: bytes) -> bytes:
    """Send bytes as they are (duplicate headers, odd targets) and read until the server closes."""
    reader, writer = await asyncio.open_connection(envd.host, envd.port)
    try:
        writer.write(request)
        await writer.drain()
        return await reader.read(-1)
    finally:
        writer.close()
        await writer.wait_closed()


# -- health, routing answers --------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
async def test_health_needs_no_credential(token: str | None, http: aiohttp.ClientSession) -> None:
    async with FakeEnvd(access_token=token) as envd, http.get(f"{envd.url}/health") as response:
        assert response.status == 204
        assert response.headers["Cache-Control"] == "no-store"
        assert await response.read() == b""


async def test_unknown_path_wrong_method_and_codec(
    envd: FakeEnvd, http: aiohttp.ClientSession
) -> None:
    async with http.get(f"{envd.url}/nope") as response:
        assert response.status == 404
        assert await response.text() == "404 page not found\n"
    async with http.post(f"{envd.url}/health") as response:
        assert response.status == 405
    async with http.get(f"{envd.url}/process.Process/List") as response:
        assert response.status == 405
    async with http.post(
        f"{envd.url}/process.Process/List", data=b"{}", headers={"Content-Type": "text/plain"}
    ) as response:
        assert response.status == 415


async def test_envs_and_metrics(http: aiohttp.ClientSession) -> None:
    async with FakeEnvd(env_vars={"A": "1"}) as envd:
        async with http.get(f"{envd.url}/envs") as response:
            assert await response.json() == {"A": "1"}
        async with http.get(f"{envd.url}/metrics") as response:
            assert response.status == 200
            assert "cpu_count" in await response.json()


@pytest.mark.parametrize("path", sorted(CONTROL_PATHS))
async def test_control_paths_answer_so_a_leak_is_visible(
    path: str, envd: FakeEnvd, http: aiohttp.ClientSession
) -> None:
    async with http.post(f"{envd.url}{path}") as response:
        assert response.status == 204
    assert [r.path for r in envd.requests_to(path)] == [path]


# -- access token -------------------------------------------------------------------------------


async def test_token_required_with_envd_body(secure_envd: FakeEnvd) -> None:
    host, port = secure_envd.host, secure_envd.port
    result = await unary(host, port, "/process.Process/List", {})
    assert result.status == 401
    assert result.head.header("Content-Type") == "application/json; charset=utf-8"
    expected = json.dumps({"code": 401, "message": UNAUTHORIZED}, separators=(",", ":"))
    assert result.body == expected.encode() + b"\n"
    ok = await unary(host, port, "/process.Process/List", {}, {"X-Access-Token": TOKEN})
    assert (ok.status, ok.json()) == (200, {})


async def test_control_paths_need_the_token_except_init(
    secure_envd: FakeEnvd, http: aiohttp.ClientSession
) -> None:
    async with http.post(f"{secure_envd.url}/freeze") as response:
        assert response.status == 401
    async with http.post(f"{secure_envd.url}/init") as response:
        assert response.status == 204  # POST/init is in authExcludedPaths


def test_signature_matches_the_sdk_vectors() -> None:
    # notes/e2b-protocol.md §7, computed with SDK 2.52's get_signature.
    assert (
        sign("/home/user/hello.txt", "read", "user", "tok_abc123", None)
        == "v1_wjASD7E7LCVMmLXqVXaR5warW2XdFG6+T1qhLrMzjCI"
    )
    assert (
        sign("/tmp/data file.bin", "read", "root", "2f1c9e0d-envd-token", 1700000300)
        == "v1_eAr1xeTBoMrf7ysk8VK39XM5VmNrMHXs5rMYWLem1gI"
    )


async def test_signed_download(secure_envd: FakeEnvd, http: aiohttp.ClientSession) -> None:
    secure_envd.host_path("/home/user/s.txt").write_text("secret")
    url = f"{secure_envd.url}/files"
    good = sign("/home/user/s.txt", "read", "", TOKEN, None)
    params = {"path": "/home/user/s.txt", "signature": good}
    async with http.get(url, params=params, headers={"Accept-Encoding": "identity"}) as response:
        assert response.status == 200
        assert await response.read() == b"secret"

    async def refused(params: dict[str, str], headers: dict[str, str] | None = None) -> str:
        async with http.get(url, params=params, headers=headers) as response:
            assert response.status == 401
            body = await response.json()
            assert body["code"] == 401
            return str(body["message"])

    assert await refused({"path": "/home/user/s.txt"}) == "missing signature query parameter"
    assert await refused({"path": "/home/user/s.txt", "signature": "v1_x"}) == "invalid signature"
    wrong_op = sign("/home/user/s.txt", "write", "", TOKEN, None)
    assert await refused({"path": "/home/user/s.txt", "signature": wrong_op}) == (
        "invalid signature"
    )
    expired_at = int(time.time()) - 10
    expired = {
        "path": "/home/user/s.txt",
        "signature": sign("/home/user/s.txt", "read", "", TOKEN, expired_at),
        "signature_expiration": str(expired_at),
    }
    assert await refused(expired) == "signature is already expired"
    # A wrong header never falls back to the signature (auth.go validateSigning).
    assert await refused(params, {"X-Access-Token": "wrong"}) == (
        "access token present in header but does not match"
    )
    bad = params | {"signature_expiration": "soon"}
    async with http.get(url, params=bad) as response:
        assert response.status == 400
        assert response.content_type == "text/plain"


async def test_file_parameters_are_read_as_gos_url_query(secure_envd: FakeEnvd) -> None:
    """envd binds /files parameters from Go's ``r.URL.Query()`` (api.gen.go): a pair with a
    malformed escape or a ``;`` is dropped, not kept as a second value. A relay in front reads
    a signed URL's ``path`` the same way; a fake that kept such pairs answered 400 where envd
    serves the signed file (or would serve another file where envd refuses)."""
    secure_envd.host_path("/home/user/s.txt").write_text("secret")
    good = quote(sign("/home/user/s.txt", "read", "", TOKEN, None), safe="")
    signed = f"path=%2Fhome%2Fuser%2Fs.txt&signature={good}"
    for extra in ("path=%zz", "path=%2Fetc%2Fpasswd;x", "signature=v1_x;"):
        for query in (f"{extra}&{signed}", f"{signed}&{extra}"):
            answer = await raw_exchange(
                secure_envd,
                f"GET /files?{query} HTTP/1.1\r\nHost: e\r\nAccept-Encoding: identity\r\n"
                "Connection: close\r\n\r\n".encode(),
            )
            assert answer.startswith(b"HTTP/1.1 200"), (query, answer[:200])
            assert answer.endswith(b"\r\n\r\nsecret"), query


async def test_repeated_file_parameter_is_a_binding_error(
    envd: FakeEnvd, http: aiohttp.ClientSession
) -> None:
    async with http.get(f"{envd.url}/files?path=/a&path=/b") as response:
        assert response.status == 400
        assert await response.text() == (
            "Invalid format for parameter path: multiple values for single value parameter 'path'\n"
        )


# -- downloads ----------------------------------------------------------------------------------


async def test_download_identity(envd: FakeEnvd, http: aiohttp.ClientSession) -> None:
    envd.host_path("/home/user/a.txt").write_text("hello world")
    url = f"{envd.url}/files?path=%2Fhome%2Fuser%2Fa.txt"
    async with http.get(url, headers={"Accept-Encoding": "identity"}) as response:
        assert response.status == 200
        assert await response.read() == b"hello world"
        assert response.headers["Content-Length"] == "11"
        assert response.headers["Content-Disposition"] == "inline; filename=a.txt"
        assert response.headers["Vary"] == "Accept-Encoding"
        assert response.headers["Accept-Ranges"] == "bytes"
        assert "Last-Modified" in response.headers
        assert "Content-Encoding" not in response.headers
    async with http.get(url, headers={"Range": "bytes=6-"}) as response:
        assert response.status == 206
        assert await response.read() == b"world"
        assert response.headers["Content-Range"] == "bytes 6-10/11"


async def test_download_gzip_is_chunked(envd: FakeEnvd, http: aiohttp.ClientSession) -> None:
    payload = bytes(range(256)) * 2000
    envd.host_path("/home/user/b.bin").write_bytes(payload)
    url = f"{envd.url}/files?path=/home/user/b.bin"
    async with http.get(url, headers={"Accept-Encoding": "gzip, deflate"}) as response:
        assert response.status == 200
        assert response.headers["Content-Encoding"] == "gzip"
        assert response.headers["Transfer-Encoding"] == "chunked"
        assert "Content-Length" not in response.headers
        assert response.headers["Content-Type"] == "application/octet-stream"
        assert gzip.decompress(await response.read()) == payload


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("", "identity"),
        ("gzip, deflate", "gzip"),
        ("zstd,gzip,br", "gzip"),
        ("br", "identity"),
        ("gzip;q=0, identity", "identity"),
        ("identity;q=0", None),
        ("*;q=0", None),
        ("identity;q=0, *", "gzip"),
        ("deflate;q=1, gzip;q=0.5", "gzip"),
    ],
)
def test_accept_encoding_negotiation(header: str, expected: str | None) -> None:
    assert negotiate_encoding(header) == expected


async def test_download_errors(envd: FakeEnvd, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{envd.url}/files?path=/home/user/none") as response:
        assert response.status == 404
        assert response.headers["Content-Type"] == "application/json; charset=utf-8"
        assert await response.read() == (
            b'{"code":404,"message":"path \'/home/user/none\' does not exist"}\n'
        )
    async with http.get(f"{envd.url}/files?path=/home/user") as response:
        assert response.status == 400
        assert (await response.json())["message"] == "path '/home/user' is a directory"
    async with http.get(f"{envd.url}/files?path=/home/user/none&username=bob") as response:
        assert response.status == 401
    envd.host_path("/home/user/c.txt").write_text("c")
    async with http.get(
        f"{envd.url}/files?path=/home/user/c.txt", headers={"Accept-Encoding": "identity;q=0"}
    ) as response:
        assert response.status == 406


# -- uploads ------------------------------------------------------------------------------------


async def test_multipart_upload_with_full_path_filenames(
    envd: FakeEnvd, http: aiohttp.ClientSession
) -> None:
    # quote_fields=False: like httpx (the SDK), send the filename as is; envd does not
    # percent-decode it (Go's mime.ParseMediaType).
    form = aiohttp.FormData(quote_fields=False)
    form.add_field("file", b"one", filename="/home/user/up/1.txt")
    form.add_field("other", "ignored")
    form.add_field("file", b"two", filename="rel/2.txt")
    async with http.post(f"{envd.url}/files", data=form) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/plain; charset=utf-8"
        assert await response.json(content_type=None) == [
            {"name": "1.txt", "path": "/home/user/up/1.txt", "type": "file"},
            {"name": "2.txt", "path": "/home/user/rel/2.txt", "type": "file"},
        ]
    assert envd.host_path("/home/user/up/1.txt").read_bytes() == b"one"
    assert envd.host_path("/home/user/rel/2.txt").read_bytes() == b"two"


async def test_multipart_upload_to_one_path_twice_is_refused(
    envd: FakeEnvd, http: aiohttp.ClientSession
) -> None:
    form = aiohttp.FormData()
    form.add_field("file", b"a", filename="x")
    form.add_field("file", b"b", filename="y")
    async with http.post(f"{envd.url}/files?path=/home/user/same", data=form) as response:
        assert response.status == 400
        assert "cannot upload multiple files to the same path" in (await response.json())["message"]


async def test_octet_stream_upload_gzip_and_metadata(
    envd: FakeEnvd, http: aiohttp.ClientSession
) -> None:
    body = gzip.compress(b"z" * 100_000)
    headers = {
        "Content-Type": "application/octet-stream",
        "Content-Encoding": "gzip",
        "X-Metadata-Owner": "tests",
    }
    url = f"{envd.url}/files?path=/home/user/z.txt"
    async with http.post(url, data=body, headers=headers) as response:
        assert response.status == 200
        entries = await response.json(content_type=None)
    assert envd.host_path("/home/user/z.txt").read_bytes() == b"z" * 100_000
    assert entries[0]["path"] == "/home/user/z.txt"
    if "metadata" in entries[0]:  # only where the filesystem keeps user xattrs
        assert entries[0]["metadata"] == {"owner": "tests"}
    (record,) = envd.requests_to("/files")
    assert record.body_size == len(body)  # counted as received, before decompression
    assert record.body_complete


async def test_upload_errors(envd: FakeEnvd, http: aiohttp.ClientSession) -> None:
    octet = {"Content-Type": "application/octet-stream"}
    async with http.post(f"{envd.url}/files", data=b"x", headers=octet) as response:
        assert response.status == 400
        assert (await response.json())["message"] == (
            "path query parameter is required for raw body upload"
        )
    async with http.post(
        f"{envd.url}/files?path=a", data=b"x", headers={"Content-Type": "text/plain"}
    ) as response:
        assert response.status == 400
    async with http.post(f"{envd.url}/files?path=/home/user", data=b"x", headers=octet) as response:
        assert response.status == 400
        assert (await response.json())["message"] == "path is a directory: /home/user"


# -- auth user, CORS, records -------------------------------------------------------------------


async def test_unknown_basic_auth_user_is_unauthenticated(envd: FakeEnvd) -> None:
    auth = "Basic " + base64.b64encode(b"bob:").decode()
    result = await unary(envd.host, envd.port, "/process.Process/List", {}, {"Authorization": auth})
    assert result.status == 401
    assert result.json() == {"code": "unauthenticated", "message": "invalid username: 'bob'"}


async def test_cors_preflight_and_simple(envd: FakeEnvd, http: aiohttp.ClientSession) -> None:
    headers = {"Origin": "https://x.example", "Access-Control-Request-Method": "POST"}
    async with http.options(f"{envd.url}/files", headers=headers) as response:
        assert response.status == 204
        assert response.headers["Access-Control-Allow-Origin"] == "*"
    async with http.get(f"{envd.url}/health", headers={"Origin": "https://x.example"}) as r:
        assert r.headers["Access-Control-Allow-Origin"] == "*"


async def test_cors_answers_as_rs_cors_1_11_1(secure_envd: FakeEnvd) -> None:
    """envd's rs/cors (v1.11.1, cors.go Handler) takes any OPTIONS with a non-empty
    Access-Control-Request-Method as a preflight and answers it 204 itself, before envd's
    token check, Origin or not; the allowed methods are compared as sent (``post`` is not
    ``POST``), and every other response carries ``Vary: Origin``."""

    async def options(headers: str) -> bytes:
        return await raw_exchange(
            secure_envd,
            f"OPTIONS /process.Process/Start HTTP/1.1\r\nHost: e\r\n{headers}"
            "Connection: close\r\n\r\n".encode(),
        )

    no_origin = await options("Access-Control-Request-Method: POST\r\n")
    assert no_origin.startswith(b"HTTP/1.1 204"), no_origin[:120]
    assert b"Access-Control-Allow-Origin" not in no_origin
    assert (
        b"\r\nVary: Origin, Access-Control-Request-Method, Access-Control-Request-Headers\r\n"
        in (no_origin)
    )
    lower = await options("Origin: https://x.example\r\nAccess-Control-Request-Method: post\r\n")
    assert lower.startswith(b"HTTP/1.1 204"), lower[:120]
    assert b"Access-Control-Allow-Origin" not in lower
    health = await raw_exchange(
        secure_envd, b"GET /health HTTP/1.1\r\nHost: e\r\nConnection: close\r\n\r\n"
    )
    assert health.startswith(b"HTTP/1.1 204")
    assert b"\r\nVary: Origin\r\n" in health
    assert b"Access-Control-Allow-Origin" not in health


@pytest.mark.parametrize("encoding", ["identity", "gzip"])
async def test_a_download_with_an_origin_has_the_cors_fields(
    encoding: str, envd: FakeEnvd, http: aiohttp.ClientSession
) -> None:
    """rs/cors writes its fields before envd's handler runs, so a download (streamed, in
    either coding) carries them too; download.go's ``Set("Vary", ...)`` replaces its Vary."""
    envd.host_path("/home/user/a.txt").write_text("hello")
    headers = {"Origin": "https://x.example", "Accept-Encoding": encoding}
    url = f"{envd.url}/files?path=%2Fhome%2Fuser%2Fa.txt"
    async with http.get(url, headers=headers) as response:
        assert response.status == 200
        assert response.headers["Access-Control-Allow-Origin"] == "*"
        assert "Location" in response.headers["Access-Control-Expose-Headers"]
        assert response.headers.getall("Vary") == ["Accept-Encoding"]
        assert await response.read()


async def test_expect_100_continue_as_gos_server(secure_envd: FakeEnvd) -> None:
    """envd's net/http: ``100 Continue`` goes out when a handler first reads the body; a
    handler that answers without reading it (a refusal) answers at once, with ``Connection:
    close`` and without waiting for the body (server.go expectContinueReader,
    closeAfterReply). The fake did neither: a client holding its body back for the 100, as
    curl does for a large upload, got no answer at all, even a 401."""
    reader, writer = await asyncio.open_connection(secure_envd.host, secure_envd.port)
    try:
        writer.write(
            b"POST /files?path=%2Fhome%2Fuser%2Fe.txt HTTP/1.1\r\nHost: e\r\n"
            b"X-Access-Token: " + TOKEN.encode() + b"\r\nExpect: 100-continue\r\n"
            b"Content-Type: application/octet-stream\r\nContent-Length: 5\r\n\r\n"
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hello")
        final = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert final.startswith(b"HTTP/1.1 200")
    finally:
        writer.close()
        await writer.wait_closed()
    assert secure_envd.host_path("/home/user/e.txt").read_bytes() == b"hello"
    refused = await asyncio.wait_for(
        raw_exchange(
            secure_envd,
            b"POST /process.Process/List HTTP/1.1\r\nHost: e\r\nExpect: 100-continue\r\n"
            b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n",
        ),
        5,
    )
    assert refused.startswith(b"HTTP/1.1 401")
    assert b"\r\nConnection: close\r\n" in refused
    assert b"100 Continue" not in refused


async def test_records_keep_the_raw_request(envd: FakeEnvd) -> None:
    request = (
        b"POST /files?path=%2Fhome%2Fuser%2Fr.txt&signature=v1_abc HTTP/1.1\r\n"
        b"Host: 49983-sbx.example\r\n"
        b"X-Dup: one\r\n"
        b"x-dup: two\r\n"
        b"Content-Type: application/octet-stream\r\n"
        b"Content-Length: 5\r\n"
        b"Connection: close\r\n"
        b"\r\n"
        b"hello"
    )
    answer = await raw_exchange(envd, request)
    assert answer.startswith(b"HTTP/1.1 200")
    (record,) = envd.records
    assert record.method == "POST"
    assert record.target == "/files?path=%2Fhome%2Fuser%2Fr.txt&signature=v1_abc"
    assert record.path == "/files"
    assert record.query() == [("path", "/home/user/r.txt"), ("signature", "v1_abc")]
    assert record.version == "HTTP/1.1"
    assert record.header_all("x-dup") == ["one", "two"]
    assert [k for k, _ in record.headers][:3] == ["Host", "X-Dup", "x-dup"]
    assert (record.body_size, record.body_head, record.body_complete) == (5, b"hello", True)
    assert not record.has_header("X-Access-Token")
    assert "signature" in record.query_names()
