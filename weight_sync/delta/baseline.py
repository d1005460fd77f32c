"""The trainer's copy of what its workers hold, and the delta pushes computed against it.

With ``SyncConfig(delta=True)`` the trainer keeps, in host memory, the bytes of every tensor as
it last pushed them -- after ``cast_dtype``, i.e. exactly what the workers hold: the model's size
in the workers' dtype (for a GPU trainer, host memory). A delta push then compares each tensor
with that copy, sends what changed (see ``weight_sync.delta.layout``), and brings the copy up to
date as it goes. A dense push brings it up to date too, from the very bytes it sends.

Memory beyond the copy stays small: comparisons run over pieces of ``PIECE`` elements on a few
threads (see ``delta.scan``), each in scratch buffers it reuses; the sparse blobs encoded while
comparing are kept for sending, in a buffer kept from push to push, only up to an eighth of the
push's size (past that they are found again while packing, at the cost of a second comparison);
any other blob exists only while it is packed. Nothing is a second copy of the model.

fp32 tensors pushed as bf16 -- master weights, the commonest delta -- and 2- or 4-byte tensors
pushed in their own dtype (bf16, fp16, fp32 weights) are compared by fused kernels
(``weight_sync.delta.kernels``) where they have loaded; everything else, and any piece the
rounding kernel meets a NaN in, in NumPy. Both ways send the same bytes.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from weight_sync.delta.codec import (
    differ,
    encode_sparse_rows,
    sparse_blob,
    words,
)
from weight_sync.delta.kernel_loader import FusedKernels
from weight_sync.delta.layout import (
    SPAN,
    Blob,
    DeltaLayout,
    sparse_bytes,
)
from weight_sync.delta.lineage import base_name, next_base
from weight_sync.delta.scan import (
    ENCODED_BUDGET,
    Scan,
    Scratch,
    fusable,
    piece_bytes,
    trainer_words,
    unsigned,
)
from weight_sync.delta.sources import Sources
from weight_sync.errors import WeightSyncError
from weight_sync.wire.checksums import checksum
from weight_sync.wire.metadata import SyncPlan, TensorMeta

logger = logging.getLogger(__name__)

MAX_THREADS = 8  # a scan's default threads at most: it is bound by memory bandwidth beyond


def default_threads() -> int:
    """The CPUs this process may run on (its affinity, where the OS tells), at most
    ``MAX_THREADS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on every OS
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_THREADS))


