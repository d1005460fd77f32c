"""Every rank of a sharded trainer pushing its own shards into real ``vllm serve`` processes
(``VLLMLaneServers``): two trainer ranks under ``mp.spawn``, the session's two servers.

Each push is checked as tests/vllm_serve/test_serve.py checks one: the servers generate what
the trainer's whole model would, serve the version, and are resumed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.vllm.models import QWEN2
from tests.vllm_serve import lane_trainer
from tests.vllm_serve.helpers import (
    TOLERANCE,
    Servers,
    Trainer,
    assert_matches,
    get,
    largest_difference,
)
from weight_sync.versions import label_version

pytestmark = pytest.mark.timeout(600)
RANKS = 2
JOB_S = 300.0


def _job(scenario: str, urls: list[str], out: Path, ranks: int = RANKS) -> list[dict[str, Any]]:
    """Run the scenario on every trainer rank; the records of ranks ``0..ranks-1`` (those
    that live), the others having exited with 9."""
    out.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(
        lane_trainer.spawned,
        args=(RANKS, scenario, urls, str(out)),
        nprocs=RANKS,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + JOB_S
    try:
        for process in context.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    codes = [process.exitcode for process in context.processes]
    assert codes == [0] * ranks + [9] * (RANKS - ranks), codes
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def _served(urls: list[str]) -> list[int | None]:
    return [label_version(str(get(url, "weight_info")["weight_version"])) for url in urls]


def _pushed(out: Path, step: int) -> Trainer:
    """The reference: the whole model rank 0 pushed at ``step``."""
    trainer = Trainer(QWEN2)
    trainer.pushed = torch.load(out / f"pushed{step}.pt")
    return trainer


def _resumed(urls: list[str]) -> bool:
    return not any(get(url, "is_paused")["is_paused"] for url in urls)


def test_two_trainer_ranks_push_their_shards_to_two_servers(
    servers: Servers, model_dir: str, tmp_path: Path
) -> None:
    before = max((v or 0 for v in _served(servers.urls)), default=0)
    reports = _job("steps", servers.urls, tmp_path)
    versions = reports[0]["versions"]
    assert [report["versions"] for report in reports] == [versions] * RANKS
    assert len(versions) == 2 and before < versions[0] < versions[1]
    assert reports[0]["nbytes"] > 0 and not reports[0]["errors"]
    assert _served(servers.urls) == [versions[-1]] * len(servers.urls)
    earlier = Trainer(QWEN2)
    earlier.model.load_state_dict(torch.load(tmp_path / "pushed0.pt"))
    for url in servers.urls:
        assert_matches(url, model_dir, _pushed(tmp_path, 1))
        # The check could fail: the first push's weights are far from what is served now.
        assert largest_difference(url, model_dir, earlier) > 100 * TOLERANCE
    assert _resumed(servers.urls)


def test_a_tensor_the_engine_cannot_place_is_refused_everywhere_before_any_byte(
    servers: Servers, model_dir: str, tmp_path: Path
) -> None:
    """Every rank raises PlanMismatchError naming the tensor; the servers keep serving their
    version, resumed; then the right state dict lands."""
    before = _served(servers.urls)
    reports = _job("refuse", servers.urls, tmp_path)
    for report in reports:
        (error,) = report["errors"]
        assert error.startswith("PlanMismatchError"), error
    assert "extra" in reports[0]["errors"][0]  # rank 0 names what each worker refused
    (version,) = reports[0]["versions"]
    assert version > max(v or 0 for v in before)
    assert _served(servers.urls) == [version] * len(servers.urls)
    assert_matches(servers.urls[0], model_dir, _pushed(tmp_path, 0))
    assert _resumed(servers.urls)


def test_a_trainer_rank_killed_mid_push_leaves_the_servers_serving_no_version(
    servers: Servers, model_dir: str, tmp_path: Path
) -> None:
    """Rank 1 dies once the workers are receiving its lane: rank 0 raises SenderFailedError
    naming it, no server claims the version (labelled "none"), every server is resumed; a new
    trainer's push then lands, past every version sent."""
    (report,) = _job("kill", servers.urls, tmp_path / "kill", ranks=1)
    (first,) = report["versions"]
    (error,) = report["errors"]
    assert error.startswith("SenderFailedError") and report["senders"] == [1], error
    assert _served(servers.urls) == [None] * len(servers.urls)
    assert _resumed(servers.urls)
    reports = _job("steps", servers.urls, tmp_path / "after")
    assert reports[0]["versions"][0] > first + 1  # the version rank 1 died in is never reused
    assert _served(servers.urls) == [reports[0]["versions"][-1]] * len(servers.urls)
    assert_matches(servers.urls[1], model_dir, _pushed(tmp_path / "after", 1))
