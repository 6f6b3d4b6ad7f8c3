"""The SDK scenario's checks of ``commands`` and ``pty`` on one sandbox handle (sync SDK): output,
exit codes, streaming, background processes, stdin and a PTY session.

Runs in the SDK's virtualenv like the scenario: only the standard library and ``e2b``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from e2b import CommandExitException, PtySize

from tests.support.sdk_scenario_run import NotAvailable, emit, expect


def command_checks(sbx: Any) -> list[tuple[str, Callable[[], object]]]:
    def run_output() -> None:
        sbx.files.make_dir("/home/user/work")
        result = sbx.commands.run('echo "$FOO" && pwd', envs={"FOO": "bar"}, cwd="/home/user/work")
        expect(result.exit_code == 0, repr(result))
        expect(result.stdout.startswith("bar\n"), repr(result.stdout))
        expect(result.stdout.endswith("/home/user/work\n"), repr(result.stdout))

    def run_failure() -> None:
        try:
            sbx.commands.run("echo oops >&2; exit 3")
        except CommandExitException as exc:
            expect(exc.exit_code == 3 and exc.stderr == "oops\n", repr(exc))
            return
        raise AssertionError("no CommandExitException")

    def incremental() -> None:
        arrivals: list[tuple[float, str]] = []
        started = time.monotonic()
        sbx.commands.run(
            "for i in 1 2 3 4; do echo line$i; sleep 0.4; done",
            on_stdout=lambda text: arrivals.append((time.monotonic() - started, text)),
        )
        text = "".join(chunk for _, chunk in arrivals)
        expect(text == "line1\nline2\nline3\nline4\n", repr(text))
        expect(len(arrivals) >= 3, f"only {len(arrivals)} on_stdout callbacks: {arrivals!r}")
        spread = arrivals[-1][0] - arrivals[0][0]
        # Four lines 0.4 s apart: streamed, the callbacks span ~1.2 s; buffered, ~0 s.
        expect(spread >= 0.8, f"callbacks within {spread:.2f}s: {arrivals!r}")
        emit({"info": {"on_stdout arrivals": [round(t, 3) for t, _ in arrivals]}})

    def background_connect_kill() -> None:
        handle = sbx.commands.run(
            "echo started; for i in $(seq 1 300); do echo tick $i; sleep 0.1; done",
            background=True,
        )
        pids = [p.pid for p in sbx.commands.list()]
        expect(handle.pid in pids, f"{handle.pid} not in {pids}")
        attached = sbx.commands.connect(handle.pid)
        expect(attached.pid == handle.pid, "connect returned another pid")
        seen = ""
        for stdout, _, _ in attached:
            seen += stdout or ""
            if "tick" in seen:
                break
        expect("tick" in seen, f"no output through connect(pid): {seen!r}")
        expect(sbx.commands.kill(handle.pid) is True, "kill returned False")
        try:
            handle.wait()
        except CommandExitException as exc:
            expect(exc.exit_code == -1, f"exit code {exc.exit_code}")
            return
        raise AssertionError("killed command exited cleanly")

    def stdin() -> None:
        handle = sbx.commands.run('read line; echo "got:$line"', background=True, stdin=True)
        sbx.commands.send_stdin(handle.pid, "hello stdin\n")
        result = handle.wait()
        expect(result.stdout == "got:hello stdin\n", repr(result.stdout))

    def close_stdin() -> object:
        if not hasattr(sbx.commands, "close_stdin"):
            raise NotAvailable("no commands.close_stdin in this release")
        handle = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(handle.pid, "to cat\n")
        sbx.commands.close_stdin(handle.pid)
        result = handle.wait()
        expect(result.stdout == "to cat\n", repr(result.stdout))
        return None

    def pty_session() -> None:
        chunks: list[bytes] = []
        handle = sbx.pty.create(PtySize(rows=24, cols=80))
        sbx.pty.resize(handle.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(handle.pid, b"stty size; echo $((6*7)); exit\n")
        result = handle.wait(on_pty=chunks.append)
        output = b"".join(chunks).decode(errors="replace")
        expect("42" in output, repr(output))
        expect("30 100" in output, f"resize not seen: {output!r}")
        expect(result.exit_code == 0, repr(result))

    return [
        ("commands.run output", run_output),
        ("commands.run non-zero exit", run_failure),
        ("commands.run output arrives incrementally", incremental),
        ("background command, connect(pid), kill", background_connect_kill),
        ("commands stdin (send_stdin)", stdin),
        ("commands close_stdin", close_stdin),
        ("PTY create, send_stdin, resize, output", pty_session),
    ]
