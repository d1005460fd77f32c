"""Both ends of a push with a baseline kept: what the trainer puts on the wire, a worker's header
and patches.

On the wire a delta push is, for each of its sections (``layout.sections``; one, the whole plan,
unless the push asks for more), one header broadcast (an int32 change count per span and their
CRC32, its size fixed by the section's plan) followed by the buckets of the layout both sides
derive from it; the push protocol around it -- prepare, receive, commit, blame -- is the same as
for any push. A header decides the size of every receive that follows it, and Gloo aborts a
process whose receive is smaller than what is sent: it is checked whole before any of them.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from weight_sync.delta.baseline import Baseline
from weight_sync.delta.codec import patch, region_checksum
from weight_sync.delta.layout import (
    COUNT_BYTES,
    DeltaLayout,
    blob_name,
    check_counts,
    delta_layout,
    header_counts,
    sections,
)
from weight_sync.errors import TransportError
from weight_sync.transport import Transport
from weight_sync.wire.metadata import TRAINER_RANK, SyncPlan
from weight_sync.wire.packing import NamedTensors, Unpacker, byte_view


@dataclass(frozen=True)
class Outgoing:
    """The buckets a push with a baseline broadcasts, for the sender: ``plan``'s buckets packed
    from ``sources`` (blobs encoded as they are first read). ``record`` copies each bucket's
    bytes into the baseline as it goes out; ``blob_sums`` receives, while packing, the checksum
    of each sparse blob's range as the worker will hold it (with checksums asked for).
    ``close`` ends the blobs' encoding ahead (see ``Baseline.sources``)."""

    plan: SyncPlan
    sources: Sequence[torch.Tensor]
    record: Callable[[int, torch.Tensor], None]
    blob_sums: list[int] | None = None
    close: Callable[[], None] = lambda: None  # once sent (or failed): stops encoding ahead


def outgoing(
    plan: SyncPlan,
    tensors: Sequence[torch.Tensor],
    baseline: Baseline,
    counts: list[int] | None,
    *,
    bucket_bytes: int,
    with_checksums: bool = False,
) -> Outgoing:
    """What goes on the wire after the header: ``plan`` as it is (``counts`` None: a dense push,
    which brings the baseline up to date too), or the layout of a delta with the per-span
    ``counts`` from ``Baseline.scan``."""
    if counts is None:
        identity = {index: index for index in range(len(plan.tensors))}
        return Outgoing(plan, tensors, baseline.recorder(plan, plan, identity))
    layout = delta_layout(plan, counts, bucket_bytes)
    blob_sums: list[int] | None = [] if with_checksums else None
    sources = baseline.sources(layout, plan, tensors, blob_sums)
    return Outgoing(
        layout.plan,
        sources,
        baseline.recorder(plan, layout.plan, layout.whole),
        blob_sums,
        sources.close,
    )


def density(plan: SyncPlan, changed: int) -> float:
    """The share of ``plan``'s elements a delta that counted ``changed`` sends as changed."""
    elements = sum(math.prod(meta.shape) for meta in plan.tensors)
    return changed / max(elements, 1)


def receive_layout(transport: Transport, plan: SyncPlan, bucket_bytes: int) -> DeltaLayout:
    """A worker's first step of a delta push: the trainer's header, checked, and the layout."""
    count = header_counts(plan)
    header = torch.empty(
        (count + 1) * COUNT_BYTES if count else 0, dtype=torch.uint8, device=transport.device
    )
    if count:
        transport.broadcast(header, src=TRAINER_RANK).wait()
    *counts, crc = header.cpu().view(torch.int32).tolist() or [0]
    try:
        if count and encode_header(counts)[-COUNT_BYTES:].view(torch.int32).item() != crc:
            raise ValueError("delta header damaged in transit (CRC32 mismatch)")
        check_counts(plan, counts)
    except ValueError as exc:
        raise TransportError(f"{exc}; the trainer and this worker disagree on the push") from exc
    return delta_layout(plan, counts, bucket_bytes)


