"""The unmodified E2B SDKs through a real relay, both URL forms: Python 2.25.0, 2.52.0, 2.64.0
and JavaScript 2.8.4, 2.51.0.

Each Python release lives in its own cached virtualenv (tests/.cache/, created on first use; the
whole matrix is skipped, saying why, when the package index is unreachable); the JS releases are
``npm ci``'d once into tests/.cache/sdk-js from the committed lock file
(``tests/support/sdk_node.py``; only the JS columns are skipped, saying why, without node, npm or
registry). The ten runs (5 releases, 2 URL forms) go in parallel, each with its own relay
process, fakes and driver process (``tests/support/sdk_matrix.py``, ``sdk_scenario.py``,
``js/scenario.mjs``).

``tests/support/sdk_expected.py`` says what every cell must show; any other outcome fails the
cell. The results go to ``tests/.cache/sdk-matrix.json``, from which
``tests/support/compat_table.py`` renders README.md's compatibility table;
``test_readme_table_matches_last_run`` keeps the committed table honest.
"""

from __future__ import annotations

import functools
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvloop

from tests.support import compat_table
from tests.support.harness import DOMAIN
from tests.support.records import RequestRecord
from tests.support.sdk_expected import (
    JS_OLD,
    JS_RELEASES,
    JS_VERSIONS,
    OLD,
    PY_VERSIONS,
    ROWS,
    VERSIONS,
    expected,
)
from tests.support.sdk_matrix import (
    FORMS,
    GHOST_ID,
    MAIN_ID,
    UNKNOWN_ID,
    WRONG_ID,
    Driver,
    RunResult,
    python_driver,
    run_all,
)
from tests.support.sdk_node import ensure_js, js_driver
from tests.support.sdk_venv import CACHE, SdkUnavailable, ensure_sdk

README = Path(__file__).resolve().parents[1] / "README.md"
RESULTS = CACHE / "sdk-matrix.json"

pytestmark = pytest.mark.slow


# -- checks made by the test on what reached the fakes and what relay printed ----------------------

CREDENTIAL_HEADERS = ("x-access-token", "e2b-traffic-access-token")
SIGNATURE_PARAMS = ("signature", "signature_expiration")


def credential_leaks(run: RunResult) -> list[str]:
    leaks = []
    sources: list[tuple[str, list[RequestRecord]]] = [
        ("envd", run.envd_records),
        ("app", run.app_records),
        ("api", run.api_records),
    ]
    for name, records in sources:
        for record in records:
            what = f"{name}: {record.method} {record.path}"
            for header in CREDENTIAL_HEADERS:
                if record.has_header(header):
                    leaks.append(f"{what} carried {header}")
            leaked_params = {n.lower() for n in record.query_names()} & set(SIGNATURE_PARAMS)
            if leaked_params:
                leaks.append(f"{what} carried {sorted(leaked_params)}")
            raw = record.target + "".join(v for _, v in record.headers)
            leaks.extend(f"{what} carried a token" for t in run.tokens.all() if t in raw)
    return leaks


def output_leaks(run: RunResult) -> list[str]:
    found = [f"token {t[:8]}…" for t in run.tokens.all() if t in run.relay_output]
    found += [marker for marker in ("v1_", "signature=") if marker in run.relay_output]
    return found


def observed_by_the_test(run: RunResult) -> dict[str, str]:
    leaks = credential_leaks(run)
    printed = output_leaks(run)
    return {
        "no credential reached envd, app or API": "ok" if not leaks else "; ".join(leaks[:5]),
        "no token or signature in relay's output": "ok" if not printed else ", ".join(printed),
    }


# -- the matrix ----------------------------------------------------------------------------------


@dataclass
class Matrix:
    runs: dict[tuple[str, str], RunResult]
    observed: dict[tuple[str, str], dict[str, str]]
    details: dict[tuple[str, str], dict[str, str]]
    cells: dict[str, dict[str, dict[str, str]]]
    install_seconds: dict[str, float]
    seconds: float
    failures: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    js_unavailable: str = ""  # why the JS columns did not run ("" when they did)


