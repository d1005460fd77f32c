"""Real ``vllm serve`` processes (the CPU build), shared by the tests of this folder; no Ray.

The trainer is the test process itself: a ``transformers`` model pushed with ``VLLMServers``
over HTTP. Two servers start together once for this folder (``local_servers``), the second with
two tensor-parallel workers (``helpers.server_args``): a start is three processes (four with
two workers), each importing vLLM, ~25 CPU-seconds alone. Every test begins with a full push
of its own and never relies on what an earlier one left. A server a test killed is started
again at the same URL, with the same flags, as the next test that takes ``servers`` begins
(``Servers.restart``): a start is paid only where a later test needs the server.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.models import QWEN2, save

vllm = pytest.importorskip("vllm", reason="the vllm-serve tests need the vllm extra")

from tests.vllm_serve.helpers import READY_S, Servers, server_args
from weight_sync.adapters.local_servers import stop_together
from weight_sync.adapters.vllm.process import local_servers


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save(QWEN2, tmp_path_factory.mktemp("models") / "qwen2", seed=0)


@pytest.fixture
def servers(started: Servers) -> Servers:
    """The folder's servers, every one up: one a test before killed starts again first."""
    for index, process in enumerate(started.processes):
        if not process.alive():
            started.restart(index)
    return started


@pytest.fixture(scope="package")  # stopped once the folder is done: others need the memory
def started(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    logs = Path(os.environ.get("WEIGHT_SYNC_SERVE_LOGS") or tmp_path_factory.mktemp("logs"))
    logs.mkdir(parents=True, exist_ok=True)
    held = Servers(model_dir, logs)
    with local_servers(
        model_dir, 2, args=server_args, log_dir=str(logs), ready_timeout_s=READY_S
    ) as started:
        held.processes = list(started)
        try:
            yield held
        finally:  # a server a test restarted is not one local_servers started
            stop_together(held.processes)
