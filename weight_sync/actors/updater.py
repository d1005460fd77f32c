"""``WeightUpdater``: the push protocol (``weight_sync.send.pusher``) over Ray actors.

The protocol itself -- plan, prepare, transfer, commit, blame -- lives in ``Pusher``; this adds
what is Ray's: members given as actor handles (``RayMembers``), replacements for dropped ones,
and per-push figures through Ray's metrics.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence

import ray
from ray.actor import ActorHandle
from typing_extensions import Self

from weight_sync.actors.members import RayMembers
from weight_sync.actors.metrics import PushMetrics
from weight_sync.config import SyncConfig
from weight_sync.send.pusher import Pusher

logger = logging.getLogger(__name__)


class WeightUpdater(Pusher):
    """Pushes named tensors from this process (rank 0) to ``workers`` (``WeightSyncWorker`` actors,
    or engines such as ``VLLMEngine``).

    The group is formed lazily on the first push and reused. A failed push tears it down,
    drops the workers that died or froze, and the next push forms a new group over the rest.
    ``push`` calls from several threads are serialised.
    """

    def __init__(self, workers: Sequence[ActorHandle], config: SyncConfig | None = None) -> None:
        self._members = RayMembers(_check_handles(workers, []))
        config = config if config is not None else SyncConfig()
        metrics = (
            PushMetrics(secrets.token_hex(4)) if config.metrics and ray.is_initialized() else None
        )
        super().__init__(self._members, config, metrics)

    @property
    def workers(self) -> tuple[ActorHandle, ...]:
        """The workers pushes go to: those given, minus any dropped after dying or freezing."""
        return self._members.handles

    def add_workers(self, workers: Sequence[ActorHandle]) -> None:
        """Add workers (e.g. replacements for dropped ones). The current group is left; the next
        push forms one over everybody and sends the newcomers the full weights."""
        with self._lock:
            self._check_open()
            added = _check_handles(workers, self.workers)
            self._teardown()
            self._members.add(added)
            logger.info("added %d worker(s); %d in all", len(added), len(self._members))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check_handles(
    workers: Sequence[ActorHandle], present: Sequence[ActorHandle]
) -> list[ActorHandle]:
    if isinstance(workers, ActorHandle) or not isinstance(workers, Sequence):
        raise TypeError("workers must be a list of WeightSyncWorker actor handles")
    if not workers and not present:
        raise ValueError("workers must name at least one WeightSyncWorker actor")
    seen = {handle._actor_id for handle in present}
    for index, worker in enumerate(workers):
        if not isinstance(worker, ActorHandle):
            raise TypeError(
                f"workers[{index}] is a {type(worker).__name__}, not a Ray actor handle"
            )
        if worker._actor_id in seen:
            raise ValueError(f"workers[{index}] is already a worker of this updater")
        seen.add(worker._actor_id)
    return list(workers)
