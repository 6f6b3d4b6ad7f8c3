"""The E2B JavaScript SDK releases of the matrix, installed once with ``npm ci`` into the cache.

``tests/support/js/package.json`` and its ``package-lock.json`` pin them exactly (one npm alias
per release, ``e2b-<version>``, plus the ``undici`` the driver uses for its own requests).
``ensure_js()`` copies both files to ``tests/.cache/sdk-js/`` (gitignored) and runs ``npm ci``
there on first use, and again whenever the lock file changes (the ``.installed`` marker holds
its hash and is written last, so an interrupted install is redone). A file lock makes concurrent
pytest sessions wait for each other instead of installing twice. Nothing is installed globally.

Like ``sdk_venv.ensure_sdk``: no ``node``/``npm`` on the PATH, or an unreachable registry, raise
``SdkUnavailable`` (callers skip, saying why); an install that fails with the registry
reachable raises ``RuntimeError`` (a real failure, never hidden as a skip).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

from tests.support.sdk_matrix import Driver
from tests.support.sdk_venv import CACHE, INSTALL_TIMEOUT_S, SdkUnavailable

SOURCE = Path(__file__).resolve().parent / "js"
SCENARIO = SOURCE / "scenario.mjs"
ROOT = CACHE / "sdk-js"
MIN_NODE = (20, 18, 1)  # the engines field of e2b 2.51.0


def ensure_js() -> tuple[Path, float]:
    """The ``node`` executable and the seconds spent installing (0.0 when cached)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        raise SdkUnavailable("the JS SDK matrix needs node and npm on the PATH")
    version = _node_version(node)
    if version < MIN_NODE:
        raise SdkUnavailable(f"node {version} is older than e2b's engines ({MIN_NODE})")
    lock_text = (SOURCE / "package-lock.json").read_bytes()
    digest = hashlib.sha256((SOURCE / "package.json").read_bytes() + lock_text).hexdigest()
    marker = ROOT / ".installed"
    if _marked(marker, digest):
        return Path(node), 0.0
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / "sdk-js.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _marked(marker, digest):  # another session installed it while we waited
            return Path(node), 0.0
        started = time.monotonic()
        marker.unlink(missing_ok=True)
        ROOT.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(SOURCE / name, ROOT / name)
        env = dict(os.environ, npm_config_update_notifier="false")
        try:
            subprocess.run(
                [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
                cwd=ROOT,
                check=True,
                timeout=INSTALL_TIMEOUT_S,
                env=env,
                capture_output=True,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            output = (getattr(exc, "stderr", None) or b"").decode(errors="replace")[-2000:]
            unreachable = registry_unreachable(npm)
            if unreachable:
                raise SdkUnavailable(
                    f"cannot install the JS SDK: npm registry unreachable ({unreachable}); "
                    f"npm said: {output.strip()[-300:]}"
                ) from exc
            raise RuntimeError(f"npm ci in {ROOT} failed:\n{output}") from exc
        marker.write_text(digest + "\n")
        return Path(node), time.monotonic() - started


def _marked(marker: Path, digest: str) -> bool:
    return marker.exists() and marker.read_text().strip() == digest


def _node_version(node: str) -> tuple[int, ...]:
    out = subprocess.run([node, "--version"], check=True, capture_output=True, text=True).stdout
    return tuple(int(part) for part in out.strip().lstrip("v").split(".")[:3])


def registry_unreachable(npm: str) -> str:
    """Why npm's registry cannot be reached, or "" when a TCP connection to it works."""
    try:
        url = subprocess.run(
            [npm, "config", "get", "registry"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        url = ""
    parts = urlsplit(url or "https://registry.npmjs.org/")
    host = parts.hostname or "registry.npmjs.org"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=5):
            return ""
    except OSError as exc:
        return f"{host}:{port}: {exc}"


def js_driver(node: Path, version: str) -> Driver:
    """The driver process for one JS SDK release (``e2b-<version>`` in package.json)."""
    env = (("SDK_JS_ROOT", str(ROOT)), ("SDK_JS_PACKAGE", f"e2b-{version}"))
    return Driver((str(node), str(SCENARIO)), "js", env)
