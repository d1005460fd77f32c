"""The senders' side of a push from several senders: each sender's lane (``Outbound``), the
agreement before any byte and the verdict after (``Senders``, ``push_share``).

A sharded trainer pushing from every rank is K lanes at once (docs/many-senders.md): each
sender's ordinary push (``Pusher``) over a store of its own, which every member reads
(``receive.inbound``); every sender reports how its lane ended in rank 0's store, rank 0
judges (``wire.blame.judge``), and every sender returns or raises together.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from weight_sync.config import SyncConfig
from weight_sync.control.deadline import Deadline
from weight_sync.control.lane_store import CLOSE, VERDICTS, Commands, Deaths, Verdicts
from weight_sync.control.store import Answers, ClientPlane
from weight_sync.errors import (
    PlanMismatchError,
    SenderFailedError,
    TransportError,
    WeightSyncError,
    WorkerFailedError,
    first_line,
)
from weight_sync.result import PushResult
from weight_sync.send.collectives import (
    ControlGroup,
    OneRank,
    any_rank,
    control_group,
    formed_everywhere,
    from_rank_0,
    gather_bytes,
    gather_rows,
    share_endpoints,
)
from weight_sync.send.pusher import Pusher
from weight_sync.send.sharded import ShardedSource
from weight_sync.transport import TorchGroup, bind_listener, listen_address
from weight_sync.transport.base import Transport
from weight_sync.transport.devices import current_gpu
from weight_sync.transport.rendezvous import open_store
from weight_sync.transport.rounds import LanePath, SendLane, lane_paths_over
from weight_sync.wire.blocks import BlockLayout
from weight_sync.wire.lane_rules import (
    Layouts,
    Share,
    config_disagreement,
    config_row,
    proposal,
    share_of,
)
from weight_sync.wire.metadata import MAX_FIRST_CHARS, NO_LANE, GroupSpec
from weight_sync.wire.state_dict import Entries, StateDict

logger = logging.getLogger(__name__)

_LINGER_S = 1.0  # a sender keeps its store this long after posting close


class Outbound:
    """A sender's lane: its commands in a store of its own, which its receiving ranks read,
    and the ``Pusher`` of its pushes."""

    def __init__(
        self,
        config: SyncConfig,
        receivers: int,
        wrap: Callable[[Transport], Transport] | None = None,
    ) -> None:
        """``wrap``: what the lane's group is used through (over one group: ``SendLane``)."""
        self.commands = Commands()
        self.plane = ClientPlane(self.commands, receivers, config)
        self.commands.plane = self.plane
        self.pusher = Pusher(self.plane, config, wrap=wrap)
        self._pushes = 0

    @property
    def address(self) -> tuple[str, int]:
        """Where its members dial its store."""
        return self.plane.address

    def push(
        self,
        state_dict: StateDict | Entries | ShardedSource,
        options: Mapping[str, Any],
        number: int | None = None,
    ) -> PushResult:
        """One push, framed by ``begin`` and ``end`` commands whatever happens between: a member
        ends its receive with the push, and skips what is left of one it gave up on. ``number``
        names the push in its frames (default: this lane's count), so that a member asked for
        push ``number`` skips the frames of any earlier one it gave up on before it began."""
        self._pushes = number if number is not None else self._pushes + 1
        frame = {"push": self._pushes}
        self.commands.post("begin", frame, new_push=True)
        try:
            result = self.pusher.push(state_dict, **options)
        except BaseException as exc:
            try:
                self._open()
            finally:
                self.commands.post("end", {**frame, "error": first_line(exc)})
            raise
        self._open()
        self.commands.landed({**frame, "version": result.version})
        return result

    def recount(self, members: int) -> None:
        """The members are now ``members`` (some were dropped or added): the lane forms again
        over them at its next push, each member answering as the slot it is called with."""
        self.plane.recount(members)
        self.pusher.regroup()

    def _open(self) -> None:
        """A push that ended before its first step (it failed first) opens now, with none
        (``Opening``): its members, called once every sender opened, read its ``end``."""
        if self.commands.unopened() and self.commands.carry is not None:
            self.commands.carry("", {})

    def close(self) -> None:
        try:
            self.pusher.close()
            self.commands.post(CLOSE, {})
        except Exception as exc:  # leaving must not fail over a peer already gone
            logger.warning("closing a lane: %s", exc)
        finally:
            # The store lingers a moment: ranks polling read the close, not its absence.
            timer = threading.Timer(_LINGER_S, self.plane.close)
            timer.daemon = True
            timer.start()


