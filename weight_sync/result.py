"""``PushResult``: what a push reports, on its own so that every layer that returns one (the
protocol, the sharded trainers' ``push_sharded``) can name it without importing the others."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushResult:
    """What one push moved. ``version`` is now committed on every worker."""

    version: int
    nbytes: int  # bytes of the tensors pushed (alignment padding on the wire not counted)
    buckets: int
    seconds: float
    tensors: int = 0  # names delivered, tied ones included
    partial: bool = False
    # Seconds per phase: group (probe + join, when a group was formed), then prepare, transfer
    # and commit -- or push, where they were one call (the steady state) -- and total.
    phases: Mapping[str, float] = field(default_factory=dict)
    wire_bytes: int = 0  # bytes broadcast (a delta push: its header and what changed)
    delta: bool = False  # sent as a delta against the workers' weights (SyncConfig.delta)
    density: float | None = None  # of a delta push: the share of elements that changed
    # Why the push went dense or as a delta (SyncConfig.delta; see weight_sync.delta.choice).
    delta_reason: str = ""

    @classmethod
    def nothing(cls, version: int) -> PushResult:
        """An empty push's: nothing moved on any rank, and every member keeps ``version`` (a
        state dict of no tensor, or -- from many senders -- of none with an element, or -- to
        SGLang -- only a head the engines tie themselves). Every front says so alike."""
        logger.info("empty state dict: nothing to push (version stays %d)", version)
        return cls(version, 0, 0, 0.0)

    @property
    def gbps(self) -> float:
        """Payload gigabytes per second, as seen by the trainer."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
