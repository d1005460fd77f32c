"""The members' side of a push from several senders: a member following each sender's lane
(``Inbound``, driving a ``StoreMember``), its blocks placed by a ``receive.assembly.Assembly``
(``Lanes``: a thread per lane). A member holds a version only once every lane committed it
there; one that saw a sender's store close reports for it, so the verdict comes at once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from weight_sync.control.deadline import Deadline
from weight_sync.control.keys import StoreGoneError, wait_one
from weight_sync.control.lane_store import (
    BEGIN,
    CLOSE,
    COMMAND,
    VERDICTS,
    Checks,
    Verdicts,
)
from weight_sync.control.store import (
    MAX_REPLY_CHARS,
    PREFIX,
    StoreMember,
)
from weight_sync.errors import (
    PlanMismatchError,
    SenderFailedError,
    TransportError,
    WeightSyncError,
    first_line,
)
from weight_sync.receive.assembly import Assembly
from weight_sync.receive.receiver import Loader, Receiver, expecting
from weight_sync.transport.rendezvous import open_store
from weight_sync.transport.rounds import Rounds
from weight_sync.wire.blame import CalledOff, lanes_failed
from weight_sync.wire.metadata import NO_LANE, Phase, ReceiveReport, SyncStatus
from weight_sync.wire.versions import held_across_lanes

logger = logging.getLogger(__name__)

_PHASES = typing.get_args(Phase)  # a push's phases in the order it goes through them


class Lanes:
    """A member's lanes from ``endpoints`` (each sender's store, in sender order), as member
    ``slot`` (1-based) of each.

    What the member holds is one record, ``record``: the receiver of its one-sender pushes
    where it takes those too (a worker, a vLLM worker), else one of the lanes' own. A push
    writes it as any push does -- no version claimed from the first byte, the version once
    every lane committed -- so a member's status reads one state, whichever senders pushed.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        slot: int,
        device: Callable[[], torch.device],
        timeout_s: float,
        rounds: Rounds | None = None,
        record: Receiver | None = None,
        concurrent: bool = False,
    ) -> None:
        """``timeout_s`` bounds dialling each sender's store. ``rounds``: the lanes' buckets
        come over one group, taken in its rounds (each lane's own group then only votes).
        ``record``: what this member holds (see the class), kept from before these lanes.
        ``concurrent``: the member serves its weights beside a push (``MemberInfo``)."""
        self.endpoints, self.slot = list(endpoints), slot
        self.rounds = rounds
        self.record = record if record is not None else Receiver(device)
        self.inbound = [
            Inbound(
                address,
                port,
                slot,
                device,
                timeout_s,
                (rounds, sender) if rounds is not None else None,
                concurrent,
            )
            for sender, (address, port) in enumerate(endpoints)
        ]
        rank_0 = dist.PrefixStore(VERDICTS, self.inbound[0].raw_store)
        self.verdicts = Verdicts(rank_0, len(endpoints))
        self.checks = Checks(rank_0)  # each push's check, answered before its lanes begin
        # ``record.changes`` when these lanes last wrote it: where it moved since (one sender
        # pushed, or the lanes are new), each lane's receiver takes what it says first.
        self._synced: int | None = None
        self._receiving = False
        self._closed = False

    def receive(
        self,
        assembly: Assembly,
        push: int,
        version: int,
        wait_s: float,
        member: str,
        firsts: Sequence[str | None] | None = None,
        answer: Callable[[str], None] | None = None,
        turn: Callable[[Callable[[], None]], None] | None = None,
    ) -> int | None:
        """Push ``push`` (of ``version``) on every lane the layout gives blocks to, each on a
        thread of its own (one lane: on the caller's), landing where ``assembly`` says. Returns
        the version every lane committed, or raises: the lanes' common error (a refusal, a push
        called off), else ``SenderFailedError`` naming the senders whose lanes did not commit
        here (``member`` names this one); where no lane's byte reached the model (refused,
        called off), the version held stays. A layout with no block (no tensor has an element)
        moves nothing: the version stays, and is not spent. ``firsts``: how each lane opens, as
        rank 0's call says (``LanePush.firsts``: which senders have a lane, and the one-step
        pushes it carries). ``answer``: where rank 0's lane commits here in the step carried,
        its reply goes there (the call returns it: ``LanePush.answer``), not into its store.
        ``turn``: the push is staged (atomic), and each lane applies its bytes in this turn
        (``buckets.Loader.turn``); the member holds the version it held until the first does
        (else it holds none from the first byte)."""
        if firsts is None:
            firsts = [
                None if assembly.layout.sent_by(s) else NO_LANE for s in range(len(self.inbound))
            ]
        active = {s: lane for s, lane in enumerate(self.inbound) if firsts[s] != NO_LANE}
        if not active:  # no tensor has an element: nothing moves, the version stays
            return self.record.version
        self.record.saw(version)  # spent here from now, landed or not: never sent again
        if self.record.changes != self._synced:
            self._adopt(self.record.status())
        # From the first byte the lanes land apart (staged: from the first apply): this member
        # holds neither the version it held nor, until every lane commits, a whole one (as a
        # one-sender receiver's state).
        if turn is None:
            before = self.record.changing()
        else:
            before, turn = self.record.status(), functools.partial(_changing, self.record, turn)
        for sender, lane in active.items():
            lane.member.retarget(
                assembly.check(sender),
                functools.partial(_loader, assembly, sender, turn),
                functools.partial(assembly.destinations, sender),
            )
        self._receiving = True
        versions = {sender: lane.member.receiver.version for sender, lane in active.items()}
        if self.rounds is not None:
            self.rounds.begin(active)

        def outcome(sender: int, lane: Inbound) -> tuple[int | None, BaseException | None]:
            try:
                first, answered = firsts[sender], answer if sender == 0 else None
                return self._lane(sender, lane, wait_s, push, first, answered), None
            except Exception as exc:
                return None, exc

        if len(active) == 1:  # one lane (a push from one sender): on this thread
            outcomes = {s: outcome(s, lane) for s, lane in active.items()}
        else:
            with ThreadPoolExecutor(len(active), thread_name_prefix="weight-sync-lane") as pool:
                calls = {s: pool.submit(outcome, s, lane) for s, lane in active.items()}
                outcomes = {s: call.result() for s, call in calls.items()}
        self._receiving = False
        try:
            held = self._settle(outcomes, assembly, push, member)
        except Exception as exc:
            untouched = all(
                lane.member.receiver.version == versions[sender] and not lane.member.receiver.dirty
                for sender, lane in active.items()
            )  # no lane committed (a lane may commit and then fail), nor wrote a byte
            self._write(before if untouched else _unheld(before), first_line(exc))
            raise
        full = before.full_version if assembly.layout.partial else held
        statuses = [lane.member.receiver.status() for lane in active.values()]
        self._write(
            before.model_copy(
                update={
                    "version": held,
                    "full_version": full,
                    "dirty": False,
                    "buckets_done": sum(status.buckets_done for status in statuses),
                    "buckets_total": sum(status.buckets_total for status in statuses),
                    "last": _together([status.last for status in statuses]),
                }
            ),
            None,
        )
        return held

    def _adopt(self, status: SyncStatus) -> None:
        """Each lane's receiver holds what the member does (the versions a partial push is
        checked against; no delta base: the model's bytes came by another route)."""
        for lane in self.inbound:
            lane.member.receiver.adopt(status)

    def _write(self, status: SyncStatus, error: str | None) -> None:
        """What the member holds after a push of these lanes (unless they were left meanwhile:
        ``close`` said what it holds then)."""
        if not self._closed:
            self.record.adopt(status.model_copy(update={"last_error": error}))
            self._synced = self.record.changes

    def _lane(
        self,
        sender: int,
        lane: Inbound,
        wait_s: float,
        push: int,
        first: str | None,
        answer: Callable[[str], None] | None,
    ) -> int:
        """One lane's receive, on its thread; over one group its rounds go on without it after."""
        try:
            version = lane.receive(wait_s, push, first, answer)
        except BaseException:
            if self.rounds is not None:
                self.rounds.done(sender, failed=True)
            raise
        if self.rounds is not None:
            self.rounds.done(sender)
        return version

    def _settle(
        self,
        outcomes: Mapping[int, tuple[int | None, BaseException | None]],
        assembly: Assembly,
        push: int,
        member: str,
    ) -> int:
        """The version every lane committed, or the error ``receive`` raises."""
        failed = {s: error for s, (_, error) in outcomes.items() if error is not None}
        gone = [sender for sender in failed if self.inbound[sender].sender_gone]
        for sender in gone:
            if sender:  # rank 0 holds the verdicts' store: gone, it hears no report
                why = f"its store closed on {member} ({first_line(failed[sender])})"
                self.verdicts.report_for(push, sender, why)
        if failed:
            assembly.forget()
            raise lanes_failed(member, failed, len(outcomes), gone)
        versions = [version for version, _ in outcomes.values()]
        held = held_across_lanes(versions)
        if held is None:
            raise SenderFailedError(f"the lanes committed different versions: {versions}")
        return held

    def lost(self, why: str) -> None:
        """What every lane committed did not reach the model after all (an engine's reload
        failed): this member holds no version, and says ``why``."""
        self._write(_unheld(self.record.status()), why)

    def status(self) -> SyncStatus:
        """This member's state (``record``), with a push of these lanes in flight at its least
        advanced lane's phase and the buckets of every lane; in a group where every lane is."""
        held = self.record.status()
        lanes = [lane.member.receiver.status() for lane in self.inbound]
        in_group = held.in_group or all(status.in_group for status in lanes)
        busy = [status.phase for status in lanes if status.phase != "idle"]
        if not busy:
            return held.model_copy(update={"in_group": in_group})
        pushing = [status.pushing for status in lanes if status.pushing is not None]
        return held.model_copy(
            update={
                "phase": min(busy, key=_PHASES.index),
                "pushing": max(pushing, default=None),
                "buckets_done": sum(status.buckets_done for status in lanes),
                "buckets_total": sum(status.buckets_total for status in lanes),
                "in_group": in_group,
            }
        )

    def close(self) -> None:
        """Leave every lane, and the one group their buckets came over (if they did). Left
        mid-push (the senders gave up on this member), the member holds no version."""
        if self._receiving:
            self._write(_unheld(self.record.status()), "it left its lanes mid-push")
        self._closed = True
        for lane in self.inbound:
            lane.member.shutdown()
        if self.rounds is not None:
            self.rounds.group.close()


