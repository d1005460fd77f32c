"""Worker side: the front of a push -- validate it, route it, own the transport.

``Receiver`` checks every request before any collective runs (a bad plan refused here never
reaches Gloo, which aborts the process on a short receive), joins and leaves the group, and
routes each call to the receive state machine (``weight_sync.receive.state``: which version this
worker holds, and where its push stands) and to the bucket path (``weight_sync.receive.buckets``:
receiving, staging and applying the bytes). What it may load is ``weight_sync.receive.checks``.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from pydantic import ValidationError

from weight_sync.delta.layout import DeltaLayout
from weight_sync.delta.transfer import receive_sections
from weight_sync.errors import WeightSyncError
from weight_sync.receive.buckets import (
    Apply,
    Destinations,
    Inbound,
    Loader,
    Targets,
    in_place,
    staging_area,
)
from weight_sync.receive.checks import (
    Check,
    accept_all,
    check_plan,
    expecting,
    partial_problems,
)
from weight_sync.receive.state import Push, ReceiveState
from weight_sync.transport import Relay, TorchGroup, Transport
from weight_sync.transport.cuda_ipc import CudaIpcReader
from weight_sync.transport.devices import CPU, gpu_uuid
from weight_sync.transport.shm import ShmReader, host_key
from weight_sync.wire.checksums import Checksum, read_checksums
from weight_sync.wire.metadata import (
    PLAN_CACHE_SIZE,
    VOTE_AGREED,
    VOTE_REFUSED,
    WIRE_VERSION,
    GroupSpec,
    MemberInfo,
    PrepareReply,
    PrepareRequest,
    PushReply,
    ReceiveReport,
    SyncPlan,
    SyncStatus,
    malformed,
)

__all__ = [
    "Apply",
    "Check",
    "Destinations",
    "Loader",
    "Receiver",
    "accept_all",
    "check_plan",
    "expecting",
]

_MAX_SPEC_CHARS = 4096

_T = TypeVar("_T")


class Receiver:
    """One worker's end of the sync protocol.

    Thread-safety: ``status`` may be called from another thread while a push runs (the
    actor's status concurrency group); it only reads attributes that are replaced whole.
    """

    def __init__(
        self,
        device: torch.device | Callable[[], torch.device] | None = None,
        wrap: Callable[[Transport], Transport] | None = None,
    ) -> None:
        # Where this member receives: its weights' device (a callable is asked when a group
        # forms: a worker's model may not exist yet when its Receiver is made). None: the CPU.
        # ``wrap``: what each group joined is used through (a lane of several senders over one
        # group: ``transport.rounds.ReceiveLane``).
        self._device = device
        self._wrap = wrap
        self._state = ReceiveState()
        self._inbound = Inbound()  # this Receiver's receive streams and reusable unpacker
        self._transport: Transport | None = None
        self._max_metadata_bytes = 0
        self._plans: OrderedDict[str, SyncPlan] = OrderedDict()
        self._accepted: tuple | None = None  # (plan digest, partial, targets) last checked good

    # -- what it holds -----------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The committed version; None before the first and while dirty."""
        return self._state.version

    @property
    def full_version(self) -> int | None:
        """The last committed push that covered every tensor."""
        return self._state.full_version

    @property
    def dirty(self) -> bool:
        """A push may have reached the model without committing: no version is claimed."""
        return self._state.dirty

    @property
    def highest_version(self) -> int:
        """The highest version ever prepared: a new trainer starts above it."""
        return self._state.highest_version

    def saw(self, version: int) -> None:
        """``version`` reached this member another way (a push from many senders, whose lanes
        have receivers of their own): a later trainer starts above it here too."""
        self._state.highest_version = max(self._state.highest_version, version)

    @property
    def changes(self) -> int:
        """How many times what the model holds changed (see ``adopt``)."""
        return self._state.changes

    def changing(self) -> SyncStatus:
        """Bytes of another route are about to reach the model this receiver loads: from here
        it claims no version, until that route says what landed (``adopt``). Returns what it
        held, for the route to restore where none of its bytes landed."""
        held = self.status()
        self._state.touch()
        return held

    def adopt(self, status: SyncStatus) -> None:
        """A push reached the model this receiver loads by another route (a push from many
        senders: each lane has a receiver of its own, and this one is the member's record of
        what it holds), and that route reports ``status``: from now on this receiver holds what
        it says -- the versions a partial push is checked against -- and its bytes are no
        delta base (a delta built on one would land on weights it was not built on)."""
        self._state.adopt(status)
        self.saw(status.version or 0)

    @property
    def delta_base(self) -> str | None:
        """The trainer's base (see weight_sync.delta) these weights are bit for bit, if any."""
        return self._state.delta_base

    @property
    def max_metadata_bytes(self) -> int:
        """The bound on a plan's metadata set by the group this receiver joined (0 before)."""
        return self._max_metadata_bytes

    @property
    def staged(self) -> bool:
        """Whether a received push waits in the staging area for its commit."""
        return self._state.staged

    def status(self) -> SyncStatus:
        return self._state.status(in_group=self._transport is not None)

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
            cuda=gpu is not None,
            gpus=(gpu,) if gpu is not None else (),
            version=self.version,
            highest_version=self.highest_version,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            concurrent=concurrent,
            host=host_key(),
            delta_base=self.delta_base,
            one_call=one_call,
        )

    @property
    def device(self) -> torch.device:
        """Where this member receives (see ``__init__``)."""
        device = self._device() if callable(self._device) else self._device
        return CPU if device is None else device

    def join(self, spec: GroupSpec, max_metadata_bytes: int) -> None:
        self.leave()
        self._max_metadata_bytes = max_metadata_bytes
        transport = _join(spec, self.device)
        self._transport = self._wrap(transport) if self._wrap is not None else transport

    def join_json(self, spec_json: str, max_metadata_bytes: int) -> None:
        """Join the group described by ``spec_json`` as it arrived (bounded, validated)."""
        if len(spec_json) > _MAX_SPEC_CHARS:
            raise ValueError("group spec too large")
        self.join(GroupSpec.model_validate_json(spec_json), max_metadata_bytes)

    def leave(self) -> None:
        """Leave the group, dropping any push not yet committed (atomic: the old weights stay;
        streaming: the worker stays dirty)."""
        transport, self._transport = self._transport, None
        self._state.drop()
        if transport is not None:
            transport.close()

    def or_leave(self, hook: Callable[[], _T]) -> _T:
        """``hook()``, run as a push's bytes are about to flow (the model's: where they land);
        where it raises, this receiver leaves the group first, as a receive that fails does --
        its peers, about to vote or broadcast with it, fail at once rather than wait for it
        until their bound."""
        try:
            return hook()
        except BaseException:
            self.leave()
            raise

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
        self._state.unprepare()
        if len(request_json) > self._max_metadata_bytes:
            return _refuse(
                f"metadata of {len(request_json)} bytes exceeds max_metadata_bytes="
                f"{self._max_metadata_bytes}"
            )
        try:
            request = PrepareRequest.model_validate_json(request_json)
        except ValidationError as exc:
            spoken = _wire_of(request_json)
            if spoken not in (None, WIRE_VERSION):  # another release's fields: say so
                return _refuse(_other_release(spoken))
            return _refuse(malformed("metadata", exc))
        named = "wire" in request.model_fields_set  # a trainer before wire versions names none
        if request.wire != WIRE_VERSION or not named:  # (and the field's default would pass)
            return _refuse(_other_release(request.wire if named else None))
        plan = request.plan or self._plans.get(request.plan_digest)
        if plan is None:
            return PrepareReply(accepted=False, need_plan=True)
        if plan.digest != request.plan_digest:
            return _refuse("plan does not match its digest")
        if self._transport is None:
            return _refuse("this worker is not in a sync group")
        if partial := partial_problems(request.partial, self.version):
            return _refuse(*partial)
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
        state = self._state
        lands = request.new_base is not None and in_place(
            plan, destinations, self._transport.device
        )
        if request.delta and not (lands and state.delta_base == request.built_on):
            return PrepareReply(accepted=False, need_dense=True, in_place=lands)
        area = None
        if request.staging == "atomic" and not request.delta:  # a delta's size comes later
            try:
                area = staging_area(plan, self._transport.device)
            except WeightSyncError as exc:  # refused before any byte moves, everywhere
                return _refuse(str(exc))
        state.prepare(
            Push(
                request.version,
                plan,
                request.staging,
                request.checksum,
                request.partial,
                state.full_version,
                request,
                state.delta_base,
                lands,
                area,
            )
        )
        return PrepareReply(accepted=True, in_place=lands)

    def push(
        self,
        request_json: str,
        check: Check,
        loader: Loader | Apply,
        destinations: Destinations | None,
    ) -> PushReply:
        """A whole push in one call -- the trainer's steady state, where this worker holds the
        plan: ``prepare``, then a vote over the group on every member's verdict before any byte
        moves (so one refusal still stops the push everywhere, as a prepare round would), then
        ``receive``, which ends in the commit (the request asks ``commit_on_receipt``)."""
        transport = self._transport
        if transport is None:
            raise WeightSyncError(
                "push on a worker that is in no sync group; the trainer rebuilds "
                "the group at its next push"
            )
        key = self.targets(destinations)
        try:
            reply = self.prepare(request_json, check, lambda: destinations)
        except BaseException:
            transport.vote(VOTE_REFUSED)  # the others must not wait on us for their timeout
            raise
        prepared = self._state.prepared
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

    def targets(self, destinations: Destinations | None) -> Targets:
        """What identifies ``destinations`` (the last answer itself while they are the same
        tensors): the key of ``remembered``, and of the unpacker a push reuses."""
        return self._inbound.targets(destinations)

    def remembered(self, check: Check, key: Targets, digest: str) -> Check:
        """``check`` (against the destinations ``key`` identifies: ``targets``), skipped for the
        push it last accepted, with the same partial flag, into the very same tensors: named by
        ``digest`` (its layout's, checked as a plan of its whole tensors:
        ``checks.check_layout``). On a model of thousands of tensors checking them is most of a
        push's own work; on a small push, a tenth of a member's time before its vote."""

        def remembered(plan: SyncPlan, partial: bool) -> Sequence[str]:
            accepted = (digest, partial, key)
            if self._accepted == accepted:
                return []
            problems = list(check(plan, partial))
            self._accepted = None if problems else accepted
            return problems

        return remembered

    def cancel(self, version: int) -> None:
        """Drop prepared push ``version`` before any byte of it moved (another worker refused
        it). Idempotent; a push already receiving is not touched."""
        self._state.cancel(version)

    @torch.no_grad()  # destinations may be the model's parameters themselves
    def receive(
        self,
        version: int,
        loader: Loader | Apply,
        destinations: Mapping[str, torch.Tensor] | None = None,
        targets_key: Targets | None = None,
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
        push = self._state.take_prepared()
        transport = self._transport
        if push is None or push.version != version or transport is None:
            self.leave()  # our peers are about to broadcast: leaving makes them fail fast
            raise WeightSyncError(f"receive({version}) without a matching prepare on this worker")
        start = time.perf_counter()
        sums: list[Checksum] | None = [] if push.checksum else None
        with self._state.receiving(push):
            try:
                sent = self._receive_bytes(transport, push, loader, destinations, targets_key, sums)
                if push.request.commit_on_receipt and transport.vote(VOTE_AGREED) != VOTE_AGREED:
                    raise WeightSyncError(
                        f"push {version} was called off by another member after the last byte; "
                        "this worker keeps it uncommitted"
                    )
            except BaseException as exc:
                # With concurrency groups, the updater may already have had this worker leave
                # and join a new group while this receive was failing: touch only what is still
                # ours.
                if self._transport is transport:
                    self._fail(exc)
                    self.leave()
                else:
                    transport.close()
                raise
        report = ReceiveReport(
            version=version,
            nbytes=sum(plan.nbytes for plan in sent),
            buckets=sum(len(plan.buckets) for plan in sent),
            seconds=time.perf_counter() - start,
            checksums=tuple(read_checksums(sums)) if sums is not None else None,
        )
        self._state.received(push, report)
        if push.request.commit_on_receipt:
            self.commit(version, loader, destinations)
        return report

    def _receive_bytes(
        self,
        transport: Transport,
        push: Push,
        loader: Loader,
        destinations: Destinations | None,
        targets_key: Targets | None,
        sums: list[Checksum] | None,
    ) -> list[SyncPlan]:
        """Route the bytes of ``push`` by its staging, after a delta's header; returns the plans
        that went over the wire (a delta's layouts, one per section, else the push's own)."""
        request, advance = push.request, self._state.advance
        sent: list[SyncPlan] = []
        layouts: Iterator[tuple[SyncPlan, DeltaLayout]] | None = None
        if request.delta:

            def expect(plan: SyncPlan) -> None:
                sent.append(plan)
                self._state.expect(sum(len(each.buckets) for each in sent))

            layouts = receive_sections(
                transport, push.plan, request.delta_bucket_bytes, request.delta_sections, expect
            )
        if push.staging == "atomic":  # nothing reaches the model before commit
            staged = self._inbound.receive_all(
                transport, push.plan, layouts, push.area, destinations, sums, advance
            )
            self._state.stage(staged)
            return sent or [push.plan]
        if layouts is not None:
            # The first header before the model is touched: a damaged one leaves it clean.
            layouts = itertools.chain([next(layouts)], layouts)
        self._state.touch()  # dirty from the first byte
        self._inbound.stream(
            transport, push.plan, layouts, destinations, loader, sums, advance, targets_key
        )
        return sent or [push.plan]

    @torch.no_grad()
    def commit(
        self,
        version: int,
        loader: Loader | Apply,
        destinations: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """The trainer saw every worker receive ``version``: claim it (atomic: apply it first,
        in one ``loader`` window, from the staging area -- through the GPU, on the receive side
        stream, for a GPU worker -- in the loader's ``turn``)."""
        loader = _as_loader(loader)
        push, staged = self._state.take_received(version)
        if staged is not None:
            self._state.applying()
            try:
                apply = functools.partial(self._inbound.apply_staged, staged, destinations, loader)
                loader.turn(apply)
            except BaseException as exc:
                self._fail(exc)
                raise
        self._state.commit(push)

    def _fail(self, exc: BaseException) -> None:
        self._inbound.forget()
        self._state.fail(exc)


def _join(spec: GroupSpec, device: torch.device) -> Transport:
    """This member's end of the part of the push ``spec`` names. A ring's reader copies into
    buffers on ``device`` for an NCCL push (its weights' GPU); for a Gloo push every buffer is on
    the host."""
    if spec.transport == "group":
        if spec.relay is not None:  # passes the push on to the other members of this host
            return Relay.join(spec)
        return TorchGroup.join(spec, device=device if spec.backend == "nccl" else None)
    on = device if spec.backend == "nccl" else CPU
    if spec.transport == "cuda_ipc":
        return CudaIpcReader.join(spec, on)
    return ShmReader.join(spec, on)


def _refuse(*problems: str) -> PrepareReply:
    return PrepareReply(accepted=False, problems=problems)


def _wire_of(request_json: str) -> object:
    """The wire version a request names, read as plain JSON (its size is already bounded):
    None where it names none, or is not a JSON object at all."""
    try:
        data = json.loads(request_json)
    except ValueError:
        return None
    return data.get("wire") if isinstance(data, dict) else None


def _other_release(spoken: object) -> str:
    return (
        f"the trainer's weight_sync speaks wire version {'none' if spoken is None else spoken}, "
        f"this worker's {WIRE_VERSION}: install the same weight_sync release on both"
    )


def _as_loader(loader: Loader | Apply) -> Loader:
    return loader if isinstance(loader, Loader) else Loader(loader)
