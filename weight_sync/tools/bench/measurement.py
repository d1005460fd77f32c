"""One strategy's figures on one case: what the harness records and the report reads.

It lives below both so that the harness (which writes the report) and the report (which reads
measurements back from results.json) import it and never each other.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Measurement:
    workload: str
    title: str
    strategy: str
    workers: int
    bucket_bytes: int
    direct_min_bytes: int | None
    nbytes: int
    seconds: list[float] = field(default_factory=list)
    trainer_extra: list[int] = field(default_factory=list)
    worker_extra: list[int] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)  # per push, where the strategy was one
    suite: str = "workloads"
    error: str | None = None  # why this strategy could not finish (e.g. out of memory)
    device: str = "cpu"  # where the weights lived, e.g. "cuda (NVIDIA H100 80GB HBM3)"

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")

    def percentile(self, p: int) -> float:
        """The ``p``-th percentile of the timed runs (interpolated between them)."""
        if len(self.seconds) < 2:
            return self.median
        return statistics.quantiles(self.seconds, n=100, method="inclusive")[p - 1]

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median / 1e9

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "median": self.median, "gbps": self.gbps}