class Inbound:
    """A receiving rank's lane from one sender: that sender's commands, read in order, and the
    ``Receiver`` that takes its pushes."""

    def __init__(
        self,
        address: str,
        port: int,
        slot: int,
        device: Callable[[], torch.device],
        timeout_s: float,
        over: tuple[Rounds, int] | None = None,
        concurrent: bool = False,
    ) -> None:
        """``over``: the lane's buckets come over one group, taken in these rounds as this
        lane (its own group then only votes: ``ReceiveLane``). ``concurrent``: as ``Lanes``."""
        self.slot = slot
        self.raw_store = open_store(address, port, 1, timeout_s, None)
        self.store = dist.PrefixStore(PREFIX, self.raw_store)
        self.sender_gone = False  # its store closed: the sender's process died or left
        self._over = over
        wrap = functools.partial(over[0].lane, over[1]) if over is not None else None
        # Over one group a lane's receive first tells the rounds it was agreed (``update``):
        # no one-call pushes there, whose agreement is a vote inside the call.
        self.member = StoreMember(
            Receiver(device, wrap),
            expecting(lambda: None),
            lambda: Loader(_unset),
            one_call=over is None,
            concurrent=concurrent,
        )
        self._next = 0  # the next command's number

    def receive(
        self,
        wait_s: float,
        push: int,
        first: str | None = None,
        answer: Callable[[str], None] | None = None,
    ) -> int:
        """Take push number ``push`` of this lane, waiting at most ``wait_s`` for it to begin
        and as long again between steps; its version as soon as it committed here (the
        sender's ``end`` is not waited for), else raises once the sender ended it. ``first``:
        the push in one step (a ``PrepareRequest``), taken before the store is read -- rank 0's
        call carried it, not the sender's store (``send.senders.Opening``); committed, the
        store is not read at all. The rest is read from the push's ``begin`` (its number under
        ``BEGIN``), whatever went before it: the steps of earlier pushes this rank gave up on (a
        member that gave up waiting for push 3 and is then asked for push 4 does not take 3,
        sent late, for it), or that the sender deleted since (``Commands.post``). ``answer``:
        where ``first`` commits here, its reply goes there rather than into the store
        (``StoreMember.push``)."""
        failure: WeightSyncError | None = None
        if first is not None:
            try:
                committed = self._step("push", {"request": first}, answer)
            except Exception as exc:  # answered to the sender already; its ``end`` follows
                failure = self._failure("push", exc)
            else:
                if committed is not None:
                    return committed
        deadline = Deadline(wait_s, "waiting for the sender's push")
        begin = int(self._wait_for(f"{BEGIN}{push}", deadline, None))
        began = self._next <= begin  # else this rank read past it already (and raises below)
        if began:  # its ``begin`` command says no more than its key did: not read
            self._next, deadline = begin + 1, Deadline(wait_s, "the sender's push")
        while True:
            op, arg = self._command(deadline, failure)
            if op == CLOSE:
                raise WeightSyncError("the sender closed its end: no more pushes will come")
            if not began:  # steps left of a push this rank gave up on are skipped
                if op == "begin" and self._begins(int(arg["push"]), push):
                    began, deadline = True, Deadline(wait_s, "the sender's push")
                continue
            if op == "end":
                self._ended(arg, failure)
            try:
                committed = self._step(op, arg)
            except Exception as exc:  # answered to the sender already; its verdict follows
                failure = self._failure(op, exc)
                continue
            if committed is not None:  # held here, whatever fails elsewhere after: not waiting
                return committed  # for the sender's ``end``, which could say nothing more

    def _failure(self, op: str, exc: Exception) -> WeightSyncError:
        """What a step that raised makes this lane raise once its sender ends the push."""
        if isinstance(exc, WeightSyncError):
            return exc
        return TransportError(f"member {self.slot}: {op} failed: {first_line(exc)}")

    def _begins(self, number: int, wanted: int) -> bool:
        """Whether the push beginning, ``number``, is the one wanted: False for an earlier one
        (skipped); a later one is left unread for the receive that asks for it, and raises."""
        if number > wanted:
            self._next -= 1
            raise WeightSyncError(
                f"member {self.slot}: the sender began push {number}, past push {wanted} this "
                "rank was asked to take; it fell behind -- receive the pushes in order"
            )
        return number == wanted

    def _step(
        self, op: str, arg: dict[str, Any], answer: Callable[[str], None] | None = None
    ) -> int | None:
        """Run one step of the sender's push; returns the version when it committed here."""
        member = self.member
        if op == "init":
            member.init(**arg, slot=self.slot)
        elif op == "start":
            member.start()
        elif op == "update":
            # Every member accepted the push: over one group, its sender sends to this rank
            # now, so this lane ending before its last round aborts the group -- the sender
            # and the others told at once, not at their bound (``Rounds.done``).
            if self._over is not None:
                self._over[0].agreed(self._over[1])
            if member.receive(int(arg["version"])):  # committed on receipt
                return int(arg["version"])
        elif op == "push":  # the whole push in one step, where every member offered it
            if member.push(str(arg["request"]), answer):
                return member.receiver.version
        elif op == "finish":
            version = member.pushing
            if member.finish():
                return version
        elif op == "shutdown":
            member.shutdown()
        return None

    def _wait_for(self, key: str, deadline: Deadline, failure: WeightSyncError | None) -> str:
        """``key``'s value in the sender's store once it is there, within ``deadline``; raises
        ``failure`` (what this rank saw first), else ``TransportError``, if the sender is gone."""
        try:
            return wait_one(self.store, key, deadline).decode()
        except StoreGoneError as exc:
            self.sender_gone = True
            if failure is not None:
                raise failure from None  # what this rank saw first: the sender left mid-push
            raise TransportError(
                f"the sender's store stopped answering ({first_line(exc)}); it died or left "
                "-- check it"
            ) from exc

    def _ended(self, arg: dict[str, Any], failure: WeightSyncError | None) -> NoReturn:
        """The push is over on the sender, not committed here: ``arg`` says how it ended
        there; raises what this rank makes of it."""
        member = self.member
        if member.pushing is not None:  # no verdict reached this rank: drop what it prepared
            member.receiver.cancel(member.pushing)
            member.pushing = None
        if member.prepared is not None and not member.prepared.accepted:
            raise PlanMismatchError({self.slot - 1: member.prepared.problems})
        if failure is not None:
            raise failure
        raise CalledOff(
            f"the sender's push was called off ({arg.get('error', 'see its error')}); nothing "
            "committed here"
        )

    def _command(
        self, deadline: Deadline, failure: WeightSyncError | None
    ) -> tuple[str, dict[str, Any]]:
        """The next step the sender asks for, waiting within ``deadline``.

        One blocking ``TCPStore.wait`` rather than a poll: the store answers the moment the
        sender posts the key (about 0.2 ms on a loaded 2-core VM; a poll's pause was 2-50 ms per
        step of every push), and a dead sender closes the connection, which ends the wait at
        once. It is not sliced: each wait that times out makes c10d log two warnings, so only
        the last one, at the deadline, may."""
        raw = self._wait_for(f"{COMMAND}{self._next}", deadline, failure)
        self._next += 1
        if len(raw) > MAX_REPLY_CHARS:
            raise WeightSyncError(f"a command of {len(raw)} bytes exceeds {MAX_REPLY_CHARS}")
        command = json.loads(raw)
        return str(command["op"]), dict(command["arg"])


