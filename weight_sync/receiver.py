"""Worker side: validate the plan, receive, unpack, apply, report -- and the version state machine.

A worker's version moves only on commit. The moment the first byte of a push may reach the
model, the worker stops claiming any version ("dirty") until a full push commits, so it never
reports a version whose weights it does not fully hold. With atomic staging no byte reaches the
model before commit, so a failed push leaves the old weights and the old version in place.

A partial push (a subset of the tensors, announced as such) is accepted only on top of a
committed version; it moves ``version`` and leaves ``full_version`` -- the last push that covered
every tensor -- where it was, so the mix of versions is always stated, never silent.
"""

from __future__ import annotations

import logging
import operator
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from pydantic import ValidationError

from weight_sync.delta.layout import DeltaLayout
from weight_sync.delta.lineage import next_base
from weight_sync.delta.transfer import Patcher, receive_layout, staged_checksums
from weight_sync.devices import CPU, gpu_uuid
from weight_sync.errors import WeightSyncError
from weight_sync.metadata import (
    PLAN_CACHE_SIZE,
    TRAINER_RANK,
    VOTE_AGREED,
    VOTE_REFUSED,
    GroupSpec,
    MemberInfo,
    Phase,
    PrepareReply,
    PrepareRequest,
    PushReply,
    ReceiveReport,
    StagingName,
    SyncPlan,
    SyncStatus,
    TensorMeta,
    dtype_name,
)
from weight_sync.packing import (
    Checksum,
    NamedTensors,
    Unpacker,
    bucket_buffers,
    can_land_in,
    checksum_of,
    pinned_chunks,
    read_checksums,
    staging_slots,
)
from weight_sync.planner import align_up
from weight_sync.transport import TorchGroup, Transport, Work
from weight_sync.transport.cuda_ipc import CudaIpcReader
from weight_sync.transport.shm import ShmReader, host_key

logger = logging.getLogger(__name__)

Apply = Callable[[NamedTensors], None]
Destinations = Mapping[str, torch.Tensor]
Streams = dict[torch.device, torch.cuda.Stream]  # a Receiver's receive streams, by device
# What a worker cannot load of a plan, given whether the push is partial; empty: all of it.
Check = Callable[[SyncPlan, bool], Sequence[str]]
_MAX_SPEC_CHARS = 4096
_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")


@dataclass(frozen=True)
class Loader:
    """Where a worker's received tensors go.

    ``load`` is called once per bucket with the tensors completed in it. ``window`` brackets all
    of one push's loads: entered before the first, left after the last -- or with the exception
    that cut the push short, which it may use to undo what it began. An engine that reloads its
    weights layer by layer (vLLM) opens its reload there, once per push: a reload per bucket would
    process layers whose tensors span buckets half-loaded. ``keeps``: ``load`` may hold on to the
    tensors it is handed after returning (until the window closes), so it must never be handed
    views into receive buffers that the push reuses.
    """

    load: Apply
    window: Callable[[], AbstractContextManager[object]] = nullcontext
    keeps: bool = False


def accept_all(plan: SyncPlan, partial: bool) -> list[str]:
    """A ``Check`` for workers whose ``load_weights`` decides for itself."""
    return []


def expecting(expected: Callable[[], Mapping[str, TensorMeta | torch.Tensor] | None]) -> Check:
    """A ``Check`` against the target ``expected()`` names (see ``check_plan``)."""
    return lambda plan, partial: check_plan(plan, expected(), partial)


def check_plan(
    plan: SyncPlan, expected: Mapping[str, TensorMeta | torch.Tensor] | None, partial: bool = False
) -> list[str]:
    """What in ``plan`` this worker cannot load; empty when it can load all of it.

    ``expected`` is the worker's target (name -> meta, or the tensor itself); ``None`` accepts
    any plan (a custom ``load_weights`` decides for itself). With a target, every name sent must be in it, and a
    full push must cover all of it: one that covered only part of the model would leave it
    mixing two versions unannounced (a ``partial`` push announces it).
    """
    if expected is None:
        return []
    problems = []
    sent = plan.metas()
    for name, meta in sent.items():
        want = expected.get(name)
        if want is None:
            problems.append(f"unknown tensor {name!r}")
            continue
        dtype, shape = _described(want)
        if (dtype, shape) != (meta.dtype, meta.shape):
            problems.append(
                f"{name!r}: sent {meta.dtype}{list(meta.shape)}, model has {dtype}{list(shape)}"
            )
    if not partial:
        problems.extend(f"missing tensor {name!r}" for name in expected if name not in sent)
    return problems


