"""``SGLangServer``: one local ``python -m sglang.launch_server``, for examples and tests.

SGLang often lives in a virtual environment of its own (its pins and vLLM's differ), so the
server runs with the interpreter given as ``python`` (default: this one). ``weight_sync.adapters.local_servers``
runs it: its own process group (stopping it stops SGLang's scheduler and detokenizer too),
ready when ``/health`` answers. SGLang cannot listen on port 0 (its warm-up request goes to the
port it was given), so ``port=0`` is a port bound here first and held until the server listens
on it. Stopped cleanly, it still leaves a 16 KB ``sglang_loads_*.shm`` in /dev/shm.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from weight_sync.adapters.local_servers import (
    LocalServer,
    ServerStartError,
    check_flags,
    start_together,
)

__all__ = ["SGLangServer", "ServerStartError", "local_servers"]


class SGLangServer(LocalServer):
    """A local SGLang server of ``model`` (a checkpoint folder), ready when this returns;
    ``url`` is its base URL. ``args``: more flags (``--device cpu``, ``--dtype bfloat16``, ...);
    ``env``: variables for it (on CPU: ``SGLANG_USE_CPU_ENGINE=1``). See ``LocalServer``."""

    # SIGTERM to the whole group kills SGLang's detokenizer first; the server then takes its
    # crash path (SIGKILL of its tree) and leaves semaphores in /dev/shm. Alone, it exits cleanly.
    terminate_group = False
    # SGLang cannot listen on port 0: its warm-up request goes to the port it was given.
    binds_port_zero = False

    def __init__(
        self,
        model: str,
        *,
        python: str | None = None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | None = None,
        ready_timeout_s: float = 600,
    ) -> None:
        check_flags(model, args, "SGLangServer")
        self.model = model

        def command(bound: int) -> list[str]:
            return [
                python or sys.executable,
                "-m",
                "sglang.launch_server",
                "--model-path",
                model,
                *args,
                "--host",
                host,
                "--port",
                str(bound),
            ]

        super().__init__(
            command,
            name=f"sglang server {model}",
            env=env,
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
    python: str | None = None,
    args: Callable[[int], Sequence[str]] | Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_dir: str | None = None,
    ready_timeout_s: float = 600,
) -> Iterator[list[SGLangServer]]:
    """``count`` local SGLang servers of ``model``, started together and stopped together on the
    way out, on failure too. ``args``: the flags, or a function of the server's index."""

    def start(index: int) -> SGLangServer:
        flags = args(index) if callable(args) else args
        log = f"{log_dir}/sglang_server_{index}.log" if log_dir else None
        return SGLangServer(
            model, python=python, args=flags, env=env, log_path=log, ready_timeout_s=ready_timeout_s
        )

    with start_together(count, start) as started:
        yield started
