"""``WeightSyncWorker``: the base class an inference-worker Ray actor inherits.

The public surface is the contract -- ``load_weights`` and ``weights_version`` -- plus
``weight_sync_*`` helpers. The protocol methods the updater calls are ``_weight_sync_*``, so the
library never takes a name a user's engine class is likely to define.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ray
import torch

from weight_sync.control.deadline import Deadline
from weight_sync.control.lane_store import NO_ONE_GROUP
from weight_sync.control.store import refuse_unjoined
from weight_sync.errors import WeightSyncError
from weight_sync.receive.assembly import Assembly
from weight_sync.receive.inbound import Lanes
from weight_sync.receive.member import Member
from weight_sync.receive.receiver import Receiver
from weight_sync.transport import TorchGroup
from weight_sync.transport.devices import CPU, module_device
from weight_sync.transport.rounds import Rounds, lane_paths_over
from weight_sync.wire.blocks import BlockLayout
from weight_sync.wire.checksums import state_dict_digests
from weight_sync.wire.metadata import (
    NO_LANE,
    GroupSpec,
    LanePush,
    MemberInfo,
    SyncStatus,
    TensorMeta,
)

SYNC_GROUP = "weight_sync"  # the protocol's calls; one at a time
STATUS_GROUP = "weight_sync_status"  # health: answers while a push runs
CONCURRENCY_GROUPS = {SYNC_GROUP: 1, STATUS_GROUP: 2}
# Which methods run in which group on a worker made with ``remote_worker``. A push's call is
# routed per call by the updater: a staged push of one lane runs in SYNC_GROUP, beside the
# actor's own methods (the model is untouched until its apply, which takes their turn:
# ``_weight_sync_turn``); any other runs in the actor's default group, in turn with them, since
# it writes into the model.
_METHOD_GROUPS = {
    "weights_version": STATUS_GROUP,
    "sync_status": STATUS_GROUP,
    "_weight_sync_info": STATUS_GROUP,
    # Form and leave groups, touching no weight: they must not wait for the actor's own
    # methods (the senders' rendezvous is bounded), unlike the lanes' receives, which write.
    "_weight_sync_lanes_join": SYNC_GROUP,
    "_weight_sync_lanes_leave": SYNC_GROUP,
}


class WeightSyncWorker:
    """Mix into an inference actor: ``@ray.remote class Engine(WeightSyncWorker)``.

    By default received weights are copied, by name, into ``self.model`` (any ``nn.Module``),
    and every push is checked against its state dict before any data moves. Override
    :meth:`load_weights` to load elsewhere (an inference engine, renamed parameters); then
    override :meth:`weight_sync_expected` too if pushes should be checked up front.
    """

    def __init__(self) -> None:
        self._weight_sync_holds = self._weight_sync_new_member()

    # -- the contract --------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs into ``self.model``. Called once per bucket, for the
        tensors that could not land in place (see ``weight_sync_destinations``); the tensors are
        views into a receive buffer, valid only during the call."""
        targets = self._weight_sync_model().state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                targets[name].copy_(tensor)

    def weights_version(self) -> int | None:
        """The version of the last fully received and committed push; ``None`` before the
        first one and while the weights are partly updated or a push failed part-way. After a
        partial push (``push(..., partial=True)``) this is its version, and
        ``sync_status().full_version`` the last push that covered every tensor."""
        return self.sync_status().version

    def sync_status(self) -> SyncStatus:
        """Version, dirty flag, the push in flight (phase, buckets done) and the last push's
        stats. Answers during a push when the actor was made with ``remote_worker``. After a
        push from many senders (``RayLanes``), it speaks for every lane together: the
        version every lane committed, their buckets summed, the least advanced lane's phase."""
        return self._weight_sync_member().status()

    # -- helpers users may call or override ------------------------------------------------------

    def weight_sync_expected(self) -> Mapping[str, TensorMeta] | None:
        """What a push must contain (name -> dtype and shape), checked before any data moves.

        Default: ``self.model``'s state dict when ``load_weights`` is the default one; ``None``
        (accept any push) when ``load_weights`` is overridden.
        """
        if self._weight_sync_custom_load():
            return None
        return {
            name: TensorMeta.of(name, tensor)
            for name, tensor in self._weight_sync_model().state_dict().items()
        }

    def weight_sync_destinations(self) -> Mapping[str, torch.Tensor] | None:
        """Tensors that received bytes may be written into directly, skipping ``load_weights``
        and any staging copy (used where contiguous, same dtype, shape and device).

        Default: ``self.model``'s parameters and buffers (its state dict with ``keep_vars``:
        the very tensors, not a detached copy of each -- 4x cheaper on a model of thousands of
        tensors; weight_sync writes into them under ``no_grad``) when ``load_weights`` is the
        default one, else ``None`` (everything goes through ``load_weights``).
        """
        if self._weight_sync_custom_load():
            return None
        return self._weight_sync_model().state_dict(keep_vars=True)

    def weight_sync_device(self) -> torch.device:
        """The device this worker receives on: that of ``self.model``'s weights (the CPU when it
        has none on a GPU). A worker that loads into an engine of its own should return its
        engine's GPU here: the trainer routes by it (NCCL, or CUDA IPC for a worker on the
        trainer's own GPU), and a worker reporting the CPU is sent host buffers over Gloo."""
        model = getattr(self, "model", None)
        return module_device(model) if isinstance(model, torch.nn.Module) else CPU

    def weight_sync_digests(self) -> dict[str, str]:
        """SHA-256 of every tensor of ``self.model``'s state dict, to compare with the trainer's."""
        return state_dict_digests(self._weight_sync_model().state_dict())

    # -- protocol, called by WeightUpdater (weight_sync.actors.lanes: RayLanes) -----------------

    def _weight_sync_info(self, timeout_s: float | None = None) -> MemberInfo:
        member = self._weight_sync_member()
        return member.record.info(member.concurrent, one_call=True)

    def _weight_sync_lanes_push(
        self,
        call_json: str,
        timeout_s: float | None = None,
        one_group: bool = False,
        beside: bool = False,
    ) -> str | None:
        """A push from the senders whose stores rank 0's call (``LanePush``, as JSON) names,
        as member ``slot`` of each, in one call (``Member.take``): this worker's check before any
        byte moves (what it cannot take, its version past every version it was sent; the layout
        read in rank 0's store if it lacks it), then every lane at once (a thread each), each
        opening as the call says -- refused on every lane where the check found problems.
        Returns the reply of rank 0's lane where the call asks for it (``LanePush.answer``) and
        it committed here in the step the call carried (a ``WorkerReply``, JSON); else None,
        every reply in its sender's store.
        ``one_group``: their buckets come over the one group this worker joined with them
        (``_weight_sync_lanes_join``); holding none, it refuses the push in every sender's store,
        and the senders form the group again. ``beside``: the push is staged (atomic) and this
        call runs in weight_sync's concurrency group, beside the actor's own methods, which go on
        serving the old weights; the staged bytes are applied in their turn (``_weight_sync_turn``)."""
        call = LanePush.parse(call_json)
        member = self._weight_sync_member()
        if one_group and (missing := _no_group(member.lanes_from(call.endpoints))):
            member.record.saw(call.check.version)  # spent, as on the senders
            status, dial_s = member.record.status(), min(call.wait_s, 60.0)
            for endpoint, first in zip(call.endpoints, call.firsts, strict=True):
                if first != NO_LANE:
                    version, slot = call.check.version, call.slot
                    refuse_unjoined(endpoint, version, slot, [missing], status, dial_s)
            return None

        made: list[Assembly] = []  # the user's hooks, asked once a push: by the check

        def problems(layout: BlockLayout) -> list[str]:
            made.append(self._weight_sync_assembly(layout))
            return made[-1].problems(member.record)

        def target(layout: BlockLayout) -> Assembly:
            assert made and made[-1].layout is layout, "a push is taken once it was checked"
            return made[-1]

        answered: list[str] = []
        name = f"worker {call.slot - 1}"
        turn = self._weight_sync_turn(Deadline(call.wait_s, "the actor's turn")) if beside else None
        member.take(call, problems, target, name, answered.append, turn)
        return answered[0] if answered else None

    def _weight_sync_turn(self, deadline: Deadline) -> Callable[[Callable[[], None]], None]:
        """Where a push received beside the actor's own methods applies its staged bytes: in
        the actor's default concurrency group, through a call the actor makes on itself
        (``_weight_sync_apply``), so that it runs in turn with those methods -- none sees the
        weights half-applied. The wait for that turn is bounded by what the push has left; a
        turn not begun by then is withdrawn (the old weights stay) and fails the lane."""
        me = ray.get_runtime_context().current_actor
        turns: dict[int, _Turn] = self.__dict__.setdefault("_weight_sync_turns", {})

        def in_turn(apply: Callable[[], None]) -> None:
            turn = _Turn(apply)
            turns[id(turn)] = turn
            applied = me._weight_sync_apply.remote(id(turn))
            wait_s = max(1.0, deadline.remaining())
            ready, _ = ray.wait([applied], timeout=wait_s)
            if not ready and turns.pop(id(turn), None) is turn:  # not begun: withdrawn
                raise WeightSyncError(
                    f"the actor's own methods held its default concurrency group for {wait_s:.1f}"
                    " s: the staged push was not applied -- check for a method that runs for "
                    "long, or raise SyncConfig.push_timeout_s"
                )
            ray.get(applied, timeout=None if ready else wait_s)  # begun: it ends
            turn.done()

        return in_turn

    def _weight_sync_apply(self, key: int) -> None:
        """The actor's turn to apply a staged push (``_weight_sync_turn``); a turn withdrawn
        meanwhile is not run."""
        turn = self.__dict__.get("_weight_sync_turns", {}).pop(key, None)
        if turn is not None:
            turn.run()

    def _weight_sync_lanes_join(
        self,
        spec_json: str,
        endpoints: list[tuple[str, int]],
        slot: int,
        timeout_s: float | None = None,
    ) -> None:
        """Join the one group the lanes of the senders at ``endpoints`` move their buckets over
        (``WeightUpdater(one_group=True)``), as the rank ``spec_json`` names, while they do;
        this worker's lanes from them (one per sender) take their buckets from it, in rounds."""
        spec = GroupSpec.model_validate_json(spec_json)
        device = self.weight_sync_device() if spec.backend == "nccl" else None
        # Joined before the earlier lanes are left: a join that comes too late (this actor was
        # busy past the senders' rendezvous bound) fails, and leaves those lanes as they were.
        group = TorchGroup.join(spec, None, device)
        try:
            senders = range(len(endpoints))  # the group's first ranks
            rounds = Rounds(group, senders, lane_paths_over(group, len(senders)))
            self._weight_sync_member().follow(endpoints, slot, spec.rendezvous_timeout_s, rounds)
        except BaseException:
            group.close()
            raise

    def _weight_sync_lanes_leave(
        self, endpoints: list[tuple[str, int]], timeout_s: float | None = None
    ) -> None:
        """The senders at ``endpoints`` left (``RayLanes.close``): let go of their lanes,
        and of the one group they came over, unless lanes from other senders took their
        place. What the lanes landed stays this worker's status."""
        self._weight_sync_member().leave(endpoints)

    # -- internals -----------------------------------------------------------------------------

    def _weight_sync_member(self) -> Member:
        """What this worker holds -- one record (a ``Receiver``), whichever senders pushed it --
        and the lanes it follows."""
        # Tolerates a subclass that forgot super().__init__().
        member = self.__dict__.get("_weight_sync_holds")
        if member is None:
            member = self._weight_sync_holds = self._weight_sync_new_member()
        return member

    def _weight_sync_new_member(self) -> Member:
        concurrent = getattr(self, "_weight_sync_concurrent", False)
        return Member(Receiver(self.weight_sync_device), concurrent)

    def _weight_sync_state(self) -> Receiver:
        return self._weight_sync_member().record

    def _weight_sync_assembly(self, layout: BlockLayout) -> Assembly:
        """Where a push from many senders lands: in this worker's destinations -- the last
        push's assembly again while it serves (the same layout into the very same tensors) --,
        or put together into whole tensors for ``load_weights``."""
        destinations = self.weight_sync_destinations()
        if destinations is None:
            return Assembly(layout, None, self.load_weights)
        last: Assembly | None = self.__dict__.get("_weight_sync_assembled")
        if last is None or not last.serves(layout, destinations):
            last = self._weight_sync_assembled = Assembly(layout, destinations)
        return last

    def _weight_sync_custom_load(self) -> bool:
        return self._weight_sync_overrides("load_weights")

    def _weight_sync_overrides(self, *names: str) -> bool:
        """Whether this worker's class replaces any of the methods ``names`` (Ray wraps an
        actor's methods: what they wrap is compared)."""
        cls = type(self)
        return any(
            inspect.unwrap(getattr(cls, name)) is not getattr(WeightSyncWorker, name)
            for name in names
        )

    def _weight_sync_model(self) -> torch.nn.Module:
        model = getattr(self, "model", None)
        if model is None:
            raise AttributeError(
                f"{type(self).__name__} has no `self.model`; set an nn.Module in __init__ or "
                "override load_weights (and weight_sync_expected)"
            )
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"{type(self).__name__}.model is a {type(model).__name__}, not an nn.Module; "
                "set one in __init__ or override load_weights (and weight_sync_expected)"
            )
        return model


