"""``WeightUpdater``: pushes to Ray actors, from one trainer process or from every rank of a
sharded trainer, by one protocol: each sending rank's share over a lane of its own
(``weight_sync.actors.lanes.RayLanes``), a trainer of one process being its K = 1 case. This
is the public face: the arguments checked, the options named.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from ray.actor import ActorHandle
from typing_extensions import Self

from weight_sync.actors.lanes import RayLanes
from weight_sync.config import SyncConfig
from weight_sync.result import PushResult
from weight_sync.send.collectives import OneRank
from weight_sync.send.routes import Route
from weight_sync.send.sharded import ShardedSource
from weight_sync.transport.base import Transport
from weight_sync.wire.mapping import Transform
from weight_sync.wire.state_dict import Rename, StateDict


class WeightUpdater:
    """Pushes named tensors to ``workers`` (``WeightSyncWorker`` actors, or engines such as
    ``VLLMEngine``), from this process -- or, with ``senders`` (the trainers'
    torch.distributed group: ``dist.group.WORLD``, or a subgroup such as one replica of a
    hybrid-sharded trainer), from every rank of a sharded trainer at once, each sending its own
    shards over a lane of its own (docs/many-senders.md). With ``senders`` it is made on every
    rank of that group at once, over the same workers (a collective), and every rank calls
    ``push`` at the same point; ``one_group`` then moves every lane's buckets over one group of
    the senders and the workers, in rounds (the NCCL design).

    Without ``senders`` this process is the one sender (``senders=OneRank()``, the same): the
    K = 1 case of the same protocol, with no torch.distributed of its own.

    The lanes are formed lazily on the first push and reused. A failed push leaves them to be
    renewed, drops the workers that died or froze (with ``senders``: rank 0 does, and the other
    ranks as the next push begins), and the next push renews the lanes over the rest. ``push``
    calls from several threads are serialised.
    """

    def __init__(
        self,
        workers: Sequence[ActorHandle],
        config: SyncConfig | None = None,
        *,
        senders: dist.ProcessGroup | OneRank | None = None,
        one_group: bool = False,
    ) -> None:
        if senders is None and one_group:
            raise ValueError(
                "one_group is for a push from many senders (senders=the trainers' group); one "
                "sender's push has one group already"
            )
        group = senders if senders is not None else OneRank()
        handles = _check_handles(workers, [])
        self._pushes = RayLanes(handles, config, group=group, one_group=one_group)

    @property
    def config(self) -> SyncConfig:
        return self._pushes.config

    @property
    def version(self) -> int:
        """The last version committed on every worker (0 before the first)."""
        return self._pushes.version

    @property
    def workers(self) -> tuple[ActorHandle, ...]:
        """The workers pushes go to: those given and added, minus any dropped after dying or
        freezing (with ``senders``: by rank 0 at once, by the others as the next push
        begins)."""
        return self._pushes.workers

    @property
    def group(self) -> Transport | None:
        """The group this rank's lane sends over (this rank is its rank 0), None until a push
        forms it; see ``Pusher.group``."""
        return self._pushes.group

    @property
    def routes(self) -> list[Route]:
        """How each worker receives through that group (``Pusher.routes``; empty while none is
        formed; over one group: ``"group"``)."""
        return self._pushes.routes

    def push(
        self,
        state_dict: StateDict | ShardedSource,
        *,
        rename: Rename | None = None,
        transform: Transform | None = None,
        partial: bool = False,
        version: int | None = None,
    ) -> PushResult:
        """Send every tensor to every worker; returns once all of them hold it (``RayLanes.push``:
        the options, the errors). With ``senders``, this rank's shards of the state dict while
        every other rank pushes its own (``transform`` on whole tensors only; a
        ``ShardedSource`` is one sender's); ``SenderFailedError`` names the trainer ranks whose
        lanes did not land."""
        options = {"rename": rename, "transform": transform, "version": version, "partial": partial}
        return self._pushes.push(state_dict, options)

    def add_workers(self, workers: Sequence[ActorHandle]) -> None:
        """Add workers (e.g. replacements for dropped ones): the next push renews the lanes over
        everybody and sends the newcomers the full weights. With ``senders``: on every rank, the
        same workers (``RayLanes.add_workers``)."""
        self._pushes.add_workers(_check_handles(workers, self.workers))

    def close(self) -> None:
        """Leave (``RayLanes.close``). Idempotent."""
        self._pushes.close()

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
