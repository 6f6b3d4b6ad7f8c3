"""The processes behind the fake envd's process.Process: spawning one with pipes or a real PTY,
reading its output, waiting for it, and the end event Go's ProcessState gives.

Sources: envd ``internal/services/process/handler/{handler,multiplex}.go``.

What matches envd:
- The command runs as ``/bin/sh -c 'exec "$@"' -- <cmd> <args…>`` (handler.go wraps it the same
  way, plus an oom/nice prefix the fake leaves out), so a missing command is exit 127 from sh, not
  a Start error. PTY mode uses a real pseudo-terminal; its output arrives as ``pty`` data.
- Output is read in 32 KiB (pipes) / 16 KiB (PTY) pieces; output produced while nobody is
  subscribed is dropped, as envd's multiplexer drops it.
- End fields from Go's ProcessState: ``exitCode`` (-1 when killed by a signal), ``exited``,
  ``status`` ("exit status 1", "signal: killed"), ``error`` when the exit was not clean.
- SIGKILL/SIGTERM stop waiting for the output pipes (handler.go SendSignal → outCancel), so the
  end event follows even if an orphaned grandchild keeps a pipe open.

Differences: each command gets its own session (so the fake can kill a whole process tree when
it closes); users are not switched (everything runs as the test's own uid); no cgroups.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import os
import pty
import signal
import struct
import termios
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.connect import JSONDict

STD_CHUNK = 32 * 1024  # handler.go stdChunkSize
PTY_CHUNK = 16 * 1024  # handler.go ptyChunkSize

WRAPPER = 'exec "$@"'
# For a PTY the wrapper, a session leader without a controlling terminal, reopens the tty as its
# stdin: that open makes it the controlling terminal, as creack/pty's Setsid+Setctty does.
_PTY_WRAPPER = 'tty=$1; shift; exec "$@" 0<>"$tty" 1>&0 2>&0'

# Go's syscall.Signal.String() on Linux, used in ProcessState.String() ("signal: killed").
_GO_SIGNAL_NAMES = {
    1: "hangup",
    2: "interrupt",
    3: "quit",
    4: "illegal instruction",
    5: "trace/breakpoint trap",
    6: "aborted",
    7: "bus error",
    8: "floating point exception",
    9: "killed",
    10: "user defined signal 1",
    11: "segmentation fault",
    12: "user defined signal 2",
    13: "broken pipe",
    14: "alarm clock",
    15: "terminated",
}


def end_event(returncode: int) -> JSONDict:
    """EndEvent as handler.go Wait() fills it from Go's ProcessState (zero values omitted)."""
    if returncode >= 0:
        status = f"exit status {returncode}"
        end: JSONDict = {"exitCode": returncode} if returncode else {}
        end |= {"exited": True, "status": status}
        if returncode:
            end["error"] = status  # exec.ExitError's text is ProcessState.String()
        return end
    number = -returncode
    status = f"signal: {_GO_SIGNAL_NAMES.get(number, f'signal {number}')}"
    return {"exitCode": -1, "status": status, "error": status}


Event = tuple[str, JSONDict]  # ("data", {...}) or ("end", {...})


@dataclass(eq=False, kw_only=True)
class ManagedProcess:
    pid: int
    config: JSONDict
    tag: str | None
    proc: asyncio.subprocess.Process
    transport: asyncio.SubprocessTransport
    pty_master: int | None
    subscribers: set[asyncio.Queue[Event]] = field(default_factory=set)
    end: JSONDict | None = None
    output_cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    readers: list[asyncio.Task[None]] = field(default_factory=list)
    timeout_handle: asyncio.TimerHandle | None = None

    def subscribe(self) -> asyncio.Queue[Event]:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        if self.end is not None:
            queue.put_nowait(("end", self.end))
        self.subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Event]) -> None:
        self.subscribers.discard(queue)

    def publish(self, event: Event) -> None:
        for queue in self.subscribers:
            queue.put_nowait(event)

    def publish_output(self, stream: str, data: bytes) -> None:
        if self.subscribers:  # multiplex.go: no subscribers, no buffering
            self.publish(("data", {stream: base64.b64encode(data).decode()}))

    def signal(self, sig: int) -> None:
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.output_cancelled.set()
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def kill_on_timeout(self) -> None:
        # exec.CommandContext: Process.Kill() once the process context expires.
        if self.proc.returncode is None:
            self.signal(signal.SIGKILL)


