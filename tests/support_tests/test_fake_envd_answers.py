"""The fake envd's own answers match envd's bytes where relay's tests read them: rs/cors's
fields with envd's options (tests/support/envd_cors.py) and Go's JSON Encoder for envd's JSON
answers (tests/support/go_json.py). Each case here was wrong before (found in review against
the envd, rs/cors v1.11.1 and connectrpc.com/cors v0.1.0 sources)."""

from __future__ import annotations

import aiohttp

from tests.support import go_json
from tests.support.fake_envd import FakeEnvd

# main.go:146-151: connectcors.ExposedHeaders() (cors.go:60-66) + three of envd's own.
EXPOSED = (
    "Grpc-Status, Grpc-Message, Grpc-Status-Details-Bin, "
    "Location, Cache-Control, X-Content-Type-Options"
)


async def test_exposed_headers_are_envds(envd: FakeEnvd, http: aiohttp.ClientSession) -> None:
    headers = {"Origin": "https://app.example"}
    async with http.get(f"{envd.url}/health", headers=headers) as response:
        assert response.status == 204
        assert response.headers.getall("Access-Control-Expose-Headers") == [EXPOSED]
        assert response.headers["Access-Control-Allow-Origin"] == "*"


async def test_a_method_rs_cors_does_not_allow_gets_only_vary(
    envd: FakeEnvd, http: aiohttp.ClientSession
) -> None:
    # cors.go:428-431: TRACE is not in envd's AllowedMethods; chi then answers 405.
    headers = {"Origin": "https://app.example"}
    async with http.request("TRACE", f"{envd.url}/health", headers=headers) as response:
        assert response.status == 405
        assert response.headers.getall("Vary") == ["Origin"]
        assert "Access-Control-Allow-Origin" not in response.headers
        assert "Access-Control-Expose-Headers" not in response.headers


async def test_error_json_is_gos_encoder(envd: FakeEnvd, http: aiohttp.ClientSession) -> None:
    # download.go:85 → error.go jsonError: UTF-8 as is, <>& escaped, a trailing newline.
    url = f"{envd.url}/files?path=/tmp/a%26%C3%BC%3C.txt"
    async with http.get(url) as response:
        assert response.status == 404
        assert await response.read() == (
            b'{"code":404,"message":"path \'/tmp/a\\u0026\xc3\xbc\\u003c.txt\' does not exist"}\n'
        )


async def test_envs_is_a_go_map(http: aiohttp.ClientSession) -> None:
    # envs.go:21 encodes a map: keys sorted, HTML-escaped values.
    async with (
        FakeEnvd(env_vars={"B": "1", "A": "<x>"}) as envd,
        http.get(f"{envd.url}/envs") as response,
    ):
        assert await response.read() == b'{"A":"\\u003cx\\u003e","B":"1"}\n'


def test_go_json_strings() -> None:
    assert go_json.encode({"m": "a\udcffb\u2028\t\x01"}) == b'{"m":"a\\ufffdb\\u2028\\t\\u0001"}\n'


async def test_upload_checks_the_encoding_before_the_user(
    envd: FakeEnvd, http: aiohttp.ClientSession
) -> None:
    # upload.go:287-306: getDecompressedBody (400) runs before user.Lookup (401).
    url = f"{envd.url}/files?path=/tmp/x&username=nobody"
    headers = {"Content-Encoding": "br", "Content-Type": "application/octet-stream"}
    async with http.post(url, data=b"x", headers=headers) as response:
        assert response.status == 400
        body = await response.json()
        assert body["message"] == (
            "error decompressing request body: unsupported Content-Encoding: br, supported: [gzip]"
        )