def receive_sections(
    transport: Transport,
    plan: SyncPlan,
    bucket_bytes: int,
    count: int,
    on_layout: Callable[[SyncPlan], None],
) -> Iterator[tuple[SyncPlan, DeltaLayout]]:
    """A worker's side of a delta in ``count`` sections (see ``layout.sections``): each
    section's plan and layout, its header received only when asked for -- after the buckets of
    the section before. ``on_layout`` sees each layout's plan as its header arrives."""
    for part in sections(plan, count):
        layout = receive_layout(transport, part.plan, bucket_bytes)
        on_layout(layout.plan)
        yield part.plan, layout


def encode_header(counts: list[int]) -> torch.Tensor:
    """The delta header (see the module docstring): the counts as int32, then their CRC32 (as an
    int32). A push of no spans sends none."""
    body = torch.tensor(counts, dtype=torch.int32)
    crc = zlib.crc32(body.numpy().data)
    return torch.cat(
        [body, torch.tensor([crc - (1 << 32) if crc >= 1 << 31 else crc], dtype=torch.int32)]
    ).view(torch.uint8)


class Patcher:
    """Applies a delta layout to a worker's own tensors (``destinations``, which must hold every
    tensor of the push in place: ``Receiver.prepare`` accepts a delta only then).

    Dense blobs are byte ranges of a destination, so the ``Unpacker`` lands them there like any
    tensor (``landing``); sparse blobs are handed back and scattered in place (``apply``); tied
    names with storage of their own are refreshed at the end (``finish``). With ``sums``, the
    checksum of each sparse blob's range once patched is appended, to match the trainer's.
    """

    def __init__(
        self,
        plan: SyncPlan,
        layout: DeltaLayout,
        destinations: Mapping[str, torch.Tensor],
        sums: list[int] | None = None,
    ) -> None:
        self._plan, self._layout, self._sums = plan, layout, sums
        self._destinations = destinations
        self._targets = {
            index: byte_view(destinations[plan.tensors[index].name])
            for index in layout.changed_tensors
        }
        self._blobs = layout.named_blobs()

    def landing(self) -> dict[str, torch.Tensor]:
        """Where the Unpacker writes: the destinations, and each dense blob's byte range."""
        ranges = {}
        for blob in self._layout.blobs.values():
            if blob.dense:
                size = self._plan.tensors[blob.tensor].itemsize
                target = self._targets[blob.tensor]
                ranges[blob_name(blob)] = target[
                    blob.first * size : (blob.first + blob.elements) * size
                ]
        return {**self._destinations, **ranges}

    def apply(self, named: NamedTensors) -> NamedTensors:
        """Patch the sparse blobs among ``named`` in; returns the rest."""
        rest = []
        for name, data in named:
            blob = self._blobs.get(name)
            if blob is None:
                rest.append((name, data))
                continue
            size = self._plan.tensors[blob.tensor].itemsize
            target = self._targets[blob.tensor]
            patch(target, blob, data, size)
            if self._sums is not None:
                self._sums.append(region_checksum(target, blob, size))
        return rest

    def finish(self) -> None:
        for tie in self._plan.tied:
            source = self._targets.get(tie.tensor)
            target = self._destinations[tie.name]
            if source is not None and target.data_ptr() != source.data_ptr():
                byte_view(target).copy_(source)


def staged_checksums(
    plan: SyncPlan,
    layout: DeltaLayout,
    staged: list[torch.Tensor],
    destinations: Mapping[str, torch.Tensor],
) -> list[int]:
    """The checksums ``Patcher`` would report for a push received into a staging area, computed
    before commit on copies of each patched range (the model stays untouched)."""
    sparse = {index for index, blob in layout.blobs.items() if not blob.dense}
    unpacker = Unpacker(
        layout.plan, None, staged[0].device if staged else torch.device("cpu"), only=sparse
    )
    sums: list[int] = []
    by_name = layout.named_blobs()
    for index, data in enumerate(staged):
        for name, blob_bytes in unpacker.unpack(index, data):
            blob = by_name[name]
            size = plan.tensors[blob.tensor].itemsize
            whole = byte_view(destinations[plan.tensors[blob.tensor].name])
            region = whole[blob.first * size : (blob.first + blob.elements) * size].clone()
            alone = dataclasses.replace(blob, first_span=0, numel=blob.elements)
            patch(region, alone, blob_bytes, size)
            sums.append(region_checksum(region, alone, size))
    return sums
