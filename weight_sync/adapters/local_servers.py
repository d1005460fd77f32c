"""Inference servers started on this machine, for examples and tests: one process group per
server, ready when ``/health`` answers, stopped cleanly (then killed, group and all).

Ports: ``port=0`` gives the server an ephemeral port without a "pick a free port, close it, hand
it over" race. A server that can bind port 0 itself (vLLM) does, and its port is read back from
the kernel's table of its listening sockets; one that cannot (SGLang, whose warm-up request goes
to the port it was given: ``binds_port_zero``) is handed a port bound here first and held until
it listens there. The engines' own modules (``adapters.vllm.process``,
``adapters.sglang.process``) say which command starts a server.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TypeVar

from typing_extensions import Self

from weight_sync.control.futures import Backoff
from weight_sync.control.http import call
from weight_sync.errors import ServerError, WeightSyncError

__all__ = ["LocalServer", "ServerStartError", "check_flags", "start_together", "stop_together"]

logger = logging.getLogger(__name__)

_POLL_S = (0.05, 0.5)  # the first and the longest pause between looks at a starting server
_LIVE: weakref.WeakSet[LocalServer] = weakref.WeakSet()
Server = TypeVar("Server", bound="LocalServer")


class ServerStartError(WeightSyncError):
    """A server exited, or was not ready, before its ``ready_timeout_s``; the message ends with
    the tail of its log."""


class LocalServer:
    """A local server run by ``command(port)`` (the command line listening at ``host`` and
    ``port``), started at construction and ready (``/health`` answers) when it returns;
    ``url`` is its base URL. ``name`` says what it is in logs and errors.

    ``env``: variables added to this process's environment. ``port=0``: an ephemeral port (see
    the module docstring). ``log_path``: where its output goes (default: a temporary
    file). Raises ``ServerStartError`` if it exits or is not ready within ``ready_timeout_s``
    (it is then stopped). ``stop()`` stops it cleanly (a killed engine leaves its shared memory
    behind); servers still running when this interpreter exits are stopped then."""

    # Whether the server can bind port 0 itself (its port is then read back from the kernel).
    # If not, ``port=0`` binds an ephemeral port here (SO_REUSEADDR, not listening) and holds it
    # until the server listens on it (with SO_REUSEADDR too, as uvicorn does): no other process
    # is handed that port meanwhile, unlike "pick a free port, close it, pass it on".
    binds_port_zero = True
    # Whether stop() sends SIGTERM to the whole process group, or to the server process alone
    # (an engine whose children, signalled first, would make it take its crash path).
    terminate_group = True

    def __init__(
        self,
        command: Callable[[int], Sequence[str]],
        *,
        name: str,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | None = None,
        ready_timeout_s: float = 600,
    ) -> None:
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be 0 (an ephemeral port) or a TCP port, got {port!r}")
        if ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be positive, got {ready_timeout_s}")
        self.name, self.host = name, host
        if log_path is None:
            handle, log_path = tempfile.mkstemp(prefix="weight-sync-server-", suffix=".log")
            os.close(handle)
        self.log_path = log_path
        held = None if port or self.binds_port_zero else _hold_port(host)
        self.port = held.getsockname()[1] if held is not None else port
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 (closed in stop)
        logger.info("starting %s (log: %s)", name, log_path)
        try:
            try:
                self._process = subprocess.Popen(
                    list(command(self.port)),
                    stdin=subprocess.DEVNULL,
                    stdout=self._log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **(env or {})},
                    start_new_session=True,  # its own group: stop() reaches the engine's processes
                )
            except BaseException:  # no process (a wrong interpreter, say): nothing to stop
                self._log.close()
                raise
            _LIVE.add(self)
            try:
                self._wait_ready(time.monotonic() + ready_timeout_s, ready_timeout_s)
            except BaseException:
                self.stop(timeout_s=30)
                raise
        finally:
            if held is not None:
                held.close()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def alive(self) -> bool:
        return self._process.poll() is None

    def stop(self, timeout_s: float = 60) -> int | None:
        """SIGTERM (the engine shuts down and frees most of its shared memory: an SGLang 0.5.23
        server still leaves a 16 KB ``sglang_loads_*.shm`` in /dev/shm), wait up to
        ``timeout_s``, then SIGKILL the whole process group. Returns the exit code. Idempotent."""
        if self._process.poll() is None:
            if self.terminate_group:
                self._signal(signal.SIGTERM)
            else:
                self._process.terminate()
            try:
                self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM for %.0fs: killing it", self.name, timeout_s)
        # The engine's processes may outlive the API server: the group goes in all cases.
        self._signal(signal.SIGKILL)
        code = self._reap()
        self._log.close()
        _LIVE.discard(self)
        return code

    def kill(self) -> None:
        """SIGKILL the server and its engine processes at once (a crash, for tests)."""
        self._signal(signal.SIGKILL)
        self._reap()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- internals -----------------------------------------------------------------------------

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self._process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def _reap(self) -> int | None:
        try:
            return self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return None

    def _wait_ready(self, deadline: float, timeout_s: float) -> None:
        backoff = Backoff(*_POLL_S)
        while True:
            if self._process.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self._process.returncode} "
                    f"before it was ready; its log ({self.log_path}) ends:\n{self.log_tail()}"
                )
            if self.port == 0:
                self.port = _listening_port(self.pid, self.host) or 0
            if self.port and _healthy(self.url):
                logger.info("%s ready at %s (pid %d)", self.name, self.url, self.pid)
                return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.name} was not ready within {timeout_s:.0f}s; its log "
                    f"({self.log_path}) ends:\n{self.log_tail()}"
                )
            backoff.sleep()


@contextmanager
def start_together(count: int, start: Callable[[int], Server]) -> Iterator[list[Server]]:
    """``count`` servers, ``start(index)`` each, started at once (each spends a while of a small
    machine importing its engine) and stopped together (``stop_together``) on the way out, on
    failure too."""
    if count < 1:
        raise ValueError(f"count must be 1 or more, got {count}")
    started: list[Server] = []
    errors: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=count) as pool:
        for future in [pool.submit(start, index) for index in range(count)]:
            try:  # every start is awaited, so none is left running unseen
                started.append(future.result())
            except BaseException as exc:
                errors.append(exc)
    try:
        if errors:
            raise errors[0]
        yield started
    finally:
        stop_together(started)


def stop_together(servers: Iterable[LocalServer], timeout_s: float = 60) -> None:
    """``stop(timeout_s)`` each of ``servers``, at once: each drains for a while after SIGTERM
    (an SGLang 0.5.23 server looks for it every 5 s), which one after another adds up."""
    stopping = list(servers)
    if stopping:
        with ThreadPoolExecutor(max_workers=len(stopping)) as pool:
            for future in [pool.submit(server.stop, timeout_s) for server in stopping]:
                future.result()


def check_flags(model: object, args: Sequence[str], server: str) -> None:
    """The checks every server's constructor makes of its model and extra flags."""
    if not isinstance(model, str) or not model:
        raise TypeError(f"model must be a model directory or hub name, got {model!r}")
    if isinstance(args, str) or not all(isinstance(arg, str) for arg in args):
        raise TypeError(f"args must be a sequence of str flags, got {args!r}")
    if "--port" in args or "--host" in args:
        raise ValueError(f"pass host and port as arguments of {server}, not in args")


def _hold_port(host: str) -> socket.socket:
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    held = socket.socket(family, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind((host, 0))
    return held


def _healthy(url: str) -> bool:
    try:
        call(url, "health", timeout_s=5)
    except ServerError:
        return False
    return True


def _listening_port(pid: int, host: str) -> int | None:
    """The TCP port ``pid`` listens on (Linux: its descriptors' socket inodes, looked up in the
    kernel's socket tables). An API server listens on its HTTP port (with several sockets,
    the lowest is taken)."""
    try:
        inodes = {
            os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1]
            for fd in os.listdir(f"/proc/{pid}/fd")
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")
        }
    except OSError:
        return None
    ports = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return min(ports) if ports else None


@atexit.register
def _stop_all() -> None:
    """Servers left running when the interpreter exits would outlive it (their own session)."""
    for server in list(_LIVE):  # one by one: no new threads once the interpreter is exiting
        server.stop(timeout_s=30)