class Baseline:
    """What the workers hold, as of base ``id`` (None while the copy is being changed, or
    before any push completed)."""

    def __init__(self, threads: int | None = None, fused: bool | None = None) -> None:
        """``threads``: how many threads a scan compares on at most (default: the CPUs this
        process may run on, at most ``MAX_THREADS``). ``fused``: whether the tensors ``fusable``
        names are compared with the fused kernels (``weight_sync.delta.kernels``): None (the
        default) once they have loaded, on a thread started here -- pushes until then compare
        the NumPy way, to the same bytes; True waits for them (and fails if numba cannot load);
        False never loads them."""
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.threads = default_threads() if threads is None else threads
        self._kernels = FusedKernels(fused)
        self._token = secrets.token_hex(8)
        self._bytes: dict[str, torch.Tensor] = {}  # name -> its bytes as the workers hold them
        self._metas: dict[str, TensorMeta] = {}
        self.id: str | None = None
        self._built_on: str | None = None
        # Sparse blobs encoded while scanning, by (tensor name, first span); see ``scan``. They
        # are views of one buffer, kept from push to push: blobs in fresh memory fault a page
        # in every 4 KiB as they are written, which two threads of a scan do no faster than one.
        self._encoded: dict[tuple[str, int], torch.Tensor] = {}
        self._room = torch.empty(0, dtype=torch.uint8)
        self._room_used = 0  # bytes of ``_room`` given to this push's kept blobs so far
        self._scan_scratches: list[Scratch] = []  # one per thread of a scan, by its number
        self._scratches = threading.local()  # each encoding thread's ``Scratch``

    def name_for(self, version: int) -> str:
        return base_name(self._token, version)

    @property
    def nbytes(self) -> int:
        """Bytes of the copy (the workers' weights as they hold them)."""
        return sum(held.numel() for held in self._bytes.values())

    # -- one push ------------------------------------------------------------------------------

    def begin(self) -> str | None:
        """A push starts changing the copy: until ``finish`` it describes no version. Returns
        the base the push is built on."""
        self._built_on, self.id = self.id, None
        self._encoded.clear()
        self._room_used = 0
        return self._built_on

    def finish(self, plan: SyncPlan, version: int, partial: bool) -> None:
        """Every byte of push ``version`` went out: the copy now holds what its workers will
        hold once they commit it."""
        self.id = next_base(self._built_on, self._built_on, self.name_for(version), not partial)
        self._encoded.clear()
        if not partial:  # a full push defines the model: forget tensors it no longer has
            names = {meta.name for meta in plan.tensors}
            for name in set(self._bytes) - names:
                del self._bytes[name], self._metas[name]

    def forget(self) -> None:
        """Drop the copy, and every buffer kept for the next scan."""
        self.id = None
        self._bytes.clear()
        self._metas.clear()
        self._encoded.clear()
        self._room, self._room_used = torch.empty(0, dtype=torch.uint8), 0
        self._scan_scratches.clear()

    def scan(
        self,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        push: SyncPlan | None = None,
        threads: int | None = None,
    ) -> list[int]:
        """Changed elements per span of every tensor of ``plan`` (the delta header).

        ``push``: the whole push, where ``plan`` is one section of it (``layout.sections``),
        scanned in order after ``begin``: the sections share the push's budget for kept blobs,
        each its own share of it, and what one keeps stays until it is sent. ``threads``: at
        most this many (default ``self.threads``).

        A tensor the copy lacks (or holds with another dtype or shape) counts as all changed.
        So does one whose first span is dense: the density of an update is much the same across
        a tensor, and this keeps a push where everything changed from comparing everything.

        While a piece's new values are at hand, its sparse blobs are encoded and the copy is
        brought up to date there (as long as the encoded blobs stay within an eighth of the
        push's size; past that, ``encode`` compares those pieces again).

        Pieces are compared on up to ``threads`` threads (see ``Scan``); the counts, the blobs
        kept and the copy come out exactly as one thread would leave them.
        """
        if push is None:
            push, self._room_used = plan, 0
        if not self._room_used and self._room.numel() < push.payload_bytes // ENCODED_BUDGET:
            self._room = torch.empty(push.payload_bytes // ENCODED_BUDGET, dtype=torch.uint8)
        budget = plan.payload_bytes // ENCODED_BUDGET
        assert self._room_used + budget <= self._room.numel()
        scan = Scan(self, plan, tensors, self._room[self._room_used : self._room_used + budget])
        scan.run(self.threads if threads is None else threads)
        self._room_used += scan.spent
        return scan.counts.tolist()

    def sources(
        self,
        layout: DeltaLayout,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        sums: list[int] | None,
    ) -> Sources:
        """What ``Sender`` packs for ``layout``: whole tensors as they are, blobs encoded when
        first packed (bringing the copy up to date, and appending the checksum of each sparse
        blob's span range, as the worker will hold it, to ``sums``)."""
        return Sources(self, layout, plan, tensors, sums)

    def recorder(
        self, plan: SyncPlan, sent: SyncPlan, whole: Mapping[int, int]
    ) -> Callable[[int, torch.Tensor], None]:
        """A ``Sender`` hook that copies the bytes of whole tensors into the copy as each bucket
        of ``sent`` goes out (``whole`` maps ``sent``'s tensors to ``plan``'s)."""

        def record(bucket_index: int, data: torch.Tensor) -> None:
            for seg in sent.buckets[bucket_index].segments:
                index = whole.get(seg.tensor)
                if index is None:
                    continue
                target = self._slot(plan.tensors[index])
                target[seg.tensor_offset : seg.tensor_offset + seg.nbytes].copy_(
                    data[seg.bucket_offset : seg.bucket_offset + seg.nbytes]
                )

        return record

    # -- internals -----------------------------------------------------------------------------

    def _scratch(self) -> Scratch:
        """This thread's scratch for ``encode`` (blobs are encoded on several threads at once)."""
        scratch = getattr(self._scratches, "scratch", None)
        if scratch is None:
            scratch = self._scratches.scratch = Scratch()
        return scratch

    def _held(self, meta: TensorMeta) -> torch.Tensor | None:
        held = self._metas.get(meta.name)
        if held is None or (held.dtype, held.shape) != (meta.dtype, meta.shape):
            return None
        return self._bytes[meta.name]

    def _slot(self, meta: TensorMeta) -> torch.Tensor:
        """The copy's bytes for ``meta``, made anew if it held something else under that name."""
        held = self._held(meta)
        if held is None:
            held = self._bytes[meta.name] = torch.empty(meta.nbytes, dtype=torch.uint8)
            self._metas[meta.name] = meta
        return held

    def encode(
        self, blob: Blob, meta: TensorMeta, flat: torch.Tensor, crc: bool = False
    ) -> tuple[torch.Tensor, int | None]:
        """The bytes of ``blob`` (and with ``crc``, for a sparse blob, the checksum of its range once
        updated), bringing the copy's range up to date. ``flat``: the tensor, flattened."""
        size = meta.itemsize
        stop = blob.first + blob.elements
        base = words(self._bytes[meta.name], size)[blob.first : stop]
        if blob.dense:
            new_bytes = piece_bytes(flat, meta, blob.first, stop)
            base.copy_(words(new_bytes, size))
            return new_bytes, None
        data = self._encoded.pop((meta.name, blob.first_span), None)
        if data is None:  # not kept while scanning: compare again
            data = self._compare_again(blob, meta, flat, base.numpy())
        assert data.numel() == sparse_bytes(blob.changed, size)
        updated = self._bytes[meta.name][blob.first * size : stop * size]
        return data, checksum(updated) if crc else None

    def _compare_again(
        self, blob: Blob, meta: TensorMeta, flat: torch.Tensor, held: np.ndarray
    ) -> torch.Tensor:
        """A sparse blob the scan did not keep, found again, and ``held`` (the copy's range, as
        NumPy ``words``) brought up to date: with the fused kernel where it applies, else in
        NumPy (where it does not, or on meeting a NaN). What it finds must be what the header
        counted, span by span: workers place each change by its span's count."""
        scratch, kernels = self._scratch(), self._kernels.get()
        stop = blob.first + blob.elements
        found = -1
        if kernels is not None and fusable(flat, meta):
            data, index, values = sparse_blob(blob.changed, meta.itemsize)
            rows = scratch.rows(blob.changed)
            found = kernels.extract(
                trainer_words(flat, blob.first, stop),
                unsigned(held),
                index,
                unsigned(values),
                rows,
            )
        if found < 0:
            new = scratch.begin(flat, meta, blob.first, stop)
            scratch.fill(0, blob.elements)
            rows = np.flatnonzero(differ(new, held, scratch.mask(blob.elements)))
            found = rows.size
            if found == blob.changed:
                data, values = encode_sparse_rows(new, rows, meta.itemsize)
                held[rows] = values
        spans = len(blob.counts)
        if found != blob.changed or np.bincount(rows // SPAN, minlength=spans).tolist() != list(
            blob.counts
        ):
            raise WeightSyncError(
                f"{meta.name!r} changed while it was being pushed ({found} changed elements "
                f"found in spans {blob.first_span}-{blob.first_span + spans - 1}, "
                f"{blob.changed} counted); do not step the optimizer during a push"
            )
        return data