class Opening:
    """How each sender's lane of a push opens, told to rank 0 before the members are called
    (where rank 0 calls them: Ray workers, ``RayLanes``). Each sender says so once a push, at
    its lane's first step (``carry``, the ``Commands.carry`` of its lane): the step itself where
    it is the whole push in one step (the steady state) and small enough to ride in rank 0's call
    on every member -- then it is not posted in the sender's store, and a member that takes it
    from the call makes no round trip to that store --, else that the lane's steps are in its
    store, or that it has no lane (``say``). Once every sender said (one all-gather over their
    control group), rank 0 ``call``s the members with every lane's opening: the members' check
    before any byte, and their lanes, begin only then -- so a lane that forms or goes the long way
    finds them reading its store. Where rank 0's lane is the push's only one, its members may
    answer it in their calls (``LanePush.answer``): ``call`` returns those calls, by member
    slot, and rank 0's lane takes their replies from them (``ClientPlane.push``)."""

    def __init__(
        self,
        control: ControlGroup,
        senders: int,
        rank: int,
        call: Callable[[list[str | None]], Answers],
    ) -> None:
        self._control, self._senders, self._rank, self._call = control, senders, rank, call
        self._said = True  # no push begun
        self._lanes: list[bool] = []  # which senders have a lane in the push under way

    def begin(self, layout: BlockLayout) -> None:
        """Push ``layout`` begins: every sender says how its lane opens, once."""
        self._said = False
        self._lanes = [bool(layout.sent_by(sender)) for sender in range(self._senders)]

    def carry(self, op: str, arg: Mapping[str, Any]) -> Answers | None:
        """The lane's first step, ``op`` with ``arg`` (none: ``op`` empty): where rank 0's
        call carries it (a push in one step, small enough), the calls that return replies
        (``say``); else None, and it goes in the store."""
        request = arg.get("request") if op == "push" else None
        carried = isinstance(request, str) and len(request) <= MAX_FIRST_CHARS
        answers = self.say(request if carried else None)
        return answers if carried else None

    def say(self, first: str | None) -> Answers | None:
        """This sender's lane opens with ``first``: ``NO_LANE``, None (its store) or a
        ``PrepareRequest``'s JSON. Returns the calls that return replies of this lane (rank 0's
        ``call``; none elsewhere), or None where a sender's word did not come: where a sender
        left before saying, every lane goes through its store after all -- rank 0 calls the
        members all the same, and the lanes of those that left fail there at once (their
        stores closed), naming them."""
        if self._said:
            return {}
        self._said = True
        heard = True
        said = b"-" if first is None else b"=" + first.encode()
        try:
            rows = gather_bytes(said, 1 + MAX_FIRST_CHARS, self._control)
            firsts = [None if r == b"-" else r[1:].decode() for r in rows[: self._senders]]
        except TransportError as exc:
            logger.info("a sender left before its lane opened (%s): lanes by store", exc)
            heard = False
            firsts = [None if lane else NO_LANE for lane in self._lanes]
        answers = self._call(firsts) if self._rank == 0 else {}
        return answers if heard else None


