"""Pure planning of a delta push: per-span change counts -> what travels, and where.

A delta push travels in three steps over the same transport as any push: a header of change
counts, then the buckets of a *layout* derived from the push's plan and those counts, which both
sides compute alike. Counting is per *span* of ``SPAN`` elements of a tensor (in the dtype the
workers hold), so that a changed element is named by a 16-bit index inside its span.

Each span is sent one of three ways, whichever is smallest:

* ``NONE``   -- nothing changed: nothing is sent;
* ``SPARSE`` -- the changed elements: their uint16 indices, then their values;
* ``DENSE``  -- every element, as in a dense push (when indices would cost more than they save).

Consecutive spans of one tensor sent the same way form one *blob* (at most ``RUN_SPANS`` spans,
never across a multiple of ``RUN_SPANS``, which bounds a worker's temporaries). A tensor whose
every span is dense is sent whole, exactly as in a dense push (the direct path included), so a
push where everything changed costs what a dense push costs. The blobs and whole tensors are then
placed in buckets by ``planner.make_plan``, like the tensors of any push, in buckets sized for
a delta (``delta_bucket_bytes``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from weight_sync.wire.metadata import SyncPlan, TensorMeta
from weight_sync.wire.planner import align_up, make_plan

SPAN = 1 << 16  # elements per span: an index inside one fits in 16 bits
RUN_SPANS = 16  # spans per blob at most (1M elements)
NONE, SPARSE, DENSE = 0, 1, 2
INDEX_BYTES = 2
VALUES_ALIGNMENT = (
    8  # a sparse blob's values start here, whatever the dtype (16-byte ones as pairs)
)
COUNT_BYTES = 4  # the header holds one int32 count per span
DELTA_BUCKETS = 8  # a delta travels in about this many buckets (see ``delta_bucket_bytes``)
MIN_DELTA_BUCKET = 1 << 20  # ...each of at least this many bytes
DELTA_SECTIONS = 4  # a delta is scanned and sent in about this many sections


def spans_of(numel: int) -> int:
    return -(-numel // SPAN)


def span_elements(numel: int, span: int) -> int:
    """Elements in span ``span`` of a tensor of ``numel`` elements (the last may be short)."""
    return min(SPAN, numel - span * SPAN)


def header_counts(plan: SyncPlan) -> int:
    """How many counts a delta push of ``plan`` sends: one per span of every tensor."""
    return sum(spans_of(math.prod(meta.shape)) for meta in plan.tensors)


def sparse_most(elements: int, itemsize: int) -> int:
    """The most changes of ``elements`` that travel sparse: while their positions and values,
    ``count * (INDEX_BYTES + itemsize)`` bytes, are fewer than the span's own."""
    return (elements * itemsize - 1) // (INDEX_BYTES + itemsize)


def encoding(count: int, elements: int, itemsize: int) -> int:
    """How a span with ``count`` of its ``elements`` changed travels: the smaller way."""
    return NONE if count == 0 else SPARSE if count <= sparse_most(elements, itemsize) else DENSE


def span_ways(counts: Sequence[int], numel: int, itemsize: int) -> list[int]:
    """``encoding`` of every span of a tensor of ``numel`` elements with these ``counts`` (one
    per span, or none at all), the full spans against one ``sparse_most`` (a worker lays out
    every span of the model each push)."""
    assert not counts or len(counts) == spans_of(numel), (len(counts), numel)
    most = sparse_most(SPAN, itemsize)
    ways = [NONE if c == 0 else SPARSE if c <= most else DENSE for c in counts]
    if counts and numel % SPAN:  # the last span is short
        ways[-1] = encoding(counts[-1], numel % SPAN, itemsize)
    return ways


def sparse_bytes(count: int, itemsize: int) -> int:
    """Size of a sparse blob holding ``count`` changed elements."""
    return align_up(count * INDEX_BYTES, VALUES_ALIGNMENT) + count * itemsize


