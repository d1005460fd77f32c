"""Lanes: each sender's push carried by the store plane, and a member following several at once.

A lane is one sender's ordinary push (``Pusher``) over the store plane: its commands in a store
of its own (``Commands``), which each member reads in order (``Inbound``, driving a
``StoreMember``). One sender is one lane (``JobSync``); a sharded trainer pushing from every
rank is K lanes at once (docs/many-senders.md): ``push_share`` on each sender, ``Lanes`` on each
member (a thread per lane, blocks placed by a ``receive.assembly.Assembly``), and ``Verdicts``
after -- every sender reports how its lane ended in rank 0's store, rank 0 judges, and a member
that saw a sender's store close reports for it, so the verdict comes at once. A member holds a
version only once every lane committed it there.

What each sender sends and when a push is called off are ``send.lanes``' (pure but for DTensor
reading); this module is the running half, above the protocol and the receiver, beside
``store_plane``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import threading
import time
import typing
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from weight_sync.blocks import BlockLayout
from weight_sync.config import SyncConfig
from weight_sync.deadline import Deadline
from weight_sync.devices import CPU, current_gpu
from weight_sync.errors import (
    PlanMismatchError,
    SenderFailedError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
    WorkerFailedError,
    first_line,
)
from weight_sync.metadata import GroupSpec, Phase, ReceiveReport, SyncStatus
from weight_sync.protocol import Pusher
from weight_sync.receive.assembly import Assembly, agreed
from weight_sync.receiver import Loader, Receiver, expecting
from weight_sync.result import PushResult
from weight_sync.send.checks import Rename, StateDict
from weight_sync.send.lanes import Share, blame, called_off, judge, row_tensor, share_of
from weight_sync.store_plane import (
    KEPT_PUSHES,
    MAX_REPLY_CHARS,
    PREFIX,
    ClientPlane,
    StoreMember,
)
from weight_sync.transport import TorchGroup, bind_listener, listen_address
from weight_sync.transport.base import Transport
from weight_sync.transport.rendezvous import open_store
from weight_sync.transport.rounds import Rounds, Route, SendLane, routes_over

logger = logging.getLogger(__name__)

COMMAND = "cmd/"  # + sequence number: the n-th step a sender asked of its members
FLOOR = f"{COMMAND}floor"  # the first command still in the store: the older ones are deleted
BEGIN = f"{COMMAND}begin/"  # + push number: the sequence number of the push's ``begin``
CLOSE = "close"
VERDICTS = "lanes/"  # + push/sender: how each lane ended; + push/verdict: rank 0's verdict
LONGEST_WAIT_S = 86400.0  # one store wait; a longer deadline waits again
_LINGER_S = 1.0  # a sender keeps its store this long after posting close
_PHASES = typing.get_args(Phase)  # a push's phases in the order it goes through them
# A member's answer to a layout check over one group it holds none of (it restarted, or lanes
# from other senders took its place): the senders form the group again before their next push.
NO_ONE_GROUP = "this worker holds no one group with these senders"
_ENDPOINT_BYTES = 256  # a sender's store address, as JSON, in one fixed-size all-gather


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
        self, state_dict: StateDict, options: Mapping[str, Any], number: int | None = None
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
            self.commands.post("end", {**frame, "error": first_line(exc)})
            raise
        self.commands.post("end", {**frame, "version": result.version})
        return result

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


class Commands:
    """A sender's ``Client``: each call of a push becomes the next command in its store, which
    each of its members reads in order; their answers come back through ``ClientPlane``'s
    mailbox. Posted through the plane itself, so that commands and the protocol's messages keep
    one order; the plane calls a client from several threads, hence the lock."""

    def __init__(self) -> None:
        self.plane: ClientPlane | None = None  # the plane this client serves: set once it exists
        self._next = 0
        # Each push still in the store: its number, and the sequence number of its first command.
        self._starts: deque[tuple[int, int]] = deque()
        self._lock = threading.Lock()

    def post(self, op: str, arg: dict[str, Any], new_push: bool = False) -> None:
        """Post the next command; ``new_push``: it begins a push, and the commands of pushes
        more than ``KEPT_PUSHES`` ago are deleted (a loop pushing for days would otherwise
        leave a few keys a push in the store). A member further behind than that skips to
        ``FLOOR`` when it next receives."""
        assert self.plane is not None, "the plane comes first"
        with self._lock:
            if new_push:
                self._starts.append((int(arg["push"]), self._next))
                if len(self._starts) > KEPT_PUSHES:
                    (push, gone), (_, floor) = self._starts.popleft(), self._starts[0]
                    self.plane.post(FLOOR, str(floor))
                    keys = [f"{COMMAND}{number}" for number in range(gone, floor)]
                    self.plane.forget([*keys, f"{BEGIN}{push}"])
                self.plane.post(f"{BEGIN}{arg['push']}", str(self._next))
            self.plane.post(f"{COMMAND}{self._next}", json.dumps({"op": op, "arg": arg}))
            self._next += 1

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post(
            "init",
            {
                k: init_info[k]
                for k in ("address", "port", "epoch", "timeout_s", "max_metadata_bytes")
            },
        )

    def start_weight_update(self) -> None:
        self.post("start", {})

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.post("update", {"version": int(update_info["version"])})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.post("finish", {})

    def shutdown_weight_transfer_engine(self) -> None:
        self.post("shutdown", {})


class Verdicts:
    """How the lanes of each push ended, in rank 0's store (``store``: a prefix of it): every
    sender reports its own, rank 0 judges them all and posts the verdict, which the others read.
    Bounded by the push's deadline; a sender that never reports is named as dead or hung."""

    def __init__(self, store: Any, senders: int) -> None:
        self._store = store
        self._senders = senders

    def settle(
        self,
        push: int,
        sender: int,
        outcome: dict[str, Any],
        deadline: Deadline,
    ) -> dict[str, Any]:
        """Report ``outcome`` (``{"error": ...}``, or the lane's nbytes, buckets and wire
        bytes), then the verdict: judged here on rank 0, read elsewhere. Raises
        ``SenderFailedError`` when a lane did not land; else returns every lane's sums."""
        self._store.set(f"{push}/{sender}", json.dumps(outcome))
        if sender == 0:
            self._forget(push - KEPT_PUSHES)
            keys = [f"{push}/{rank}" for rank in range(self._senders)]
            try:
                self._store.wait(keys, _left(deadline))
            except dist.DistStoreError:
                pass  # named below as never having reported
            reports = {
                rank: json.loads(self._store.get(key)) if self._store.check([key]) else None
                for rank, key in enumerate(keys)
            }
            verdict = judge(reports)
            self._store.set(f"{push}/verdict", json.dumps(verdict))
        else:
            verdict = self._wait(f"{push}/verdict", deadline)
        if "failed" in verdict:
            if outcome.get("broken") and verdict["dead"]:
                # Workers died or froze mid-push: every lane has them, this one too, which
                # broke naming no one (from here, the death had not been seen yet).
                raise WorkerFailedError(
                    f"worker(s) {verdict['dead']} died or stopped answering mid-push, which "
                    f"broke this lane too: {verdict['failed']}",
                    verdict["dead"],
                )
            raise SenderFailedError(verdict["failed"], verdict["senders"])
        return verdict

    def report_for(self, push: int, sender: int, why: str) -> None:
        """A member saw ``sender``'s store close mid-push: its process is gone and will never
        report. Said for it (unless it reported first), so that rank 0's verdict comes now
        rather than at the push's deadline."""
        try:
            report = json.dumps({"error": why, "gone": True})
            self._store.compare_set(f"{push}/{sender}", "", report)
        except RuntimeError as exc:  # rank 0 is gone too: nobody to tell
            logger.debug("cannot report sender %d's death: %s", sender, exc)

    def _forget(self, push: int) -> None:
        """Rank 0: delete the keys of ``push``, long settled (every sender read its verdict
        before it began the next push)."""
        if push > 0:
            for key in [f"{push}/{rank}" for rank in range(self._senders)] + [f"{push}/verdict"]:
                self._store.delete_key(key)

    def _wait(self, key: str, deadline: Deadline) -> dict[str, Any]:
        try:
            self._store.wait([key], _left(deadline))
        except dist.DistStoreError as exc:
            raise SyncTimeoutError(f"rank 0 gave no verdict ({key}) in time") from exc
        except RuntimeError as exc:
            raise SenderFailedError(
                f"rank 0 died or left before its verdict ({first_line(exc)}); no member "
                "claims the push",
                [0],
            ) from exc
        return dict(json.loads(self._store.get(key)))


