"""Drive a sandbox with the real ``e2b`` SDK and report what happened, one JSON line per check.

Runs in a separate virtualenv holding one exact ``e2b`` release (2.25.0, 2.52.0 or 2.64.0), so it
imports only the standard library and ``e2b``, and copes with the differences between those
releases (2.25 speaks httpx, 2.52+ pyqwest; 2.25 has no ``close_stdin``...).

The caller points the SDK at fakes or at relay with the usual environment (``E2B_API_URL``,
``E2B_SANDBOX_URL`` for the fixed-URL form, ``E2B_DOMAIN``, ``E2B_API_KEY``; ``HTTPS_PROXY`` and
``SSL_CERT_FILE`` for the Host form over TLS) and describes the run in ``SCENARIO_CONFIG``
(JSON)::

    form            "direct" (no relay), "fixed" (E2B_SANDBOX_URL) or "host" (https://<port>-<id>.<domain>)
    sandbox_id      the sandbox that ``Sandbox.create(template="base")`` hands out
    api_direct_url  the control plane reached without relay (for 2.25's connect() handle)
    relay           true: also run the checks that need relay (app port, errors, route removal)
    app_port        an app port behind the sandbox's traffic token (FakeApp: /, /ws)
    wrong_token_template, ghost_template, unknown_sandbox_id: see the relay checks below

Output lines:

- ``{"check": <name>, "observed": <str>, "detail": <str>, "seconds": <float>}``: ``observed`` is
  ``"ok"`` when the check returned nothing, ``"returned <repr>"`` when it returned a value, or
  ``"<ExceptionClass>: <message>"`` when it raised. The caller compares ``observed`` with what it
  expects for this SDK version and URL form; the exit status is 0 whatever happened.
- ``{"info": {...}}``: facts for debugging (SDK version, URLs the SDK built).
- ``{"event": "remove-route"}``: the driver then waits for one line on stdin, sent once the
  caller has removed the main sandbox's route from relay.

The checks live in ``sdk_scenario_commands``, ``sdk_scenario_files`` and ``sdk_scenario_relay``
(``sdk_scenario_run``: configuration and reporting; ``sdk_scenario_http``: plain HTTP clients).
This file is run by path as a script, so it puts the repository root on ``sys.path`` for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run by path in the SDK's virtualenv: the repository root makes the sibling modules importable
# as tests.support.* there too (tests/__init__.py and tests/support/__init__.py hold no code).
# Appended, not prepended, so that the SDK and its dependencies resolve exactly as before.
sys.path.append(str(Path(__file__).resolve().parents[2]))

from e2b import AsyncSandbox, Sandbox

from tests.support.sdk_scenario_commands import command_checks
from tests.support.sdk_scenario_files import file_checks
from tests.support.sdk_scenario_relay import after_removal_checks, relay_checks
from tests.support.sdk_scenario_run import (
    CONFIG,
    FORM,
    HTTPX_TRANSPORT,
    MAIN_ID,
    OPTS,
    SDK_VERSION,
    describe,
    emit,
    expect,
    run_async_check,
    run_check,
)

# -- handles ------------------------------------------------------------------------------------


def connect_handle() -> Any:
    """What ``Sandbox.connect(MAIN_ID)`` gives a user of this release.

    2.25's connect() puts E2b-Sandbox-Id/Port on the control-plane call (E2B PR #1272). relay
    ignores routing headers on ``api.<domain>``, so in the Host form the real connect() works
    through relay. With a fixed URL the API shares relay's address with envd and the headers
    route the call to envd (the "Sandbox.connect" check shows it); to still see what the envd
    calls of a 2.25 connect() handle do there (no routing headers; notes §1.2), the control
    plane is reached directly with the real ``Sandbox.connect(api_url=...)``.
    """
    if not HTTPX_TRANSPORT or not CONFIG.get("relay") or FORM == "host":
        return Sandbox.connect(MAIN_ID, **OPTS)
    return Sandbox.connect(MAIN_ID, api_url=CONFIG["api_direct_url"], **OPTS)


# -- checks on one sandbox handle (sync SDK) -----------------------------------------------------


def sandbox_checks(sbx: Any) -> list[tuple[str, Callable[[], object]]]:
    return [
        *command_checks(sbx),
        *file_checks(sbx),
        ("is_running() while routed", sbx.is_running),
    ]


# -- async SDK ----------------------------------------------------------------------------------


async def async_checks() -> None:
    holder: list[Any] = []

    async def create() -> None:
        holder.append(await AsyncSandbox.create(template="base", **OPTS))

    await run_async_check("AsyncSandbox.create", create)
    if not holder:
        return
    sbx = holder[0]

    async def watch() -> None:
        await sbx.files.make_dir("/home/user/aw")
        events: list[Any] = []
        seen = asyncio.Event()

        def on_event(event: Any) -> None:
            events.append(event)
            if {"f.txt", "d/g.txt"} <= {e.name for e in events}:
                seen.set()

        handle = await sbx.files.watch_dir("/home/user/aw", on_event=on_event, recursive=True)
        await sbx.files.write("/home/user/aw/f.txt", "hello")
        await sbx.files.make_dir("/home/user/aw/d")
        await sbx.files.write("/home/user/aw/d/g.txt", "nested")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(seen.wait(), 5)
        await handle.stop()
        names = {(e.name, e.type.value) for e in events}
        expect(("f.txt", "create") in names and ("d/g.txt", "create") in names, repr(names))

    async def command_timeout() -> None:
        started = time.monotonic()
        try:
            await sbx.commands.run("sleep 10", timeout=1)
        except Exception as exc:
            elapsed = time.monotonic() - started
            expect(elapsed < 5, f"took {elapsed:.1f}s: {describe(exc)}")
            expect("Timeout" in type(exc).__name__, describe(exc))
            return
        raise AssertionError("no timeout")

    await run_async_check("watch_dir (AsyncSandbox)", watch)
    await run_async_check("commands.run timeout (AsyncSandbox)", command_timeout)


# -- main ---------------------------------------------------------------------------------------


def run_checks(checks: list[tuple[str, Callable[[], object]]]) -> None:
    for name, check in checks:
        run_check(name, check)


def main() -> None:
    emit({"info": {"sdk": SDK_VERSION, "form": FORM, "httpx": HTTPX_TRANSPORT, "opts": OPTS}})
    handles: dict[str, Any] = {}

    def create() -> None:
        handles["main"] = Sandbox.create(template="base", **OPTS)
        expect(handles["main"].sandbox_id == MAIN_ID, handles["main"].sandbox_id)
        emit({"info": {"envd_api_url": handles["main"].envd_api_url}})

    def connect() -> None:
        Sandbox.connect(MAIN_ID, **OPTS)

    def connect_handle_runs() -> None:
        result = connect_handle().commands.run("echo connected")
        expect(result.stdout == "connected\n", repr(result.stdout))

    run_check("Sandbox.create", create)
    run_check("Sandbox.connect", connect)
    run_check("envd calls on a connect() handle", connect_handle_runs)
    sbx = handles.get("main")
    if sbx is None:
        return
    run_checks(sandbox_checks(sbx))
    asyncio.run(async_checks())
    if not CONFIG.get("relay"):
        return
    run_checks(relay_checks(sbx))
    emit({"event": "remove-route", "sandbox_id": MAIN_ID})
    expect(sys.stdin.readline().strip() == "removed", "the caller did not remove the route")
    run_checks(after_removal_checks(sbx))


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        emit({"check": "scenario", "observed": describe(exc), "detail": traceback.format_exc()})
    sys.exit(0)
