"""Drive a sandbox with the real ``e2b`` SDK and report what happened, one JSON line per check.

Runs in a separate virtualenv that has ``e2b`` installed (not the project's), so it imports only
the standard library and ``e2b``. The caller points the SDK at fakes with the usual environment:
``E2B_API_URL`` (fake control plane), ``E2B_SANDBOX_URL`` (fake envd or a relay),
``E2B_API_KEY``, ``E2B_DOMAIN``; and names the sandbox with ``SCENARIO_SANDBOX_ID``.

Each line: ``{"check": <name>, "ok": <bool>, "detail": <str>}``. The exit status is 0 even when
checks fail: the caller decides what must pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import sys
import time
import traceback
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

from e2b import AsyncSandbox, CommandExitException, FilesystemEventType, PtySize, Sandbox

Check = Callable[[], Any]


def report(name: str, ok: bool, detail: object = "") -> None:
    print(json.dumps({"check": name, "ok": ok, "detail": str(detail)[:500]}), flush=True)


def run_check(name: str, check: Check) -> None:
    try:
        detail = check()
        report(name, True, detail)
    except Exception as exc:
        report(name, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")


async def run_async_check(name: str, check: Callable[[], Awaitable[Any]]) -> None:
    try:
        detail = await check()
        report(name, True, detail)
    except Exception as exc:
        report(name, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.read(), response.headers


# -- sync SDK -----------------------------------------------------------------------------------


def sync_checks(sbx: Sandbox) -> None:
    def run_echo() -> str:
        result = sbx.commands.run("echo hi")
        expect(result.stdout == "hi\n" and result.exit_code == 0, repr(result))
        return repr(result.stdout)

    def run_failure() -> str:
        try:
            sbx.commands.run("echo oops >&2; exit 3")
        except CommandExitException as exc:
            expect(exc.exit_code == 3 and exc.stderr == "oops\n", repr(exc))
            return f"exit_code={exc.exit_code} error={exc.error!r}"
        raise AssertionError("no CommandExitException")

    def run_env_cwd() -> str:
        sbx.files.make_dir("/home/user/work")
        result = sbx.commands.run('echo "$FOO" && pwd', envs={"FOO": "bar"}, cwd="/home/user/work")
        expect(
            result.stdout.startswith("bar\n") and result.stdout.endswith("/home/user/work\n"),
            result.stdout,
        )
        return str(result.stdout)

    def background_connect_kill() -> str:
        handle = sbx.commands.run("echo started; sleep 30", background=True)
        pids = [p.pid for p in sbx.commands.list()]
        expect(handle.pid in pids, f"{handle.pid} not in {pids}")
        attached = sbx.commands.connect(handle.pid)
        expect(attached.pid == handle.pid, "connect returned another pid")
        expect(sbx.commands.kill(handle.pid) is True, "kill returned False")
        try:
            handle.wait()
        except CommandExitException as exc:
            expect(exc.exit_code == -1, f"exit code {exc.exit_code}")
            return f"pid={handle.pid} killed: {exc.error!r} stdout={exc.stdout!r}"
        raise AssertionError("killed command exited cleanly")

    def kill_unknown() -> str:
        expect(sbx.commands.kill(999999) is False, "kill of an unknown pid returned True")
        return "False"

    def stdin_roundtrip() -> str:
        handle = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(handle.pid, "hello stdin\n")
        sbx.commands.close_stdin(handle.pid)
        result = handle.wait()
        expect(result.stdout == "hello stdin\n", repr(result.stdout))
        return repr(result.stdout)

    def pty_session() -> str:
        chunks: list[bytes] = []
        handle = sbx.pty.create(PtySize(rows=24, cols=80))
        sbx.pty.resize(handle.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(handle.pid, b"stty size; echo $((6*7)); exit\n")
        result = handle.wait(on_pty=chunks.append)
        output = b"".join(chunks).decode(errors="replace")
        expect("42" in output, output)
        expect("30 100" in output, f"resize not seen: {output!r}")
        return f"exit_code={result.exit_code} output={output[-80:]!r}"

    def files_roundtrip() -> str:
        info = sbx.files.write("/home/user/dir/a.txt", "alpha")
        expect(info.path == "/home/user/dir/a.txt", repr(info))
        expect(sbx.files.read("/home/user/dir/a.txt") == "alpha", "read back differs")
        expect(
            sbx.files.read("/home/user/dir/a.txt", format="bytes") == bytearray(b"alpha"), "bytes"
        )
        sbx.files.write("relative.txt", b"\x00\x01binary")
        expect(sbx.files.exists("/home/user/relative.txt"), "relative path not under home")
        expect(sbx.files.make_dir("/home/user/dir/sub") is True, "make_dir returned False")
        expect(sbx.files.make_dir("/home/user/dir/sub") is False, "second make_dir returned True")
        listing = sbx.files.list("/home/user/dir")
        names = sorted(e.name for e in listing)
        expect(names == ["a.txt", "sub"], repr(names))
        deep = sbx.files.list("/home/user", depth=2)
        expect(any(e.path == "/home/user/dir/a.txt" for e in deep), repr(deep))
        moved = sbx.files.rename("/home/user/dir/a.txt", "/home/user/dir/b.txt")
        expect(moved.path == "/home/user/dir/b.txt", repr(moved))
        got = sbx.files.get_info("/home/user/dir/b.txt")
        expect(got.size == 5 and got.type is not None, repr(got))
        sbx.files.remove("/home/user/dir")
        expect(not sbx.files.exists("/home/user/dir"), "remove left the directory")
        return repr(got)

    def write_many() -> str:
        infos = sbx.files.write_files(
            [
                {"path": "/home/user/m/1.txt", "data": "one"},
                {"path": "/home/user/m/2.txt", "data": "two"},
            ]
        )
        expect(
            sorted(i.path for i in infos) == ["/home/user/m/1.txt", "/home/user/m/2.txt"],
            repr(infos),
        )
        return repr(infos)

    def gzip_transfers() -> str:
        sbx.files.write("/home/user/z.txt", "z" * 10000, gzip=True)
        expect(sbx.files.read("/home/user/z.txt", gzip=True) == "z" * 10000, "gzip read differs")
        return "ok"

    def stream_read() -> str:
        sbx.files.write("/home/user/big.bin", os.urandom(300_000))
        total = sum(len(c) for c in sbx.files.read("/home/user/big.bin", format="stream"))
        expect(total == 300_000, str(total))
        return str(total)

    def missing_file() -> str:
        try:
            sbx.files.read("/home/user/nope.txt")
        except Exception as exc:  # FileNotFoundException / NotFoundException
            expect("NotFound" in type(exc).__name__, type(exc).__name__)
            return f"{type(exc).__name__}: {exc}"
        raise AssertionError("no error")

    def urls() -> str:
        sbx.files.write("/home/user/url.txt", "via url")
        url = sbx.download_url("/home/user/url.txt")
        status, body, headers = http_get(url, {"Accept-Encoding": "gzip"})
        if headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        expect(status == 200 and body == b"via url", f"{status} {body!r}")
        upload = sbx.upload_url("/home/user/uploaded.txt")
        request = urllib.request.Request(
            upload, data=b"up!", method="POST", headers={"Content-Type": "application/octet-stream"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            expect(response.status == 200, str(response.status))
        expect(sbx.files.read("/home/user/uploaded.txt") == "up!", "upload_url content")
        return str(url)

    def sync_watch() -> str:
        sbx.files.make_dir("/home/user/w")
        handle = sbx.files.watch_dir("/home/user/w")
        sbx.files.write("/home/user/w/new.txt", "x")
        events: list[Any] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not events:
            events = handle.get_new_events()
            time.sleep(0.1)
        handle.stop()
        expect(
            any(e.name == "new.txt" and e.type == FilesystemEventType.CREATE for e in events),
            repr(events),
        )
        return repr(events)

    def is_running() -> str:
        expect(sbx.is_running() is True, "is_running False")
        return "True"

    for name, check in [
        ("sync.commands.run echo", run_echo),
        ("sync.commands.run failure", run_failure),
        ("sync.commands.run envs+cwd", run_env_cwd),
        ("sync.commands background+connect+kill", background_connect_kill),
        ("sync.commands.kill unknown pid", kill_unknown),
        ("sync.commands stdin", stdin_roundtrip),
        ("sync.pty create+resize+send_stdin", pty_session),
        ("sync.files roundtrip", files_roundtrip),
        ("sync.files write_files", write_many),
        ("sync.files gzip", gzip_transfers),
        ("sync.files stream read", stream_read),
        ("sync.files missing", missing_file),
        ("sync download_url/upload_url", urls),
        ("sync.files watch_dir (polling)", sync_watch),
        ("sync is_running", is_running),
    ]:
        run_check(name, check)


# -- async SDK ----------------------------------------------------------------------------------


async def async_checks(sandbox_id: str) -> None:
    sbx = await AsyncSandbox.connect(sandbox_id)

    async def run_echo() -> str:
        result = await sbx.commands.run("echo async")
        expect(result.stdout == "async\n", repr(result))
        return repr(result.stdout)

    async def watch() -> str:
        await sbx.files.make_dir("/home/user/aw")
        events: list[Any] = []
        nested_seen = asyncio.Event()

        def on_event(event: Any) -> None:
            events.append(event)
            if {"f.txt", "d/g.txt"} <= {e.name for e in events}:
                nested_seen.set()

        handle = await sbx.files.watch_dir("/home/user/aw", on_event=on_event, recursive=True)
        await sbx.files.write("/home/user/aw/f.txt", "hello")
        await sbx.files.make_dir("/home/user/aw/d")
        await sbx.files.write("/home/user/aw/d/g.txt", "nested")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(nested_seen.wait(), 5)
        await handle.stop()
        names = {(e.name, e.type.value) for e in events}
        expect(("f.txt", "create") in names and ("d/g.txt", "create") in names, repr(names))
        return repr(sorted(names))

    async def streamed_output() -> str:
        lines: list[str] = []
        result = await sbx.commands.run(
            "for i in 1 2 3; do echo $i; sleep 0.1; done", on_stdout=lines.append
        )
        expect("".join(lines) == "1\n2\n3\n", repr(lines))
        return f"{len(lines)} callbacks, exit {result.exit_code}"

    async def command_timeout() -> str:
        started = time.monotonic()
        try:
            await sbx.commands.run("sleep 10", timeout=1)
        except Exception as exc:
            elapsed = time.monotonic() - started
            expect(elapsed < 5, f"took {elapsed:.1f}s")
            return f"{type(exc).__name__} after {elapsed:.1f}s: {exc}"
        raise AssertionError("no timeout")

    for name, check in [
        ("async.commands.run", run_echo),
        ("async.files.watch_dir recursive", watch),
        ("async.commands on_stdout", streamed_output),
        ("async.commands timeout", command_timeout),
    ]:
        await run_async_check(name, check)


def main() -> None:
    sandbox_id = os.environ["SCENARIO_SANDBOX_ID"]
    sbx = Sandbox.connect(sandbox_id)
    report("sync Sandbox.connect", True, f"envd_api_url={sbx.envd_api_url}")
    sync_checks(sbx)
    asyncio.run(async_checks(sandbox_id))


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        report("scenario", False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    sys.exit(0)
