"""Per-push figures through Ray's metrics API, so they appear on every node's Prometheus endpoint
(``ray start --metrics-export-port``) and in Ray's Grafana dashboards.

Exported, tagged with the updater's ``updater`` id (and ``phase`` / ``outcome`` where shown):

=====================================  =========  ============================================
``weight_sync_pushes``                 counter    pushes, by ``outcome`` (ok / the error class)
``weight_sync_push_bytes``             counter    tensor bytes pushed
``weight_sync_push_buckets``           counter    buckets (collectives) broadcast
``weight_sync_push_seconds``           histogram  seconds per ``phase``: group, prepare,
                                                  transfer, commit, total
``weight_sync_push_gbps``              gauge      payload GB/s of the last push
``weight_sync_version``                gauge      the last committed version
=====================================  =========  ============================================

Ray prefixes these with ``ray_`` in Prometheus (counters also get ``_total``). One
``PushMetrics`` per updater; nothing is registered at import time.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

import ray
from ray.util import metrics

from weight_sync.config import SyncConfig

_SECONDS_BOUNDARIES = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300]


class PushMetrics:
    """Records pushes for one updater (``updater`` tag: its id)."""

    def __init__(self, updater_id: str) -> None:
        keys = ("updater",)
        self._tags = {"updater": updater_id}
        self._pushes = metrics.Counter(
            "weight_sync_pushes", "Pushes, by outcome", tag_keys=("updater", "outcome")
        )
        self._bytes = metrics.Counter(
            "weight_sync_push_bytes", "Tensor bytes pushed", tag_keys=keys
        )
        self._buckets = metrics.Counter(
            "weight_sync_push_buckets", "Buckets broadcast", tag_keys=keys
        )
        self._seconds = metrics.Histogram(
            "weight_sync_push_seconds",
            "Seconds per push phase",
            boundaries=_SECONDS_BOUNDARIES,
            tag_keys=("updater", "phase"),
        )
        self._gbps = metrics.Gauge("weight_sync_push_gbps", "GB/s of the last push", tag_keys=keys)
        self._version = metrics.Gauge(
            "weight_sync_version", "Last committed version", tag_keys=keys
        )

    def pushed(
        self, version: int, nbytes: int, buckets: int, phases: Mapping[str, float], gbps: float
    ) -> None:
        self._pushes.inc(1, tags={**self._tags, "outcome": "ok"})
        if nbytes:  # Ray counters refuse increments of zero
            self._bytes.inc(nbytes, tags=self._tags)
        if buckets:
            self._buckets.inc(buckets, tags=self._tags)
        for phase, seconds in phases.items():
            self._seconds.observe(seconds, tags={**self._tags, "phase": phase})
        self._gbps.set(gbps, tags=self._tags)
        self._version.set(version, tags=self._tags)

    def failed(self, error: BaseException) -> None:
        self._pushes.inc(1, tags={**self._tags, "outcome": type(error).__name__})


def push_metrics(config: SyncConfig) -> PushMetrics | None:
    """An updater's metrics, where ``config`` asks for them and Ray runs here (an id of its own
    each: several updaters in one process are told apart)."""
    if not (config.metrics and ray.is_initialized()):
        return None
    return PushMetrics(secrets.token_hex(4))
