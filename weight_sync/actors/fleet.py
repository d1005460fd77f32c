"""A trainer actor and its workers, as the demo and the cluster job run them: check that every
worker holds the trainer's weights, and take the actors down."""

from __future__ import annotations

import logging
from typing import Any

import ray

logger = logging.getLogger(__name__)


def count_verified(
    trainer: Any, workers: list[Any], version: int, timeout_s: float
) -> tuple[int, int]:
    """(workers holding the trainer's weights bit for bit at ``version``, tensors compared). The
    trainer actor answers ``digests()``; workers are ``WeightSyncWorker`` actors."""
    want = ray.get(trainer.digests.remote(), timeout=timeout_s)
    got = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=timeout_s)
    versions = ray.get([w.weights_version.remote() for w in workers], timeout=timeout_s)
    return sum(d == want and v == version for d, v in zip(got, versions, strict=True)), len(want)


def take_down(trainer: Any, workers: list[Any]) -> None:
    """Close the trainer's updater (so the workers leave its group), then kill every actor. A
    failure to close is logged, not raised: it must not hide the error that brought us here."""
    try:
        ray.get(trainer.close.remote(), timeout=60)
    except Exception as exc:
        logger.warning("closing the trainer: %s", exc)
    for actor in [trainer, *workers]:
        ray.kill(actor)
