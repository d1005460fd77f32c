"""The members of pushes to Ray actors (``WeightSyncWorker`` subclasses, ``VLLMEngine``): one
actor call per member per push (``actors.lanes.RayLanes``), each carrying ``timeout_s``, what
the push has left for it, so that a member that forwards the call (an engine to its worker
processes) can bound its own wait by it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError

from weight_sync.errors import first_line
from weight_sync.wire.blame import Fate, is_collateral


class RayMembers:
    """The workers of a Ray front, in order (their index is what errors name): their handles,
    those added and dropped, and how an actor call that raised ended (``control.plane.collect``
    sorts the calls of a push by it)."""

    def __init__(self, handles: Sequence[ActorHandle]) -> None:
        self._handles = list(handles)

    @property
    def handles(self) -> tuple[ActorHandle, ...]:
        return tuple(self._handles)

    def add(self, handles: Sequence[ActorHandle]) -> None:
        self._handles.extend(handles)

    def __len__(self) -> int:
        return len(self._handles)

    def drop(self, members: Sequence[int]) -> None:
        gone = set(members)
        self._handles = [h for i, h in enumerate(self._handles) if i not in gone]

    def fate(self, error: BaseException) -> tuple[Fate, str]:
        if isinstance(error, RayActorError):
            return "died", f"actor died ({first_line(error)})"
        cause = (
            error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
        )
        return ("collateral" if is_collateral(cause) else "raised"), first_line(cause)
