"""A worker its supervisor restarts runs what its siblings run, not the file as it is now
(relay.worker_config; found by review): restart-only keys keep their running value, a file
broken since the last good reload does not keep it from starting, and it serves the TLS pair
its siblings serve. The same with real supervisors and workers: tests/test_workers.py."""

from __future__ import annotations

import os
from pathlib import Path

from relay.config_parse import load
from relay.lifecycle import RUN_DIR_ENV, WORKER_ENV, effective_config
from relay.reload import plan, reload_settings
from relay.runtime import Relay
from relay.worker_config import save
from tests.support.certs import Issued, issue
from tests.support.harness import DOMAIN, config_data, to_toml, write_routes


def test_the_saved_configuration_reads_back_with_the_files_paths(tmp_path: Path) -> None:
    config_file = tmp_path / "etc" / "relay.toml"
    config_file.parent.mkdir()
    config_file.write_text(
        '[routes]\nfile = "routes.json"\nmax_stale_s = 5.0\n'
        '[upstream]\ndenied_ports = [1, 2]\n[listen]\naddress = ["127.0.0.1:1", "[::1]:1"]\n'
    )
    started = load(config_file)
    config_file.write_text('[routes]\nfile = "other.json"\nmax_stale_s = 9.0\n')
    running = plan(started, load(config_file)).config  # after a SIGHUP
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save(run_dir, running, None)
    assert (run_dir / "config.json").stat().st_mode & 0o777 == 0o600
    env = {WORKER_ENV: "1", RUN_DIR_ENV: str(run_dir)}
    config_file.write_text("not = = toml")  # broken since
    restarted = effective_config(env, str(config_file))
    assert restarted is not None
    assert restarted.config == running
    assert restarted.tls_files is None
    assert restarted.config.routes.file == "routes.json"  # restart-only: as at start
    assert restarted.config.routes.max_stale_s == 9.0  # reloadable: as last reloaded
    assert restarted.config.path("routes.json") == config_file.parent / "routes.json"
    assert restarted.config.source == config_file.absolute()  # the next SIGHUP reads the file
    assert effective_config({}, str(config_file)) is None  # a single relay reads the file
    assert effective_config({**env, RUN_DIR_ENV: str(tmp_path)}, str(config_file)) is None


def test_the_tls_pair_is_saved_with_the_configuration(tmp_path: Path) -> None:
    """In the same file, so that a certificate and a key always come from one save (found by
    review: saved as two files, two workers' saves could leave one's certificate beside the
    other's key); the restarted worker gets copies of its own, and keeps the configured
    paths for its reloads."""
    config_file = tmp_path / "relay.toml"
    config_file.write_text('[listen]\ntls_cert = "c.pem"\ntls_key = "k.pem"\n')
    (tmp_path / "c.pem").write_text("cert")
    (tmp_path / "k.pem").write_text("key")
    config = load(config_file)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save(run_dir, config, (b"served cert", b"served key"))
    restarted = effective_config({WORKER_ENV: "0", RUN_DIR_ENV: str(run_dir)}, str(config_file))
    assert restarted is not None
    assert restarted.config.listen.tls_cert == "c.pem"
    assert restarted.tls_files is not None
    cert, key = restarted.tls_files
    assert (cert.read_bytes(), key.read_bytes()) == (b"served cert", b"served key")
    assert cert.stat().st_mode & 0o777 == key.stat().st_mode & 0o777 == 0o600
    assert str(os.getpid()) in cert.name


def test_a_save_that_fails_leaves_no_older_one_behind(tmp_path: Path) -> None:
    """A restarted worker would otherwise run settings its siblings dropped at the reload
    whose save failed (access controls among them): it reads the file instead."""
    config_file = tmp_path / "relay.toml"
    config_file.write_text("[upstream]\ndenied_ports = [1]\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save(run_dir, load(config_file), None)
    env = {WORKER_ENV: "0", RUN_DIR_ENV: str(run_dir)}
    assert effective_config(env, str(config_file)) is not None
    (run_dir / f".config.json.{os.getpid()}").mkdir()  # the next write fails, as on ENOSPC
    save(run_dir, load(config_file), None)
    assert effective_config(env, str(config_file)) is None


def _renew_in_place(directory: Path, served: Issued, config_file: Path) -> None:
    renewed = issue(directory, [f"*.{DOMAIN}"])
    served.cert_file.write_bytes(renewed.cert_file.read_bytes())
    served.key_file.write_bytes(renewed.key_file.read_bytes())
    config_file.write_text("not = = toml")  # and an edit of the config file in progress


async def test_a_restarted_worker_renews_its_certificate_as_its_siblings_do(
    tmp_path: Path,
) -> None:
    """It starts from its siblings' saved pair, then a renewal rewrites the files in place
    and a SIGHUP comes while the config file does not parse: every worker keeps its running
    configuration and re-reads the pair from the configured paths (found by review: the
    restarted one re-read the run directory's copy and kept the old certificate)."""
    etc = tmp_path / "etc"
    etc.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = issue(etc, [f"*.{DOMAIN}"])
    write_routes(tmp_path / "routes.json", [])
    tls = {"tls_cert": str(first.cert_file), "tls_key": str(first.key_file)}
    config_file = etc / "relay.toml"
    config_file.write_text(to_toml(config_data(tmp_path, {"listen": tls})))
    sibling = Relay(load(config_file))
    await sibling.start()
    assert sibling.tls is not None
    save(run_dir, sibling.config, sibling.tls.pem)
    saved = effective_config({WORKER_ENV: "1", RUN_DIR_ENV: str(run_dir)}, str(config_file))
    assert saved is not None
    assert saved.tls_files is not None
    restarted = Relay(saved.config, initial_tls=saved.tls_files)
    await restarted.start()
    try:
        assert not any(path.exists() for path in saved.tls_files)  # copies for one load
        assert restarted.tls is not None
        old = sibling.tls.info.serial
        assert restarted.tls.info.serial == old
        _renew_in_place(tmp_path / "new", first, config_file)
        reload_settings(sibling)
        reload_settings(restarted)
        assert restarted.tls.info.serial == sibling.tls.info.serial != old
    finally:
        await restarted.stop()
        await sibling.stop()
