"""What every cell of the SDK matrix must show (tests/test_sdk_matrix.py), per release and URL form.

By default a check passes (``observed == "ok"``); the entries below name the release-specific
exception a correct SDK raises, and the known gaps with the exact behaviour asserted, each with
the footnote README's table prints. Python releases are columns by version, JS ones
``js-<version>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tests.support.sdk_matrix import UNKNOWN_ID

PY_VERSIONS = ("2.25.0", "2.52.0", "2.64.0")  # Harbor's pin, the notes' reference, newest on PyPI
# The JS SDK (npm ``e2b``): a year-old release and the newest; pinned in
# tests/support/js/package-lock.json.
JS_RELEASES = ("2.8.4", "2.51.0")
JS_VERSIONS = tuple(f"js-{v}" for v in JS_RELEASES)  # the column labels
VERSIONS = PY_VERSIONS + JS_VERSIONS


@dataclass(frozen=True)
class Expect:
    observed: str  # regex, matched at the start of the driver's "observed"
    status: str = "pass"  # "pass" | "gap" | "n/a"
    label: str = ""  # short text in the table cell
    note: str = ""  # footnote under the table (gaps, n/a)


OK = Expect("ok$")
OLD, MID, NEW = PY_VERSIONS

# -- the known gaps, asserted exactly ------------------------------------------------------------

GAP_225_CONTROL_PLANE = (
    "2.25's `Sandbox.connect()` puts `E2b-Sandbox-Id`/`E2b-Sandbox-Port` on the control-plane "
    "call `POST /sandboxes/<id>/connect` (E2B PR #1272). relay ignores routing headers on "
    "`api.<domain>` (so the Host form works), but with a fixed URL the API shares relay's "
    "address with envd, the headers route the call to the sandbox's envd port, and relay "
    'refuses it there: 401 (an API call carries no envd token), or 502 "The sandbox was not '
    'found" for an unknown id. Point `E2B_API_URL` at `https://api.<domain>` to avoid it; '
    "`Sandbox.create()` (Harbor's path) is unaffected."
)
GAP_225_NO_HEADERS = (
    "A 2.25 `connect()` handle sends no routing headers to envd (notes §1.2); with a fixed "
    "`E2B_SANDBOX_URL` nothing in the request names the sandbox, so relay passes it to the "
    "management upstream (here the fake API: 404 → `NotFoundException`; without a management "
    "upstream relay answers 404 itself). The Host form routes it by name. Handle obtained with "
    "the control plane reached directly (see [1])."
)
GAP_FIXED_SIGNED_URL = (
    "With a fixed `E2B_SANDBOX_URL` the SDK signs `<E2B_SANDBOX_URL>/files?…`: no sandbox id "
    "anywhere (notes §1.2), so relay has no target and passes the request, signature stripped, "
    "to the management upstream (here the fake API: 404); without one relay answers 404. "
    "Signed URLs need the Host form."
)
NA_CLOSE_STDIN = "2.25 has no `commands.close_stdin`."
NOTE_JS_284_GZIP = (
    "JS 2.8.4 has no gzip option: `gzip: true` is ignored and the file goes as plain "
    "multipart/form-data (`tests/test_sdk_matrix_js.py`)."
)
NA_JS_284_CLOSE_STDIN = "JS 2.8.4 has no `commands.closeStdin`."
NA_JS_ONE_CLASS = (
    "The JS SDK has one `Sandbox` class whose calls are all async; the JS columns put it in the "
    "`(AsyncSandbox)` rows (`watchDir` with a callback, `commands.run` with `timeoutMs`)."
)
GAP_JS_284_NO_HEADERS = (
    "JS 2.8.4 puts `E2b-Sandbox-Id`/`E2b-Sandbox-Port` on envd's RPCs only, not on its REST "
    "calls (`/files`, `/health`: only `X-Access-Token`; 2.51 sends them on both). With a fixed "
    "`E2B_SANDBOX_URL` nothing in those requests names the sandbox, so relay passes them to the "
    'management upstream (here the fake API: 404 → `NotFoundError`, and its `/health` "ok" '
    "fails `isRunning()`'s JSON parse; without a management upstream relay answers 404 itself). "
    "`files.read` of a missing file passes only because that 404 came from the API. The Host "
    "form routes them by name."
)
JS_NOT_RUNNING = Expect(
    "SandboxNotFoundError: Sandbox is probably not running anymore$", label="SandboxNotFoundError"
)
JS_OLD = "js-2.8.4"
JS_284_REST_ROWS = {
    "files write/read text",
    "files write/read 1 MiB binary",
    "files list, make_dir, rename, remove, exists",
    "files gzip write/read",
    "watch_dir (AsyncSandbox)",  # it writes files into the watched directory
    "download_url",  # it writes the file it then downloads
    "download_url with expiration",
}
JS_284_HEALTH_ROWS = {
    "is_running() while routed",
    "sandbox without a route: is_running()",
    "is_running() after route removed",
}

TIMEOUT_NOT_FOUND = Expect("TimeoutException: The sandbox was not found", label="TimeoutException")
NOT_RUNNING = Expect(
    "SandboxNotRunningException: The sandbox was not found", label="SandboxNotRunningException"
)

# Rows of the table, in order; the driver's check names plus the test's own.
ROWS = [
    "Sandbox.create",
    "Sandbox.connect",
    "envd calls on a connect() handle",
    "commands.run output",
    "commands.run non-zero exit",
    "commands.run output arrives incrementally",
    "background command, connect(pid), kill",
    "commands stdin (send_stdin)",
    "commands close_stdin",
    "commands.run timeout (AsyncSandbox)",
    "PTY create, send_stdin, resize, output",
    "files write/read text",
    "files write/read 1 MiB binary",
    "files list, make_dir, rename, remove, exists",
    "files.read missing file → NotFound",
    "files gzip write/read",
    "watch_dir (sync, polling)",
    "AsyncSandbox.create",
    "watch_dir (AsyncSandbox)",
    "download_url",
    "download_url with expiration",
    "upload_url",
    "upload_url with expiration",
    "is_running() while routed",
    "app port behind traffic token (403 without, 200 with)",
    "WebSocket on app port",
    "wrong envd token",
    "unknown sandbox (control plane)",
    "sandbox without a route: commands.run",
    "sandbox without a route: is_running()",
    "is_running() after route removed",
    "commands.run after route removed",
    "no credential reached envd, app or API",
    "no token or signature in relay's output",
]


def expected(row: str, version: str, form: str) -> Expect:
    if version in JS_VERSIONS:
        return expected_js(row, version, form)
    if row == "Sandbox.connect" and version == OLD and form == "fixed":
        return Expect(
            "AuthenticationException: 401: Unauthorized, please check your credentials. - "
            "unauthorized access, please provide a valid access token or method signing if "
            "supported$",
            status="gap",
            label="AuthenticationException",
            note=GAP_225_CONTROL_PLANE,
        )
    if row == "unknown sandbox (control plane)":
        if version == OLD and form == "fixed":
            return Expect(
                "SandboxException: 502: The sandbox was not found$",
                status="gap",
                label="SandboxException 502",
                note=GAP_225_CONTROL_PLANE,
            )
        return Expect(
            f"SandboxNotFoundException: Paused sandbox {UNKNOWN_ID} not found$",
            label="SandboxNotFoundException",
        )
    if row == "envd calls on a connect() handle" and version == OLD and form == "fixed":
        return Expect(
            "NotFoundException: POST /process.Process/Start is not served by the fake API$",
            status="gap",
            label="NotFoundException",
            note=GAP_225_NO_HEADERS,
        )
    if row.startswith(("download_url", "upload_url")) and form == "fixed":
        method = "GET" if row.startswith("download") else "POST"
        return Expect(
            re.escape(
                f'AssertionError: HTTP 404: {{"code": 404, "message": '
                f'"{method} /files is not served by the fake API"}}'
            )
            + "$",
            status="gap",
            label="404",
            note=GAP_FIXED_SIGNED_URL,
        )
    if row == "commands close_stdin" and version == OLD:
        return Expect("n/a: ", status="n/a", note=NA_CLOSE_STDIN)
    if row == "is_running() while routed":
        return Expect("returned True$", label="True")
    if row in ("is_running() after route removed", "sandbox without a route: is_running()"):
        return Expect("returned False$", label="False")
    if row == "wrong envd token":
        return Expect(
            "AuthenticationException: unauthorized access, please provide a valid access token",
            label="AuthenticationException",
        )
    if row in ("sandbox without a route: commands.run", "commands.run after route removed"):
        return NOT_RUNNING if version == NEW else TIMEOUT_NOT_FOUND
    return OK


def expected_js(row: str, version: str, form: str) -> Expect:
    """The JS columns: the same rows, run by camelCase twins (``sendStdin``, ``isRunning``)."""
    if version == JS_OLD and form == "fixed":
        gap = {"status": "gap", "note": GAP_JS_284_NO_HEADERS}
        if row in JS_284_REST_ROWS:
            return Expect(
                "NotFoundError: POST /files is not served by the fake API$", label="404", **gap
            )
        if row in JS_284_HEALTH_ROWS:
            return Expect(
                re.escape("""SyntaxError: Unexpected token 'o', "ok" is not valid JSON""") + "$",
                label="SyntaxError",
                **gap,
            )
        if row == "files.read missing file → NotFound":
            return Expect("ok$", label="404 of the API", **gap)
    if version == JS_OLD:
        if row == "files gzip write/read":
            return Expect("ok$", label="uncompressed", note=NOTE_JS_284_GZIP)
        if row == "commands close_stdin":
            return Expect("n/a: ", status="n/a", note=NA_JS_284_CLOSE_STDIN)
        if row == "unknown sandbox (control plane)":
            return Expect(
                f"NotFoundError: Paused sandbox {UNKNOWN_ID} not found$", label="NotFoundError"
            )
        if row in ("sandbox without a route: commands.run", "commands.run after route removed"):
            return Expect(
                "NotFoundError: Sandbox is probably not running anymore$", label="NotFoundError"
            )
    if row.startswith(("download_url", "upload_url")) and form == "fixed":
        return expected(row, NEW, form)  # the same URL, the same 404 (the driver says it alike)
    if row in ("watch_dir (sync, polling)", "AsyncSandbox.create"):
        return Expect("n/a: ", status="n/a", note=NA_JS_ONE_CLASS)
    if row == "is_running() while routed":
        return Expect("returned true$", label="true")
    if row in ("is_running() after route removed", "sandbox without a route: is_running()"):
        return Expect("returned false$", label="false")
    if row == "wrong envd token":
        # connect-web reads no body from a non-200 streaming answer: the message is its own
        # "HTTP 401" whatever relay (or E2B's proxy) wrote; the class comes from the status.
        return Expect(
            re.escape("AuthenticationError: [unauthenticated] HTTP 401") + "$",
            label="AuthenticationError",
        )
    if row == "unknown sandbox (control plane)":
        return Expect(
            f"SandboxNotFoundError: Paused sandbox {UNKNOWN_ID} not found$",
            label="SandboxNotFoundError",
        )
    if row in ("sandbox without a route: commands.run", "commands.run after route removed"):
        # The SDK answers a failed RPC with GET /health: relay's 502 → "not running".
        return JS_NOT_RUNNING
    return OK
