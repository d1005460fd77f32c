"""The control plane: how the trainer reaches the members of a push -- the seam beside
``Transport``.

The push protocol (``weight_sync.send.pusher``) speaks to its members in rounds: probe, join,
prepare (and cancel, when someone refused), receive, commit, leave -- or, in the steady state of
members that offer it, one round (push) for prepare, receive and commit. A ``ControlPlane``
starts one round's call on the members it is asked to and returns a future per member;
``collect`` waits for them, bounded, and sorts what came back into ``Outcomes``, from which the
protocol blames and drops. Two planes exist, one file each:

* ``actors.members.RayMembers`` -- ``WeightSyncWorker`` / ``VLLMEngine`` Ray actors, one actor
  call per member per round;
* ``control.store.ClientPlane`` -- a client that reaches every member at once (vLLM's own
  weight-transfer clients through ``adapters.vllm.backend``, several ``vllm serve`` processes
  through ``adapters.vllm.servers``, the ranks of a torchrun job through ``launch.job_sync``): one
  client call per round, the members' answers coming back through the sync group's store.

(SGLang servers are driven by a push of their own, ``adapters.sglang.pusher``, over their HTTP
endpoints: SGLang runs the receiving side itself.)

Only typed metadata crosses a plane; bytes travel over the ``Transport``. Nothing here knows Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from weight_sync.control.futures import gather
from weight_sync.errors import SyncTimeoutError, TransportError, WeightSyncError, WorkerFailedError
from weight_sync.wire.metadata import (
    GroupSpec,
    MemberInfo,
    PrepareReply,
    PrepareRequest,
    PushReply,
    ReceiveReport,
    SyncPlan,
)

# How a member's failed call ended: its process is gone; it lost a collective because another
# member failed (alive, not at fault); or it raised (alive, at fault).
Fate = Literal["died", "collateral", "raised"]


class ControlPlane(Protocol):
    """The members of a push, in a fixed order (their index is what errors name)."""

    def __len__(self) -> int: ...

    def probe(self, timeout_s: float) -> list[Future[MemberInfo]]:
        """Ask every member what it is before a group is formed."""

    def join(
        self, specs: Sequence[GroupSpec], max_metadata_bytes: int, timeout_s: float
    ) -> list[Future[None]]:
        """Member ``i`` joins the group ``specs[i]`` describes (returns once it has joined)."""

    def prepare(
        self,
        request: PrepareRequest,
        plan: SyncPlan,
        members: Sequence[int],
        send_plan: Sequence[bool],
        timeout_s: float,
    ) -> list[Future[PrepareReply]]:
        """``members`` check push ``request`` (whose plan is ``plan``); ``send_plan[j]`` says
        whether ``members[j]`` may lack the plan and must be sent it whole (else its hash is
        enough). A reply may ask for the plan (``need_plan``) if the member lost it."""

    def cancel(self, version: int, members: Sequence[int], timeout_s: float) -> list[Future[None]]:
        """``members`` drop prepared push ``version``: another member refused it."""

    def push(self, request: PrepareRequest, timeout_s: float) -> list[Future[PushReply]]:
        """Every member takes push ``request`` (whose plan it holds) in one call: prepare,
        receive and commit, agreeing with the others by votes over the group. Asked only when
        every member offered it (``MemberInfo.one_call``)."""

    def receive(self, version: int, atomic: bool, timeout_s: float) -> list[Future[ReceiveReport]]:
        """Every member takes part in the broadcast of ``version`` (returns when it has all)."""

    def commit(self, version: int, timeout_s: float) -> list[Future[None]]:
        """Every member claims ``version``: every member has received it."""

    def leave(self, timeout_s: float) -> list[Future[None]]:
        """Every member leaves the group (dropping any push it has not committed)."""

    def drop(self, members: Sequence[int]) -> None:
        """Forget ``members`` (dead or frozen): later rounds go to the others."""

    def fate(self, error: BaseException) -> tuple[Fate, str]:
        """How a member's call that raised ``error`` ended, and a one-line reason."""


@dataclass
class Outcomes:
    """What came of one call to each of several members (indexed as the calls were)."""

    results: list[Any]
    raised: dict[int, str] = field(default_factory=dict)  # alive; its call failed
    collateral: list[int] = field(default_factory=list)  # alive; lost a collective to someone else
    died: dict[int, str] = field(default_factory=dict)
    late: list[int] = field(default_factory=list)  # no answer in time

    @property
    def ok(self) -> bool:
        return not (self.raised or self.collateral or self.died or self.late)

    @property
    def unreachable(self) -> list[int]:
        """Members to give up on: dead, or silent while others answered. If nobody answered,
        nobody can be blamed (the fault is more likely here, or the timeout too short)."""
        answered = len(self.results) - len(self.late) - len(self.died)
        return sorted([*self.died, *(self.late if answered else [])])

    def error(self, what: str, timeout_s: float, dropped: Sequence[int] = ()) -> WeightSyncError:
        """The error to raise for these outcomes (which must not be ``ok``)."""
        blamed = {**self.raised, **self.died}
        blamed.update(
            {
                index: f"no answer within {timeout_s:.1f}s (frozen?)"
                for index in self.unreachable
                if index not in self.died
            }
        )
        if not blamed:
            if self.collateral and not self.late:
                return TransportError(
                    f"{what}: the sync group failed on worker(s) {self.collateral} with no "
                    "worker at fault; check the trainer's network and logs"
                )
            return SyncTimeoutError(
                f"{what}: worker(s) {sorted(self.late)} did not answer within {timeout_s:.1f}s; "
                "they may be frozen, overloaded or still starting -- raise the timeout in "
                "SyncConfig or check them"
            )
        detail = "; ".join(f"worker {i}: {why}" for i, why in sorted(blamed.items()))
        if self.collateral:
            detail += f"; worker(s) {self.collateral} lost the broadcast as a result"
        if dropped:
            detail += f"; dropped worker(s) {list(dropped)} from the updater"
        return WorkerFailedError(
            f"{what} failed on {len(blamed)} worker(s): {detail}", sorted(blamed), dropped
        )


def collect(plane: ControlPlane, calls: Sequence[Future[Any]], timeout_s: float) -> Outcomes:
    """Wait up to ``timeout_s`` in total for every call; never raises for a member's failure."""
    outcomes = Outcomes(results=[None] * len(calls))
    gather(calls, timeout_s)
    for index, call in enumerate(calls):
        if not call.done():
            outcomes.late.append(index)
            continue
        error = call.exception()
        if error is None:
            outcomes.results[index] = call.result()
            continue
        fate, reason = plane.fate(error)
        if fate == "died":
            outcomes.died[index] = reason
        elif fate == "collateral":
            outcomes.collateral.append(index)
        else:
            outcomes.raised[index] = reason
    return outcomes


def is_collateral(error: BaseException) -> bool:
    """Whether a member's own error says it lost a collective to another member's failure."""
    return isinstance(error, TransportError | SyncTimeoutError)