def lane_config(config: SyncConfig, one_group: bool = False, alone: bool = False) -> SyncConfig:
    """How each lane of a push from several senders runs: a group of its own rendezvous (the
    lanes form at once), every member a rank of it, over Gloo -- K NCCL communicators driven
    from K threads on one GPU may deadlock (docs/many-senders.md) -- its members on the
    sender's host taking it through a shared-memory ring of its own as one sender's push does
    (``same_host``). ``one_group``: the lanes' buckets go over one group of every rank instead
    (``form_one_group``), on the backend ``config`` names, and each lane's own Gloo group only
    votes: every member then takes them from that group. ``alone``: the push's one sender (the
    K = 1 case, not over one group) -- one lane, one communicator, so its group runs on the
    backend ``config`` names, NCCL and the CUDA ring included, as one sender's push does."""
    if alone and not one_group:
        return config.model_copy(update={"group_mode": "standalone"})
    if config.backend == "nccl" and not one_group:
        raise ValueError(
            "a push from several senders runs its lanes over Gloo (CUDA tensors go through the "
            "host); leave SyncConfig.backend unset or 'gloo', or move the buckets over one "
            "group (JobSync or WeightUpdater with one_group=True)"
        )
    update: dict[str, str] = {"group_mode": "standalone", "backend": "gloo"}
    if one_group:
        update["same_host"] = "group"
    return config.model_copy(update=update)


# Rank 0 asks the members to join one group, each as the rank its spec names, with the senders'
# endpoints (the lanes that take its buckets); returns what waits for their answers.
Invite = Callable[[list[GroupSpec], list[tuple[str, int]]], Callable[[], None]]


def form_one_group(
    config: SyncConfig,
    control: ControlGroup,
    invite: Callable[[list[GroupSpec]], object] | None = None,
    members: int = 0,
) -> TorchGroup:
    """The group every rank of ``control`` (the job's ranks, or the senders') moves the lanes'
    buckets over (``transport.rounds``), in ``control``'s order, then ``members`` processes
    outside it (Ray workers): made by all of them at once, rank 0 holding the rendezvous.
    ``invite`` (rank 0, with ``members``) asks those to join, as the ranks the specs it is given
    name, before rank 0 joins. On ``config.backend`` ("nccl": each rank of ``control`` on its
    current GPU; else Gloo, on the host)."""
    rank, ranks = control.rank, control.size
    listener = None
    here: tuple[str, int] | Exception | None = None
    if rank == 0:
        try:
            listener = bind_listener(listen_address(config.master_addr, config.interface))
            here = (str(listener.getsockname()[0]), int(listener.getsockname()[1]))
        except Exception as exc:  # raised once the others know, not left to wait for rank 0
            here = exc
    try:
        ((address, port),) = share_endpoints(here, 1, control)
        nccl = config.backend == "nccl"
        spec = GroupSpec(
            group_id=f"{port:016x}",  # the group's own store: no other group to tell it from
            address=address,
            port=port,
            world_size=ranks + members,
            rank=rank,
            backend="nccl" if nccl else "gloo",
            mode="standalone",
            rendezvous_timeout_s=config.rendezvous_timeout_s,
            collective_timeout_s=config.collective_timeout_s,
        )
        if invite is not None and rank == 0 and members:
            invite([spec.model_copy(update={"rank": r}) for r in range(ranks, spec.world_size)])
        on = current_gpu() if nccl else None
        return TorchGroup.join(spec, listener, device=on)
    except BaseException:
        if listener is not None:
            listener.close()
        raise


# A receiving rank of the senders' group (a launched job's) follows the senders' lanes, at the
# stores ``endpoints`` name, their buckets over the one group and ``paths`` where there is one.
Follow = Callable[[list[tuple[str, int]], TorchGroup | None, list[LanePath]], None]