@dataclass(frozen=True)
class Blob:
    """A run of spans of one tensor, sent the same way. ``counts``: changed elements per span."""

    tensor: int  # index into the push's plan
    first_span: int
    counts: tuple[int, ...]
    dense: bool
    numel: int  # of the whole tensor

    @property
    def first(self) -> int:
        """Its first element in the tensor."""
        return self.first_span * SPAN

    @property
    def elements(self) -> int:
        return min(len(self.counts) * SPAN, self.numel - self.first)

    @property
    def changed(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class DeltaLayout:
    """What a delta push sends: ``plan`` places whole tensors and blobs in buckets; ``whole``
    maps each of its whole tensors to the push's plan, ``blobs`` each of its blobs."""

    plan: SyncPlan
    whole: dict[int, int]  # layout tensor -> push plan tensor
    blobs: dict[int, Blob]  # layout tensor -> blob

    def named_blobs(self) -> dict[str, Blob]:
        """Each blob under the name the layout's plan gives it (see ``blob_name``)."""
        return {blob_name(blob): blob for blob in self.blobs.values()}

    @property
    def changed_tensors(self) -> set[int]:
        """Push plan tensors sent as blobs (not whole)."""
        return {blob.tensor for blob in self.blobs.values()}


def blob_name(blob: Blob) -> str:
    """A layout-internal name; it never travels, and no model's tensor is named with a NUL."""
    return f"\0{blob.tensor}:{blob.first_span}"


def check_counts(plan: SyncPlan, counts: Sequence[int]) -> None:
    """Refuse a header that cannot belong to ``plan`` (``ValueError``): it decides every size
    that follows, and a receive sized wrong would abort the process."""
    if len(counts) != header_counts(plan):
        raise ValueError(
            f"delta header has {len(counts)} counts, the plan needs {header_counts(plan)}"
        )
    at = 0
    for meta in plan.tensors:
        numel = math.prod(meta.shape)
        for span in range(spans_of(numel)):
            if not 0 <= counts[at] <= span_elements(numel, span):
                raise ValueError(
                    f"delta header: {counts[at]} changes in span {span} of {meta.name!r}"
                )
            at += 1


@dataclass(frozen=True)
class Section:
    """Tensors ``first:first + len(plan.tensors)`` of a push's plan, as a plan of their own."""

    plan: SyncPlan
    first: int

    @property
    def stop(self) -> int:
        return self.first + len(self.plan.tensors)


def sections(plan: SyncPlan, count: int) -> list[Section]:
    """``plan`` cut at tensor boundaries into at most ``count`` runs of about equal bytes.

    A delta pushed in sections has each section's header and buckets follow one another, so
    that the trainer compares section k+1 with its copy while section k is on the wire, instead
    of comparing the whole model before the first byte goes. Both ends cut alike: the cut is a
    pure function of the plan. A section's own plan keeps which of its tensors are sent direct,
    and its tied names; its buckets are not used (a delta plans its own)."""
    if count < 1:
        raise ValueError(f"count must be >= 1 (got {count})")
    if count == 1:
        return [Section(plan, 0)]
    total = max(plan.payload_bytes, 1)
    cuts, start, last = [], 0, -1
    for index, meta in enumerate(plan.tensors):  # a tensor goes where its first byte falls
        share = start * count // total
        if share != last:
            cuts.append(index)
            last = share
        start += meta.nbytes
    cuts = (cuts or [0]) + [len(plan.tensors)]
    direct = {b.segments[0].tensor for b in plan.buckets if b.direct}
    out = []
    for first, stop in itertools.pairwise(cuts):
        metas = plan.tensors[first:stop]
        ties = [
            tie.model_copy(update={"tensor": tie.tensor - first})
            for tie in plan.tied
            if first <= tie.tensor < stop
        ]
        room = align_up(max([meta.nbytes for meta in metas] + [1]), plan.alignment)
        flags = [index in direct for index in range(first, stop)]
        out.append(Section(make_plan(metas, room, plan.alignment, flags, ties), first))
    return out


def delta_bucket_bytes(payload: int, bucket_bytes: int, alignment: int) -> int:
    """The bucket size of a delta layout that puts ``payload`` bytes on the wire: about one
    ``DELTA_BUCKETS``-th part of it, at least ``MIN_DELTA_BUCKET``, at most ``bucket_bytes``.

    A delta is small (a few percent of the model), so at the configured size it went as one
    bucket: a relay forwarded nothing, and no worker patched a byte, until all of it had
    crossed the link. In eighths, each is forwarded and patched while the next crosses (W1 after
    a step over 1 Gbit/s, 3 far workers: 0.30 s against 0.40 s). Not smaller: every bucket is a
    collective, with a round trip of its own."""
    share = align_up(-(-payload // DELTA_BUCKETS), alignment)
    return max(alignment, min(bucket_bytes, max(share, MIN_DELTA_BUCKET)))


def delta_layout(plan: SyncPlan, counts: Sequence[int], bucket_bytes: int) -> DeltaLayout:
    """The layout of a delta push of ``plan`` with these per-span ``counts`` (see the module
    docstring). Deterministic: the trainer and every worker derive the same one."""
    direct = {b.segments[0].tensor for b in plan.buckets if b.direct}
    metas: list[TensorMeta] = []
    flags: list[bool] = []
    whole: dict[int, int] = {}
    blobs: dict[int, Blob] = {}
    at = 0
    for index, meta in enumerate(plan.tensors):
        numel = math.prod(meta.shape)
        spans = spans_of(numel)
        tensor_counts = counts[at : at + spans]
        at += spans
        ways = span_ways(tensor_counts, numel, meta.itemsize)
        if all(way == DENSE for way in ways):  # every span (or none: an empty tensor)
            whole[len(metas)] = index
            metas.append(meta)
            flags.append(index in direct)
            continue
        for start, stop, way in span_runs(ways):
            if way == NONE:
                continue
            blob = Blob(index, start, tuple(tensor_counts[start:stop]), way == DENSE, numel)
            size = (
                blob.elements * meta.itemsize
                if blob.dense
                else sparse_bytes(blob.changed, meta.itemsize)
            )
            blobs[len(metas)] = blob
            metas.append(
                TensorMeta.model_construct(name=blob_name(blob), dtype="uint8", shape=(size,))
            )
            flags.append(False)
    ties = tuple(
        tie.model_copy(update={"tensor": position})
        for position, index in whole.items()
        for tie in plan.tied
        if tie.tensor == index
    )
    payload = sum(meta.nbytes for meta, alone in zip(metas, flags, strict=True) if not alone)
    bucket_bytes = delta_bucket_bytes(payload, bucket_bytes, plan.alignment)
    layout_plan = make_plan(metas, bucket_bytes, plan.alignment, flags, ties)
    return DeltaLayout(layout_plan, whole, blobs)


def span_runs(ways: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs ``(start, stop, way)`` of equal ways, cut at every multiple of RUN_SPANS."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for span in range(1, len(ways) + 1):
        if span == len(ways) or ways[span] != ways[start] or span % RUN_SPANS == 0:
            runs.append((start, span, ways[start]))
            start = span
    return runs
