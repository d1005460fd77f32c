"""Buckets in: from a push's transport into the model (streaming), or into a staging area and
from there into the model at commit (atomic).

Pipelined like the sender: bucket k is applied (or copied out) while bucket k+1 arrives, so
memory stays bounded by a couple of buckets. On a GPU all of it runs on the Receiver's own receive
stream and waits only by stream order, with one host synchronisation per receive (``_drain``).
What is kept across pushes -- the receive streams, the last push's unpacker and its buffers --
belongs to one ``Inbound`` per Receiver, never to the module: an engine's workers may run several
Receivers in one process.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from weight_sync.delta.layout import DeltaLayout
from weight_sync.delta.transfer import Patcher, staged_checksums
from weight_sync.errors import WeightSyncError
from weight_sync.transport import Transport, Work
from weight_sync.wire.checksums import Checksum, checksum_of, read_checksums
from weight_sync.wire.metadata import TRAINER_RANK, SyncPlan
from weight_sync.wire.packing import (
    NamedTensors,
    Unpacker,
    bucket_buffers,
    can_land_in,
    pinned_chunks,
    staging_slots,
)
from weight_sync.wire.planner import align_up

Apply = Callable[[NamedTensors], None]
Destinations = Mapping[str, torch.Tensor]
Streams = dict[torch.device, torch.cuda.Stream]  # a Receiver's receive streams, by device
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
    views into receive buffers that the push reuses. ``turn`` runs an atomic push's apply from
    its staging area (the whole of it, window and all): at once, or where the member's own use
    of its weights lets it -- a Ray worker's methods, which run on another thread than its
    receive (``actors.worker``), so that none of them sees the weights half-applied.
    """

    load: Apply
    window: Callable[[], AbstractContextManager[object]] = nullcontext
    keeps: bool = False
    turn: Callable[[Callable[[], None]], None] = lambda apply: apply()  # at once


@dataclass(frozen=True)
class StagedPart:
    """Buckets of a received atomic push, in host memory: of ``plan`` (the push's), or of a
    delta section's ``layout`` (``plan`` then the section's own)."""

    plan: SyncPlan
    layout: DeltaLayout | None
    views: list[torch.Tensor]

    @property
    def sent(self) -> SyncPlan:
        """What the bytes are: the plan's buckets, or the layout's."""
        return self.plan if self.layout is None else self.layout.plan


@dataclass(frozen=True)
class Staged:
    """A received atomic push: its parts in order (one, or a delta's sections), and the device
    the push's transport received on (where the bytes go back at commit)."""

    parts: list[StagedPart]
    device: torch.device


@dataclass(frozen=True)
class Targets:
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
    def of(cls, targets: Destinations | None, last: Targets | None = None) -> Targets:
        targets = targets or {}
        tensors = list(targets.values())
        names, addresses = tuple(targets), tuple(map(torch.Tensor.data_ptr, tensors))
        if (
            last is not None
            and last.names == names
            and last.addresses == addresses
            and all(map(operator.is_, tensors, last.tensors))
        ):
            return last
        return cls(
            names, addresses, tuple(map(_DTYPE, tensors)), tuple(map(_SHAPE, tensors)), tensors
        )


