"""The ring protocol's cost per chunk (benchmarks/ring_chunks.py) on the CPU, over the host ring:
a change to the protocol shows on CI's machines, and the bench's readers get the bytes exactly."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(150)


def test_the_ring_chunks_bench_reports_a_cost_per_chunk(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ring_chunks.py"), "--quick", "--timeout", "60",
         "--out", str(tmp_path)],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((tmp_path / "ring_chunks.json").read_text())
    assert result["bit_exact"] is True
    assert set(result["fit"]) == {"1", "3"}
    for figures in result["fit"].values():
        assert math.isfinite(figures["per_chunk_us"]) and figures["per_chunk_us"] > 0
    for case in result["cases"]:
        assert case["bit_exact"] is True and case["median_s"] > 0
        # every reader verified every broadcast, the warm-up included
        assert case["verified_broadcasts"] == case["readers"] * (1 + result["repeats"])
    assert result["memcpy_s"] > 0
    assert "| 3 | 4 KiB | 1024 |" in (tmp_path / "ring_chunks.md").read_text()