@dataclass(frozen=True)
class _Targets:
    """What identifies a worker's tensors for reuse across pushes (of its plan check and its
    unpacker): names, addresses, dtypes and shapes -- taken column by column, since on a model
    of thousands of tensors a tuple per tensor costs 3x more. ``tensors``, not compared, let
    the next push recognise the very same tensor objects (a default worker's are the model's
    own) at their old addresses, and take their dtypes and shapes as read: only an in-place
    reshape that kept the address would escape that, and nothing does that to weights."""

    names: tuple[str, ...]
    addresses: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[torch.Size, ...]
    tensors: list[torch.Tensor] = field(compare=False, repr=False)

    @classmethod
    def of(cls, targets: Destinations | None, last: _Targets | None = None) -> _Targets:
        targets = targets or {}
        tensors = list(targets.values())
        names, addresses = tuple(targets), tuple(map(torch.Tensor.data_ptr, tensors))
        if (
            last is not None and last.names == names and last.addresses == addresses
            and all(map(operator.is_, tensors, last.tensors))
        ):  # fmt: skip
            return last
        return cls(
            names, addresses, tuple(map(_DTYPE, tensors)), tuple(map(_SHAPE, tensors)), tensors
        )


def _described(target: TensorMeta | torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """The dtype name and shape of a worker's target: a tensor is described on the spot (a
    TensorMeta per tensor per push costs more than the check on models of thousands)."""
    if not isinstance(target, torch.Tensor):
        return target.dtype, target.shape
    try:
        return dtype_name(target.dtype), tuple(target.shape)
    except TypeError:  # a dtype that cannot travel: no push can match it
        return str(target.dtype), tuple(target.shape)


@dataclass(frozen=True)
class _Push:
    """A push this worker has accepted: what ``receive`` and ``commit`` will act on."""

    version: int
    plan: SyncPlan
    staging: StagingName
    checksum: bool
    partial: bool
    base: int | None  # full_version when prepared: what a partial push completes
    request: PrepareRequest  # its delta fields: built_on, new_base, delta, delta_bucket_bytes
    held: str | None  # delta_base when prepared
    in_place: bool  # every tensor of the push can be written in place (a delta can apply)
    # An atomic push's staging area, reserved when it was prepared (see _staging_area).
    area: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class _Staged:
    """A received atomic push: each bucket's bytes in host memory, and the device the push's
    transport received on (where they go back at commit)."""

    views: list[torch.Tensor]
    device: torch.device


class Receiver:
    """One worker's end of the sync protocol.

    Thread-safety: ``status`` may be called from another thread while a push runs (the
    actor's status concurrency group); it only reads attributes that are replaced whole.
    """

    def __init__(self, device: torch.device | Callable[[], torch.device] | None = None) -> None:
        # Where this member receives: its weights' device (a callable is asked when a group
        # forms: a worker's model may not exist yet when its Receiver is made). None: the CPU.
        self._device = device
        self.version: int | None = None  # committed version; None before the first / when dirty
        self.full_version: int | None = None  # the last committed push that covered everything
        self.dirty = False
        self.highest_version = 0  # highest version ever prepared: a new trainer starts above it
        # The trainer's base (see weight_sync.delta) these weights are bit for bit, if any.
        self.delta_base: str | None = None
        self._transport: Transport | None = None
        self._max_metadata_bytes = 0
        self._plans: OrderedDict[str, SyncPlan] = OrderedDict()
        self._prepared: _Push | None = None
        self._receiving: _Push | None = None
        self._received: _Push | None = None
        self._staged: _Staged | None = None  # atomic staging: every bucket's bytes
        self._staged_layout: DeltaLayout | None = None  # ... and their layout, for a delta
        self._phase: Phase = "idle"
        self._progress = (0, 0)  # buckets done, of how many
        self._last: ReceiveReport | None = None
        self._last_error: str | None = None
        self._unpackers: tuple[tuple, Unpacker] | None = None  # the last one, by what it serves
        self._accepted: tuple | None = None  # (plan digest, partial, targets) last checked good
        self._targets: _Targets | None = None  # the last destinations seen
        self._streams: Streams = {}  # on a GPU: the stream pushes are received on (per device)

    # -- membership --------------------------------------------------------------------------

    @property
    def transport(self) -> Transport | None:
        """The group this worker is in, if any."""
        return self._transport

    def info(self, concurrent: bool = False, one_call: bool = False) -> MemberInfo:
        """What this member tells the trainer before a group is built. ``one_call``: it takes
        pushes through ``push`` (its receive call may also end in the commit)."""
        gpu = gpu_uuid(self.device)
        return MemberInfo(
            has_default_group=dist.is_available() and dist.is_initialized(),
            cuda=gpu is not None, gpus=(gpu,) if gpu is not None else (), version=self.version,
            highest_version=self.highest_version, hostname=socket.gethostname(),
            pid=os.getpid(), concurrent=concurrent, host=host_key(), delta_base=self.delta_base,
            one_call=one_call,
        )  # fmt: skip

    @property
    def device(self) -> torch.device:
        """Where this member receives (see ``__init__``)."""
        device = self._device() if callable(self._device) else self._device
        return CPU if device is None else device

    def join(self, spec: GroupSpec, max_metadata_bytes: int) -> None:
        self.leave()
        self._max_metadata_bytes = max_metadata_bytes
        self._transport = _join(spec, self.device)

    def join_json(self, spec_json: str, max_metadata_bytes: int, rank_offset: int = 0) -> None:
        """Join the group described by ``spec_json`` as it arrived (bounded, validated), as
        its rank plus ``rank_offset`` (a member's further ranks: an engine's other workers)."""
        if len(spec_json) > _MAX_SPEC_CHARS:
            raise ValueError("group spec too large")
        spec = GroupSpec.model_validate_json(spec_json)
        if rank_offset:
            spec = GroupSpec.model_validate({**spec.model_dump(), "rank": spec.rank + rank_offset})
        self.join(spec, max_metadata_bytes)

    def leave(self) -> None:
        """Leave the group, dropping any push not yet committed (atomic: the old weights stay;
        streaming: the worker stays dirty)."""
        transport, self._transport = self._transport, None
        self._prepared, self._received, self._staged, self._staged_layout = None, None, None, None
        if self._phase in ("prepared", "received"):
            self._phase = "idle"
        if transport is not None:
            transport.close()

    @property
    def staged(self) -> bool:
        """Whether a received push waits in the staging area for its commit."""
        return self._staged is not None

    def status(self) -> SyncStatus:
        pushing = self._prepared or self._receiving or self._received
        done, total = self._progress
        return SyncStatus(
            version=self.version, full_version=self.full_version, dirty=self.dirty,
            phase=self._phase,
            pushing=pushing.version if pushing is not None else None,
            buckets_done=done, buckets_total=total, in_group=self._transport is not None,
            last=self._last, last_error=self._last_error,
        )  # fmt: skip

    # -- one push ----------------------------------------------------------------------------

    def prepare(
        self,
        request_json: str,
        check: Check,
        destinations: Callable[[], Destinations | None] | None = None,
    ) -> PrepareReply:
        """Validate a push before any collective runs. Changes nothing the model can see.

        ``check(plan, partial)`` says what this worker cannot load (see ``expecting``);
        ``destinations()``, where this worker's tensors can be written in place (asked only when
        the trainer keeps a delta baseline). A delta is accepted only on top of the base it was
        computed against, and only into tensors written in place; else the reply asks for
        dense bytes."""
        self._prepared = None
        if len(request_json) > self._max_metadata_bytes:
            return _refuse(
                f"metadata of {len(request_json)} bytes exceeds max_metadata_bytes="
                f"{self._max_metadata_bytes}"
            )
        try:
            request = PrepareRequest.model_validate_json(request_json)
        except ValidationError as exc:
            return _refuse(
                f"malformed metadata ({exc.error_count()} errors): {exc.errors()[0]['msg']}"
            )
        plan = request.plan or self._plans.get(request.plan_digest)
        if plan is None:
            return PrepareReply(accepted=False, need_plan=True)
        if plan.digest != request.plan_digest:
            return _refuse("plan does not match its digest")
        if self._transport is None:
            return _refuse("this worker is not in a sync group")
        if request.partial and self.version is None:
            return _refuse(
                "a partial push needs weights to complete, and this worker holds no "
                "committed version: push the full state dict first"
            )
        try:
            problems = list(check(plan, request.partial))
        except Exception as exc:  # a user's hook: report it instead of crashing the actor call
            problems = [f"cannot check this push against the worker's weights: {exc!r}"]
        if problems:
            return _refuse(*problems)
        self._plans[plan.digest] = plan
        self._plans.move_to_end(plan.digest)
        while len(self._plans) > PLAN_CACHE_SIZE:
            self._plans.popitem(last=False)
        in_place = request.new_base is not None and _in_place(
            plan, destinations, self._transport.device
        )
        if request.delta and not (in_place and self.delta_base == request.built_on):
            return PrepareReply(accepted=False, need_dense=True, in_place=in_place)
        area = None
        if request.staging == "atomic" and not request.delta:  # a delta's size comes later
            try:
                area = _staging_area(plan, self._transport.device)
            except WeightSyncError as exc:  # refused before any byte moves, everywhere
                return _refuse(str(exc))
        self._prepared = _Push(
            request.version, plan, request.staging, request.checksum, request.partial,
            self.full_version, request, self.delta_base, in_place, area,
        )  # fmt: skip
        self.highest_version = max(self.highest_version, request.version)
        self._phase = "prepared"
        return PrepareReply(accepted=True, in_place=in_place)

    def push(
        self,
        request_json: str,
        check: Check,
        loader: Loader | Apply,
        destinations: Destinations | None,
        checks_destinations: bool = False,
    ) -> PushReply:
        """A whole push in one call -- the trainer's steady state, where this worker holds the
        plan: ``prepare``, then a vote over the group on every member's verdict before any byte
        moves (so one refusal still stops the push everywhere, as a prepare round would), then
        ``receive``, which ends in the commit (the request asks ``commit_on_receipt``).

        ``checks_destinations``: ``check`` checks against ``destinations`` themselves (a default
        ``WeightSyncWorker``), so a plan it accepted last time into the very same tensors is not
        checked again -- on a model of thousands of tensors, that is most of a push's own work."""
        transport = self._transport
        if transport is None:
            raise WeightSyncError("push on a worker that is in no sync group; the trainer rebuilds "
                                  "the group at its next push")  # fmt: skip
        key = self._targets_of(destinations)
        if checks_destinations:
            check = self._remembered(check, key)
        try:
            reply = self.prepare(request_json, check, lambda: destinations)
        except BaseException:
            transport.vote(VOTE_REFUSED)  # the others must not wait on us for their timeout
            raise
        prepared = self._prepared
        try:
            verdict = transport.vote(VOTE_AGREED if reply.accepted else VOTE_REFUSED)
        except BaseException as exc:  # a peer or the trainer failed: this group is done
            self._fail(exc)
            self.leave()
            raise
        if verdict != VOTE_AGREED:
            if prepared is not None:
                self.cancel(prepared.version)
            return PushReply(prepared=reply)
        assert prepared is not None and prepared.request.commit_on_receipt
        received = self.receive(prepared.version, loader, destinations, key)
        return PushReply(prepared=reply, received=received)

    def _remembered(self, check: Check, key: _Targets) -> Check:
        """``check``, skipped for the plan (and partial flag) it last accepted against ``key``."""

        def remembered(plan: SyncPlan, partial: bool) -> Sequence[str]:
            if self._accepted == (plan.digest, partial, key):
                return []
            problems = list(check(plan, partial))
            self._accepted = None if problems else (plan.digest, partial, key)
            return problems

        return remembered

    def cancel(self, version: int) -> None:
        """Drop prepared push ``version`` before any byte of it moved (another worker refused
        it). Idempotent; a push already receiving is not touched."""
        if self._prepared is not None and self._prepared.version == version:
            self._prepared, self._phase = None, "idle"

    @torch.no_grad()  # destinations may be the model's parameters themselves
    def receive(
        self,
        version: int,
        loader: Loader | Apply,
        destinations: Mapping[str, torch.Tensor] | None = None,
        targets_key: _Targets | None = None,
    ) -> ReceiveReport:
        """Take part in the broadcast of a prepared push.

        Streaming: each bucket is applied as it lands -- tensors named in ``destinations`` that
        fit (``can_land_in``) are written there in place, the others go to ``loader`` (one
        window for the whole push) -- and the worker is dirty from the first byte. Atomic: every
        bucket is kept in a staging area and nothing reaches the model (or the version) before
        ``commit``. ``targets_key``: what identifies ``destinations``, where the caller has it.

        With ``commit_on_receipt`` (the trainer asks for it only of members that offered it),
        every rank then votes over the group: the vote completes only once all have received,
        so the push is committed here at once, saving the trainer a round of calls.
        """
        loader = _as_loader(loader)
        push, self._prepared = self._prepared, None
        transport = self._transport
        if push is None or push.version != version or transport is None:
            self.leave()  # our peers are about to broadcast: leaving makes them fail fast
            raise WeightSyncError(f"receive({version}) without a matching prepare on this worker")
        start = time.perf_counter()
        self._received, self._staged, self._receiving = None, None, push
        self._progress = (0, len(push.plan.buckets))
        self._phase = "receiving"
        sums: list[Checksum] | None = [] if push.checksum else None
        sent = push.plan
        try:
            layout = None
            if push.request.delta:
                layout = receive_layout(transport, push.plan, push.request.delta_bucket_bytes)
                sent = layout.plan
                self._progress = (0, len(sent.buckets))
            if push.staging == "atomic":
                area = push.area if layout is None else _staging_area(sent, transport.device)
                assert area is not None
                _receive_all(transport, sent, area, sums, self._advance, self._streams)
                if sums is not None and layout is not None:
                    sums += staged_checksums(push.plan, layout, area, _required(destinations))
                self._staged, self._staged_layout = _Staged(area, transport.device), layout
            else:
                self.version, self.full_version, self.dirty, self.delta_base = (
                    None,
                    None,
                    True,
                    None,
                )
                patched: list[int] | None = [] if push.checksum else None
                landing, apply, finish = _appliers(
                    push.plan, layout, destinations, loader.load, patched
                )
                if layout is not None:  # a delta's layout changes every push: nothing to reuse
                    unpacker = Unpacker(sent, landing, transport.device, owned=loader.keeps)
                else:
                    key = targets_key if targets_key is not None else self._targets_of(landing)
                    unpacker = self._unpacker(sent, landing, key, transport.device, loader.keeps)
                with loader.window():
                    _stream(transport, sent, apply, unpacker, sums, self._advance, self._streams)
                    finish()
                if sums is not None and patched:
                    sums += patched
            if push.request.commit_on_receipt and transport.vote(VOTE_AGREED) != VOTE_AGREED:
                raise WeightSyncError(f"push {version} was called off by another member after the "
                                      "last byte; this worker keeps it uncommitted")  # fmt: skip
        except BaseException as exc:
            # With concurrency groups, the updater may already have had this worker leave and
            # join a new group while this receive was failing: touch only what is still ours.
            if self._transport is transport:
                self._fail(exc)
                self.leave()
            else:
                transport.close()
            raise
        finally:
            if self._receiving is push:
                self._receiving = None
        self._received, self._phase = push, "received"
        self._last = ReceiveReport(
            version=version, nbytes=sent.nbytes, buckets=len(sent.buckets),
            seconds=time.perf_counter() - start,
            checksums=tuple(read_checksums(sums)) if sums is not None else None,
        )  # fmt: skip
        if push.request.commit_on_receipt:
            self.commit(version, loader, destinations)
        return self._last

    @torch.no_grad()
    def commit(
        self,
        version: int,
        loader: Loader | Apply,
        destinations: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """The trainer saw every worker receive ``version``: claim it (atomic: apply it first,
        in one ``loader`` window, from the staging area -- through the GPU, on the receive side
        stream, for a GPU worker)."""
        loader = _as_loader(loader)
        push, staged, layout = self._received, self._staged, self._staged_layout
        self._received, self._staged, self._staged_layout = None, None, None
        if push is None or push.version != version:
            held = push.version if push is not None else None
            self._phase = "idle"
            raise WeightSyncError(
                f"commit({version}) but this worker fully holds {held}; it keeps its state"
            )
        if staged is not None:
            self._phase, self.version, self.full_version, self.dirty = "applying", None, None, True
            self.delta_base = None
            try:
                landing, apply, finish = _appliers(push.plan, layout, destinations, loader.load)
                with loader.window():
                    plan = layout.plan if layout else push.plan
                    _apply_staged(plan, staged, apply, landing, self._streams, loader.keeps)
                    finish()
            except BaseException as exc:
                self._fail(exc)
                raise
        self.version, self.dirty, self._phase = version, False, "idle"
        self.full_version = push.base if push.partial else version
        request = push.request
        self.delta_base = (
            next_base(push.held, request.built_on, request.new_base, not push.partial)
            if push.in_place else None
        )  # fmt: skip
        self._last_error = None

    # -- internals ---------------------------------------------------------------------------

    def _unpacker(
        self,
        plan: SyncPlan,
        landing: Destinations | None,
        targets: _Targets,
        device: torch.device,
        owned: bool,
    ) -> Unpacker:
        """The last push's unpacker when this one has its plan and lands in the very same
        tensors (``targets``), as in the steady state: what it worked out per tensor and per
        bucket, and its receive buffers, are reused."""
        key = (plan.digest, targets, device, owned)
        if self._unpackers is None or self._unpackers[0] != key:
            self._unpackers = (key, Unpacker(plan, landing, device, owned=owned))
        return self._unpackers[1]

    def _targets_of(self, destinations: Destinations | None) -> _Targets:
        self._targets = _Targets.of(destinations, self._targets)
        return self._targets

    def _advance(self) -> None:
        done, total = self._progress
        self._progress = (done + 1, total)

    def _fail(self, exc: BaseException) -> None:
        self._unpackers = None  # it may hold pieces of a tensor that never completed
        self._phase = "idle"
        self._last_error = f"{type(exc).__name__}: {exc}"[:1000]


def _stream(
    transport: Transport,
    plan: SyncPlan,
    apply: Apply,
    unpacker: Unpacker,
    sums: list[Checksum] | None,
    advance: Callable[[], None],
    streams: Streams,
) -> None:
    """Receive bucket k+1 while applying bucket k.

    On a GPU all of it -- receiving, unpacking, ``apply`` (a ``load_weights`` that queues its
    copies on the current stream is ordered with the rest) -- runs on this worker's receive
    stream (``_receive_stream``), and waits only by stream order (``Work.after``) until the one
    host synchronisation at the end (``_drain``). A receive buffer is reused two buckets on,
    after its bucket was applied: the next broadcast into it is queued behind that work, since
    the process group makes its stream wait on the current one when the broadcast is posted.
    """
    device = transport.device
    with _receive_stream(device, streams):
        empties = unpacker.empty_tensors(device)
        if empties:
            apply(empties)
        if not plan.buckets:
            return
        buffers = unpacker.buffers()
        slots = staging_slots(plan)

        def start(index: int) -> tuple[torch.Tensor, Work]:
            slot = slots[index]
            if slot is None:
                data = unpacker.direct_target(index, device)
            else:
                data = buffers[slot][: plan.buckets[index].nbytes]
            return data, transport.broadcast(data, src=TRAINER_RANK)

        data, pending = start(0)
        works = [pending]
        for index in range(len(plan.buckets)):
            works[index].after()
            current = data
            if index + 1 < len(plan.buckets):
                data, pending = start(index + 1)
                works.append(pending)
            if sums is not None:
                sums.append(checksum_of(current))
            ready = unpacker.unpack(index, current)
            if ready:
                apply(ready)
            advance()
        _drain(device, works, sums)


def _receive_all(
    transport: Transport,
    plan: SyncPlan,
    area: list[torch.Tensor],
    sums: list[Checksum] | None,
    advance: Callable[[], None],
    streams: Streams,
) -> None:
    """Receive every bucket into the staging area ``area`` (see ``_staging_area``), touching
    nothing else. Two broadcasts are kept in flight, as when streaming.

    On the host the buckets arrive in the area itself. On a GPU they arrive in two buffers on
    the device (a direct bucket, in memory of its own while it passes) and are copied out to
    the area in pinned host memory as they land: asynchronously, on the receive stream, one
    host synchronisation at the end.
    """
    device = transport.device
    on_host = device.type == "cpu"
    buffers = [] if on_host else bucket_buffers(plan, device)
    slots = staging_slots(plan)
    works: list[Work] = []
    landed: list[torch.Tensor | None] = []
    with _receive_stream(device, streams):
        for index, view in enumerate(area):
            slot = slots[index]
            if on_host:
                data = view
            elif slot is None:
                data = torch.empty(view.numel(), dtype=torch.uint8, device=device)
            else:
                data = buffers[slot][: view.numel()]
            works.append(transport.broadcast(data, src=TRAINER_RANK))
            landed.append(data)
            if index >= 1:
                _finish(works[index - 1], landed, area, index - 1, sums, advance)
        if area:
            _finish(works[-1], landed, area, len(area) - 1, sums, advance)
        _drain(device, works, sums)


def _finish(
    work: Work,
    landed: list[torch.Tensor | None],
    area: list[torch.Tensor],
    index: int,
    sums: list[Checksum] | None,
    advance: Callable[[], None],
) -> None:
    """Bucket ``index`` of an atomic push has landed (in stream order): its checksum, and its
    bytes into the staging area if they landed elsewhere (a GPU buffer, released here)."""
    work.after()
    data, landed[index] = landed[index], None
    assert data is not None
    if sums is not None:
        sums.append(checksum_of(data))
    if data is not area[index]:
        area[index].copy_(data, non_blocking=True)  # into pinned memory: queued, not waited
    advance()


def _apply_staged(
    plan: SyncPlan,
    staged: _Staged,
    apply: Apply,
    destinations: Mapping[str, torch.Tensor] | None,
    streams: Streams,
    owned: bool = False,
) -> None:
    """Apply a received atomic push from its staging area. For a GPU worker each bucket goes
    back to the GPU first, into two buffers used in turn (a direct bucket straight into its
    destination, where it has one), by asynchronous copies from pinned memory on the receive
    stream: the model then takes its tensors on the device, as when streaming."""
    device = staged.device
    unpacker = Unpacker(plan, destinations, device, owned=owned)
    on_host = device.type == "cpu"
    buffers = [] if on_host else unpacker.buffers()
    slots = staging_slots(plan)
    with _receive_stream(device, streams):
        empties = unpacker.empty_tensors(device)
        if empties:
            apply(empties)
        for index, view in enumerate(staged.views):
            slot = slots[index]
            if on_host:
                data = view
            else:
                if slot is None:
                    data = unpacker.direct_target(index, device)
                else:
                    data = buffers[slot][: view.numel()]
                data.copy_(view, non_blocking=True)
            ready = unpacker.unpack(index, data)
            if ready:
                apply(ready)
        _drain(device, [], None)


def _staging_area(plan: SyncPlan, device: torch.device) -> list[torch.Tensor]:
    """Every bucket's place in the staging area of an atomic push received on ``device``: host
    memory always. For a GPU worker it is pinned host memory, not a second copy of the model
    on its GPU (a serving engine's GPU is kept nearly full); pinned so that the copies out of
    the GPU and back at commit are asynchronous. Raises ``WeightSyncError`` when the memory
    cannot be had -- ``prepare`` turns that into a refusal, before any byte moves."""
    sizes = [bucket.nbytes for bucket in plan.buckets]
    pinned = device.type == "cuda"
    try:
        if pinned:
            chunks, where = pinned_chunks(sizes, plan.alignment)
            memory = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for size in chunks]
            return [
                memory[chunk][offset : offset + size]
                for (chunk, offset), size in zip(where, sizes, strict=True)
            ]
        # Each bucket starts on the plan's alignment, as in a buffer of its own: a bucket that
        # ends on an odd byte must not leave the next one's tensors misaligned for their dtype.
        padded = [align_up(size, plan.alignment) for size in sizes]
        memory = [torch.empty(sum(padded), dtype=torch.uint8)]
        return [
            part[:size] for part, size in zip(torch.split(memory[0], padded), sizes, strict=True)
        ]
    except RuntimeError as exc:  # the allocator's out-of-memory error
        where_to = "pinned host memory" if pinned else "host memory"
        raise WeightSyncError(
            f"cannot allocate the staging area of an atomic push: {sum(sizes)} bytes of "
            f"{where_to} ({exc}); free host memory or use staging='stream'"
        ) from exc


def _receive_stream(device: torch.device, streams: Streams) -> AbstractContextManager[object]:
    """Where a push is received on ``device``: a stream of its own on a GPU (made once per
    device and kept in ``streams``, the Receiver's), current for the whole receive. Not the legacy default stream, which a serving
    engine runs on: the receive's waits (``Work.after``/``wait`` block the current stream:
    ProcessGroupNCCL.cpp, ``WorkNCCL::synchronizeStream``) then never stall serving, and
    posting a broadcast waits for nothing of serving's either (the NCCL stream waits on the
    current stream: ``syncStream``). Nothing on the host."""
    if device.type != "cuda":
        return nullcontext()
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    return torch.cuda.stream(stream)


def _drain(device: torch.device, works: Sequence[Work], sums: list[Checksum] | None) -> None:
    """A receive's one host synchronisation, on the current (receive) stream: a bounded wait on
    every broadcast, in order (one already complete returns at once), then the stream's work
    -- and every checksum queued, read in place in the same copy."""
    for work in works:
        work.wait()
    if sums:
        sums[:] = read_checksums(sums)  # a copy to the host: waits for the stream
    elif device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _in_place(
    plan: SyncPlan, destinations: Callable[[], Destinations | None] | None, device: torch.device
) -> bool:
    """Whether every name of ``plan`` has a destination its bytes can be written into."""
    targets = destinations() if destinations is not None else None
    if targets is None:
        return False
    return all(
        name in targets and can_land_in(targets[name], meta, device)
        for name, meta in plan.metas().items()
    )


def _required(destinations: Destinations | None) -> Destinations:
    if destinations is None:
        raise WeightSyncError("a delta push needs this worker's tensors in place (destinations)")
    return destinations


def _appliers(
    plan: SyncPlan,
    layout: DeltaLayout | None,
    destinations: Destinations | None,
    load: Apply,
    sums: list[int] | None = None,
) -> tuple[Destinations | None, Apply, Callable[[], None]]:
    """Where a push's bytes land, what takes the rest, and what finishes it: for a delta, a
    ``Patcher`` writes into ``destinations`` ahead of ``load``."""
    if layout is None:
        return destinations, load, lambda: None
    patcher = Patcher(plan, layout, _required(destinations), sums)

    def apply(named: NamedTensors) -> None:
        rest = patcher.apply(named)
        if rest:
            load(rest)

    return patcher.landing(), apply, patcher.finish


def _join(spec: GroupSpec, device: torch.device) -> Transport:
    """This member's end of the part of the push ``spec`` names. A ring's reader copies into
    buffers on ``device`` for an NCCL push (its weights' GPU); for a Gloo push every buffer is on
    the host."""
    if spec.transport == "group":
        return TorchGroup.join(spec, device=device if spec.backend == "nccl" else None)
    on = device if spec.backend == "nccl" else CPU
    if spec.transport == "cuda_ipc":
        return CudaIpcReader.join(spec, on)
    return ShmReader.join(spec, on)


def _refuse(*problems: str) -> PrepareReply:
    return PrepareReply(accepted=False, problems=problems)


def _as_loader(loader: Loader | Apply) -> Loader:
    return loader if isinstance(loader, Loader) else Loader(loader)
