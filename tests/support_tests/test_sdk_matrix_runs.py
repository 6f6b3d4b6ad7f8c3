"""``sdk_matrix.run_all``: a run that fails does not leave the others running.

The matrix fixture runs ``run_all`` under ``uvloop.run``. When one run raised (seen: a relay
that took over 10 s to become ready, ten of them starting at once on two loaded cores), the
others were still mid-run; the runner then cancelled them, and one cancelled before its
fakes were in its ``try`` left their servers open. Under ``-W error`` the ResourceWarning of
such a server, raised where uvloop closes its handle, kept ``loop.close()`` waiting forever:
pytest hung inside the fixture (found running the matrix on a busy machine). Each run must
finish its own cleanup before ``run_all`` reports the failure.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import RelayProcess
from tests.support.sdk_matrix import READY_TIMEOUT_S, Driver, run_all

# Exits after the failing run has raised (its relay start takes about a second).
SLOW = Driver((sys.executable, "-c", "import time; time.sleep(3)"))
MISSING = Driver(("/nonexistent/sdk-driver",))
QUICK = Driver((sys.executable, "-c", "pass"))


async def test_a_failing_run_waits_for_the_others_to_clean_up(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await run_all({"missing": MISSING, "slow": SLOW}, tmp_path, forms=("fixed",))
    # The slow run ended on its own, its relay stopped, before the failure was reported.
    assert "relay stopped" in (tmp_path / "slow-fixed" / "relay.stderr").read_text()


async def test_a_relay_gets_a_minute_to_become_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten relays start at once in the matrix; on two loaded cores one took 16-20 s to become
    ready and the run failed on the former 10 s budget (found running ``make test``)."""
    budgets: list[float] = []
    original = RelayProcess.start

    def start(self: RelayProcess, timeout: float = 10.0, **kwargs: Any) -> None:
        budgets.append(timeout)
        original(self, timeout, **kwargs)

    monkeypatch.setattr(RelayProcess, "start", start)
    await run_all({"quick": QUICK}, tmp_path, forms=("fixed",))
    assert budgets == [READY_TIMEOUT_S]
    assert READY_TIMEOUT_S >= 60


def test_a_relay_that_exits_fails_at_once_despite_the_long_budget(tmp_path: Path) -> None:
    relay = RelayProcess(tmp_path, [], {"listen": {"no_such_setting": 1}})
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="relay exited"):
        relay.start(READY_TIMEOUT_S)
    assert time.monotonic() - started < READY_TIMEOUT_S / 4
