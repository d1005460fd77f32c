"""The ranks of one launched job -- ``torchrun``, ``mpirun``, ``mp.spawn`` -- as a sync group, no Ray.

The textbook shape: N processes started by a launcher, rank 0 training, ranks 1..N-1 serving,
rank 0 broadcasting fresh weights to the others over a group made with ``new_group`` beside the
job's default group. Every rank makes a ``JobSync`` at the same point (a collective), then calls
``update(model)`` once per push::

    sync = JobSync(SyncConfig())          # reads the launcher's environment if need be
    for step in range(steps):
        if sync.rank == 0:
            train_step(model)
        version = sync.update(model)      # rank 0 pushes model.state_dict(), the others receive
    sync.close()

One push protocol, whatever the number of senders (``JobSync(senders=K)``: ranks ``0..K-1``,
one by default; K > 1 a sharded trainer, every rank pushing its own shards, see
docs/many-senders.md). A push is:

1. the agreement, every rank at once, before any byte moves (``send.senders.agree``: a gather of
   fixed-size rows over a Gloo group of the job): each sender's checks, version and layout
   digest; the layout itself to receiving ranks that lack it; their word on it (``Member.check``:
   the tensors against their model, the version past every one they were sent), each refusal
   said to every rank. A receiving rank waits for rank 0 to begin (its ``timeout_s``) before it
   joins: a wait in a collective would be bounded by the group alone, and leave it out of step;
2. each sender's lane: its ordinary push (``send.pusher.Pusher``: prepare, transfer, two-phase
   commit) over its own store, which every receiving rank reads in order -- one sender's lane
   over a group made with ``new_group`` (``group_mode='job'``, Gloo; an NCCL push stands alone,
   see ``transport.torch_group``), several senders' over a standalone Gloo group each, or
   every lane's buckets over one group of every rank (``one_group``);
3. the verdict: every sender reports how its lane ended in rank 0's store and rank 0 judges them
   (``wire.blame``); a receiving rank holds a version only once every lane committed it there
   (``receive.member.Member``, its blocks placed by ``receive.assembly``).

So the checks before any byte moves, versions that never repeat, two-phase commit, bounded waits
and typed errors are those of every front: a sender's ``push`` raises what ``WeightUpdater.push``
raises, and every other rank's ``receive`` raises a ``WeightSyncError`` when the push did not
commit there (``PlanMismatchError`` when this rank refused it; ``SenderFailedError`` naming the
trainer ranks that died or failed, their death said first).

Rank 0 listens on a store of its own (``SyncConfig.master_addr`` or ``interface``: loopback
unless named, so a job across nodes must name rank 0's address), as every sender does for its
lane, and the ranks learn where over that Gloo group (``send.senders.Senders``, the senders of
every front). Ranks are the job's ranks: rank r of the job is rank r of the group.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import Self

from weight_sync.config import SyncConfig
from weight_sync.control.deadline import Deadline
from weight_sync.errors import (
    PlanMismatchError,
    WeightSyncError,
)
from weight_sync.receive.assembly import Assembly
from weight_sync.receive.member import Member
from weight_sync.receive.receiver import Receiver
from weight_sync.result import PushResult
from weight_sync.send.collectives import from_rank_0, gather_bytes, gather_rows
from weight_sync.send.senders import Outbound, Senders, agree, lane_config, nothing_moves
from weight_sync.transport import TorchGroup
from weight_sync.transport.devices import CPU, module_device
from weight_sync.transport.rounds import LanePath, Rounds
from weight_sync.wire.lane_rules import Share, row_digest, share_of
from weight_sync.wire.state_dict import StateDict
from weight_sync.wire.versions import past_sent

__all__ = ["JobSync", "LaunchEnv", "launch_env"]

logger = logging.getLogger(__name__)

_REFUSAL_BYTES = 1024  # what a receiving rank says of a layout it refuses, to the senders


@dataclass(frozen=True)
class LaunchEnv:
    """Who this process is in a launched job, as its launcher says."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "torchrun" or "mpirun"