def _loader(
    assembly: Assembly, sender: int, turn: Callable[[Callable[[], None]], None] | None
) -> Loader:
    loader = Loader(assembly.loader(sender), keeps=assembly.keeps)
    return loader if turn is None else dataclasses.replace(loader, turn=turn)


def _changing(
    record: Receiver, turn: Callable[[Callable[[], None]], None], apply: Callable[[], None]
) -> None:
    """``apply`` a lane's staged bytes in ``turn``, the member's record changing first."""

    def changing() -> None:
        record.changing()
        apply()

    turn(changing)


def _together(reports: Sequence[ReceiveReport | None]) -> ReceiveReport | None:
    """The lanes' reports of one push as one: bytes and buckets summed, the slowest lane's
    seconds, every lane's checksums in lane order (where every lane kept them)."""
    if not reports or None in reports:
        return None
    kept = [r for r in reports if r is not None]
    checked = all(r.checksums is not None for r in kept)
    return ReceiveReport(
        version=kept[0].version,
        nbytes=sum(r.nbytes for r in kept),
        buckets=sum(r.buckets for r in kept),
        seconds=max(r.seconds for r in kept),
        checksums=tuple(c for r in kept for c in r.checksums or ()) if checked else None,
    )


def _unheld(status: SyncStatus) -> SyncStatus:
    """``status`` once bytes of a push that did not commit reached the model: no version."""
    return status.model_copy(update={"version": None, "full_version": None, "dirty": True})


def _unset(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    raise AssertionError("a lane's target is set before any push")