class Inbound:
    """One Receiver's way in for buckets, and what it keeps from push to push: its receive
    streams (one per device, on a GPU) and the last push's unpacker, whose per-tensor work and
    receive buffers the next push with the same plan and destinations reuses."""

    def __init__(self) -> None:
        self._streams: Streams = {}
        self._unpackers: tuple[tuple, Unpacker] | None = None  # the last one, by what it serves
        self._targets: Targets | None = None  # the last destinations seen

    def targets(self, destinations: Destinations | None) -> Targets:
        """What identifies ``destinations``: the last answer itself when they are the same."""
        self._targets = Targets.of(destinations, self._targets)
        return self._targets

    def forget(self) -> None:
        """After a failed push: its unpacker may hold pieces of a tensor that never completed."""
        self._unpackers = None

    def stream(
        self,
        transport: Transport,
        plan: SyncPlan,
        layouts: Iterable[tuple[SyncPlan, DeltaLayout]] | None,
        destinations: Destinations | None,
        loader: Loader,
        sums: list[Checksum] | None,
        advance: Callable[[], None],
        targets: Targets | None = None,
    ) -> None:
        """Receive a streaming push of ``plan``, each bucket applied as it lands, in one
        ``loader`` window. A delta comes as ``layouts``: each section's plan and layout, in
        order (``delta.transfer.receive_sections``). ``targets``: what identifies
        ``destinations``, where the caller has it."""
        with loader.window():
            if layouts is None:
                key = targets if targets is not None else self.targets(destinations)
                unpacker = self._unpacker(plan, destinations, key, transport.device, loader.keeps)
                _stream(transport, plan, loader.load, unpacker, sums, advance, self._streams)
                return
            for section, layout in layouts:  # a delta's layout changes every push: no reuse
                patched: list[int] | None = [] if sums is not None else None
                landing, apply, finish = _appliers(
                    section, layout, destinations, loader.load, patched
                )
                unpacker = Unpacker(layout.plan, landing, transport.device, owned=loader.keeps)
                _stream(transport, layout.plan, apply, unpacker, sums, advance, self._streams)
                finish()
                if sums is not None and patched:
                    sums += patched

    def receive_all(
        self,
        transport: Transport,
        plan: SyncPlan,
        layouts: Iterable[tuple[SyncPlan, DeltaLayout]] | None,
        area: list[torch.Tensor] | None,
        destinations: Destinations | None,
        sums: list[Checksum] | None,
        advance: Callable[[], None],
    ) -> Staged:
        """Receive an atomic push of ``plan`` into its staging area, touching nothing else:
        ``area``, reserved when it was prepared -- or, for a delta (``layouts``, as for
        ``stream``), one per section, reserved as each header tells its size."""
        device = transport.device
        if layouts is None:
            assert area is not None
            _receive_all(transport, plan, area, sums, advance, self._streams)
            return Staged([StagedPart(plan, None, area)], device)
        parts = []
        for section, layout in layouts:
            part = StagedPart(section, layout, staging_area(layout.plan, device))
            _receive_all(transport, layout.plan, part.views, sums, advance, self._streams)
            if sums is not None:
                sums += staged_checksums(section, layout, part.views, _required(destinations))
            parts.append(part)
        return Staged(parts, device)

    def apply_staged(
        self, staged: Staged, destinations: Destinations | None, loader: Loader
    ) -> None:
        """Apply a received atomic push from its staging area, part after part, in one
        ``loader`` window (see ``_apply_staged``)."""
        with loader.window():
            for part in staged.parts:
                landing, apply, finish = _appliers(
                    part.plan, part.layout, destinations, loader.load
                )
                _apply_staged(
                    part.sent,
                    part.views,
                    staged.device,
                    apply,
                    landing,
                    self._streams,
                    loader.keeps,
                )
                finish()

    def _unpacker(
        self,
        plan: SyncPlan,
        landing: Destinations | None,
        targets: Targets,
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


def in_place(
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


def staging_area(plan: SyncPlan, device: torch.device) -> list[torch.Tensor]:
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
    """Receive every bucket into the staging area ``area`` (see ``staging_area``), touching
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
    views: list[torch.Tensor],
    device: torch.device,
    apply: Apply,
    destinations: Destinations | None,
    streams: Streams,
    owned: bool = False,
) -> None:
    """Apply the buckets of ``plan`` received into the staging area (``views``). For a GPU
    worker each bucket goes back to the GPU first, into two buffers used in turn (a direct
    bucket straight into its destination, where it has one), by asynchronous copies from pinned
    memory on the receive stream: the model then takes its tensors on the device, as when
    streaming."""
    unpacker = Unpacker(plan, destinations, device, owned=owned)
    on_host = device.type == "cpu"
    buffers = [] if on_host else unpacker.buffers()
    slots = staging_slots(plan)
    with _receive_stream(device, streams):
        empties = unpacker.empty_tensors(device)
        if empties:
            apply(empties)
        for index, view in enumerate(views):
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