class Senders:
    """One rank's part in pushes from every rank of a sharded trainer, whatever the members
    are: the group the agreement runs over (``control``: ``send.collectives``), this rank's
    lane, and the verdicts in rank 0's store. Made on every rank of ``group`` (the trainers'
    torch.distributed group; None: the default group) at once, a collective -- or, a trainer of
    one process, over ``OneRank``: no torch.distributed at all. ``members(config)`` is asked on
    rank 0 only. ``owner`` names the caller's class in what it tells a caller to change.

    The members are reached one of two ways. Called by rank 0 (Ray workers, the workers of
    ``vllm serve``): every rank of ``group`` sends, and ``invite`` (with a one group) asks the
    members to join it, each a rank past the senders' in member order, with the senders'
    ``endpoints``: the lanes to take those buckets. Or ranks of ``group`` themselves (a
    launched job, ``JobSync``): its last ``receivers`` ranks receive -- ranks of the agreement,
    with no lane of their own (``out``) -- each following the lanes with ``follow`` as they
    form, and again whenever the one group does. ``one_group`` (implied by ``invite``): the
    lanes' buckets go over one group of the senders and the members (``form_one_group``), on
    ``config``'s backend. ``lanes`` (default): each lane's own group is a standalone Gloo group
    -- the push's one sender's on the backend ``config`` names (``lane_config``); False -- a
    launched job's one sender -- its push runs on ``config`` as given (``group_mode="job"``:
    ``new_group`` of the job, NCCL allowed). ``call``: rank 0 calls the members as each push's
    lanes open (``Opening``). ``deaths`` (implied by ``call``): rank 0 learns of members that
    died mid-push from its calls on them, and tells every lane (``gone``)."""

    def __init__(
        self,
        config: SyncConfig | None,
        group: dist.ProcessGroup | OneRank | None,
        members: Callable[[SyncConfig], int],
        owner: str,
        invite: Invite | None = None,
        *,
        one_group: bool = False,
        receivers: int = 0,
        follow: Follow | None = None,
        lanes: bool = True,
        call: Callable[[list[str | None]], Answers] | None = None,
        deaths: bool = False,
    ) -> None:
        if config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig, got {type(config).__name__}")
        given = config or SyncConfig()
        self._given, self._invite, self._follow = given, invite, follow
        self._one = one_group or invite is not None
        self.control = control_group(group, given.push_timeout_s, owner)
        self.rank = self.control.rank
        self.senders = self.control.size - receivers
        alone = self.senders == 1
        self.config = lane_config(given, self._one, alone) if lanes else given
        assert follow is None or self.rank >= self.senders, "only a receiving rank follows"
        sending = self.rank < self.senders
        agree_on_config(given, sending, self._one, self.control)
        self.one_group: TorchGroup | None = None  # with ``one_group``: every lane's buckets
        self.paths: list[LanePath] = []  # and each lane's way to the members over it
        self._out: Outbound | None = None
        self.deaths: Deaths | None = None  # where rank 0 calls the members (``call``)
        try:
            self.members = self.from_rank_0(lambda: members(self.config))
            wrap = self._over_one_group if self._one else None  # once the lane forms
            mine: tuple[str, int] | Exception | None = None
            if sending:
                try:
                    self._out = Outbound(self.config, self.members, wrap)
                    mine = self._out.address
                except Exception as exc:  # raised once the others know (see share_endpoints)
                    mine = exc
            self.endpoints = share_endpoints(mine, self.senders, self.control)
            if sending:
                store = open_store(*self.endpoints[0], 1, self.config.rendezvous_timeout_s, None)
                # Rank 0's store: the verdicts, and whatever else its members answer there.
                self.store = dist.PrefixStore(VERDICTS, store)
                self.verdicts = Verdicts(self.store, self.senders)
            # What the others say of a rank whose part failed (the same words on every rank).
            what = "learn the one group's routes"
            if receivers:
                what = "follow the senders' lanes" + (f" or {what}" if self._one else "")
            formed_everywhere(self._form(), what, self.control)
        except BaseException:
            self.close()
            raise
        self.pushes = 0
        self.layouts = Layouts()  # this rank's shares' layouts, the last one kept
        # Where rank 0 calls the members (``call``): each push's lanes open through its call.
        self.opening: Opening | None = None
        if call is not None:
            self.opening = Opening(self.control, self.senders, self.rank, call)
            self.out.commands.carry = self.opening.carry
        if call is not None or deaths:  # rank 0 tells every lane of the members it found dead
            rank_0 = self.endpoints[0] if self.rank else None
            try:
                self.deaths = Deaths(self.out.plane, rank_0, self.config.rendezvous_timeout_s)
            except BaseException:
                self.close()
                raise

    @property
    def out(self) -> Outbound:
        """This sender's lane."""
        assert self._out is not None, "a receiving rank has no lane"
        return self._out

    def from_rank_0(self, value: Callable[[], int]) -> int:
        """``value()`` (never negative) on rank 0, on every sender; where it raises there, it
        raises on the others too."""
        error: Exception | None = None
        mine = 0
        if self.rank == 0:
            try:
                mine = value()
            except Exception as exc:  # raised once the others know
                error, mine = exc, -1
        word = from_rank_0(mine, self.control)
        if error is not None:
            raise error
        if word < 0:
            raise WeightSyncError("rank 0 failed before the push (see its error)")
        return word

    def agree(
        self,
        state_dict: StateDict | object,
        options: Mapping[str, Any],
        check: Callable[[BlockLayout, int], dict[int, list[str]]] | None,
        gathered: bool = False,
    ) -> tuple[Share, int]:
        """Begin push ``pushes``, every sender at once, before any lane moves a byte: this
        rank's share of ``state_dict`` (with ``options`` and ``gathered``:
        ``lane_rules.share_of``) passes its checks, the senders' layouts are one, the version is
        past every sender's, and on rank 0
        ``check`` finds nothing the members cannot take at that version (problems by member; a
        ``WeightSyncError`` when it could not ask them all) -- None where the members check the
        push as their lanes open (``Opening``: each refuses on every lane). Returns the share
        and the version; raises on every sender otherwise, each learning the word before any
        raises."""
        self.pushes += 1
        share = share_of(
            state_dict, options, self.senders, self.rank, self.config, self.layouts, gathered
        )

        def refused(ahead: bool, chosen: int, _: object) -> Exception | None:
            if check is None:
                return None
            problems: dict[int, list[str]] = {}
            unchecked: WeightSyncError | None = None  # rank 0 could not ask every member
            if ahead and self.rank == 0:
                assert share.layout is not None, "an agreed push has a layout"
                try:
                    problems = check(share.layout, chosen)
                except WeightSyncError as exc:  # raised once every sender has the word
                    unchecked = exc
            word = self.from_rank_0(lambda: int(bool(problems)) | 2 * int(unchecked is not None))
            if unchecked is not None:
                return unchecked
            if word & 2:
                return WeightSyncError(
                    "rank 0 could not check the layout with every member (see its error); "
                    "nothing was sent"
                )
            # By member on rank 0; the others learn only that.
            return PlanMismatchError(problems) if word else None

        gather = functools.partial(gather_rows, control=self.control)
        return share, agree(share, self.out.pusher.next_version, gather, self.senders, refused)

    def conclude(self, landed: Callable[[], object], elsewhere: Callable[[], Exception]) -> None:
        """Once every lane committed, what rank 0 alone checks -- ``landed()``: that the members
        took the push (their calls returned, their servers loaded it) -- becomes every sender's
        outcome: all return, or all raise (rank 0 its own error, the others ``elsewhere()``),
        so that a loop calling ``push`` on every rank stays in step."""
        error: Exception | None = None
        if self.rank == 0:
            try:
                landed()
            except Exception as exc:  # raised once the others know
                error = exc
        try:
            failed = from_rank_0(int(error is not None), self.control)
        except TransportError as exc:
            raise TransportError(
                f"a trainer rank left once every lane had committed ({first_line(exc)}); the "
                "members hold the push, which rank 0 may not have confirmed"
            ) from exc
        if error is not None:
            raise error
        if failed:
            raise elsewhere()

    def wait_s(self, started: float) -> float:
        """How long a member may wait for the lanes of the push begun at ``started``: what is
        left of its time (at least a second), so that no member waits on after the senders."""
        return max(1.0, Deadline(self.config.push_timeout_s, "the push", started).remaining())

    def push(self, share: Share, version: int, started: float) -> PushResult:
        """This rank's lane of the push agreed, settled with the other senders (``push_share``)."""
        if self.opening is not None:
            assert share.layout is not None, "an agreed push has a layout"
            self.opening.begin(share.layout)
        if self.deaths is not None:
            self.deaths.watch(self.pushes)
        try:
            return push_share(
                self.out,
                share,
                version,
                self.verdicts,
                self.pushes,
                self.rank,
                started,
                self.config.push_timeout_s,
                self.opening,
            )
        finally:
            if self.deaths is not None:
                self.deaths.watch(None)

    def gone(self, push: int, slots: Sequence[int], why: str) -> None:
        """Rank 0, from any thread: members ``slots`` died during push ``push``, as its call on
        them found. Every lane stops waiting for them (``Deaths``), if that push is still under
        way."""
        assert self.deaths is not None and self.rank == 0, "rank 0 calls the members"
        if push == self.pushes:
            self.deaths.tell(push, slots, why)

    def close(self) -> None:
        """Leave this rank's lane and the one group, whatever of them formed (a receiving
        rank's lanes are its caller's to leave). The control group stays registered with
        torch.distributed: a group made with ``use_local_synchronization`` is named from its
        ranks and the count of groups alive on this rank, so destroying one would name a later
        group like one still alive (refused), or -- destroyed on some ranks only -- differently
        from rank to rank (a hang)."""
        if self.deaths is not None:
            self.deaths.close()
        if self._out is not None:
            self._out.close()
        group, self.one_group = self.one_group, None
        if group is not None:
            group.close()

    def renew(self, needed: bool, members: Callable[[SyncConfig], int] | None = None) -> bool:
        """Every rank at once, as a push begins: the one renewal of a push from many senders
        after a failure, whoever the members are (Ray workers called by rank 0, or the receiving
        ranks of a launched job). Where any rank says it is ``needed`` -- its last push failed
        once bytes began (a one group may be aborted, or a member may have lost it), or the
        members changed (dropped, added) -- or the one group is missing (forming it failed):
        rank 0 counts the members again (``members``, where given), every lane forms anew over
        them at its push, and over one group every member joins a new one -- rejoining, or
        following the lanes anew. One small all-reduce otherwise (none for ``OneRank``).
        Returns whether it renewed."""
        missing = self._one and self.one_group is None
        if not any_rank(needed or missing, self.control):
            return False
        if self.pushes:  # (a front may count its members as its first push begins)
            logger.info(
                "push %d: the lanes form again (a push failed, or the members changed)",
                self.pushes + 1,
            )
        if members is not None:
            count = members
            self.members = self.from_rank_0(lambda: count(self.config))
        if self._out is not None:
            self._out.recount(self.members)  # the lane forms again, over them
        if self._one:
            group, self.one_group = self.one_group, None
            if group is not None:
                group.close()
            formed_everywhere(self._form(), "form the one group again", self.control)
        return True

    def _form(self) -> Exception | None:
        """This rank's part in forming what the lanes move over: the one group, if any, then on
        a receiving rank its following of the lanes. Returns what failed here, to be raised
        once every rank knows (``formed_everywhere``): the others do not wait for this one."""
        failure = self._form_one_group() if self._one else None
        if failure is None and self._follow is not None:
            try:
                self._follow(self.endpoints, self.one_group, self.paths)
            except Exception as exc:
                failure = exc
        return failure

    def _form_one_group(self) -> Exception | None:
        """Form the one group, asking the members called by rank 0 to join (``invite``), then
        tell every rank whether each of those joined it: one may fail after the group formed (a
        sender's store it cannot reach), and the senders must not go on without it, waiting on
        each other, while rank 0 raises. Returns what failed on this rank in learning the
        group's routes."""
        answers: list[Callable[[], None]] = []  # rank 0: what waits for the members' joins
        invite = self._invite

        def ask(specs: list[GroupSpec]) -> None:
            assert invite is not None
            answers.append(invite(specs, self.endpoints))

        self.one_group = None
        called = self.members if invite is not None else 0  # members outside ``control``
        self.one_group = form_one_group(
            self._given, self.control, ask if invite is not None else None, called
        )
        failure: Exception | None = None
        try:
            self.paths = lane_paths_over(self.one_group, self.senders)
        except Exception as exc:  # raised once the others know, not left to wait for this rank
            failure = exc

        def joined() -> int:
            for wait in answers:
                wait()
            return 0

        if invite is not None:
            self.from_rank_0(joined)
        return failure

    def _over_one_group(self, lane: Transport) -> Transport:
        assert self.one_group is not None, "the one group forms before any push"
        return SendLane(lane, self.one_group, self.paths[self.rank].targets)


