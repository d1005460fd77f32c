"""The benchmark harness runs end to end (tiny workloads): every strategy moves the bytes, the
report is written, and weight_sync's warm-up push is verified bit-exact inside the harness."""

from pathlib import Path

import pytest

from weight_sync.tools.bench.actors import STRATEGIES
from weight_sync.tools.bench.harness import Bench, Case, Progress
from weight_sync.tools.bench.report import write_report
from weight_sync.tools.bench.workloads import small_tensors, synthetic


@pytest.mark.timeout(300)
def test_harness_measures_every_strategy_and_writes_a_report(
    ray_cluster: None, tmp_path: Path
) -> None:
    bench = Bench(2)
    try:
        cases = [
            Case(small_tensors(count=50, nbytes=4096), 2, STRATEGIES),
            Case(
                synthetic(4 << 20, tensor_bytes=1 << 20), 2, ("weight_sync", "raw"), suite="scaling"
            ),
            Case(small_tensors(count=20, nbytes=4096), 2, ("raw", "weight_sync"), suite="options"),
            Case(
                small_tensors(count=20, nbytes=4096),
                2,
                ("weight_sync",),
                (("staging", "atomic"), ("checksum", True)),
                "weight_sync (atomic, checksum)",
                suite="options",
            ),
        ]
        progress = Progress(sum(len(c.strategies) * 2 for c in cases))
        rows = [row for case in cases for row in bench.measure(case, 1, progress)]
    finally:
        bench.close()
    assert [r.strategy for r in rows] == [
        *STRATEGIES,
        "weight_sync",
        "raw",
        "raw",
        "weight_sync",
        "weight_sync (atomic, checksum)",
    ]
    assert not any(r.error for r in rows)
    assert all(len(r.seconds) == 1 and r.seconds[0] > 0 for r in rows)
    assert all(r.nbytes == 50 * 4096 for r in rows[: len(STRATEGIES)])
    report = write_report(rows, tmp_path)
    text = report.read_text()
    assert "## W2: 50 tensors of 4 KB" in text and "| per_tensor |" in text and "## Scaling" in text
    assert (
        "## What the safety options cost" in text and "| weight_sync (atomic, checksum) |" in text
    )
    assert (tmp_path / "results.json").exists()


def test_cuda_bench_needs_a_gpu_per_actor(ray_cluster: None) -> None:
    from weight_sync.tools.bench.harness import run_bench

    with pytest.raises(ValueError, match="needs 3 GPUs in the Ray cluster"):
        run_bench(workloads=["W2"], workers=2, strategies=["raw"], device="cuda")