def lane_config(config: SyncConfig, one_group: bool = False) -> SyncConfig:
    """How each lane of a push from several senders runs: a group of its own rendezvous (the
    lanes form at once), every member a rank of it, over Gloo -- K NCCL communicators driven
    from K threads on one GPU may deadlock (docs/many-senders.md). ``one_group``: the lanes'
    buckets go over one group of every rank instead (``form_one_group``), on the backend
    ``config`` names, and each lane's own Gloo group only votes."""
    if config.backend == "nccl" and not one_group:
        raise ValueError(
            "a push from several senders runs its lanes over Gloo (CUDA tensors go through the "
            "host); leave SyncConfig.backend unset or 'gloo', or move the buckets over one "
            "group (JobSync or LaneUpdater with one_group=True)"
        )
    return config.model_copy(
        update={"group_mode": "standalone", "same_host": "group", "backend": "gloo"}
    )


# Rank 0 asks the members to join one group, each as the rank its spec names, with the senders'
# endpoints (the lanes that take its buckets); returns what waits for their answers.
Invite = Callable[[list[GroupSpec], list[tuple[str, int]]], Callable[[], None]]


def form_one_group(
    config: SyncConfig,
    group: dist.ProcessGroup | None,
    device: torch.device,
    invite: Callable[[list[GroupSpec]], object] | None = None,
    members: int = 0,
) -> TorchGroup:
    """The group every rank of ``group`` (a torch.distributed group: the job's, or the
    senders') moves the lanes' buckets over (``transport.rounds``), in ``group``'s order, then
    ``members`` processes outside it (Ray workers): made by all of them at once, rank 0 holding
    the rendezvous. ``invite`` (rank 0, with ``members``) asks those to join, as the ranks the
    specs it is given name, before rank 0 joins. On ``config.backend`` ("nccl": each rank of
    ``group`` on its current GPU; else Gloo, on the host); ``device`` is where ``group``'s
    backend takes the rendezvous address."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    listener = None
    here: tuple[str, int] | Exception | None = None
    if rank == 0:
        try:
            listener = bind_listener(listen_address(config.master_addr, config.interface))
            here = (str(listener.getsockname()[0]), int(listener.getsockname()[1]))
        except Exception as exc:  # raised once the others know, not left to wait for rank 0
            here = exc
    try:
        ((address, port),) = share_endpoints(here, 1, group, device)
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


class Senders:
    """One trainer rank's part in pushes from every rank of a sharded trainer, whatever the
    members are (Ray workers, the workers of vLLM servers): the senders' Gloo group the
    agreement runs over, this rank's lane, and the verdicts in rank 0's store. Made on every
    rank of ``group`` (the trainers' torch.distributed group; None: the default group) at once,
    a collective; ``members(config)`` is asked on rank 0 only. ``owner`` names the caller's
    class in what it tells a caller to change. ``invite``: the lanes' buckets go over one group
    of the senders and the members (``form_one_group``, which asks the members to join through
    it, each a rank past the senders' in member order, with the senders' ``endpoints``: the
    lanes to take those buckets), on ``config``'s backend."""

    def __init__(
        self,
        config: SyncConfig | None,
        group: dist.ProcessGroup | None,
        members: Callable[[SyncConfig], int],
        owner: str,
        invite: Invite | None = None,
    ) -> None:
        if config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig, got {type(config).__name__}")
        if not dist.is_initialized():
            raise ValueError(
                f"a {owner} needs the trainers' torch.distributed group; call "
                "init_process_group on every trainer rank first"
            )
        given = config or SyncConfig()
        self.config = lane_config(given, one_group=invite is not None)
        self.rank, self.senders = dist.get_rank(group), dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        timeout = datetime.timedelta(seconds=self.config.push_timeout_s)
        # Named from its ranks (use_local_synchronization), not from the world's count of
        # groups: when the trainers are part of a larger world -- one replica of a hybrid-
        # sharded trainer pushing -- the other ranks never make it, and a count advanced here
        # only would name the groups the whole world makes later apart (they would hang).
        self.control = dist.new_group(
            ranks, backend="gloo", timeout=timeout, use_local_synchronization=True
        )
        self.one_group: TorchGroup | None = None  # with ``invite``: every lane's buckets
        self.routes: list[Route] = []  # and each lane's way to the members over it
        out: Outbound | None = None
        try:
            self.members = self.from_rank_0(lambda: members(self.config))
            wrap = self._over_one_group if invite is not None else None  # once the lane forms
            mine: tuple[str, int] | Exception
            try:
                out = self.out = Outbound(self.config, self.members, wrap)
                mine = out.address
            except Exception as exc:  # raised once the others know (see share_endpoints)
                mine = exc
            self.endpoints = share_endpoints(mine, self.senders, self.control, CPU)
            store = open_store(*self.endpoints[0], 1, self.config.rendezvous_timeout_s, None)
            # Rank 0's store: the verdicts, and whatever else its members answer there.
            self.store = dist.PrefixStore(VERDICTS, store)
            self.verdicts = Verdicts(self.store, self.senders)
            if invite is not None:
                self._form_one_group(given, invite)
        except BaseException:
            self._close(out)
            raise
        self.pushes = 0
        self._given, self._invite = given, invite

    def from_rank_0(self, value: Callable[[], int]) -> int:
        """``value()`` (never negative) on rank 0, on every sender; where it raises there, it
        raises on the others too."""
        error: Exception | None = None
        word = torch.tensor([0])
        if self.rank == 0:
            try:
                word[0] = value()
            except Exception as exc:  # raised once the others know
                error, word[0] = exc, -1
        src = dist.get_global_rank(self.control, 0)
        before_any_byte(lambda: dist.broadcast(word, src=src, group=self.control))
        if error is not None:
            raise error
        if int(word) < 0:
            raise WeightSyncError("rank 0 failed before the push (see its error)")
        return int(word)

    def agree(
        self,
        state_dict: StateDict,
        rename: Rename | None,
        version: int | None,
        check: Callable[[BlockLayout, int], dict[int, list[str]]],
        partial: bool = False,
    ) -> tuple[Share, int]:
        """Begin push ``pushes``, every sender at once, before any lane moves a byte: this
        rank's share of ``state_dict`` passes its checks, the senders' layouts are one, the
        version is past every sender's, and on rank 0 ``check`` finds nothing the members cannot
        take at that version (problems by member; a ``WeightSyncError`` when it could not ask
        them all). Returns the share and the version; raises on every sender otherwise, each
        learning the word before any raises."""
        self.pushes += 1
        options = {
            key: value
            for key, value in (("rename", rename), ("version", version))
            if value is not None
        }
        if partial:
            options["partial"] = True
        share = share_of(state_dict, options, self.senders, self.rank, self.config)
        values, digest = share.row(self.out.pusher.next_version)
        rows = gather_rows(values, digest, self.control)
        reason = called_off(rows)
        chosen = max(row[1] for row in rows)
        problems: dict[int, list[str]] = {}
        unchecked: WeightSyncError | None = None  # rank 0 could not ask every member
        if reason is None and self.rank == 0:
            assert share.layout is not None
            try:
                problems = check(share.layout, chosen)
            except WeightSyncError as exc:  # raised below, once every sender has the word
                unchecked = exc
        word = self.from_rank_0(lambda: int(bool(problems)) | 2 * int(unchecked is not None))
        if share.error is not None:
            raise share.error
        if reason is not None:
            raise ValueError(f"{reason}; nothing was sent")
        if unchecked is not None:
            raise unchecked
        if word & 2:
            raise WeightSyncError(
                "rank 0 could not check the layout with every member (see its error); nothing "
                "was sent"
            )
        if word:
            raise PlanMismatchError(problems)  # by member on rank 0; the others learn only that
        return share, chosen

    def conclude(self, landed: Callable[[], None], elsewhere: Callable[[], Exception]) -> None:
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
        word = torch.tensor([int(error is not None)])
        try:
            dist.broadcast(word, src=dist.get_global_rank(self.control, 0), group=self.control)
        except RuntimeError as exc:
            raise TransportError(
                f"a trainer rank left once every lane had committed ({first_line(exc)}); the "
                "members hold the push, which rank 0 may not have confirmed"
            ) from exc
        if error is not None:
            raise error
        if int(word):
            raise elsewhere()

    def wait_s(self, started: float) -> float:
        """How long a member may wait for the lanes of the push begun at ``started``: what is
        left of its time (at least a second), so that no member waits on after the senders."""
        return max(1.0, Deadline(self.config.push_timeout_s, "the push", started).remaining())

    def push(self, share: Share, version: int, started: float) -> PushResult:
        """This rank's lane of the push agreed, settled with the other senders (``push_share``)."""
        return push_share(
            self.out,
            share,
            version,
            self.verdicts,
            self.pushes,
            self.rank,
            started,
            self.config.push_timeout_s,
        )

    def close(self) -> None:
        self._close(self.out)

    def _close(self, out: Outbound | None) -> None:
        """Leave the lane (``out``) and the one group, whatever of them formed. The senders'
        control group stays registered with torch.distributed: a group made with
        ``use_local_synchronization`` is named from its ranks and the count of groups alive on
        this rank, so destroying one would name a later group like one still alive (refused),
        or -- destroyed on some ranks only -- differently from rank to rank (a hang)."""
        if out is not None:
            out.close()
        if self.one_group is not None:
            self.one_group.close()

    def renew_one_group(self, needed: bool) -> bool:
        """Every sender at once, before a push over the one group: where any of them says it is
        ``needed`` (its last push failed: the group may be aborted, or a member may have lost
        it), leave it and form a new one, every member rejoining, and have every lane form its
        own group again over the members' new lanes. One small all-reduce otherwise. Returns
        whether it formed the group again."""
        assert self._invite is not None
        flag = torch.tensor([int(needed or self.one_group is None)])  # None: forming it failed
        before_any_byte(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control))
        if not int(flag):
            return False
        logger.info("forming the one group again after a failed push")
        self.out.pusher.regroup()
        group, self.one_group = self.one_group, None
        if group is not None:
            group.close()
        self._form_one_group(self._given, self._invite)
        return True

    def _form_one_group(self, config: SyncConfig, invite: Invite) -> None:
        """Form the one group with the members, then tell every sender whether each member
        joined it: one may fail after the group formed (a sender's store it cannot reach), and
        the senders must not go on without it, waiting on each other, while rank 0 raises."""
        answers: list[Callable[[], None]] = []  # rank 0: what waits for the members' joins

        def ask(specs: list[GroupSpec]) -> None:
            answers.append(invite(specs, self.endpoints))

        self.one_group = form_one_group(config, self.control, CPU, ask, self.members)
        failure: Exception | None = None
        try:
            self.routes = routes_over(self.one_group, self.senders)
        except Exception as exc:  # raised once the others know, not left to wait for this rank
            failure = exc

        def joined() -> int:
            for wait in answers:
                wait()
            return 0

        self.from_rank_0(joined)
        formed_everywhere(failure, "learn the one group's routes", self.control, CPU)

    def _over_one_group(self, lane: Transport) -> Transport:
        assert self.one_group is not None, "the one group forms before any push"
        return SendLane(lane, self.one_group, self.routes[self.rank].targets)