def launch_env(environ: Mapping[str, str]) -> LaunchEnv | None:
    """Read the launcher's variables: torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) or
    Open MPI's (``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``); None where neither is
    set (``mp.spawn`` sets none: its processes make their default group themselves)."""
    for launcher, prefix in (("torchrun", ""), ("mpirun", "OMPI_COMM_WORLD_")):
        rank, size = (
            environ.get(f"{prefix}RANK"),
            environ.get(f"{prefix}SIZE" if prefix else "WORLD_SIZE"),
        )
        if rank is None and size is None:
            continue
        try:
            parsed = LaunchEnv(
                int(rank or ""),
                int(size or ""),
                int(environ.get(f"{prefix}LOCAL_RANK", "0")),
                launcher,
            )
        except ValueError:
            raise ValueError(
                f"{launcher}'s variables {prefix or ''}RANK={rank!r} and "
                f"{prefix + 'SIZE' if prefix else 'WORLD_SIZE'}={size!r} must both be integers"
            ) from None
        if not 0 <= parsed.rank < parsed.world_size:
            raise ValueError(f"rank {parsed.rank} is outside a world of {parsed.world_size}")
        return parsed
    return None


class JobSync:
    """This rank's end of the job's pushes; see the module doc.

    Made on every rank at once (it shares the senders' addresses over the default group). If
    the process has no default group yet, one is made from the launcher's variables (Gloo,
    ``init_method``: ``env://`` by default, which needs ``MASTER_ADDR``/``MASTER_PORT``: torchrun
    sets them, mpirun users export them with ``-x``; or a ``file://`` path every rank shares).

    ``senders``: how many ranks send, ranks ``0..senders-1``. One (the default): rank 0 pushes
    its state dict whole. More: the ranks of a sharded trainer (FSDP2, tensor parallel), each
    pushing the blocks of its own shards at once over a lane of its own. The same protocol
    either way; see the module doc.

    ``one_group`` (with several senders): every lane's buckets go over one group of every rank,
    point to point, each receiving rank taking them in rounds (``transport.rounds``), rather
    than over a Gloo group per lane -- the design for NCCL (``SyncConfig(backend="nccl")``,
    which needs it), where K communicators on one GPU may deadlock. A push that fails midway
    leaves that group aborted; every rank forms it again as the next push begins.
    """

    def __init__(
        self,
        config: SyncConfig | None = None,
        *,
        senders: int = 1,
        init_method: str | None = None,
        one_group: bool = False,
    ) -> None:
        if config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig, got {type(config).__name__}")
        if not isinstance(senders, int) or isinstance(senders, bool) or senders < 1:
            raise ValueError(f"senders must be an int >= 1 (the trainer's ranks), got {senders!r}")
        config = config or SyncConfig()
        if "same_host" in config.model_fields_set and config.same_host != "group":
            raise ValueError(
                "JobSync pushes over the job's own groups, every receiving rank a member: "
                f"same_host={config.same_host!r} would take some ranks out of them; leave it unset"
            )
        # One sender: new_group over the job's world, unless the config asks for a group of its
        # own rendezvous ("standalone": members on one host then take the push from one of them,
        # see SyncConfig.relay). Several: a group per lane, each standalone (new_group is
        # collective over the world, and the lanes form at once).
        mode = "job" if senders == 1 else "standalone"
        if "group_mode" in config.model_fields_set and config.group_mode != mode:
            if config.group_mode != "standalone":
                raise ValueError(
                    f"JobSync pushes over a group made with new_group ('job') or of its own "
                    f"('standalone'), not group_mode={config.group_mode!r}"
                    + (" (several senders need 'standalone')" if senders > 1 else "")
                )
            mode = "standalone"
        self.config = config.model_copy(update={"group_mode": mode, "same_host": "group"})
        if one_group and senders == 1:
            raise ValueError("one_group is for several senders; one sender already has one group")
        buckets = self.config  # with one_group, the backend the buckets travel on
        if senders > 1:
            self.config = lane_config(self.config, one_group)  # the lanes' own groups: Gloo
        self.senders = senders
        self._one_group = one_group  # every lane's buckets over one group of every rank
        self._renew = False  # this rank's last push failed once the bytes began
        self._senders: Senders | None = None  # every rank's part in the senders' lanes
        self._out: Outbound | None = None  # a sender's lane
        self._member: Member | None = None  # a receiving rank's: what it holds, its lanes
        self._committed = 0  # a sender's: the last push every lane committed
        self._closed = False
        self._device = CPU  # where this rank's model lives: set by each receive
        self.last_result: PushResult | None = None
        self._owns_world = _ensure_world(config, init_method)
        try:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            if self.world_size <= senders:
                raise ValueError(
                    f"a job of {self.world_size} ranks, {senders} of them sending, has nobody to "
                    "push to: launch more ranks, or name fewer senders"
                )
            receiving = self.rank >= senders
            if receiving:
                self._member = Member(Receiver(lambda: self._device))
            receivers = self.world_size - senders
            # The senders' lanes, every receiving rank a rank of their group and agreement.
            self._senders = Senders(
                buckets,
                None,
                lambda _: receivers,
                "JobSync",
                one_group=one_group,
                receivers=receivers,
                follow=self._follow if receiving else None,
                lanes=senders > 1,
            )
            self._out = None if receiving else self._senders.out
        except BaseException:
            self.close()
            raise

    # -- every rank ----------------------------------------------------------------------------

    @property
    def is_sender(self) -> bool:
        return self.rank < self.senders

    def update(
        self, model: torch.nn.Module, timeout_s: float | None = None, version: int | None = None
    ) -> int:
        """One push: the senders send ``model.state_dict()`` (with several senders, each its
        own shards of it), every other rank receives into its ``model`` (same names, shapes,
        dtypes: whole tensors). Returns the version now held, on every rank. ``version`` (read
        on the senders only): as ``WeightUpdater.push`` -- an RL loop's step, past every
        version a rank holds or was sent, or refused before anything is sent."""
        if self.is_sender:
            return self.push(model.state_dict(), version=version).version
        return self.receive(model, timeout_s=timeout_s)

    @property
    def version(self) -> int | None:
        """The version this rank holds (a sender: the last one every rank committed); None
        before the first push, while this rank's weights are part-way through one, and once
        closed."""
        if self._out is not None:
            return self._committed or None
        if self._member is None or self._member.lanes is None:
            return None
        return self._member.record.version

    def close(self) -> None:
        """Leave. On a sender the other ranks' next ``receive`` raises; the default group is
        destroyed only if ``JobSync`` made it. Idempotent."""
        self._closed = True
        out, self._out = self._out, None
        if self._member is not None:
            self._member.close()
        self._member = None
        senders, self._senders = self._senders, None
        if senders is not None:
            senders.close()  # this rank's lane with it
        elif out is not None:
            out.close()
        if self._owns_world and dist.is_initialized():
            self._owns_world = False
            dist.destroy_process_group()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _follow(
        self, endpoints: list[tuple[str, int]], one_group: TorchGroup | None, paths: list[LanePath]
    ) -> None:
        """A receiving rank's lanes from every sender (over ``one_group`` along ``paths``, if
        there is one: then anew, the group being new)."""
        assert self._member is not None
        rounds = Rounds(one_group, range(self.senders), paths) if one_group is not None else None
        slot = self.rank - self.senders + 1
        self._member.follow(endpoints, slot, self.config.rendezvous_timeout_s, rounds)

    def _begin(self) -> Senders:
        """Every rank at once, as a push from several senders begins: over one group, formed
        again first where any rank's last push failed once its bytes began (the group is then
        aborted, or may be; ``Senders.renew``)."""
        assert self._senders is not None
        if self._one_group:
            self._senders.renew(self._renew)
            self._renew = False
        self._senders.pushes += 1
        return self._senders

    # -- the senders ---------------------------------------------------------------------------

    def push(self, state_dict: StateDict, **options: Any) -> PushResult:
        """A sender: send ``state_dict`` to every receiving rank (``options``: ``version``,
        ``rename``, ``transform`` -- whole tensors only -- and ``partial``, as
        ``WeightUpdater.push`` takes them); the others call ``receive`` meanwhile. Every sender
        calls it at once with its own shards of the same state dict (one sender: the whole of
        it), and each returns once every lane committed (``SenderFailedError`` naming the
        senders that did not, when one failed or died). A mistake in the state dict or the
        options raises on the sender that made it, once every rank agreed to call the push off:
        nothing is sent anywhere."""
        if self._closed:
            raise WeightSyncError("this JobSync is closed; make a new one on every rank")
        if self._out is None:
            raise ValueError(
                f"rank {self.rank} receives: only ranks 0..{self.senders - 1} push (call receive)"
            )
        started = time.monotonic()  # the push's bound counts from here, as on Ray
        assert self._senders is not None
        if self.rank == 0:  # the receiving ranks wait for this, bounded by their timeout_s
            self._senders.verdicts.begin(self._senders.pushes + 1)
        senders = self._begin()
        share = share_of(state_dict, options, self.senders, self.rank, self.config, senders.layouts)
        version = self._agree(share, None, None)
        if (empty := nothing_moves(share, self._committed)) is not None:
            return empty
        try:
            self.last_result = senders.push(share, version, started)
        except BaseException:  # once agreed: whatever failed may have left the group aborted
            self._renew = True
            raise
        self._committed = self.last_result.version
        return self.last_result

    # -- every other rank ----------------------------------------------------------------------

    def receive(
        self,
        model: torch.nn.Module | None = None,
        *,
        load_weights: Any = None,
        timeout_s: float | None = None,
    ) -> int:
        """Take one push into ``model`` (its state dict: checked against the push before any
        byte moves, written in place), or hand it to ``load_weights`` (an iterable of ``(name,
        tensor)`` per bucket, tensors valid during the call; accepts any names).

        Waits at most ``timeout_s`` (default ``push_timeout_s``) for the push to begin, and as
        long again, between steps, for it to end (a step under way is bounded by the group's
        own timeouts). Returns the version committed; raises a ``WeightSyncError`` when the
        push did not commit here (this rank then reports no version, unless the push was
        refused before any byte moved). With several senders, it holds a version only once
        every sender's lane committed it here (``SenderFailedError`` naming the senders whose
        lanes did not)."""
        if self._closed:
            raise WeightSyncError("this JobSync is closed; make a new one on every rank")
        if self._member is None:
            raise ValueError("the senders push: call push (or update) there")
        if (model is None) == (load_weights is None):
            raise ValueError("pass a model, or a load_weights callable, not both")
        self._device = module_device(model) if model is not None else CPU
        group = self._senders.one_group if self._senders is not None else None
        if group is not None and group.is_nccl and self._device not in (CPU, group.device):
            raise ValueError(
                f"this rank's model is on {self._device}, its one NCCL group on {group.device}: "
                "call torch.cuda.set_device on the model's GPU before making the JobSync"
            )
        wait_s = timeout_s if timeout_s is not None else self.config.push_timeout_s
        assert self._senders is not None and self._member.lanes is not None, "followed at once"
        # Until rank 0 begins the push, not in the agreement's first collective: that would
        # wait out the group's bound (push_timeout_s), and a rank that gave up there could not
        # take the next push. One that gives up here takes this push at its next receive.
        waiting = Deadline(wait_s, "waiting for the senders' push")
        self._member.lanes.verdicts.begun(self._senders.pushes + 1, waiting)
        push = self._begin().pushes
        target = model.state_dict(keep_vars=True) if model is not None else None
        load = load_weights if target is None else None
        version = self._agree(None, target, load)
        assert self._member.layout is not None, "an agreed push's layout is held"
        assembly = Assembly(self._member.layout, target, load)
        try:
            name = f"rank {self.rank}"
            held = self._member.receive(assembly, push, version, wait_s, name)
        except BaseException:  # once agreed: whatever failed may have left the group aborted
            self._renew = True
            raise
        if held is None:  # an empty push, before any other
            raise WeightSyncError("the push was empty, and this rank holds no version yet")
        return held

    # -- several senders: agreeing before any byte moves, reporting after ------------------------

    def _agree(self, share: Share | None, target: dict[str, torch.Tensor] | None, load: Any) -> int:
        """Every rank at once, before any lane moves a byte (``send.senders.agree``): the
        senders' layouts are one, each sender's ``share`` passes its checks, the version is past
        every sender's, and every receiving rank takes the layout -- sent by rank 0 to those
        that lack it, checked as any member checks a push (``Member.check``: the layout bounded,
        its tensors against ``target`` or for ``load``, the version past every one this rank was
        sent). Returns the version; any failure raises on every rank, nothing sent.

        One collective where every receiving rank holds the senders' layout and its model
        takes it (a loop's every push after the first): each receiving rank's row carries its
        word on the layout it holds and the highest version it was sent, so every rank judges
        the push from the rows alone. A second round (the layout to ranks that lack it, each
        rank's check, what each refused) only where a rank lacks the layout or refuses it."""
        member = self._member
        senders = self.senders

        def refused(ahead: bool, version: int, rows: list[tuple[int, ...]]) -> Exception | None:
            if not ahead:  # called off: the senders' word alone, on every rank
                return None
            lacking = self._lacks_layout(rows)
            if not lacking and not any(row[0] for row in rows[senders:]):
                refusals = {
                    rank: stale
                    for rank, row in enumerate(rows[senders:], senders)
                    if (stale := past_sent(version, row[1]))
                }
                return self._refusal(refusals)
            layout_json: str | None = None
            if lacking:  # rank 0 sends it, every other rank reads it
                mine = share.layout if share is not None and self.rank == 0 else None
                layout_json = self._send_layout(mine.wire if mine is not None else None)
            problems: list[str] = []
            if member is not None:
                problems = member.check(
                    layout_json,
                    row_digest(rows[0]),
                    version,
                    self.config.max_metadata_bytes,
                    lambda layout: Assembly(layout, target, load).problems(member.record),
                )
            return self._refusal(self._gather_refusals(problems))

        if share is not None:
            assert self._out is not None
            return agree(share, self._out.pusher.next_version, self._gather, senders, refused)
        assert member is not None
        held, word = member.layout, 0
        if held is not None:  # its word on the layout it holds, should the senders' be that
            word = int(bool(Assembly(held, target, load).problems(member.record)))
        row = [word, member.record.highest_version, 0]
        digest = held.digest if held is not None else None
        return agree(None, 0, self._gather, senders, refused, (row, digest))

    def _refusal(self, refusals: dict[int, list[str]]) -> Exception | None:
        """What this rank raises where receiving ranks refused the push (rank -> why): the
        refusing rank its own words, a sender a ``PlanMismatchError`` naming each (as one
        sender's members are named, ``worker <rank - senders>``), any other receiving rank that
        the push is called off."""
        if not refusals:
            return None
        me = self.rank - self.senders
        if self.rank in refusals:
            return PlanMismatchError({me: refusals[self.rank]})
        if self._member is not None:
            return WeightSyncError(
                f"ranks {sorted(refusals)} refused the push before any byte moved: it is "
                "called off, nothing changed here"
            )
        return PlanMismatchError({r - self.senders: why for r, why in refusals.items()})

    def _lacks_layout(self, rows: list[tuple[int, ...]]) -> bool:
        """Whether a receiving rank holds another layout than the senders' (then rank 0 sends
        it): the same answer on every rank, from the same rows."""
        return any(row[3:] != rows[0][3:] for row in rows[self.senders :])

    def _gather(self, values: list[int], digest: bytes) -> list[tuple[int, ...]]:
        assert self._senders is not None
        return gather_rows(values, digest, self._senders.control)

    def _gather_refusals(self, problems: list[str]) -> dict[int, list[str]]:
        """Why each receiving rank that refused the layout did, on every rank (this one's own
        ``problems``; another's as it said them, UTF-8, cut at ``_REFUSAL_BYTES``): the senders
        name the ranks and what they could not take, as one sender's members are named."""
        assert self._senders is not None
        said = ("; ".join(problems) or "refused").encode() if problems else b""
        rows = gather_bytes(said, _REFUSAL_BYTES, self._senders.control)
        refusals = {
            rank: [raw.decode("utf-8", "replace")]
            for rank, raw in enumerate(rows)
            if raw and rank >= self.senders
        }
        return {**refusals, self.rank: problems} if problems else refusals

    def _send_layout(self, layout: str | None) -> str:
        """Rank 0's layout (``layout``, its JSON: no pickle) to every rank, read back as JSON;
        every rank takes both broadcasts (its size, then it) before any checks what came
        (``Member.check``: a rank leaving between them would hang the rest)."""
        assert self._senders is not None
        control = self._senders.control
        raw = layout.encode() if layout is not None else b""
        raw = control.broadcast(raw, from_rank_0(len(raw), control))
        return layout if layout is not None else raw.decode("utf-8", "replace")


def _ensure_world(config: SyncConfig, init_method: str | None) -> bool:
    """Make the default group from the launcher's variables unless there is one; returns
    whether it was made here."""
    if dist.is_initialized():
        return False
    env = launch_env(os.environ)
    if env is None:
        raise ValueError(
            "no torch.distributed default group and no launcher variables (RANK/WORLD_SIZE from "
            "torchrun, OMPI_COMM_WORLD_RANK/_SIZE from mpirun): launch with one of those, or call "
            "init_process_group first (as mp.spawn's processes do)"
        )
    if init_method is None and not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        raise ValueError(
            f"{env.launcher} gave no MASTER_ADDR/MASTER_PORT: export them to every rank "
            "(mpirun -x MASTER_ADDR=... -x MASTER_PORT=...) or pass init_method='file:///shared/path'"
        )
    dist.init_process_group(
        "gloo",
        init_method=init_method or "env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=config.rendezvous_timeout_s),
    )
    return True
