"""Real ``vllm serve`` processes (the CPU build), shared by the tests of this folder; no Ray.

The trainer is the test process itself: a ``transformers`` model pushed with ``VLLMServers``
over HTTP. Two servers start together once per session (each costs 40-80 s of the 2 cores
here: three processes, each importing vLLM); every test begins with a full push of its own and
never relies on what an earlier one left. A test that kills a server starts it again at the same
URL before it ends (``Servers.restart``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.models import QWEN2, save

vllm = pytest.importorskip("vllm", reason="the vllm-serve tests need the vllm extra")

from tests.vllm_serve.helpers import READY_S, Servers
from weight_sync.adapters.vllm import ServerProcess


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save(QWEN2, tmp_path_factory.mktemp("models") / "qwen2", seed=0)


@pytest.fixture(scope="session")
def servers(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    logs = Path(os.environ.get("WEIGHT_SYNC_SERVE_LOGS") or tmp_path_factory.mktemp("logs"))
    logs.mkdir(parents=True, exist_ok=True)
    held = Servers(model_dir, logs)
    started: list[ServerProcess | BaseException | None] = [None, None]

    def start(index: int) -> None:
        try:
            started[index] = held.start()
        except BaseException as exc:
            started[index] = exc

    # Daemon threads: an interrupted session exits at once, and ServerProcess's exit hook stops
    # the servers they were starting.
    threads = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(READY_S + 60)
        for outcome in started:
            if not isinstance(outcome, ServerProcess):
                raise RuntimeError(f"a server did not start: {outcome}")  # noqa: TRY004
        held.processes = [server for server in started if isinstance(server, ServerProcess)]
        yield held
    finally:
        for server in held.processes or started:
            if isinstance(server, ServerProcess):
                server.stop(timeout_s=60)
