"""What the E2B JavaScript SDK put on the wire reached envd as it was sent, through relay.

The JS columns of the SDK matrix (tests/test_sdk_matrix.py, which runs them in parallel with the
Python ones; this module shares that one run) say that each feature works. These tests look at
the requests FakeEnvd received from the JS driver, where the JS SDK differs from the Python one:
connect-web over undici's fetch (``Connect-Protocol-Version``, ``Keepalive-Ping-Interval`` and
``Connect-Timeout-Ms`` on server streams, JSON codec), uploads as chunked multipart/form-data
(octet-stream with ``Content-Encoding: gzip`` for ``gzip: true``), and an HTTP/2-capable client
(``allowH2``) that relay's TLS listener keeps on HTTP/1.1 (ALPN offers only http/1.1). JS 2.8.4
(Node's global fetch) sends its uploads as multipart with a Content-Length, ignores ``gzip``, and
names the sandbox on RPCs only, so its REST calls with a fixed URL go to the management upstream.
"""

from __future__ import annotations

import pytest

from tests.support.harness import DOMAIN
from tests.support.records import RequestRecord
from tests.support.sdk_expected import JS_RELEASES, JS_VERSIONS
from tests.support.sdk_matrix import FORMS, MAIN_ID
from tests.test_sdk_matrix import Matrix, column, run_matrix

pytestmark = pytest.mark.slow

OLD, NEW = JS_VERSIONS
STREAMS = {"/process.Process/Start", "/process.Process/Connect", "/filesystem.Filesystem/WatchDir"}
MIB = 1024 * 1024


@pytest.fixture(scope="session")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    return run_matrix(tmp_path_factory.getbasetemp() / "sdk-matrix")


def _rpc(records: list[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.path.startswith(("/process.", "/filesystem."))]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("label", "release"), list(zip(JS_VERSIONS, JS_RELEASES, strict=True)))
def test_js_connect_requests_reached_envd_as_sent(
    matrix: Matrix, label: str, release: str, form: str
) -> None:
    run = column(matrix, label, form)
    rpcs = _rpc(run.envd_records)
    assert {r.path for r in rpcs} >= STREAMS | {"/process.Process/SendInput"}
    for record in rpcs:
        what = f"{record.method} {record.path}"
        assert record.version == "HTTP/1.1", what
        assert record.header("Connect-Protocol-Version") == "1", what
        assert record.header("User-Agent") == f"e2b-js-sdk/{release}", what
        assert record.header("E2b-Sandbox-Id") == MAIN_ID, what
        assert record.header("E2b-Sandbox-Port") == "49983", what
        assert not record.has_header("X-Access-Token"), what  # relay consumed the credential
        if record.path in STREAMS:
            assert record.header("Content-Type") == "application/connect+json", what
            assert record.header("Keepalive-Ping-Interval") == "50", what
            # The SDK's default 60 s, or the check's ``timeoutMs: 1000`` (commands.run timeout).
            assert record.header("Connect-Timeout-Ms") in ("60000", "1000"), what
        else:
            assert record.header("Content-Type") == "application/json", what
        assert record.body_complete, what
    timeouts = {r.header("Connect-Timeout-Ms") for r in rpcs if r.path.endswith("/Start")}
    assert timeouts == {"60000", "1000"}
    host = f"49983-{MAIN_ID}.{DOMAIN}" if form == "host" else None
    if host is not None:
        assert {r.header("Host") for r in run.envd_records} == {host}


@pytest.mark.parametrize("form", FORMS)
def test_js_uploads_reached_envd_unchanged(matrix: Matrix, form: str) -> None:
    """2.51: chunked multipart for plain writes, gzip'd octet-stream for ``gzip: true``."""
    run = column(matrix, NEW, form)
    uploads = _uploads(run.envd_records)
    blob = uploads["/home/user/t/blob.bin"]
    assert (blob.header("Content-Type") or "").startswith("multipart/form-data; boundary=")
    assert blob.header("Transfer-Encoding") == "chunked"
    assert blob.body_complete
    assert MIB < blob.body_size < MIB + 1024  # the file and one part's head and tail
    gzipped = uploads["/home/user/z.txt"]
    assert gzipped.header("Content-Type") == "application/octet-stream"
    assert gzipped.header("Content-Encoding") == "gzip"
    assert gzipped.body_head.startswith(b"\x1f\x8b")  # relay did not decompress it
    assert gzipped.body_complete


def test_js_284_uploads_reached_envd_unchanged(matrix: Matrix) -> None:
    """2.8.4 (Host form): multipart with a Content-Length, ``gzip: true`` ignored."""
    run = column(matrix, OLD, "host")
    uploads = _uploads(run.envd_records)
    for path in ("/home/user/t/blob.bin", "/home/user/z.txt"):
        record = uploads[path]
        assert (record.header("Content-Type") or "").startswith("multipart/form-data; boundary=")
        assert record.header("Content-Length") == str(record.body_size)
        assert not record.has_header("Content-Encoding")
        assert record.body_complete
    assert MIB < uploads["/home/user/t/blob.bin"].body_size < MIB + 1024


def test_js_284_fixed_url_rest_calls_reach_the_management_upstream(matrix: Matrix) -> None:
    """2.8.4 names the sandbox on envd's RPCs only: its /files and /health name none."""
    run = column(matrix, OLD, "fixed")
    assert not [r for r in run.envd_records if not r.path.startswith(("/process.", "/filesystem."))]
    rest = [r for r in run.api_records if r.path in ("/files", "/health")]
    assert {r.path for r in rest} == {"/files", "/health"}
    assert not [r for r in rest if r.has_header("E2b-Sandbox-Id")]
    # The missing-file read "passes": its 404 came from the API, not from envd.
    missing = [
        r for r in rest if r.method == "GET" and r.query() == [("path", "/home/user/nope.txt")]
    ]
    assert len(missing) == 1
    # relay's access log: no sandbox named, the management upstream's answers passed on.
    logged = [e for e in run.access_log() if e["path"] in ("/files", "/health")]
    assert logged
    assert all(e["sandbox_id"] is None for e in logged)
    assert {e["status"] for e in logged} == {200, 404}  # /health "ok", /files not served


def _uploads(records: list[RequestRecord]) -> dict[str, RequestRecord]:
    return {r.query()[0][1]: r for r in records if r.method == "POST" and r.path == "/files"}


# The cells whose watch_dir passes (2.8.4's fixed URL sends the scenario's file writes to the
# management upstream: its watch fails before it is stopped, and ends with the route).
@pytest.mark.parametrize(("version", "form"), [(NEW, "fixed"), (NEW, "host"), (OLD, "host")])
def test_js_a_stopped_watch_ends_its_stream_at_once(
    matrix: Matrix, version: str, form: str
) -> None:
    """``handle.stop()`` aborts the WatchDir fetch: undici ends the connection with a FIN (over
    plain HTTP) or a TLS close. relay must end the exchange then ("client_closed"), not hold
    envd's watch until a later event or the route's removal ("revoked"), as it did with the fixed
    URL before a FIN during a stream counted as the client leaving (README, "Half-closed
    clients wait")."""
    run = column(matrix, version, form)
    watches = [e for e in run.access_log() if e["path"] == "/filesystem.Filesystem/WatchDir"]
    assert watches
    assert {e["reason"] for e in watches} == {"client_closed"}, watches
