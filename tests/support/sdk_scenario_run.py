"""What every check of the SDK scenario (``sdk_scenario.py``) shares: the run's configuration
and how a check is run and reported (one JSON line each).

Runs in the SDK's virtualenv like the scenario: only the standard library (it reads the
installed ``e2b`` release's version and transport).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

SDK_VERSION = importlib.metadata.version("e2b")
CONFIG: dict[str, Any] = json.loads(os.environ.get("SCENARIO_CONFIG") or "{}")
FORM: str = CONFIG.get("form", "direct")
MAIN_ID: str = CONFIG.get("sandbox_id", "")
PROXY = os.environ.get("HTTPS_PROXY")
# 2.52+ send everything through pyqwest (reqwest), which reads HTTPS_PROXY itself. 2.25 builds
# its httpx clients on an explicit transport object, and httpx ignores the proxy environment
# variables then: the SDK's own ``proxy`` option is the way in.
HTTPX_TRANSPORT = importlib.util.find_spec("pyqwest") is None
OPTS: dict[str, Any] = {"proxy": PROXY} if PROXY and HTTPX_TRANSPORT else {}


class NotAvailable(Exception):
    """This SDK release has no API for the feature; reported as ``n/a: <reason>``."""


def emit(payload: dict[str, Any]) -> None:
    print(json.dumps(payload), flush=True)


def describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:400]


def observed_value(value: object) -> str:
    return "ok" if value is None else f"returned {value!r}"[:400]


def report(name: str, started: float, observed: str, detail: str = "") -> None:
    emit(
        {
            "check": name,
            "observed": observed,
            "detail": detail[:1500],
            "seconds": round(time.monotonic() - started, 3),
        }
    )


def run_check(name: str, check: Callable[[], object]) -> None:
    started = time.monotonic()
    try:
        value = check()
    except NotAvailable as exc:
        report(name, started, f"n/a: {exc}")
    except Exception as exc:
        report(name, started, describe(exc), traceback.format_exc(limit=4))
    else:
        report(name, started, observed_value(value))


async def run_async_check(name: str, check: Callable[[], Awaitable[object]]) -> None:
    started = time.monotonic()
    try:
        value = await check()
    except Exception as exc:
        report(name, started, describe(exc), traceback.format_exc(limit=4))
    else:
        report(name, started, observed_value(value))


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