def _install_all() -> tuple[dict[str, Driver], dict[str, float], str]:
    """Every release's driver (the Python venvs and the JS install, in parallel)."""
    with ThreadPoolExecutor(len(PY_VERSIONS) + 1) as pool:
        futures = {v: pool.submit(ensure_sdk, v) for v in PY_VERSIONS}
        js_future = pool.submit(ensure_js)
        try:
            done = {v: f.result() for v, f in futures.items()}
        except SdkUnavailable as exc:
            pytest.skip(str(exc))
        drivers = {v: python_driver(d[0]) for v, d in done.items()}
        seconds = {v: round(d[1], 1) for v, d in done.items()}
        try:
            node, js_seconds = js_future.result()
        except SdkUnavailable as exc:
            return drivers, seconds, str(exc)
    for label, release in zip(JS_VERSIONS, JS_RELEASES, strict=True):
        drivers[label] = js_driver(node, release)
    seconds["js"] = round(js_seconds, 1)
    return drivers, seconds, ""


def _evaluate(runs: list[RunResult]) -> Matrix:
    matrix = Matrix(
        runs={},
        observed={},
        details={},
        cells={row: {} for row in ROWS},
        install_seconds={},
        seconds=0.0,
    )
    for run in runs:
        key = (run.version, run.form)
        matrix.runs[key] = run
        observed = {name: check.observed for name, check in run.checks.items()}
        observed |= observed_by_the_test(run)
        matrix.observed[key] = observed
        matrix.details[key] = {name: check.detail for name, check in run.checks.items()}
        failures = []
        for name in observed.keys() - set(ROWS):
            failures.append(f"{name}: not a row of the table (observed {observed[name]!r})")
        for row in ROWS:
            want = expected(row, *key)
            got = observed.get(row)
            cell = {"status": want.status, "label": want.label, "note": want.note}
            if got is None or not re.match(want.observed, got):
                cell = {"status": "FAIL", "label": "", "note": ""}
                detail = matrix.details[key].get(row, "")
                failures.append(f"{row}: expected /{want.observed}/, observed {got!r}\n{detail}")
            matrix.cells[row][f"{run.version}/{run.form}"] = cell
        matrix.failures[key] = failures
    return matrix


def _write_results(matrix: Matrix) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "versions": [v for v in VERSIONS if any(key[0] == v for key in matrix.runs)],
        "forms": list(FORMS),
        "rows": ROWS,
        "cells": matrix.cells,
        # Not part of the table: for people reading the file.
        "seconds": round(matrix.seconds, 1),
        "install_seconds": matrix.install_seconds,
        "run_seconds": {f"{v}/{f}": round(r.seconds, 1) for (v, f), r in matrix.runs.items()},
    }
    RESULTS.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")


@functools.cache
def run_matrix(tmp: Path) -> Matrix:
    """The whole matrix, once per session (tests/test_sdk_matrix_js.py shares it)."""
    drivers, install_seconds, js_unavailable = _install_all()
    runs, seconds = uvloop.run(run_all(drivers, tmp))
    result = _evaluate(runs)
    result.install_seconds = install_seconds
    result.seconds = seconds
    result.js_unavailable = js_unavailable
    _write_results(result)
    return result


@pytest.fixture(scope="session")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    return run_matrix(tmp_path_factory.getbasetemp() / "sdk-matrix")


