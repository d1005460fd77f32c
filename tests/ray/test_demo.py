"""The main job, as `weight-sync demo` runs it, on the shared cluster."""

import pytest

from weight_sync.tools.demo import run_demo


@pytest.mark.timeout(300)
def test_demo_verifies_seven_workers(ray_cluster: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_demo(workers=7, steps=2, bucket_mb=8, timeout_s=240) == 0
    out = capsys.readouterr().out
    assert "verified: 7/7 workers hold version 2" in out and "OK" in out
