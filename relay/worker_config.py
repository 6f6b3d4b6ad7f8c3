"""What a worker its supervisor restarts starts with: what its siblings run (SPEC §6-7).

A restarted worker that read the configuration file itself would take keys that only a
restart of the whole relay applies (its siblings keep their running values: two route tables
behind one port), fail for as long as the file has been broken since the last good reload, or
load a TLS pair rewritten in place since, which the siblings' reload refused (all found by
review). So each worker saves, at start and after each SIGHUP, the configuration it runs with
(the file as last reloaded, restart-only keys as at start, a refused TLS pair or domains left
out: ``relay.reload``) and the bytes of the TLS pair it serves, as one file replaced
atomically, so that configuration, certificate and key always come from one save. Every
worker saves the same but for a TLS pair one worker's reload refused and another's took; the
last save wins, whole.

The file lives in the supervisor's run directory (0700), readable by this user only (0600),
and holds nothing the configuration and key files do not. A restarted worker loads the pair
from copies made for its own process, deleted once loaded; its configuration keeps the file's
own paths, so its next SIGHUP reads the real files, as its siblings' does.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from relay.config import Config, ConfigError
from relay.config_parse import config_sections, parse

log = logging.getLogger("relay")

SAVED = "config.json"


@dataclass(frozen=True, slots=True)
class Saved:
    config: Config
    # The TLS pair the siblings serve, written for this process to load once (Relay.start).
    tls_files: tuple[Path, Path] | None


def save(run_dir: Path, config: Config, tls_pem: tuple[bytes, bytes] | None) -> None:
    data: dict[str, object] = {"config": config_sections(config)}
    if tls_pem is not None:
        data["tls"] = [base64.b64encode(pem).decode("ascii") for pem in tls_pem]
    try:
        write_private(run_dir / SAVED, json.dumps(data).encode())
    except OSError as exc:
        # An older save must not outlive this reload (a restarted worker would run settings
        # its siblings dropped, access controls among them): without one it reads the file.
        with contextlib.suppress(OSError):
            (run_dir / SAVED).unlink()
        log.warning("cannot save the running configuration for restarted workers: %s", exc)


def load_saved(run_dir: Path, config_file: str) -> Saved | None:
    """The siblings' save, its relative paths and SIGHUP still from ``config_file``; None
    before any worker saved one (the first start reads the file)."""
    path = run_dir / SAVED
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        pem = [base64.b64decode(text, validate=True) for text in data.get("tls", ())]
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    source = Path(config_file).absolute()  # as relay.config_parse.load: links followed at each open
    config = dataclasses.replace(parse(data["config"], source.parent), source=source)
    tls_files = None
    if len(pem) == 2:
        cert, key = (run_dir / f".tls-{os.getpid()}-{part}.pem" for part in ("cert", "key"))
        write_private(cert, pem[0])
        write_private(key, pem[1])
        tls_files = (cert, key)
    return Saved(config, tls_files)


def write_private(path: Path, data: bytes) -> None:
    """Atomically, readable by this user only; a failed write leaves no temporary file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
