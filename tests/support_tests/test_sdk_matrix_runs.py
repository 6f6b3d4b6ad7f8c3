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
from pathlib import Path

import pytest

from tests.support.sdk_matrix import Driver, run_all

# Exits after the failing run has raised (its relay start takes about a second).
SLOW = Driver((sys.executable, "-c", "import time; time.sleep(3)"))
MISSING = Driver(("/nonexistent/sdk-driver",))


async def test_a_failing_run_waits_for_the_others_to_clean_up(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await run_all({"missing": MISSING, "slow": SLOW}, tmp_path, forms=("fixed",))
    # The slow run ended on its own, its relay stopped, before the failure was reported.
    assert "relay stopped" in (tmp_path / "slow-fixed" / "relay.stderr").read_text()
