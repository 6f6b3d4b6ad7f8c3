"""process.Process for the fake envd: real subprocesses behind envd's event stream.

Sources: envd ``internal/services/process/{start,connect,list,input,signal,update,service}.go``,
``handler/handler.go`` and ``spec/process/process.proto``.

What matches envd:
- The command runs as ``/bin/sh -c 'exec "$@"' -- <cmd> <args…>`` (handler.go wraps it the same
  way, plus an oom/nice prefix the fake leaves out), so a missing command is exit 127 from sh, not
  a Start error. ``cwd`` and ``envs`` as envd resolves them (PATH, HOME, USER, LOGNAME first).
- Stdin is a pipe unless the Start request says ``"stdin": false`` (absent means true, for old
  SDKs; handler.go). PTY mode uses a real pseudo-terminal; its output arrives as ``pty`` data.
- Events: start{pid} → data{stdout|stderr|pty} (32 KiB / 16 KiB reads) → end{…}; a keepalive when
  the ticker fires, the ticker reset by each data event. Output produced while nobody is
  subscribed is dropped, as envd's multiplexer drops it.
- End fields from Go's ProcessState: ``exitCode`` (-1 when killed by a signal), ``exited``,
  ``status`` ("exit status 1", "signal: killed"), ``error`` when the exit was not clean.
- SIGKILL/SIGTERM stop waiting for the output pipes (handler.go SendSignal → outCancel), so the
  end event follows even if an orphaned grandchild keeps a pipe open.
- ``Connect-Timeout-Ms`` on Start bounds the process itself (start.go determineTimeoutFromHeader):
  it is SIGKILLed when the deadline passes, whether or not a client is still attached.
- A pid that exited less than 30 s ago still answers Connect with start + end (service.go
  terminatedRetentionTTL).

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
from typing import Any

from tests.support.connect import ConnectError, JSONDict
from tests.support.envd_rpc import Call, KeepaliveTicker, Send, StreamMethod, UnaryMethod
from tests.support.sandbox_fs import SandboxFS, SandboxUser, go_errno_text

STD_CHUNK = 32 * 1024  # handler.go stdChunkSize
PTY_CHUNK = 16 * 1024  # handler.go ptyChunkSize
RETENTION_S = 30.0  # service.go terminatedRetentionTTL

_WRAPPER = 'exec "$@"'
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

_SIGNALS = {"SIGNAL_SIGKILL": signal.SIGKILL, "SIGNAL_SIGTERM": signal.SIGTERM}
_SIGNAL_NUMBERS = {9: "SIGNAL_SIGKILL", 15: "SIGNAL_SIGTERM"}

KEEPALIVE_EVENT: JSONDict = {"event": {"keepalive": {}}}


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


def normalize_config(config: JSONDict) -> JSONDict:
    """ProcessConfig as envd echoes it in List (proto3 JSON: empty repeated/map omitted)."""
    out: JSONDict = {}
    if config.get("cmd"):
        out["cmd"] = config["cmd"]
    if config.get("args"):
        out["args"] = list(config["args"])
    if config.get("envs"):
        out["envs"] = dict(config["envs"])
    if config.get("cwd") is not None:
        out["cwd"] = config["cwd"]  # `optional string`: present even when empty
    return out


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


class ProcessService:
    def __init__(self, fs: SandboxFS, env_vars: dict[str, str]) -> None:
        self._fs = fs
        self._env_vars = env_vars
        self._processes: dict[int, ManagedProcess] = {}
        self._terminated: dict[int, tuple[str | None, JSONDict]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self.workdir: str | None = None

    def unary_methods(self) -> dict[str, UnaryMethod]:
        return {
            "/process.Process/List": self.list_processes,
            "/process.Process/SendInput": self.send_input,
            "/process.Process/SendSignal": self.send_signal,
            "/process.Process/CloseStdin": self.close_stdin,
            "/process.Process/Update": self.update,
        }

    def stream_methods(self) -> dict[str, StreamMethod]:
        return {
            "/process.Process/Start": self.start,
            "/process.Process/Connect": self.connect,
        }

    @property
    def running(self) -> dict[int, ManagedProcess]:
        return dict(self._processes)

    # -- streams --------------------------------------------------------------------------------

    async def start(self, call: Call, request: JSONDict, send: Send) -> None:
        managed = await self._spawn(call, request)
        # start.go forks the data and end channels before the process starts: nothing is lost.
        queue = managed.subscribe()
        try:
            await send({"event": {"start": {"pid": managed.pid}}})
            await self._pump(call, queue, send)
        finally:
            managed.unsubscribe(queue)

    async def connect(self, call: Call, request: JSONDict, send: Send) -> None:
        selector = request.get("process") or {}
        try:
            managed = self._lookup(selector)
        except ConnectError:
            retained = self._lookup_terminated(selector)
            if retained is None:
                raise
            pid, end = retained
            await send({"event": {"start": {"pid": pid}}})
            await send({"event": {"end": end}})
            return
        queue = managed.subscribe()
        try:
            await send({"event": {"start": {"pid": managed.pid}}})
            await self._pump(call, queue, send)
        finally:
            managed.unsubscribe(queue)

    async def _pump(self, call: Call, queue: asyncio.Queue[Event], send: Send) -> None:
        ticker = KeepaliveTicker(call.keepalive_s)
        while True:
            try:
                async with asyncio.timeout(ticker.remaining()):
                    kind, payload = await queue.get()
            except TimeoutError:
                await send(KEEPALIVE_EVENT)
                ticker.fired()
                continue
            await send({"event": {kind: payload}})
            if kind == "end":
                return
            ticker.reset()

    # -- unary ----------------------------------------------------------------------------------

    async def list_processes(self, call: Call, request: JSONDict) -> JSONDict:
        processes = []
        for managed in self._processes.values():
            info: JSONDict = {"config": managed.config, "pid": managed.pid}
            if managed.tag is not None:
                info["tag"] = managed.tag
            processes.append(info)
        return {"processes": processes} if processes else {}

    async def send_input(self, call: Call, request: JSONDict) -> JSONDict:
        managed = self._lookup(request.get("process") or {})
        data = request.get("input") or {}
        if "pty" in data:
            self._write_pty(managed, base64.b64decode(data["pty"]))
        elif "stdin" in data:
            await self._write_stdin(managed, base64.b64decode(data["stdin"]))
        else:
            raise ConnectError("unimplemented", "invalid input type <nil>")
        return {}

    async def send_signal(self, call: Call, request: JSONDict) -> JSONDict:
        managed = self._lookup(request.get("process") or {})
        name = request.get("signal", "SIGNAL_UNSPECIFIED")
        name = _SIGNAL_NUMBERS.get(name, name) if isinstance(name, int) else name
        if name not in _SIGNALS:
            raise ConnectError("unimplemented", f"invalid signal: {name}")
        managed.signal(_SIGNALS[name])
        return {}

    async def close_stdin(self, call: Call, request: JSONDict) -> JSONDict:
        managed = self._lookup(request.get("process") or {})
        if managed.pty_master is not None:
            raise ConnectError(
                "unknown",
                "error closing stdin: cannot close stdin for PTY process — "
                "send Ctrl+D (0x04) instead",
            )
        if managed.proc.stdin is not None and not managed.proc.stdin.is_closing():
            managed.proc.stdin.close()
        return {}

    async def update(self, call: Call, request: JSONDict) -> JSONDict:
        managed = self._lookup(request.get("process") or {})
        if request.get("pty") is not None:
            size = request["pty"].get("size") or {}
            if managed.pty_master is None:
                raise ConnectError("internal", "error resizing tty: tty not assigned to process")
            set_window_size(managed.pty_master, size.get("rows", 0), size.get("cols", 0))
        return {}

    # -- lifecycle ------------------------------------------------------------------------------

    async def close(self) -> None:
        """Kill every process tree (each runs in its own session) and wait for them."""
        for managed in list(self._processes.values()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(managed.pid, signal.SIGKILL)
            managed.output_cancelled.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    async def _spawn(self, call: Call, request: JSONDict) -> ManagedProcess:
        config = request.get("process") or {}
        cmd, args = config.get("cmd", ""), list(config.get("args", []))
        cwd = self._fs.resolve(config.get("cwd") or "", call.user, self.workdir)
        if not self._fs.host(cwd).exists():
            raise ConnectError("invalid_argument", f"cwd '{cwd}' does not exist")
        env = self._environment(call.user, config.get("envs") or {})
        argv = ["/bin/sh", "-c", _WRAPPER, "--", cmd, *args]
        try:
            if request.get("pty") is not None:  # JSON null is an unset field
                size = request["pty"].get("size") or {}
                spawned, master = await self._spawn_pty(argv, cwd, env, size)
            else:
                stdin = request.get("stdin") in (None, True)
                spawned, master = await self._spawn_pipes(argv, cwd, env, stdin), None
        except OSError as exc:
            user_command = " ".join([cmd, *args])
            raise ConnectError(
                "invalid_argument",
                f"error starting process '{user_command}': {go_errno_text(exc)}",
            ) from exc
        managed = ManagedProcess(
            pid=spawned.process.pid,
            config=normalize_config(config),
            tag=request.get("tag"),
            proc=spawned.process,
            transport=spawned.transport,
            pty_master=master,
        )
        self._terminated.pop(managed.pid, None)
        self._processes[managed.pid] = managed
        if call.timeout_s:
            loop = asyncio.get_running_loop()
            managed.timeout_handle = loop.call_later(call.timeout_s, managed.kill_on_timeout)
        self._track(asyncio.create_task(self._run(managed)))
        return managed

    def _environment(self, user: SandboxUser, envs: dict[str, str]) -> dict[str, str]:
        # handler.go: only PATH from envd's own environment, then HOME/USER/LOGNAME, then the
        # /init env vars, then the request's (last one wins).
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self._fs.host(user.home)),
            "USER": user.name,
            "LOGNAME": user.name,
        }
        return env | self._env_vars | envs

    async def _spawn_pipes(
        self, argv: list[str], cwd: str, env: dict[str, str], stdin: bool
    ) -> Spawned:
        return await spawn(
            argv,
            cwd=self._fs.host(cwd),
            env=env,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    async def _spawn_pty(
        self, argv: list[str], cwd: str, env: dict[str, str], size: JSONDict
    ) -> tuple[Spawned, int]:
        master, slave = pty.openpty()
        try:
            set_window_size(master, size.get("rows", 0), size.get("cols", 0))
            tty_argv = ["/bin/sh", "-c", _PTY_WRAPPER, "--", os.ttyname(slave), *argv[4:]]
            spawned = await spawn(
                tty_argv, cwd=self._fs.host(cwd), env=env, stdin=slave, stdout=slave, stderr=slave
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            # Only the child keeps the slave open, so the master reads EIO once it is gone.
            os.close(slave)
        os.set_blocking(master, False)
        return spawned, master

    async def _run(self, managed: ManagedProcess) -> None:
        """handler.go Wait(): output done (or cancelled by a signal) → wait → end event."""
        if managed.pty_master is not None:
            managed.readers.append(asyncio.create_task(self._read_pty(managed)))
        else:
            for name, reader in (("stdout", managed.proc.stdout), ("stderr", managed.proc.stderr)):
                if reader is not None:
                    managed.readers.append(
                        asyncio.create_task(self._read_pipe(managed, name, reader))
                    )
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
        self._retire(managed)

    def _retire(self, managed: ManagedProcess) -> None:
        if self._processes.get(managed.pid) is managed:
            del self._processes[managed.pid]
        assert managed.end is not None
        self._terminated[managed.pid] = (managed.tag, managed.end)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(RETENTION_S, self._forget, managed.pid, managed.end)
        self._timers.add(timer)

    def _forget(self, pid: int, end: JSONDict) -> None:
        retained = self._terminated.get(pid)
        if retained is not None and retained[1] is end:
            del self._terminated[pid]

    async def _read_pipe(
        self, managed: ManagedProcess, name: str, reader: asyncio.StreamReader
    ) -> None:
        while data := await reader.read(STD_CHUNK):
            managed.publish_output(name, data)

    async def _read_pty(self, managed: ManagedProcess) -> None:
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

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- helpers --------------------------------------------------------------------------------

    def _lookup(self, selector: JSONDict) -> ManagedProcess:
        """service.go getProcess."""
        if "pid" in selector:
            pid = int(selector["pid"])
            managed = self._processes.get(pid)
            if managed is None:
                raise ConnectError("not_found", f"process with pid {pid} not found")
            return managed
        if "tag" in selector:
            tag = selector["tag"]
            for managed in self._processes.values():
                if managed.tag == tag:
                    return managed
            raise ConnectError("not_found", f"process with tag {tag} not found")
        raise ConnectError("unimplemented", "invalid input type *process.ProcessSelector")

    def _lookup_terminated(self, selector: JSONDict) -> tuple[int, JSONDict] | None:
        if "pid" in selector:
            retained = self._terminated.get(int(selector["pid"]))
            return (int(selector["pid"]), retained[1]) if retained else None
        if "tag" in selector:
            for pid, (tag, end) in self._terminated.items():
                if tag == selector["tag"]:
                    return pid, end
        return None

    def _write_pty(self, managed: ManagedProcess, data: bytes) -> None:
        if managed.pty_master is None:
            raise ConnectError(
                "internal",
                "error writing to tty: tty not assigned to process — "
                "input should be written to the stdin, not the tty",
            )
        try:
            os.write(managed.pty_master, data)
        except OSError as exc:
            raise ConnectError(
                "internal",
                f"error writing to tty: error writing to tty of process '{managed.pid}': "
                f"{go_errno_text(exc)}",
            ) from exc

    async def _write_stdin(self, managed: ManagedProcess, data: bytes) -> None:
        if managed.pty_master is not None:
            raise ConnectError(
                "internal",
                "error writing to stdin: tty assigned to process — "
                "input should be written to the pty, not the stdin",
            )
        stdin = managed.proc.stdin
        if stdin is None or stdin.is_closing():
            raise ConnectError("internal", "error writing to stdin: stdin not enabled or closed")
        try:
            stdin.write(data)
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ConnectError(
                "internal",
                f"error writing to stdin: error writing to stdin of process '{managed.pid}': "
                "write |1: broken pipe",
            ) from exc


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
