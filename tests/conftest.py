from __future__ import annotations

import compileall
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import scheduling, shm_leftovers

REPO = Path(__file__).resolve().parents[1]
_SHM_BEFORE = pytest.StashKey[set[str]]()
_SHM_REMOVED = pytest.StashKey[list[str]]()
_IPC = pytest.StashKey[str]()


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """Once, before xdist's workers start: vLLM's engines listen on ZeroMQ sockets at
    ``$VLLM_RPC_BASE_PATH/<uuid>`` (default: the temp folder) and leave them there (~85 a run):
    the run gives them a folder of its own, which every process it starts inherits and which
    goes at its end."""
    if _is_xdist_worker(config):
        return
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        os.environ["VLLM_RPC_BASE_PATH"] = config.stash[_IPC] = tempfile.mkdtemp(prefix="ws-ipc-")
    # Bytecode for the repository's own code, once (0.3 s): where PYTHONDONTWRITEBYTECODE is set
    # (as on this VM), each of the ~300 processes the suite starts -- Ray
    # actors, ranks, engines -- would otherwise compile weight_sync and the tests' modules
    # again, ~0.25 CPU-s each. pip compiled the installed packages already.
    for folder in ("weight_sync", "tests", "examples", "benchmarks"):
        compileall.compile_dir(REPO / folder, quiet=2)


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _is_xdist_worker(session.config):
        session.config.stash[_SHM_BEFORE] = shm_leftovers.entries()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove what vLLM and SGLang engines left in /dev/shm during the run (see
    tests/shm_leftovers.py), once every worker is done; the summary names them."""
    before = session.config.stash.get(_SHM_BEFORE, None)
    if before is not None:
        session.config.stash[_SHM_REMOVED] = shm_leftovers.remove_new(before)
    ipc = session.config.stash.get(_IPC, None)
    if ipc is not None:
        shutil.rmtree(ipc, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent where it is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Groups of tests sharing processes, longest first, engines bounded (tests/scheduling.py)."""
    return scheduling.make_scheduler(config, log)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    removed = config.stash.get(_SHM_REMOVED, [])
    if removed:
        terminalreporter.write_line(f"removed engine leftovers from /dev/shm: {', '.join(removed)}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray cluster for every Ray test of this worker (starting one costs seconds on 2
    cores); each xdist worker starts its own (``address="local"``: never one found running)."""
    # Actor classes defined in test modules are imported by reference in the workers.
    import ray  # here, not at the top: the GPU suite runs where Ray is not installed

    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True)
    try:
        yield
    finally:
        ray.shutdown()
