"""Every rank of a sharded trainer pushing its own shards into real ``vllm serve`` processes
(``VLLMServers`` with ``senders``): two trainer ranks under ``mp.spawn``, the session's two servers.

Each push is checked as tests/vllm_serve/test_serve.py checks one: the servers generate what
the trainer's whole model would, serve the version, and are resumed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.vllm.models import QWEN2
from tests.vllm_serve.helpers import (
    TOLERANCE,
    Servers,
    Trainer,
    all_resumed,
    assert_matches,
    largest_difference,
    served_versions,
)
from tests.vllm_serve.lane_trainer import RANKS, pushed_model, run_job

pytestmark = pytest.mark.timeout(600)


def test_two_trainer_ranks_push_their_shards_to_two_servers(
    servers: Servers, model_dir: str, tmp_path: Path
) -> None:
    before = max((v or 0 for v in served_versions(servers.urls)), default=0)
    reports = run_job("steps", servers.urls, tmp_path)
    versions = reports[0]["versions"]
    assert [report["versions"] for report in reports] == [versions] * RANKS
    assert len(versions) == 2 and before < versions[0] < versions[1]
    assert reports[0]["nbytes"] > 0 and not reports[0]["errors"]
    assert served_versions(servers.urls) == [versions[-1]] * len(servers.urls)
    earlier = Trainer(QWEN2)
    earlier.model.load_state_dict(torch.load(tmp_path / "pushed0.pt"))
    for url in servers.urls:
        assert_matches(url, model_dir, pushed_model(tmp_path, 1))
        # The check could fail: the first push's weights are far from what is served now.
        assert largest_difference(url, model_dir, earlier) > 100 * TOLERANCE
    assert all_resumed(servers.urls)


def test_a_tensor_the_engine_cannot_place_is_refused_everywhere_before_any_byte(
    servers: Servers, model_dir: str, tmp_path: Path
) -> None:
    """Every rank raises PlanMismatchError naming the tensor; the servers keep serving their
    version, resumed; then the right state dict lands."""
    before = served_versions(servers.urls)
    reports = run_job("refuse", servers.urls, tmp_path)
    for report in reports:
        assert len(report["errors"]) == 1, report  # the refusal alone: the next push landed
        (error,) = report["errors"]
        assert error.startswith("PlanMismatchError"), error
    assert "extra" in reports[0]["errors"][0]  # rank 0 names what each worker refused
    (version,) = reports[0]["versions"]
    assert version > max(v or 0 for v in before)
    assert served_versions(servers.urls) == [version] * len(servers.urls)
    assert_matches(servers.urls[0], model_dir, pushed_model(tmp_path, 0))
    assert all_resumed(servers.urls)


def test_a_trainer_rank_killed_mid_push_leaves_the_servers_serving_no_version(
    servers: Servers, model_dir: str, tmp_path: Path
) -> None:
    """Rank 1 dies once the workers are receiving its lane: rank 0 raises SenderFailedError
    naming it, no server claims the version (labelled "none"), every server is resumed; a new
    trainer's push then lands, past every version sent."""
    (report,) = run_job("kill", servers.urls, tmp_path / "kill", ranks=1)
    (first,) = report["versions"]
    (error,) = report["errors"]
    assert error.startswith("SenderFailedError: trainer rank 1 died or left mid-push"), error
    assert report["senders"] == [1], report
    assert served_versions(servers.urls) == [None] * len(servers.urls)
    assert all_resumed(servers.urls)
    reports = run_job("steps", servers.urls, tmp_path / "after")
    assert reports[0]["versions"][0] > first + 1  # the version rank 1 died in is never reused
    assert served_versions(servers.urls) == [reports[0]["versions"][-1]] * len(servers.urls)
    assert_matches(servers.urls[1], model_dir, pushed_model(tmp_path / "after", 1))
