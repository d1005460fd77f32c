from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import shm_leftovers

REPO = Path(__file__).resolve().parents[1]
_SHM_REMOVED = pytest.StashKey[list[str]]()


@pytest.fixture(scope="session", autouse=True)
def _engine_shm_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Remove what vLLM and SGLang engines left in /dev/shm during the run (see
    tests/shm_leftovers.py); the session's summary names them."""
    before = shm_leftovers.entries()
    yield
    request.config.stash[_SHM_REMOVED] = shm_leftovers.remove_new(before)


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
    """One local Ray cluster for every Ray test (starting one costs seconds on 2 cores)."""
    # Actor classes defined in test modules are imported by reference in the workers.
    import ray  # here, not at the top: the GPU suite runs where Ray is not installed

    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    try:
        yield
    finally:
        ray.shutdown()
