"""A member's end of pushes from many senders, whatever carries the calls to it: a Ray worker's
methods (``actors.worker``), a vLLM worker's ``collective_rpc`` (``adapters.vllm``), a vLLM
server's store, a launched job's collectives (``launch.job_sync``). The push's layout is
checked and kept here, the lanes from its senders followed (``receive.inbound.Lanes``), and
every push written to one record of what the member holds -- the ``Receiver`` of its
one-sender pushes, which those write too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from weight_sync.control.deadline import Deadline
from weight_sync.control.lane_store import Checks
from weight_sync.errors import first_line
from weight_sync.receive.assembly import Assembly, Refusal, layout_of_push
from weight_sync.receive.inbound import Lanes
from weight_sync.receive.receiver import Receiver
from weight_sync.transport.rounds import Rounds
from weight_sync.wire.blocks import BlockLayout
from weight_sync.wire.metadata import LaneCheck, LanePush, SyncStatus
from weight_sync.wire.versions import past_sent

# The lanes of the last fronts that pushed, kept by their senders: a worker that takes pushes
# from two updaters in turn (one process's, and every rank's of the same trainer) keeps both
# lane sets, their groups formed, as one sender's group and the lanes once were.
KEPT_LANES = 2


class Member:
    """What one member holds (``record``, a ``Receiver``, whichever front pushed) and the
    lanes it follows."""

    def __init__(self, record: Receiver, concurrent: bool = False) -> None:
        """``concurrent``: this member serves its weights beside a push (a Ray worker made
        with ``remote_worker``): its lanes tell their senders so (``MemberInfo``)."""
        self.record, self.concurrent = record, concurrent
        self.lanes: Lanes | None = None  # the lanes of the last push
        self._kept: dict[tuple[tuple[str, int], ...], Lanes] = {}  # by senders, oldest first
        self.layout: BlockLayout | None = None  # the last layout checked here

    def status(self) -> SyncStatus:
        """What this member holds, with its lanes' push in flight, if any."""
        return self.lanes.status() if self.lanes is not None else self.record.status()

    def holds(self, digest: str) -> bool:
        """Whether this member holds the layout ``digest`` names (else it is sent one)."""
        return self.layout is not None and self.layout.digest == digest

    def check(
        self,
        layout_json: str | None,
        digest: str,
        version: int,
        max_metadata_bytes: int,
        problems: Callable[[BlockLayout], Sequence[str]],
    ) -> list[str]:
        """What of a push this member cannot take -- empty: all of it --, before any byte moves:
        its layout (``layout_json``, bounded and validated; None where this member holds it),
        whatever ``problems`` finds in it against the member's weights, and ``version``, which
        must be past every version this member was sent (by one sender or many)."""
        layout = layout_of_push(layout_json, digest, self.layout, max_metadata_bytes)
        if isinstance(layout, str):
            return [layout]
        self.layout = layout
        return [*problems(layout), *past_sent(version, self.record.highest_version)]

    def take(
        self,
        call: LanePush,
        problems: Callable[[BlockLayout], Sequence[str]],
        target: Callable[[BlockLayout], Assembly],
        name: str,
        answer: Callable[[str], None] | None = None,
        turn: Callable[[Callable[[], None]], None] | None = None,
    ) -> int | None:
        """Rank 0's ``call`` in one step: the senders' lanes followed (``follow``), the push
        checked (``checked``: the layout read from rank 0's store if this member lacks it), and
        taken on every lane at once as each opens (``receive``), into ``target(layout)`` (what
        ``problems`` checked it against: the user's hooks are asked once a push) -- where the
        check found problems (a hook that raised is one), refused on every lane with them
        (``Refusal``): nothing moves anywhere and every sender raises the refusal. Returns the
        version held; ``name`` names this member in its problems and errors. ``answer``: where
        the call asks for it (``LanePush.answer``), the reply of rank 0's lane, if it committed
        in the step the call carried, goes there (``Lanes.receive``); ``turn``: a staged push's
        bytes are applied in it (``Lanes.receive``)."""
        lanes = self.follow_call(call)
        deadline = Deadline(call.wait_s, f"the lanes of push {call.check.push}")
        found = self.checked(lanes.checks, call.check, problems, name)
        layout = self.layout if self.holds(call.check.digest) else None
        if not found and layout is not None:
            assembly = target(layout)  # what ``problems`` checked the layout against
        else:
            unread = BlockLayout(senders=len(call.endpoints), tensors=(), blocks=())
            assembly = Refusal(layout or unread, found)
        left_s = max(1.0, deadline.remaining())
        answered = answer if call.answer else None
        push, version = call.check.push, call.check.version
        firsts = call.firsts
        return self.receive(assembly, push, version, left_s, name, firsts, answered, turn)

    def answer(
        self,
        checks: Checks,
        slot: int,
        check: LaneCheck,
        problems: Callable[[BlockLayout], Sequence[str]],
        name: str,
    ) -> None:
        """Answer ``check`` in rank 0's store (``checks``) as member ``slot``: what of the push
        this member cannot take (``checked``) -- where rank 0 asks before the lanes open
        (``vllm serve``'s ``start_weight_update``)."""
        checks.answer(check.push, slot, self.checked(checks, check, problems, name))

    def checked(
        self,
        checks: Checks,
        check: LaneCheck,
        problems: Callable[[BlockLayout], Sequence[str]],
        name: str,
    ) -> list[str]:
        """What of ``check``'s push this member cannot take (``check``; the layout read through
        ``checks`` if this member lacks it). A check that failed is one problem."""
        digest, limit = check.digest, check.max_metadata_bytes
        try:
            layout = None if self.holds(digest) else checks.layout(digest, limit)
            return self.check(layout, digest, check.version, limit, problems)
        except Exception as exc:  # a refusal like any other
            return [f"{name} could not check the push: {first_line(exc)}"]

    def follow_call(self, call: LanePush) -> Lanes:
        """``follow`` the lanes rank 0's ``call`` names, as its member ``slot``, dialling each
        sender's store within what the call may wait (at most a minute)."""
        return self.follow(call.endpoints, call.slot, min(call.wait_s, 60.0))

    def lanes_from(self, endpoints: Sequence[Sequence[Any]]) -> Lanes | None:
        """This member's lanes from the senders at ``endpoints``, if it keeps them (else None:
        it has none, or lanes of ``KEPT_LANES`` other fronts took their place)."""
        return self._kept.get(tuple(addresses(endpoints)))

    def follow(
        self,
        endpoints: Sequence[Sequence[Any]],
        slot: int,
        timeout_s: float,
        rounds: Rounds | None = None,
    ) -> Lanes:
        """Follow the lanes of the senders at ``endpoints`` as member ``slot`` of each (dialled
        again only when either changed), their buckets over ``rounds`` of one group, if given
        (then always anew: it is a new group); they are ``lanes`` from now. ``timeout_s`` bounds
        dialling each sender's store. The lanes of the last ``KEPT_LANES`` fronts are kept,
        the oldest left; new lanes are made before any are left: where they cannot be, this
        member keeps the lanes it had."""
        key = tuple(addresses(endpoints))
        held = self._kept.get(key)
        if held is not None and held.slot == slot and rounds is None:
            self._kept[key] = self.lanes = self._kept.pop(key)  # the most recent last
            return held
        device, record = (lambda: self.record.device), self.record
        lanes = Lanes(list(key), slot, device, timeout_s, rounds, record, self.concurrent)
        if held is not None:  # replaced, once the new ones stand
            self._kept.pop(key).close()
        while len(self._kept) >= KEPT_LANES:
            self._kept.pop(next(iter(self._kept))).close()
        self._kept[key] = self.lanes = lanes
        return lanes

    def leave(self, endpoints: Sequence[Sequence[Any]]) -> None:
        """The senders at ``endpoints`` left: let go of their lanes, if it keeps them. What they
        landed stays in ``record``."""
        lanes = self._kept.pop(tuple(addresses(endpoints)), None)
        if lanes is not None:
            lanes.close()
            if self.lanes is lanes:
                self.lanes = None

    def receive(
        self,
        assembly: Assembly,
        push: int,
        version: int,
        wait_s: float,
        name: str,
        firsts: Sequence[str | None] | None = None,
        answer: Callable[[str], None] | None = None,
        turn: Callable[[Callable[[], None]], None] | None = None,
    ) -> int | None:
        """Take push ``push`` (of ``version``) on every lane at once, landing where
        ``assembly`` says (``Lanes.receive``, with ``firsts``, ``answer`` and ``turn``);
        ``name`` names this member in errors."""
        assert self.lanes is not None, "follow the senders' lanes first"
        return self.lanes.receive(assembly, push, version, wait_s, name, firsts, answer, turn)

    def close(self) -> None:
        """Leave every lane kept (and the one group their buckets came over, if they did)."""
        kept, self._kept, self.lanes = list(self._kept.values()), {}, None
        for lanes in kept:
            lanes.close()


def addresses(endpoints: Sequence[Sequence[Any]]) -> list[tuple[str, int]]:
    """Senders' stores as a member compares them (Ray and JSON hand tuples back as lists)."""
    return [(str(address), int(port)) for address, port in endpoints]