class _Turn:
    """A staged push's apply, handed from the thread that received it to the actor's own
    (``WeightSyncWorker._weight_sync_turn``): its error goes back to the receiving thread, in
    this process, unpickled."""

    def __init__(self, apply: Callable[[], None]) -> None:
        self._apply = apply
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._apply()
        except BaseException as exc:
            self._error = exc

    def done(self) -> None:
        if self._error is not None:
            raise self._error


def remote_worker(cls: type | None = None, /, **ray_options: Any) -> Any:
    """``ray.remote`` for a ``WeightSyncWorker`` subclass, with weight_sync's concurrency groups:
    ``weights_version`` and ``sync_status`` then answer while a push is in flight, and with
    atomic staging the push is received while the actor goes on serving.

    Use as ``@remote_worker`` or ``@remote_worker(num_gpus=1, concurrency_groups={...})``; any
    ``ray.remote`` option passes through, and your own concurrency groups are kept. A plain
    ``@ray.remote`` works too, but then every call waits for a push in flight to finish.
    """

    def wrap(cls: type) -> Any:
        if not (isinstance(cls, type) and issubclass(cls, WeightSyncWorker)):
            raise TypeError(f"remote_worker decorates WeightSyncWorker subclasses, not {cls!r}")
        groups = dict(ray_options.get("concurrency_groups") or {})
        taken = sorted(groups.keys() & CONCURRENCY_GROUPS.keys())
        if taken:
            raise ValueError(f"concurrency group names {taken} are weight_sync's; rename yours")
        methods = {
            name: _in_group(getattr(cls, name), group) for name, group in _METHOD_GROUPS.items()
        }
        tagged = type(
            cls.__name__,
            (cls,),
            {
                **methods,
                "_weight_sync_concurrent": True,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__,
            },
        )
        options = {**ray_options, "concurrency_groups": {**groups, **CONCURRENCY_GROUPS}}
        return ray.remote(**options)(tagged)

    return wrap(cls) if cls is not None else wrap


def _in_group(method: Callable[..., Any], group: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def in_group(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs)

    # Ray reads the group from the unwrapped function, which is the base class's and shared by
    # every subclass: the tag must sit on a function of our own, with no __wrapped__ to follow.
    del in_group.__wrapped__  # type: ignore[attr-defined]
    in_group.__ray_concurrency_group__ = group  # type: ignore[attr-defined]
    return in_group


def _no_group(lanes: Lanes | None) -> str | None:
    """Why a worker holding ``lanes`` (its lanes from some senders, if any) cannot take a push
    over their one group, if it cannot: it would listen on lanes of its own while they send
    over the group, and they would wait out their bound."""
    if lanes is None or lanes.rounds is None:
        return (
            f"{NO_ONE_GROUP} (it restarted, or lanes from other senders took its place); "
            "their next push forms the group again"
        )
    return None
