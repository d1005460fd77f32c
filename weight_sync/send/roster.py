"""The members of a push as the trainer knows them, and the accounting of their calls.

The trainer reaches its members only through a ``ControlPlane``; what it knows of each one
beyond that -- which plans it holds, which delta base its weights are -- is a guess kept in step
with the plane here, member for member, so that dropping a member that died or froze drops it
everywhere at once. Settling a round of calls (every answer, or the error naming who failed) and
asking everyone to leave live here too: forming the group and pushing both need them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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


class Roster:
    """The members reached through ``plane``, with what the trainer knows of each one.

    ``known``: per member, the digests of the plans it holds, most recent last, as its own cache
    keeps them (a guess: a member that lost one asks for it, and the push goes the long way).
    ``bases``: per member, the delta base its weights are (see ``weight_sync.delta.lineage``).
    """

    def __init__(self, plane: ControlPlane, rpc_timeout_s: float) -> None:
        self.plane = plane
        self._rpc_timeout_s = rpc_timeout_s
        self.known: list[list[str]] = []
        self.bases: list[str | None] = []

    def probed(self, infos: Sequence[MemberInfo]) -> None:
        """A probe answered: the members hold no plan the trainer can count on, and the bases
        they report."""
        self.known = [[] for _ in infos]
        self.bases = [info.delta_base for info in infos]

    # -- plans held ----------------------------------------------------------------------------

    def all_hold(self, digest: str) -> bool:
        return all(digest in known for known in self.known)

    def lacking(self, digest: str, members: Sequence[int]) -> list[bool]:
        """For each of ``members``, whether it must be sent the plan ``digest`` in full."""
        return [digest not in self.known[index] for index in members]

    def learnt(self, digest: str) -> None:
        """Every member accepted the plan ``digest``: it holds it now, as its latest."""
        for index, known in enumerate(self.known):
            self.known[index] = [*(d for d in known if d != digest), digest][-PLAN_CACHE_SIZE:]

    def forgot(self, index: int, digest: str) -> None:
        """Member ``index`` asked for the plan ``digest``: it no longer holds it."""
        self.known[index] = [d for d in self.known[index] if d != digest]

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
            self.plane.drop(dropped)
            self.known = [known for i, known in enumerate(self.known) if i not in dropped]
            self.bases = [held for i, held in enumerate(self.bases) if i not in dropped]
            logger.warning(
                "dropped worker(s) %s (dead or not answering); %d left", dropped, len(self.plane)
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