def push_share(
    lane: Outbound,
    share: Share,
    version: int,
    verdicts: Verdicts,
    push: int,
    sender: int,
    started: float,
    timeout_s: float,
) -> PushResult:
    """Push this sender's lane (none, where the layout gives it no block) and settle the push
    with the other senders. Returns the push's result (every lane's bytes), or raises: this
    lane's own error where it failed, else ``SenderFailedError`` naming the lanes that did.
    Either way the version is spent on this sender."""
    deadline = Deadline(timeout_s, "the senders' reports", started)
    assert share.layout is not None and share.layout.blocks, "an empty push moves nothing"
    result = PushResult(version, 0, 0, 0.0)
    try:
        if share.lane:
            try:
                result = lane.push(share.lane, {"version": version}, push)
            except Exception as exc:
                # Broke naming no one: not to blame beside a lane that names a cause (over one
                # group, the failure of a member on one lane aborts all).
                broken = type(exc) is TransportError
                try:
                    dead = exc.dropped if isinstance(exc, WorkerFailedError) else []
                    report = {"error": first_line(exc), "broken": broken, "dead": dead}
                    verdicts.settle(push, sender, report, deadline)
                except SenderFailedError as others:
                    if sender not in others.senders or (broken and len(others.senders) > 1):
                        # Not to blame, or no more than the others: the group broke under
                        # this lane (over one group a sender's death, or a member's failure
                        # on another lane, fails every round); the verdict names who broke it.
                        raise others from exc
                    logger.debug("push %d failed: %s", push, others)  # its own error says more
                raise
        landed = {"nbytes": result.nbytes, "buckets": result.buckets, "wire": result.wire_bytes}
        sums = verdicts.settle(push, sender, landed, deadline)
    finally:  # spent whatever happens: members take note of it before any byte moves
        lane.pusher.spent(version)
    return dataclasses.replace(
        result,
        nbytes=sums["nbytes"],
        buckets=sums["buckets"],
        wire_bytes=sums["wire"],
        seconds=time.monotonic() - started,
    )