def column(matrix: Matrix, version: str, form: str) -> RunResult:
    """One column's run; the JS columns skip, saying why, when node or npm's registry is absent."""
    if version in JS_VERSIONS and matrix.js_unavailable:
        pytest.skip(matrix.js_unavailable)
    return matrix.runs[(version, form)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("version", VERSIONS)
def test_sdk_matrix_column(matrix: Matrix, version: str, form: str) -> None:
    run = column(matrix, version, form)
    failures = matrix.failures[(version, form)]
    assert not failures, (
        "\n".join(failures)
        + f"\ndriver stderr:\n{run.driver_stderr[-3000:]}"
        + f"\nrelay output:\n{run.relay_output[-3000:]}"
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_host_form_went_through_the_tunnel_proxy_to_relay_tls(matrix: Matrix, version: str) -> None:
    """The Host form really used names under the test domain, over TLS, via the proxy only."""
    run = column(matrix, version, "host")
    assert run.refused == []
    assert set(run.tunnels) == {
        f"api.{DOMAIN}:443",
        f"49983-{MAIN_ID}.{DOMAIN}:443",
        f"49983-{WRONG_ID}.{DOMAIN}:443",
        f"49983-{GHOST_ID}.{DOMAIN}:443",
        f"{run.app_port}-{MAIN_ID}.{DOMAIN}:443",
    }
    # relay preserves Host; only the main sandbox's requests got past relay's checks.
    assert {r.header("Host") for r in run.envd_records} == {f"49983-{MAIN_ID}.{DOMAIN}"}
    assert {r.header("Host") for r in run.app_records} == {f"{run.app_port}-{MAIN_ID}.{DOMAIN}"}


def test_225_connect_control_plane_call_on_the_api_host_reaches_the_api(matrix: Matrix) -> None:
    """E2B PR #1272: on ``api.<domain>`` relay ignores 2.25's routing headers."""
    run = matrix.runs[(OLD, "host")]
    connects = [r for r in run.api_records if r.path.endswith("/connect")]
    assert {r.path for r in connects} == {
        f"/sandboxes/{MAIN_ID}/connect",
        f"/sandboxes/{UNKNOWN_ID}/connect",
    }
    assert all(r.has_header("E2b-Sandbox-Id") for r in connects)  # 2.25 did send them
    assert not [r for r in run.envd_records if r.path.startswith("/sandboxes/")]


def test_225_connect_control_plane_call_is_routed_by_its_headers(matrix: Matrix) -> None:
    """With a fixed URL relay takes 2.25's control-plane connect call for an envd request."""
    run = matrix.runs[(OLD, "fixed")]
    calls = [
        entry
        for entry in run.access_log()
        if entry["method"] == "POST"
        and entry["path"]
        in (
            f"/sandboxes/{MAIN_ID}/connect",
            f"/sandboxes/{UNKNOWN_ID}/connect",
        )
    ]
    by_path = {(e["path"], e["sandbox_id"], e["status"], e["reason"]) for e in calls}
    assert by_path == {
        (f"/sandboxes/{MAIN_ID}/connect", MAIN_ID, 401, "envd_token"),
        (f"/sandboxes/{UNKNOWN_ID}/connect", UNKNOWN_ID, 502, "not_found"),
    }, calls
    # Refused by relay: envd never saw them, and the control plane saw only the driver's own
    # direct call (made to get a 2.25 connect() handle at all).
    assert not [r for r in run.envd_records if r.path.startswith("/sandboxes/")]
    connects = [r.path for r in run.api_records if r.path.endswith("/connect")]
    assert connects == [f"/sandboxes/{MAIN_ID}/connect"]


# JS 2.8.4 sends more without a target: tests/test_sdk_matrix_js.py.
@pytest.mark.parametrize("version", [v for v in VERSIONS if v != JS_OLD])
def test_fixed_url_requests_without_target_reach_the_management_upstream(
    matrix: Matrix, version: str
) -> None:
    """Signed URLs (and 2.25's connect() handle) with a fixed E2B_SANDBOX_URL name no sandbox."""
    run = column(matrix, version, "fixed")
    files = [r for r in run.api_records if r.path == "/files"]
    assert sorted(r.method for r in files) == ["GET", "GET", "POST", "POST"]
    assert all(r.query_names() == {"path"} for r in files), [r.target for r in files]
    # relay's access log: no sandbox named, the management upstream's 404 passed on.
    logged = [e for e in run.access_log() if e["path"] == "/files" and e["sandbox_id"] is None]
    assert [e["status"] for e in logged] == [404] * 4, logged
    envd_rpc_at_api = [r.path for r in run.api_records if r.path.startswith("/process.")]
    assert envd_rpc_at_api == (["/process.Process/Start"] if version == OLD else [])


def test_matrix_ran_every_row(matrix: Matrix) -> None:
    for key, observed in matrix.observed.items():
        assert set(ROWS) <= set(observed), (key, set(ROWS) - set(observed))


def test_readme_table_matches_last_run(matrix: Matrix) -> None:
    if matrix.js_unavailable:
        pytest.skip(f"the table has JS columns, this run has none: {matrix.js_unavailable}")
    section = compat_table.render(json.loads(RESULTS.read_text()))
    committed = compat_table.current_section(README.read_text())
    assert committed == section, (
        "README.md's SDK compatibility table differs from the last run; regenerate it with "
        "`python tests/support/compat_table.py --write README.md`"
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_fixed_url_only_the_routed_sandbox_reached_envd(matrix: Matrix, version: str) -> None:
    """Wrong token, no route, unknown id, removed route: relay answered all of them itself."""
    run = column(matrix, version, "fixed")
    assert run.envd_records
    assert {r.header("E2b-Sandbox-Id") for r in run.envd_records} == {MAIN_ID}
    assert {r.header("E2b-Sandbox-Port") for r in run.envd_records} == {"49983"}
