"""The cluster job on the local test cluster: CPU bundles from a real placement group."""

from __future__ import annotations

import json
import re

import pytest
from ray.util.placement_group import placement_group_table

from weight_sync import SyncTimeoutError
from weight_sync.actors.placement import reserve
from weight_sync.tools.ray_job import main

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("ray_cluster")]


def test_job_places_pushes_and_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workers", "2", "--size-mb", "20", "--pushes", "2", "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"verified: 2/2 workers hold version \d+, 6 tensors bit-exact", out), out
    report = json.loads(re.search(r"^REPORT (.*)$", out, re.MULTILINE).group(1))
    assert report["strategy"] == "PACK" and not report["gpus"] and len(report["seconds"]) == 2
    assert "group listens on 127.0.0.1" in out  # one node: loopback


def test_a_placement_that_cannot_fit_times_out_and_is_released() -> None:
    with pytest.raises(SyncTimeoutError, match="could not fit 41 bundles"):
        reserve(40, gpus="no", timeout_s=2)  # 41 x 0.1 CPU on a 2-CPU cluster
    states = [group["state"] for group in placement_group_table().values()]
    assert "PENDING" not in states and "CREATED" not in states  # the request was withdrawn
    with reserve(1, gpus="no", timeout_s=30) as placement:
        assert placement.worker_options(0)["num_cpus"] == 0.1
        with pytest.raises(IndexError):
            placement.worker_options(1)
