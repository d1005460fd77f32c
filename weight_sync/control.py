"""The control plane: how the trainer reaches the members of a push -- the seam beside
``Transport``.

The push protocol (``weight_sync.protocol``) speaks to its members in rounds: probe, join,
prepare (and cancel, when someone refused), receive, commit, leave -- or, in the steady state of
members that offer it, one round (push) for prepare, receive and commit. A ``ControlPlane``
starts one round's call on the members it is asked to and returns a future per member;
``collect`` waits for them, bounded, and sorts what came back into ``Outcomes``, from which the
protocol blames and drops. Two planes exist, one file each:

* ``actors.members.RayMembers`` -- ``WeightSyncWorker`` / ``VLLMEngine`` Ray actors, one actor
  call per member per round;
* ``adapters.vllm.backend`` -- vLLM's own weight-transfer clients (Ray handles of vLLM engines,
  or HTTP to a vLLM server): one client call per round for every engine at once, the members'
  answers coming back through the sync group's store.

Only typed metadata crosses a plane; bytes travel over the ``Transport``. Nothing here knows Ray.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError, wait
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from weight_sync.errors import SyncTimeoutError, TransportError, WeightSyncError, WorkerFailedError
from weight_sync.metadata import (
    GroupSpec,
    MemberInfo,
    PrepareReply,
    PrepareRequest,
    PushReply,
    ReceiveReport,
    SyncPlan,
)
from weight_sync.transport import teardown

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
        blamed.update({
            index: f"no answer within {timeout_s:.1f}s (frozen?)"
            for index in self.unreachable if index not in self.died
        })  # fmt: skip
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
    if calls:
        wait(calls, timeout=max(timeout_s, 0.0))
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


def first_line(error: BaseException) -> str:
    """``Type: last non-empty line of the message``, bounded: a reason for an error message."""
    text = str(error).strip() or type(error).__name__
    lines = [line for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else text}"[:500]


def settle(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless something else already did (two sources may race to)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def in_thread(
    call: Callable[[], Any], name: str = "weight-sync-call", exit_waits: bool = False
) -> Future[Any]:
    """Run a blocking call on a daemon thread of its own: a stuck peer may never return, and must
    not hold up anything else (the caller bounds its wait on the future).

    ``exit_waits``: the call blocks in C++ with the GIL released (an NCCL communicator's
    creation, an NCCL wait), so an exit waits for it, within a bound, rather than let the
    interpreter kill it inside the call (see ``transport.teardown``)."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            settle(future, result=call())
        except BaseException as exc:
            settle(future, error=exc)

    if exit_waits:
        teardown.start(name, run)
    else:
        threading.Thread(target=run, name=name, daemon=True).start()
    return future


def then(future: Future[Any], step: Callable[[Any], Any]) -> Future[Any]:
    """A future of ``step(result)``, resolved only once ``step`` has run; an error, of ``future``
    or of ``step``, passes through."""
    outer: Future[Any] = Future()

    def chain(inner: Future[Any]) -> None:
        try:
            outer.set_result(step(inner.result()))
        except BaseException as error:
            outer.set_exception(error)

    future.add_done_callback(chain)
    return outer