def push_share(
    lane: Outbound,
    share: Share,
    version: int,
    verdicts: Verdicts,
    push: int,
    sender: int,
    started: float,
    timeout_s: float,
    opening: Opening | None = None,
) -> PushResult:
    """Push this sender's lane (none, where the layout gives it no block) and settle the push
    with the other senders. Returns the push's result -- the whole push's version, bytes,
    buckets, tensors and partial flag on every sender; this rank's seconds, phases and delta
    choice (docs/api.md) -- or raises: this lane's own error where it failed (a refusal on every
    sender where the members refused every lane), else ``SenderFailedError`` naming the lanes
    that did. Either way the version is spent on this sender. ``opening``: where rank 0 calls
    the members once every lane opened (``Opening``), a sender without a lane says so."""
    deadline = Deadline(timeout_s, "the senders' reports", started)
    assert share.layout is not None and share.layout.blocks, "an empty push moves nothing"
    result = PushResult(version, 0, 0, 0.0)
    begun = started
    try:
        if share.sends:
            sends = share.source if share.source is not None else share.checked
            assert isinstance(sends, Entries | ShardedSource), "its share checked, or a source"
            options = {"version": version, "rename": share.rename}
            begun = time.monotonic()
            try:
                result = lane.push(sends, options, push)
            except Exception as exc:
                # Broke naming no one: not to blame beside a lane that names a cause (over one
                # group, the failure of a member on one lane aborts all).
                broken = type(exc) is TransportError
                try:
                    dead = exc.dropped if isinstance(exc, WorkerFailedError) else []
                    report = {"error": first_line(exc), "broken": broken, "dead": dead}
                    if isinstance(exc, PlanMismatchError):
                        report["refused"] = {str(k): v for k, v in exc.problems.items()}
                    verdicts.settle(push, sender, report, deadline)
                except PlanMismatchError:  # every lane refused: this one's refusal says so
                    pass
                except SenderFailedError as others:
                    if sender not in others.senders or (broken and len(others.senders) > 1):
                        # Not to blame, or no more than the others: the group broke under
                        # this lane (over one group a sender's death, or a member's failure
                        # on another lane, fails every round); the verdict names who broke it.
                        raise others from exc
                    logger.debug("push %d failed: %s", push, others)  # its own error says more
                raise
        elif opening is not None:
            opening.say(NO_LANE)
        landed = {
            "nbytes": result.nbytes,
            "buckets": result.buckets,
            "wire": result.wire_bytes,
            "lane": share.sends,
        }
        sums = verdicts.settle(push, sender, landed, deadline)
    finally:  # spent whatever happens: members take note of it before any byte moves
        lane.pusher.spent(version)
    seconds = time.monotonic() - started
    return dataclasses.replace(
        result,
        nbytes=sums["nbytes"],
        buckets=sums["buckets"],
        wire_bytes=sums["wire"],
        tensors=len(share.layout.tensors),
        partial=share.layout.partial,
        seconds=seconds,
        phases=_phases(result.phases, begun - started, seconds),
    )