def gather_rows(
    values: list[int], digest: bytes, group: dist.ProcessGroup
) -> list[tuple[int, ...]]:
    """Every rank's row of an agreement (``values``, then a layout digest), on every rank of
    ``group`` (a Gloo group; fixed size, no pickle). ``TransportError`` if a rank is gone."""
    mine = row_tensor(values, digest)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    before_any_byte(lambda: dist.all_gather(rows, mine, group=group))
    return [tuple(row.tolist()) for row in rows]


def before_any_byte(run: Callable[[], object]) -> None:
    """Run one collective of an agreement; ``TransportError`` if a rank is gone (Gloo raises
    a bare RuntimeError), nothing having been sent."""
    try:
        run()
    except RuntimeError as exc:
        raise TransportError(
            f"a rank left before the push began ({first_line(exc)}); nothing was sent"
        ) from exc


def share_endpoints(
    endpoint: tuple[str, int] | Exception | None,
    senders: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> list[tuple[str, int]]:
    """The senders' store addresses, on every rank of ``group`` (its ranks ``0..senders-1``
    being the senders): each rank gives its own (a sender) or None, all gathered (no pickle: JSON
    in byte tensors of fixed size, on ``device``, which the group's backend takes). A sender
    that could not listen gives its error instead, which it raises once the others know: they
    raise ``TransportError`` at once rather than wait for it at their bound."""
    mine = torch.zeros(_ENDPOINT_BYTES, dtype=torch.uint8, device=device)
    if isinstance(endpoint, tuple):
        raw = json.dumps(list(endpoint)).encode()
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    if isinstance(endpoint, Exception):
        raise endpoint
    endpoints = []
    for sender, row in enumerate(rows[:senders]):
        raw = bytes(row.cpu().tolist()).rstrip(b"\0")
        if not raw:
            raise TransportError(
                f"trainer rank {sender} could not listen for its lane (see its error); nothing "
                "was sent"
            )
        address, port = json.loads(raw.decode())
        endpoints.append((str(address), int(port)))
    return endpoints


def formed_everywhere(
    failure: Exception | None, what: str, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Every rank of ``group`` at once, after a step each took on its own (``what``, as the
    others' error words it): a rank whose step failed gives its ``failure``, which it raises
    once the others know; they raise ``TransportError`` naming it, rather than wait for it
    at their next collective's bound. One small all-reduce (on ``device``, which the group's
    backend takes)."""
    failed = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=device)
    failed[dist.get_rank(group)] = int(failure is not None)
    before_any_byte(lambda: dist.all_reduce(failed, group=group))
    if failure is not None:
        raise failure
    ranks = failed.nonzero().flatten().tolist()
    if ranks:
        raise TransportError(
            f"rank(s) {ranks} could not {what} (see their errors); nothing was sent"
        )


class Lanes:
    """A member's lanes from ``endpoints`` (each sender's store, in sender order), as member
    ``slot`` (1-based) of each."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        slot: int,
        device: Callable[[], torch.device],
        timeout_s: float,
        rounds: Rounds | None = None,
        before: SyncStatus | None = None,
    ) -> None:
        """``timeout_s`` bounds dialling each sender's store. ``rounds``: the lanes' buckets
        come over one group, taken in its rounds (each lane's own group then only votes).
        ``before``: what this member held as these lanes were made (through lanes they
        replace, or one sender's pushes), which it holds until their first push begins."""
        self.endpoints = list(endpoints)
        self.rounds = rounds
        self.inbound = [
            Inbound(
                address,
                port,
                slot,
                device,
                timeout_s,
                (rounds, sender) if rounds is not None else None,
            )
            for sender, (address, port) in enumerate(endpoints)
        ]
        self.verdicts = Verdicts(
            dist.PrefixStore(VERDICTS, self.inbound[0].raw_store), len(endpoints)
        )
        # The version every lane committed here; the last of those that covered every tensor.
        self.held: int | None = None
        self.full: int | None = None
        self.layout: BlockLayout | None = None  # the last layout this member took
        self.error: str | None = None  # why the last push failed here
        self.last: ReceiveReport | None = None  # the last push every lane committed
        if before is not None:
            self.adopt(before)

    def adopt(self, status: SyncStatus) -> None:
        """Pushes reached this member's model by another route (one sender's), which reports
        ``status``: hold what it says; no lane's bytes are a delta base any more."""
        self.held, self.full = status.version, status.full_version
        self.error, self.last = status.last_error, status.last
        for lane in self.inbound:
            lane.member.receiver.adopt(status)

    def receive(self, assembly: Assembly, push: int, wait_s: float, member: str) -> int | None:
        """Push ``push`` on every lane the layout gives blocks to, each on a thread of its own,
        landing where ``assembly`` says. Returns the version every lane committed, or raises:
        the lanes' common error (a refusal, a push called off), else ``SenderFailedError``
        naming the senders whose lanes did not commit here (``member`` names this one); where
        no lane's byte reached the model (refused, called off), the version held stays. A
        layout with no block (no tensor has an element) moves nothing: the version stays."""
        active = {s: lane for s, lane in enumerate(self.inbound) if assembly.layout.sent_by(s)}
        if not active:  # no tensor has an element: nothing moves, the version stays
            return self.held
        for sender, lane in active.items():
            lane.member.retarget(
                assembly.check(sender),
                functools.partial(_loader, assembly, sender),
                functools.partial(assembly.destinations, sender),
            )
        # From the first byte the lanes land apart: this member holds neither the version it
        # held nor, until every lane commits, a whole one (as a one-sender receiver's state).
        held, base, self.held, self.full = self.held, self.full, None, None
        versions = {sender: lane.member.receiver.version for sender, lane in active.items()}
        if self.rounds is not None:
            self.rounds.begin(active)
        with ThreadPoolExecutor(len(active), thread_name_prefix="weight-sync-lane") as pool:
            calls = {
                s: pool.submit(self._lane, s, lane, wait_s, push) for s, lane in active.items()
            }
            outcomes = {s: _outcome(call) for s, call in calls.items()}
        try:
            self.held = self._settle(outcomes, assembly, push, member)
        except Exception as exc:
            self.error = first_line(exc)
            if all(
                lane.member.receiver.version == versions[sender] and not lane.member.receiver.dirty
                for sender, lane in active.items()
            ):  # no lane committed (a lane may commit and then fail), nor wrote a byte
                self.held, self.full = held, base
            raise
        self.error, self.full = None, base if assembly.layout.partial else self.held
        self.last = _together([lane.member.receiver.status().last for lane in active.values()])
        return self.held

    def _lane(self, sender: int, lane: Inbound, wait_s: float, push: int) -> int:
        """One lane's receive, on its thread; over one group its rounds go on without it after."""
        try:
            version = lane.receive(wait_s, push)
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
        for sender, error in failed.items():
            if sender and self.inbound[sender].sender_gone:
                why = f"its process is gone (its store closed on {member}: {first_line(error)})"
                self.verdicts.report_for(push, sender, why)
        if failed:
            assembly.forget()
            gone = [sender for sender in failed if self.inbound[sender].sender_gone]
            same = len({str(e) for e in failed.values()}) == 1
            if not gone and len(failed) == len(outcomes) and same:
                raise next(iter(failed.values()))  # the same on every lane: refused, called off
            reasons = {sender: first_line(error) for sender, error in failed.items()}
            blamed, tail = blame(reasons, gone)
            why = (
                f"{member} holds no version: the lanes of trainer ranks {blamed} did not commit "
                f"here{tail}"
            )
            if not gone and all(isinstance(e, TransportError) for e in failed.values()):
                # Every sender is alive and its lane's collective failed here: a member of the
                # lanes' groups died (the senders name it), not a sender.
                raise TransportError(f"{why} (a receiving rank left mid-push?)")
            raise SenderFailedError(why, blamed)
        versions = [version for version, _ in outcomes.values()]
        held = agreed(versions)
        if held is None:
            raise SenderFailedError(f"the lanes committed different versions: {versions}")
        return held

    def lost(self, why: str) -> None:
        """What every lane committed did not reach the model after all (an engine's reload
        failed): this member holds no version, and says ``why``."""
        self.held = self.full = None
        self.error = why

    def status(self) -> SyncStatus:
        """This member's state as one receiver's would read: the version every lane committed,
        the push in flight at its least advanced lane's phase, the buckets of every lane, and
        the last push every lane committed, as they received it together."""
        lanes = [lane.member.receiver.status() for lane in self.inbound]
        busy = [status.phase for status in lanes if status.phase != "idle"]
        pushing = [status.pushing for status in lanes if status.pushing is not None]
        return SyncStatus(
            version=self.held,
            full_version=self.full,
            dirty=self.held is None,
            phase=min(busy, key=_PHASES.index, default="idle"),
            pushing=max(pushing, default=None),
            buckets_done=sum(status.buckets_done for status in lanes),
            buckets_total=sum(status.buckets_total for status in lanes),
            in_group=all(status.in_group for status in lanes),
            last=self.last,
            last_error=self.error,
        )

    def close(self) -> None:
        """Leave every lane, and the one group their buckets came over (if they did)."""
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
    ) -> None:
        """``over``: the lane's buckets come over one group, taken in these rounds as this
        lane (its own group then only votes: ``ReceiveLane``)."""
        self.slot = slot
        self.raw_store = open_store(address, port, 1, timeout_s, None)
        self.store = dist.PrefixStore(PREFIX, self.raw_store)
        self.sender_gone = False  # its store closed: the sender's process died or left
        self._over = over
        wrap = functools.partial(over[0].lane, over[1]) if over is not None else None
        self.member = StoreMember(
            Receiver(device, wrap), expecting(lambda: None), lambda: Loader(_unset)
        )
        self._next = 0  # the next command's number

    def receive(self, wait_s: float, push: int | None = None) -> int:
        """Take one push of this lane -- push number ``push`` (None: the next to begin) --
        waiting at most ``wait_s`` for it to begin and as long again, between steps, for it to
        end; its version once committed here, else raises. The steps of earlier pushes, which
        this rank gave up on, are skipped: a member that gave up waiting for push 3 and is then
        asked for push 4 does not take 3, sent late, for it."""
        deadline = Deadline(wait_s, "waiting for the sender's push")
        self._skip_deleted()
        if push is not None:  # straight to its begin: the steps before it may be deleted as read
            self._next = max(self._next, int(self._wait_for(f"{BEGIN}{push}", deadline, None)))
        began = False
        committed: int | None = None
        failure: WeightSyncError | None = None
        while True:
            op, arg = self._command(deadline, failure)
            if op == CLOSE:
                raise WeightSyncError("the sender closed its end: no more pushes will come")
            if not began:  # steps left of a push this rank gave up on are skipped
                if op == "begin" and (push is None or self._begins(int(arg["push"]), push)):
                    began, deadline = True, Deadline(wait_s, "the sender's push")
                continue
            if op == "end":
                return self._ended(arg, committed, failure)
            try:
                committed = self._step(op, arg) or committed
            except Exception as exc:  # answered to the sender already; its verdict follows
                failure = (
                    exc
                    if isinstance(exc, WeightSyncError)
                    else TransportError(f"member {self.slot}: {op} failed: {first_line(exc)}")
                )

    def _skip_deleted(self) -> None:
        """Start from the sender's first command left in its store, if this rank fell so far
        behind that its next one was deleted (``Commands.post``)."""
        try:
            if self.store.check([FLOOR]):
                self._next = max(self._next, int(self.store.get(FLOOR)))
        except RuntimeError as exc:  # the sender is gone: the first command's wait says so
            logger.debug("reading the sender's floor: %s", exc)

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

    def _step(self, op: str, arg: dict[str, Any]) -> int | None:
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
            member.receive(int(arg["version"]))
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
        while True:
            wait = datetime.timedelta(seconds=deadline.left(LONGEST_WAIT_S))  # raises once spent
            try:
                self.store.wait([key], wait)
                return str(self.store.get(key).decode())
            except dist.DistStoreError:
                continue  # timed out: the next ``left`` raises if the deadline is spent
            except RuntimeError as exc:  # DistNetworkError: the store's process is gone
                self.sender_gone = True
                if failure is not None:
                    raise failure from None  # what this rank saw first: the sender left mid-push
                raise TransportError(
                    f"the sender's store stopped answering ({first_line(exc)}); it died or left "
                    "-- check it"
                ) from exc

    def _ended(
        self, arg: dict[str, Any], committed: int | None, failure: WeightSyncError | None
    ) -> int:
        """The push is over on the sender: ``arg`` says how it ended there."""
        member = self.member
        if member.pushing is not None:  # no verdict reached this rank: drop what it prepared
            member.receiver.cancel(member.pushing)
            member.pushing = None
        if committed is not None:  # this rank holds it, whatever failed elsewhere afterwards
            return committed
        if member.prepared is not None and not member.prepared.accepted:
            raise PlanMismatchError({self.slot - 1: member.prepared.problems})
        if failure is not None:
            raise failure
        raise WeightSyncError(
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


def _loader(assembly: Assembly, sender: int) -> Loader:
    return Loader(assembly.loader(sender))


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


def _outcome(call: Future[int]) -> tuple[int | None, BaseException | None]:
    try:
        return call.result(), None
    except Exception as exc:
        return None, exc


def _unset(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    raise AssertionError("a lane's target is set before any push")


def _left(deadline: Deadline) -> datetime.timedelta:
    return datetime.timedelta(seconds=deadline.left(LONGEST_WAIT_S))
