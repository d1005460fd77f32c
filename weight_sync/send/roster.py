"""The members of a push as the trainer knows them, and the accounting of their calls.

The trainer reaches its members only through a ``ControlPlane``; what it knows of each one
beyond that -- which plans it holds, which delta base its weights are -- is a guess kept in step
with the plane here, member for member, so that dropping a member that died or froze drops it
everywhere at once. Settling a round of calls (every answer, or the error naming who failed) and
asking everyone to leave live here too: forming the group and pushing both need them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from concurrent.futures import Future
from typing import Any

from weight_sync.control.deadline import Deadline
from weight_sync.control.plane import ControlPlane, Outcomes, collect
from weight_sync.errors import WeightSyncError
from weight_sync.wire.metadata import PLAN_CACHE_SIZE, MemberInfo

logger = logging.getLogger(__name__)

# After a failure, how long past its own timeout a member's call may take to report (latency of
# the control plane on a loaded node); a member silent beyond that is taken for frozen.
GRACE_S = 5.0


class Held:
    """The plans (or layouts) each member holds, as far as its sender knows: per member their
    digests, most recent last, as many as the member's own cache keeps (``size``). A guess kept
    so that a plan travels in full only to members that lack it: a member that lost one asks
    for it (or refuses), and the push goes the long way. The one record of it, whatever the
    front: ``Roster`` keeps one for one sender's members, ``RayLanes`` for its workers."""

    def __init__(self, members: int = 0, size: int = PLAN_CACHE_SIZE) -> None:
        assert size >= 1, "a member holds at least the plan it was last sent"
        self._size = size
        self._digests: list[list[str]] = [[] for _ in range(members)]

    def __len__(self) -> int:
        return len(self._digests)

    def reset(self, members: int | None = None) -> None:
        """Count on nothing any member holds (``members``: how many there are from now)."""
        self._digests = [[] for _ in range(len(self) if members is None else members)]

    def all_hold(self, digest: str) -> bool:
        return all(digest in held for held in self._digests)

    def lacking(self, digest: str, members: Sequence[int] | None = None) -> list[bool]:
        """For each of ``members`` (default: every one), whether it must be sent ``digest`` in
        full."""
        chosen = range(len(self)) if members is None else members
        return [digest not in self._digests[index] for index in chosen]

    def learnt(self, digest: str, members: Sequence[int] | None = None) -> None:
        """``members`` (default: every one) accepted ``digest``: they hold it now, as their
        latest (the oldest beyond ``size`` falls out, as from the member's own cache)."""
        for index in range(len(self)) if members is None else members:
            held = [*(d for d in self._digests[index] if d != digest), digest]
            self._digests[index] = held[-self._size :]

    def forgot(self, member: int, digest: str | None = None) -> None:
        """``member`` asked for ``digest``: count on it no more (None: on nothing it holds --
        it refused a push, and what it kept of it is not known)."""
        self._digests[member] = [d for d in self._digests[member] if digest not in (None, d)]

    def drop(self, members: Collection[int]) -> None:
        """``members`` are gone: the others keep their places, in order."""
        self._digests = [held for i, held in enumerate(self._digests) if i not in members]


class Roster:
    """The members reached through ``plane``, with what the trainer knows of each one.

    ``plans``: the plans each holds (``Held``). ``bases``: per member, the delta base its
    weights are (see ``weight_sync.delta.lineage``).
    """

    def __init__(self, plane: ControlPlane, rpc_timeout_s: float) -> None:
        self.plane = plane
        self._rpc_timeout_s = rpc_timeout_s
        self.plans = Held()
        self.bases: list[str | None] = []

    def probed(self, infos: Sequence[MemberInfo]) -> None:
        """A probe answered: the members hold no plan the trainer can count on, and the bases
        they report."""
        self.plans.reset(len(infos))
        self.bases = [info.delta_base for info in infos]

    # -- gathering answers -----------------------------------------------------------------------

    def replies(self, calls: Sequence[Future[Any]], what: str, timeout_s: float) -> list:
        """Every member's answer, or (dropping the dead and frozen) the error naming who failed."""
        outcomes = collect(self.plane, calls, timeout_s)
        if not outcomes.ok:
            raise self.blame(outcomes, what, timeout_s)
        return outcomes.results

    def blame_late(
        self,
        calls: Sequence[Future[Any]],
        what: str,
        wait_s: float,
        timeout_s: float | None = None,
    ) -> WeightSyncError | None:
        """After a failure here: wait ``wait_s`` for the members' calls, then the error naming
        (and dropping) who failed, or None if every call succeeded after all. ``timeout_s`` is
        the bound the error quotes, when the members had longer than ``wait_s``."""
        outcomes = collect(self.plane, calls, wait_s)
        quoted = wait_s if timeout_s is None else timeout_s
        return None if outcomes.ok else self.blame(outcomes, what, quoted)

    def blame(self, outcomes: Outcomes, what: str, timeout_s: float) -> WeightSyncError:
        dropped = outcomes.unreachable
        if dropped:
            before = len(self.plane)
            self.plane.drop(dropped)
            self.plans.drop(dropped)
            self.bases = [held for i, held in enumerate(self.bases) if i not in dropped]
            if len(self.plane) < before:  # (a store plane's members are counted by its owner)
                logger.warning(
                    "dropped worker(s) %s (dead or not answering); %d left",
                    dropped,
                    len(self.plane),
                )
        return outcomes.error(what, timeout_s, dropped)

    # -- bounded requests ----------------------------------------------------------------------

    def cancel(self, version: int, members: list[int], deadline: Deadline) -> None:
        """Tell members that accepted a push refused elsewhere to drop it (an engine that paused
        its generation for the push resumes). Bounded; a member that cannot act on it drops the
        push at its next prepare anyway."""
        wait_s = min(GRACE_S, deadline.remaining())
        outcomes = collect(self.plane, self.plane.cancel(version, members, wait_s), wait_s)
        if not outcomes.ok:
            logger.warning("cancelling a refused push: %s", outcomes.error("cancel", wait_s))

    def leave(self, deadline: Deadline | None = None) -> None:
        """Ask every member to leave, waiting at most what is left of ``deadline``: the request is
        sent either way, and a member that cannot act on it is left to its own timeouts."""
        if not len(self.plane):
            return
        wait_s = min(GRACE_S, self._rpc_timeout_s)
        if deadline is not None:
            wait_s = min(wait_s, deadline.remaining())
        outcomes = collect(self.plane, self.plane.leave(wait_s), wait_s)
        if not outcomes.ok:
            logger.warning(
                "some workers did not leave the sync group cleanly: %s",
                outcomes.error("leave", wait_s),
            )