def _phases(lane: Mapping[str, float], agreed_s: float, seconds: float) -> dict[str, float]:
    """A sender's phases of a push: the senders' agreement before its lane's push (``agree``),
    the lane's own phases, the senders settling it after (``settle``) -- together this call's
    ``seconds``, its ``total``."""
    steps = {name: spent for name, spent in lane.items() if name != "total"}
    settled_s = seconds - agreed_s - lane.get("total", 0.0)
    return {"agree": agreed_s, **steps, "settle": settled_s, "total": seconds}


def agree(
    share: Share | None,
    next_version: int,
    gather: Callable[[list[int], bytes], list[tuple[int, ...]]],
    senders: int,
    refused: Callable[[bool, int, list[tuple[int, ...]]], Exception | None],
    held: tuple[list[int], str | None] | None = None,
) -> int:
    """One rank's part in the agreement before any byte of a push from ``senders`` senders
    moves, every rank of the agreement at once. ``share``: a sender's (``Share.row`` its row);
    None: a launched job's receiving rank, a rank of the agreement too, whose row is ``held``:
    three words of its own (``JobSync`` says which) and the digest of the layout it holds (None:
    none). The senders' rows (the first ``senders`` of those ``gather`` returns) say whether
    the push goes ahead (``called_off``) and at which version; then the members' word,
    ``refused(ahead, version, rows)`` -- a collective of its own where it needs one, so every
    rank gets the same word -- says whether they take it. Returns the version; else raises, on every
    rank once every rank has the word: a sender's own mistake first, then why the push is off,
    then the members' refusal. Ray workers and ``vllm serve`` (``Senders.agree``: rank 0 asks
    them) and a launched job (``JobSync``: its receiving ranks are ranks of the agreement)
    differ only in ``refused``."""
    if share is not None:
        values, digest = share.row(next_version)
    else:
        assert held is not None, "a receiving rank gives its own row"
        values, digest = held[0], bytes.fromhex(held[1]) if held[1] is not None else bytes(32)
    rows = gather(values, digest)
    reason, version = proposal(rows, senders)
    refusal = refused(reason is None, version, rows)
    if share is not None and share.error is not None:
        raise share.error
    if reason is not None:
        if share is None:  # not this rank's mistake: the senders'
            raise WeightSyncError(
                f"the push was called off by the senders ({reason}); nothing changed"
            )
        raise ValueError(f"{reason}; nothing was sent")
    if refusal is not None:
        raise refusal
    return version


def nothing_moves(share: Share, committed: int) -> PushResult | None:
    """The result of an agreed push whose layout has no block (no tensor has an element):
    nothing moves on any rank and every member keeps the version ``committed``, as one sender's
    empty push. None where the push has bytes to move. Every sender decides alike: they agreed
    on the layout."""
    assert share.layout is not None, "agreed pushes have a layout"
    if share.layout.blocks:
        return None
    return PushResult.nothing(committed)


def agree_on_config(
    config: SyncConfig, sender: bool, one_group: bool, control: ControlGroup
) -> None:
    """Every rank of ``control`` at once, before anything is formed: ``ValueError`` on every
    rank, naming each rank's value, where the fields that must agree differ
    (``lane_rules.config_row``); ``config`` is the one this rank was given."""
    rows = gather_rows(config_row(config, sender, one_group), bytes(32), control)
    problem = config_disagreement(rows)
    if problem is not None:
        raise ValueError(problem)
