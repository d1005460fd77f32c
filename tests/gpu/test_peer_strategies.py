"""The peers' colocated strategies (benchmarks/gpu_peers.py) on one GPU: vLLM's per-tensor and
packed CUDA IPC, SGLang's flattened bucket per dtype, each pushing a tiny model to two reader
processes on the trainer's device, every reader's own weights checked byte for byte.

Written to run as is on a machine with one NVIDIA GPU and a CUDA torch; no Ray. Skipped where
there is no GPU (here and by tests/conftest.py for the ``gpu`` marker).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:  # as benchmarks/gpu.py finds it; the spawned readers inherit it
    sys.path.insert(0, str(BENCHMARKS))

import gpu_peers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# About 4.3 MB in bf16: a 1 MiB bucket makes several chunks (the packed mode's barrier and buffer
# reuse, the flat mode's buffer per chunk); odd sizes put tensors at unaligned byte offsets.
SHAPES: list[tuple[str, tuple[int, ...]]] = [
    *((f"layers.{i}.weight", (256, 384)) for i in range(16)),
    ("norm.weight", (257,)),
    ("cube", (3, 5, 7)),
    ("embed.weight", (1000, 512)),
]
BUCKET = 1 << 20


@pytest.mark.timeout(300)
def test_every_peer_strategy_lands_bit_exact_in_every_reader() -> None:
    results = gpu_peers.run_peers(
        SHAPES, torch.bfloat16, readers=2, repeats=2, timeout_s=120, bucket_bytes=BUCKET
    )
    assert set(results) == set(gpu_peers.STRATEGIES)
    nbytes = sum(math.prod(shape) for _, shape in SHAPES) * 2
    for name, result in results.items():
        assert "error" not in result, f"{name}: {result.get('traceback', result['error'])}"
        assert result["bit_exact"], f"{name}: mismatched tensors {result['mismatched_tensors']}"
        assert result["median_s"] > 0, name
        assert len(result["all_s"]) == 2 and all(s > 0 for s in result["all_s"]), name
        assert result["bytes"] == nbytes, name
    assert results["packed_reused_buffer"]["chunks"] > 1  # the barrier was exercised
    assert results["flat_bucket_per_dtype"]["chunks"] > 1


@pytest.mark.timeout(120)
def test_the_check_fails_on_a_stale_or_partial_copy() -> None:
    """The readers' check can fail: another version, or one byte changed, is caught."""
    device = torch.device("cuda", torch.cuda.current_device())
    tensors = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _, shape in SHAPES]
    gpu_peers.fill(tensors, seed=0, version=3)
    assert gpu_peers.mismatches(tensors, seed=0, version=3) == []
    assert gpu_peers.mismatches(tensors, seed=0, version=2) == list(range(len(SHAPES)))
    raw = tensors[5].view(-1).view(torch.uint8)
    raw[7] ^= 1
    assert gpu_peers.mismatches(tensors, seed=0, version=3) == [5]


@pytest.mark.timeout(60)
def test_the_floor_is_positive() -> None:
    assert gpu_peers.floor_s(1 << 20, readers=2, repeats=2) > 0
