"""The control plane: how the trainer reaches the members of a push -- the seam beside
``Transport``.

The push protocol (``weight_sync.send.pusher``) speaks to its members in rounds: probe, join,
prepare (and cancel, when someone refused), receive, commit, leave -- or, in the steady state of
members that offer it, one round (push) for prepare, receive and commit. A ``ControlPlane``
starts one round's call on the members it is asked to and returns a future per member;
``collect`` waits for them, bounded, and sorts what came back into ``Outcomes``, from which the
protocol blames and drops (the rules: ``wire.blame``). One plane carries a lane's rounds:

* ``control.store.ClientPlane`` -- a client that reaches every member at once (vLLM's own
  weight-transfer clients through ``adapters.vllm.backend``, several ``vllm serve`` processes
  through ``adapters.vllm.servers``, the ranks of a torchrun job through ``launch.job_sync``): one
  client call per round, the members' answers coming back through the sync group's store.

Ray actors (``WeightSyncWorker``, ``VLLMEngine``) take a whole push in one call each, from
``actors.lanes.RayLanes``, which sorts those calls with ``collect`` too (``actors.members``).
(SGLang servers are driven by a push of their own, ``adapters.sglang.pusher``, over their HTTP
endpoints: SGLang runs the receiving side itself.)

Only typed metadata crosses a plane; bytes travel over the ``Transport``. Nothing here knows Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from weight_sync.control.futures import gather
from weight_sync.wire.blame import Fate, Outcomes
from weight_sync.wire.metadata import (
    GroupSpec,
    MemberInfo,
    PrepareReply,
    PrepareRequest,
    PushReply,
    ReceiveReport,
    SyncPlan,
)


class Fates(Protocol):
    """Members whose calls ``collect`` sorts: how a call that raised ended."""

    def fate(self, error: BaseException) -> tuple[Fate, str]:
        """How a member's call that raised ``error`` ended, and a one-line reason."""


class ControlPlane(Fates, Protocol):
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

    def unformed(self, why: str) -> None:
        """Forming the group failed before any member was told its place (``why``): a member
        already waiting for it (one whose join began with the probe) stops waiting."""

    def drop(self, members: Sequence[int]) -> None:
        """Forget ``members`` (dead or frozen): later rounds go to the others."""


def collect(plane: Fates, calls: Sequence[Future[Any]], timeout_s: float) -> Outcomes:
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
