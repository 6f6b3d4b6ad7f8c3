"""Cached virtualenvs holding one exact ``e2b`` SDK release each, for driver subprocesses.

``ensure_sdk(version)`` creates ``tests/.cache/sdk-e2b-<version>/`` (gitignored) on first use:
``python -m venv`` then ``pip install e2b==<version>``; later calls return at once (the
``.installed`` marker is written last, so an interrupted install is redone). A file lock makes
concurrent pytest sessions wait for each other instead of installing twice.

When the install fails, the package index is probed: unreachable → ``SdkUnavailable`` (callers
turn it into a skip that names the reason); reachable → ``RuntimeError`` (a real failure,
never hidden as a skip).
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

CACHE = Path(__file__).resolve().parents[1] / ".cache"
INSTALL_TIMEOUT_S = 600


class SdkUnavailable(Exception):
    """The SDK cannot be installed because the package index is unreachable."""


def venv_dir(version: str) -> Path:
    return CACHE / f"sdk-e2b-{version}"


def ensure_sdk(version: str) -> tuple[Path, float]:
    """The venv's python and the seconds spent installing (0.0 when it was cached)."""
    root = venv_dir(version)
    python = root / "bin" / "python"
    marker = root / ".installed"
    if marker.exists():
        return python, 0.0
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f"sdk-e2b-{version}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():  # another session installed it while we waited
            return python, 0.0
        started = time.monotonic()
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        try:
            subprocess.run(
                [sys.executable, "-m", "venv", "--clear", str(root)],
                check=True,
                capture_output=True,
            )
            subprocess.run(
                [str(python), "-m", "pip", "install", "--quiet", f"e2b=={version}"],
                check=True,
                timeout=INSTALL_TIMEOUT_S,
                env=env,
                capture_output=True,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            output = (getattr(exc, "stderr", None) or b"").decode(errors="replace")[-2000:]
            unreachable = index_unreachable()
            if unreachable:
                raise SdkUnavailable(
                    f"cannot install e2b=={version}: package index unreachable "
                    f"({unreachable}); pip said: {output.strip()[-300:]}"
                ) from exc
            raise RuntimeError(f"pip install e2b=={version} failed:\n{output}") from exc
        marker.write_text(f"e2b=={version}\n")
        return python, time.monotonic() - started


def index_unreachable() -> str:
    """Why the package index cannot be reached, or "" when a TCP connection to it works."""
    url = os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
    parts = urlsplit(url)
    host = parts.hostname or "pypi.org"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=5):
            return ""
    except OSError as exc:
        return f"{host}:{port}: {exc}"
