"""Timing a step the way every figure of ours is taken: warm-up runs first (communicators,
staging buffers and caches are made then, and would dominate a cold median), each run
synchronised with the device it used, medians quoted.

The library's ``weight-sync bench`` (``bench.harness``, timing inside its trainer actor) and the
scripts under ``benchmarks/`` read their seconds through here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed(
    step: Callable[[], object],
    repeats: int,
    *,
    warmup: int = 1,
    before: Callable[[], object] | None = None,
    device: torch.device | None = None,
) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``step``, after ``warmup`` untimed ones.
    ``before`` runs untimed ahead of every run (restoring what a run changed, say); on a CUDA
    ``device`` each run starts and ends with the device idle, so queued work is counted."""
    runs = []
    for _ in range(warmup + repeats):
        if before is not None:
            before()
        runs.append(seconds_of(step, device))
    return runs[warmup:]


def seconds_of(step: Callable[[], object], device: torch.device | None = None) -> float:
    """Seconds of one run of ``step`` (on a CUDA ``device``, until its work is done there)."""
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
