"""The Ray control plane: members are Ray actors that speak the protocol's ``_weight_sync_*``
methods (``WeightSyncWorker`` subclasses, ``VLLMEngine``), one actor call per member per round.

Every call carries ``timeout_s``, what the push has left for it, so a member that forwards the
call (an engine to its worker processes) can bound its own wait by it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError

from weight_sync.actors.worker import SYNC_GROUP
from weight_sync.control.futures import resolve, then
from weight_sync.errors import first_line
from weight_sync.wire.blame import Fate, MemberGone, is_collateral
from weight_sync.wire.metadata import (
    GroupSpec,
    MemberInfo,
    PrepareReply,
    PrepareRequest,
    PushReply,
    ReceiveReport,
    SyncPlan,
)


class RayMembers:
    """``ControlPlane`` over actor handles."""

    def __init__(self, handles: Sequence[ActorHandle]) -> None:
        self._handles = list(handles)
        # Made with remote_worker: it declares weight_sync's concurrency groups (learnt by probe).
        self._concurrent = [False] * len(self._handles)

    @property
    def handles(self) -> tuple[ActorHandle, ...]:
        return tuple(self._handles)

    def add(self, handles: Sequence[ActorHandle]) -> None:
        self._handles.extend(handles)
        self._concurrent.extend(False for _ in handles)

    def __len__(self) -> int:
        return len(self._handles)

    def probe(self, timeout_s: float) -> list[Future[MemberInfo]]:
        def note(index: int) -> Callable[[MemberInfo], MemberInfo]:
            def noted(info: MemberInfo) -> MemberInfo:
                self._concurrent[index] = info.concurrent
                return info

            return noted

        return [
            then(h._weight_sync_info.remote(timeout_s=timeout_s).future(), note(i))
            for i, h in enumerate(self._handles)
        ]

    def join(
        self, specs: Sequence[GroupSpec], max_metadata_bytes: int, timeout_s: float
    ) -> list[Future[None]]:
        return [
            h._weight_sync_join.remote(
                spec.model_dump_json(), max_metadata_bytes, timeout_s=timeout_s
            ).future()
            for h, spec in zip(self._handles, specs, strict=True)
        ]

    def prepare(
        self,
        request: PrepareRequest,
        plan: SyncPlan,
        members: Sequence[int],
        send_plan: Sequence[bool],
        timeout_s: float,
    ) -> list[Future[PrepareReply]]:
        """The plan travels whole only to members that may lack it; the others get its hash."""
        by_hash = request.model_dump_json()
        with_plan = (
            request.model_copy(update={"plan": plan}).model_dump_json() if any(send_plan) else ""
        )
        return [
            self._handles[i]
            ._weight_sync_prepare.remote(with_plan if whole else by_hash, timeout_s=timeout_s)
            .future()
            for i, whole in zip(members, send_plan, strict=True)
        ]

    def push(self, request: PrepareRequest, timeout_s: float) -> list[Future[PushReply]]:
        message = request.model_dump_json()
        return [
            h._weight_sync_push.remote(message, timeout_s=timeout_s).future() for h in self._handles
        ]

    def cancel(self, version: int, members: Sequence[int], timeout_s: float) -> list[Future[None]]:
        return [
            self._handles[i]._weight_sync_cancel.remote(version, timeout_s=timeout_s).future()
            for i in members
        ]

    def receive(self, version: int, atomic: bool, timeout_s: float) -> list[Future[ReceiveReport]]:
        calls = []
        for handle, concurrent in zip(self._handles, self._concurrent, strict=True):
            method: Any = handle._weight_sync_receive
            if concurrent and atomic:  # received beside the actor's own methods: see worker.py
                method = method.options(concurrency_group=SYNC_GROUP)
            calls.append(method.remote(version, timeout_s=timeout_s).future())
        return calls

    def commit(self, version: int, timeout_s: float) -> list[Future[None]]:
        return [
            h._weight_sync_commit.remote(version, timeout_s=timeout_s).future()
            for h in self._handles
        ]

    def leave(self, timeout_s: float) -> list[Future[None]]:
        return [h._weight_sync_leave.remote(timeout_s=timeout_s).future() for h in self._handles]

    def unformed(self, why: str) -> None:
        """Nothing to tell: an actor joins only when called to (``join``)."""

    def drop(self, members: Sequence[int]) -> None:
        gone = set(members)
        self._handles = [h for i, h in enumerate(self._handles) if i not in gone]
        self._concurrent = [c for i, c in enumerate(self._concurrent) if i not in gone]

    def fate(self, error: BaseException) -> tuple[Fate, str]:
        if isinstance(error, RayActorError):
            return "died", f"actor died ({first_line(error)})"
        cause = (
            error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
        )
        return ("collateral" if is_collateral(cause) else "raised"), first_line(cause)


def death_told(call: Future[Any]) -> Future[Any]:
    """``call`` (an actor call carrying a push), its actor's death told as ``MemberGone``: a
    store plane that takes its answer from it (``ClientPlane.push``'s ``Answers``) then fails
    what that member owes at once, judged dead, rather than waiting for it to the bound."""
    told: Future[Any] = Future()

    def settle(done: Future[Any]) -> None:
        error = done.exception()
        if isinstance(error, RayActorError):
            error = MemberGone(f"actor died ({first_line(error)})")
        resolve(told, result=None if error is not None else done.result(), error=error)

    call.add_done_callback(settle)
    return told
