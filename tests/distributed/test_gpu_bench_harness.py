"""The GPU benchmark's harness (benchmarks/gpu.py) on the CPU, over Gloo and the host ring: the
figures it writes on a GPU come from code that runs in CI, not only on the rare GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(240)
# benchmarks/gpu_peers.py's: the peers' colocated strategies, run beside ours
STRATEGIES = ("per_tensor_ipc", "packed_reused_buffer", "flat_bucket_per_dtype")


def test_the_gpu_bench_harness_runs_and_reports_every_case(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--cpu", "--gib", "0.001",
         "--hidden", "256", "--repeats", "2", "--timeout", "180", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=220,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads((tmp_path / "gpu.json").read_text())["results"]
    peers = {f"peer {strategy} 1 -> 1" for strategy in STRATEGIES}
    assert set(results) == {"gloo 1 -> 2", "host ring 1 -> 1"} | peers
    for name, figures in results.items():
        assert "error" not in figures, (name, figures)  # a peer's row says bit-exact too
        time_s = figures["push_s"] if name in peers else figures["weight_sync_s"]
        assert time_s > 0 and figures["bytes"] > 0
        assert name in peers or figures["bit_exact"]  # landed in the readers' own weights
    assert results["gloo 1 -> 2"]["raw_broadcast_s"] > 0
    for name in {"host ring 1 -> 1"} | peers:
        assert results[name]["d2d_copy_s"] > 0
    assert "| gloo 1 -> 2 | 3 |" in (tmp_path / "gpu.md").read_text()


def test_the_pack_paths_bench_runs_on_the_cpu() -> None:
    """benchmarks/pack_paths.py (pack/unpack GB/s; on a GPU also device->host) runs as written:
    it broke once unnoticed when Unpacker's signature changed."""
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "pack_paths.py"), "--workload", "W5",
         "--repeats", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=220,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "pack " in run.stdout and "unpack " in run.stdout and "GB/s" in run.stdout