async def supervise(managed: ManagedProcess) -> None:
    """handler.go Wait(): output done (or cancelled by a signal) → wait → end event."""
    if managed.pty_master is not None:
        managed.readers.append(asyncio.create_task(_read_pty(managed)))
    else:
        for name, reader in (("stdout", managed.proc.stdout), ("stderr", managed.proc.stderr)):
            if reader is not None:
                managed.readers.append(asyncio.create_task(_read_pipe(managed, name, reader)))
    outputs = asyncio.gather(*managed.readers, return_exceptions=True)
    cancelled = asyncio.create_task(managed.output_cancelled.wait())
    waiters: list[asyncio.Future[Any]] = [outputs, cancelled]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        returncode = await managed.proc.wait()
    finally:
        cancelled.cancel()
        for reader_task in managed.readers:
            reader_task.cancel()
        await asyncio.gather(outputs, cancelled, return_exceptions=True)
        if managed.timeout_handle is not None:
            managed.timeout_handle.cancel()
        if managed.pty_master is not None:
            os.close(managed.pty_master)
        # Closing the transport closes the pipes even if an orphaned grandchild holds them.
        managed.transport.close()
    managed.end = end_event(returncode)
    managed.publish(("end", managed.end))


async def _read_pipe(managed: ManagedProcess, name: str, reader: asyncio.StreamReader) -> None:
    while data := await reader.read(STD_CHUNK):
        managed.publish_output(name, data)


async def _read_pty(managed: ManagedProcess) -> None:
    assert managed.pty_master is not None
    fd = managed.pty_master
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(fd, readable.set)
    try:
        while True:
            await readable.wait()
            readable.clear()
            try:
                data = os.read(fd, PTY_CHUNK)
            except BlockingIOError:
                continue
            except OSError:
                return  # EIO: every slave descriptor is closed (handler.go treats it as EOF)
            if not data:
                return
            managed.publish_output("pty", data)
    finally:
        loop.remove_reader(fd)


async def spawn_pipes(argv: list[str], cwd: Path, env: dict[str, str], stdin: bool) -> Spawned:
    return await spawn(
        argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def spawn_pty(
    argv: list[str], cwd: Path, env: dict[str, str], size: JSONDict
) -> tuple[Spawned, int]:
    master, slave = pty.openpty()
    try:
        set_window_size(master, size.get("rows", 0), size.get("cols", 0))
        tty_argv = ["/bin/sh", "-c", _PTY_WRAPPER, "--", os.ttyname(slave), *argv[4:]]
        spawned = await spawn(tty_argv, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave)
    except BaseException:
        os.close(master)
        raise
    finally:
        # Only the child keeps the slave open, so the master reads EIO once it is gone.
        os.close(slave)
    os.set_blocking(master, False)
    return spawned, master


@dataclass(frozen=True, slots=True)
class Spawned:
    transport: asyncio.SubprocessTransport
    process: asyncio.subprocess.Process


async def spawn(
    argv: list[str],
    *,
    cwd: os.PathLike[str],
    env: dict[str, str],
    stdin: int,
    stdout: int,
    stderr: int,
) -> Spawned:
    """create_subprocess_exec, keeping the transport so the fake can close it deterministically.

    Every command gets its own session (start_new_session) so close() can kill the whole tree.
    """
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.subprocess_exec(
        lambda: asyncio.subprocess.SubprocessStreamProtocol(limit=2**16, loop=loop),
        *argv,
        cwd=cwd,
        env=env,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )
    return Spawned(transport, asyncio.subprocess.Process(transport, protocol, loop))


def set_window_size(fd: int, rows: int, cols: int) -> None:
    """pty.Setsize: TIOCSWINSZ on the master (the kernel sends SIGWINCH to the foreground group)."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
