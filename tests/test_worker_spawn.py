"""``process.workers > 1``: a worker that cannot even be spawned at start (relay/workers.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.support.harness import config_data, to_toml, write_routes
from tests.support.ports import free_port


def _own_interpreter(directory: Path) -> Path:
    """A virtualenv of its own that shares this one's packages: its ``bin/python`` can be
    removed under a running relay, whose workers are spawned from ``sys.executable``."""
    cfg = Path(sys.prefix) / "pyvenv.cfg"
    if sys.prefix == sys.base_prefix or not cfg.exists():
        pytest.skip("the tests do not run in a virtualenv")
    shutil.copy(cfg, directory / "pyvenv.cfg")
    (directory / "bin").mkdir()
    python = directory / "bin" / "python"
    python.symlink_to(os.path.realpath(sys.executable))
    purelib = Path(sysconfig.get_paths()["purelib"])
    site = directory / purelib.relative_to(sys.prefix)
    site.parent.mkdir(parents=True)
    site.symlink_to(purelib)
    return python


def test_a_worker_that_cannot_be_spawned_at_start_is_one_error_line(tmp_path: Path) -> None:
    """Found by review: when the first spawn of a worker failed (its interpreter gone, as while
    a virtualenv is being replaced; fork failing under TasksMax), the supervisor died with a
    Python traceback in the journal. It now stops as for a worker that dies before all were
    ready (docs/operations.md): one error line naming the interpreter, exit 1 (so systemd's
    Restart= tries again)."""
    venv = tmp_path / "venv"
    venv.mkdir()
    python = _own_interpreter(venv)
    write_routes(tmp_path / "routes.json", [])
    data = config_data(tmp_path, {"process": {"workers": 2}}, port=free_port())
    config = tmp_path / "relay.toml"
    config.write_text(to_toml(data))
    stderr = (tmp_path / "stderr").open("wb")
    with stderr:
        proc = subprocess.Popen(
            [str(python), "-m", "relay", "serve", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        python.unlink()  # the supervisor runs; its workers' interpreter is gone
        try:
            code = proc.wait(timeout=30)
        finally:
            proc.kill()
    output = (tmp_path / "stderr").read_text()
    assert "Traceback" not in output, output
    assert f"worker 0 could not be started ({python})" in output, output
    assert code == 1, output
