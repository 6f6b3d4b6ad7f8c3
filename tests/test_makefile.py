"""README's first promise: ``make run`` and ``make test`` do all their set-up on a fresh
machine. Debian and Ubuntu ship ``python3`` without ``ensurepip`` (it is in the separate
``python3.X-venv`` package), and ``python3 -m venv`` fails without it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"


@pytest.mark.parametrize("ensurepip", [True, False], ids=["has-ensurepip", "debian-python"])
def test_the_venv_step_installs_the_venv_module_when_python_lacks_it(
    tmp_path: Path, ensurepip: bool
) -> None:
    """Found by review, reading the Makefile as a new operator on Debian/Ubuntu: ``make run``
    stopped at ``python3 -m venv`` ("ensurepip is not available") although README says it
    needs only python3. A stand-in python3 without ensurepip until a stand-in apt-get has run,
    whose ``-m venv`` stops the build before anything reaches PyPI."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, repo / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    installed = tmp_path / "installed"
    if ensurepip:
        installed.touch()
    scripts = {
        "python3": f"""#!/bin/sh
if [ "$1" = "-c" ] && [ "$2" = "import ensurepip" ] && [ ! -e {installed} ]; then exit 1; fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then echo "venv $3" >> {log}; exit 3; fi
exec {sys.executable} "$@"
""",
        "apt-get": f'#!/bin/sh\necho "apt-get $*" >> {log}\ntouch {installed}\n',
        "sudo": '#!/bin/sh\nexec "$@"\n',  # when the test does not run as root
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    result = subprocess.run(
        [make, "-C", str(repo), ".venv/.installed", "PYTHON=python3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode != 0  # the stand-in venv step stops it
    calls = log.read_text().splitlines()
    expected = [] if ensurepip else [f"apt-get install -y -q python{VERSION}-venv"]
    assert calls == [*expected, "venv .venv"], result.stdout + result.stderr
