"""The trainer's copy of what its workers hold, and the delta pushes computed against it.

With ``SyncConfig(delta=True)`` the trainer keeps, in host memory, the bytes of every tensor as
it last pushed them -- after ``cast_dtype``, i.e. exactly what the workers hold: the model's size
in the workers' dtype (for a GPU trainer, host memory). A delta push then compares each tensor
with that copy, sends what changed (see ``weight_sync.delta.layout``), and brings the copy up to
date as it goes. A dense push brings it up to date too, from the very bytes it sends.

Memory beyond the copy stays small: comparisons run over pieces of ``PIECE`` elements on a few
threads (see ``_Scan``), each in scratch buffers it reuses; the sparse blobs encoded while
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
import math
import os
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch

from weight_sync.checksums import checksum
from weight_sync.delta.codec import (
    differ,
    encode_sparse_rows,
    mask_span_counts,
    sparse_blob,
    words,
)
from weight_sync.delta.kernel_loader import FusedKernels
from weight_sync.delta.layout import (
    DENSE,
    RUN_SPANS,
    SPAN,
    SPARSE,
    VALUES_ALIGNMENT,
    Blob,
    DeltaLayout,
    encoding,
    span_elements,
    span_runs,
    span_ways,
    spans_of,
    sparse_bytes,
)
from weight_sync.delta.lineage import base_name, next_base
from weight_sync.errors import WeightSyncError
from weight_sync.metadata import SyncPlan, TensorMeta
from weight_sync.planner import align_up

logger = logging.getLogger(__name__)

PIECE = RUN_SPANS * SPAN  # elements compared at once; a blob never crosses a piece boundary
_ENCODED_BUDGET = 8  # blobs encoded while scanning take at most 1/8 of the push's bytes
MAX_THREADS = 8  # a scan's default threads at most: it is bound by memory bandwidth beyond
PARALLEL_MIN = 2 * PIECE  # elements to compare below which a scan stays on the calling thread


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
        self._scan_scratches: list[_Scratch] = []  # one per thread of a scan, by its number
        self._scratches = threading.local()  # each encoding thread's ``_Scratch``

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

        Pieces are compared on up to ``threads`` threads (see ``_Scan``); the counts, the blobs
        kept and the copy come out exactly as one thread would leave them.
        """
        if push is None:
            push, self._room_used = plan, 0
        if not self._room_used and self._room.numel() < push.payload_bytes // _ENCODED_BUDGET:
            self._room = torch.empty(push.payload_bytes // _ENCODED_BUDGET, dtype=torch.uint8)
        budget = plan.payload_bytes // _ENCODED_BUDGET
        assert self._room_used + budget <= self._room.numel()
        scan = _Scan(self, plan, tensors, self._room[self._room_used : self._room_used + budget])
        scan.run(self.threads if threads is None else threads)
        self._room_used += scan.spent
        return scan.counts.tolist()

    def sources(
        self,
        layout: DeltaLayout,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        sums: list[int] | None,
    ) -> _Sources:
        """What ``Sender`` packs for ``layout``: whole tensors as they are, blobs encoded when
        first packed (bringing the copy up to date, and appending the checksum of each sparse
        blob's span range, as the worker will hold it, to ``sums``)."""
        return _Sources(self, layout, plan, tensors, sums)

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

    def _scratch(self) -> _Scratch:
        """This thread's scratch for ``encode`` (blobs are encoded on several threads at once)."""
        scratch = getattr(self._scratches, "scratch", None)
        if scratch is None:
            scratch = self._scratches.scratch = _Scratch()
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
            new_bytes = _bytes(flat, meta, blob.first, stop)
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
                _trainer_words(flat, blob.first, stop),
                _unsigned(held),
                index,
                _unsigned(values),
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


class _Cancelled(Exception):
    """Another thread of the scan failed: this one stops (the scan raises that thread's error)."""


@dataclass
class _Piece:
    """Elements ``start:stop`` of one tensor, within one piece of ``PIECE``: what one thread of
    a scan compares at a time. ``seq``: its place in the order one thread would compare it."""

    seq: int
    tensor: int  # index into the plan
    meta: TensorMeta
    numel: int
    flat: torch.Tensor  # the tensor, flattened
    held: torch.Tensor  # the copy's ``words``
    start: int
    stop: int
    at: int  # the tensor's first count in the header
    blobs: list[tuple[tuple[str, int], torch.Tensor]] = field(default_factory=list)

    @property
    def first_span(self) -> int:
        return self.start // SPAN


class _Scan:
    """One ``Baseline.scan``, shared by the threads that compare its pieces.

    Why threads: a scan casts each piece into the workers' dtype (torch), compares it with the
    copy and counts per span, and for the spans it keeps encoded finds the changed elements
    (NumPy) -- or does all of it in one fused kernel (``fusable``). Every one of these
    releases the GIL, and on one thread they are compute-bound (the cast ~0.5 ns per element,
    ``flatnonzero`` ~0.8 ns, the kernel ~0.7 ns), above memory speed: threads divide that time.

    Why it computes exactly what one thread computes, in any interleaving:

    * pieces are handed out in the order one thread compares them. A tensor's pieces after its
      first go out only once its first span said whether to compare on (a span is 1/16 of a
      piece: the wait is short), so a tensor sent whole is still compared no further;
    * a piece counts its spans, then waits for its turn -- every piece before it decided -- to
      decide whether its sparse blobs are kept, against what is left of the budget: the budget
      is spent in the same order, the same blobs are kept. Deciding needs only the counts, so a
      turn waits at most for another thread to finish counting the piece before;
    * a piece writes only its own counts, its own range of the copy and its own blobs, merged
      into ``Baseline._encoded`` in order at the end.

    Each thread has a scratch of its own (a piece in the workers' dtype and its mask; for the
    kernel, room for a piece's changes: 6 bytes an element), so the memory beyond the copy and
    the kept blobs stays threads x a piece. Kept blobs are written into ``Baseline._room``, at
    offsets given out in turn order with the budget. The threads are the
    scan's own: started for it, joined before it returns (starting one cost ~0.15 ms against
    ~0.1 s for a GPT-2-sized scan), so nothing outlives a scan, whatever becomes of the
    ``Baseline``.
    """

    def __init__(
        self,
        baseline: Baseline,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        room: torch.Tensor,
    ) -> None:
        self._baseline, self._plan, self._tensors = baseline, plan, tensors
        self._numels = [math.prod(meta.shape) for meta in plan.tensors]
        firsts = np.cumsum([0] + [spans_of(numel) for numel in self._numels])
        self._at: list[int] = firsts[:-1].tolist()
        self.counts = np.zeros(int(firsts[-1]), dtype=np.int64)  # the header, filled by pieces
        # Where kept blobs are written, in the order they are kept: as large as the budget.
        self._room = room
        self._fused = baseline._kernels.get()  # for the whole scan, whenever they become ready
        self._cond = threading.Condition()
        # Guarded by _cond:
        self.spent = 0  # bytes of ``_room`` given to kept blobs
        self._tensor = 0  # the next piece handed out is of this tensor...
        self._start = 0  # ...from this element
        self._current: tuple[torch.Tensor, torch.Tensor] | None = None  # its (flat, copy words)
        self._handed = 0  # pieces handed out
        self._decided = 0  # pieces whose blobs were kept or not, in order
        self._go_on: dict[int, bool] = {}  # tensor -> its first span said: compare the rest
        self._failed = False
        self._kept: list[tuple[int, list[tuple[tuple[str, int], torch.Tensor]]]] = []

    def run(self, threads: int) -> None:
        """Compare every piece, on up to ``threads`` threads (this one among them), and keep
        the blobs encoded on the way in ``Baseline._encoded``."""
        compared = sum(
            numel
            for meta, numel in zip(self._plan.tensors, self._numels, strict=True)
            if numel and self._baseline._held(meta) is not None
        )
        workers = min(threads, -(-compared // PIECE)) if compared >= PARALLEL_MIN else 1
        errors: list[BaseException] = []
        scratches = self._baseline._scan_scratches
        scratches += [_Scratch() for _ in range(workers - len(scratches))]
        helpers = [
            threading.Thread(
                target=self._work,
                args=(scratches[i], errors),
                name=f"weight-sync-scan-{i}",
                daemon=True,
            )
            for i in range(1, workers)
        ]
        started: list[threading.Thread] = []
        try:
            for helper in helpers:
                helper.start()
                started.append(helper)
            self._work(scratches[0], errors)
        finally:  # no helper outlives the scan, even one that could not start all of them
            if len(started) < len(helpers):
                self._stop()
            for helper in started:
                helper.join()
        if errors:  # the first that is not another thread stopping because of it
            raise next((e for e in errors if not isinstance(e, _Cancelled)), errors[0])
        for _, blobs in sorted(self._kept, key=lambda kept: kept[0]):
            self._baseline._encoded.update(blobs)
        logger.debug("scanned %d elements on %d thread(s)", compared, workers)

    # -- one thread ----------------------------------------------------------------------------

    def _work(self, scratch: _Scratch, errors: list[BaseException]) -> None:
        """Compare pieces until none is left (or another thread failed), in ``scratch`` (this
        thread's, kept by the ``Baseline`` from scan to scan: memory fresh from the allocator
        faults a page in every 4 KiB it is first written)."""
        try:
            while (piece := self._take()) is not None:
                self._compare(piece, scratch)
        except BaseException as exc:  # handed to the scan's caller by ``run``
            errors.append(exc)
            self._stop()

    def _stop(self) -> None:
        """Every thread stops at its next step (``_Cancelled``)."""
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def _take(self) -> _Piece | None:
        """The next piece to compare, in order (None once all are handed out)."""
        with self._cond:
            while True:
                if self._failed:
                    raise _Cancelled
                index, start = self._tensor, self._start
                if index == len(self._plan.tensors):
                    return None
                meta, numel = self._plan.tensors[index], self._numels[index]
                if start == 0:
                    base = self._baseline._held(meta)
                    if base is None or not numel:
                        self._all_changed(index)
                        self._tensor += 1
                        continue
                    self._current = (self._tensors[index].reshape(-1), words(base, meta.itemsize))
                else:
                    if index not in self._go_on:
                        # Another thread may hand out this very piece meanwhile: look again.
                        self._cond.wait()
                        continue
                    if not self._go_on[index]:  # sent whole: compare no further
                        self._tensor, self._start = index + 1, 0
                        continue
                assert self._current is not None
                stop = min(start + PIECE, numel)
                piece = _Piece(
                    self._handed, index, meta, numel, *self._current, start, stop, self._at[index]
                )
                self._handed += 1
                self._tensor, self._start = (index + 1, 0) if stop == numel else (index, stop)
                return piece

    def _compare(self, piece: _Piece, scratch: _Scratch) -> None:
        """Count the changes of one piece per span and, if its turn keeps its sparse blobs,
        encode them and bring the copy up to date there."""
        meta, size = piece.meta, piece.meta.itemsize
        elements = piece.stop - piece.start
        held = piece.held[piece.start : piece.stop].numpy()
        found = _Found(self._fused, piece, held, scratch)
        if piece.start == 0:  # a tensor's first span decides whether to compare the rest
            split = min(SPAN, elements)
            found.count(split)
            go_on = encoding(found.counts[0], split, size) != DENSE
            with self._cond:
                self._go_on[piece.tensor] = go_on
                self._cond.notify_all()
            if not go_on:
                self._all_changed(piece.tensor)
                self._decide(piece, [])
                return
        found.count(elements)
        counts = found.counts
        first = piece.at + piece.first_span
        self.counts[first : first + len(counts)] = counts
        runs = self._decide(piece, counts)
        # Where each span's changes start among those the kernel found.
        starts = np.cumsum([0] + counts).tolist() if runs and found.kernel is not None else []
        for start, stop, room in runs:
            if found.kernel is not None:  # the changes of these spans, in order, in the scratch
                lo, hi = starts[start], starts[stop]
                assert hi <= found.written
                blob, index, blob_values = sparse_blob(hi - lo, size, room)
                found.kernel.emit(
                    found.rows[lo:hi],
                    found.values[lo:hi],
                    _unsigned(held),
                    index,
                    _unsigned(blob_values),
                )
            else:
                assert found.new is not None
                lo, hi = start * SPAN, min(stop * SPAN, elements)
                changed = np.flatnonzero(scratch.mask(elements)[lo:hi])
                blob, changed_values = encode_sparse_rows(found.new[lo:hi], changed, size, room)
                held[lo:hi][changed] = changed_values
            piece.blobs.append(((meta.name, piece.first_span + start), blob))

    def _decide(self, piece: _Piece, counts: list[int]) -> list[tuple[int, int, torch.Tensor]]:
        """In the piece's turn, whether its sparse blobs are kept (encoded now): as long as they
        fit in what is left of the budget. Returns its sparse runs (spans from its first) to
        encode, each with the bytes of the room it is to be written into: all of them, or
        none."""
        size = piece.meta.itemsize
        ways = span_ways(counts, piece.stop - piece.start, size)  # a piece starts on a span
        runs = [(start, stop) for start, stop, way in span_runs(ways) if way == SPARSE]
        sizes = [sparse_bytes(sum(counts[start:stop]), size) for start, stop in runs]
        kept = sum(kept_bytes(blob) for blob in sizes)
        with self._cond:
            while self._decided != piece.seq and not self._failed:
                self._cond.wait()
            if self._failed:
                raise _Cancelled
            at = self.spent
            keep = bool(runs) and at + kept <= self._room.numel()
            if keep:
                self.spent += kept
                self._kept.append((piece.seq, piece.blobs))
            self._decided += 1
            self._cond.notify_all()
        if not keep:
            return []
        kept_runs = []
        for (start, stop), blob in zip(runs, sizes, strict=True):
            kept_runs.append((start, stop, self._room[at : at + blob]))
            at += kept_bytes(blob)
        return kept_runs

    def _all_changed(self, index: int) -> None:
        """Count every element of tensor ``index`` as changed."""
        numel, at = self._numels[index], self._at[index]
        spans = spans_of(numel)
        self.counts[at : at + spans] = SPAN
        if spans:
            self.counts[at + spans - 1] = span_elements(numel, spans - 1)


class _Scratch:
    """The host buffers one thread of a scan reuses piece after piece. Memory fresh from the
    allocator has its pages faulted in on first touch: a cast into new memory cost 1.5 ns per
    element, into memory already touched 0.4 ns (fp32 -> bf16, one thread), and the cast is a
    large part of a scan."""

    def __init__(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8)
        self._mask = np.empty(0, dtype=np.bool_)
        self._rows = np.empty(0, dtype=np.int32)
        self._values = np.empty(0, dtype=np.uint8)
        self._from: torch.Tensor | None = None  # the piece being cast, flattened
        self._into: torch.Tensor | None = None  # where to, in the workers' dtype

    def begin(self, flat: torch.Tensor, meta: TensorMeta, start: int, stop: int) -> np.ndarray:
        """Elements ``start:stop`` of a flattened tensor as the workers will hold them, as
        NumPy ``words``: a view where nothing needs converting, else the scratch buffer that
        ``fill`` casts them into."""
        piece = flat[start:stop]
        if piece.device.type == "cpu" and piece.dtype == meta.torch_dtype and piece.is_contiguous():
            self._from = self._into = None
            return words(piece.detach().view(torch.uint8), meta.itemsize).numpy()
        nbytes = (stop - start) * meta.itemsize
        if self._bytes.numel() < nbytes:
            self._bytes = torch.empty(nbytes, dtype=torch.uint8)
        self._from, self._into = piece.detach(), self._bytes[:nbytes].view(meta.torch_dtype)
        return words(self._bytes[:nbytes], meta.itemsize).numpy()

    def fill(self, start: int, stop: int) -> None:
        """Cast elements ``start:stop`` of the piece ``begin`` took into the scratch buffer
        (nothing to do where it returned a view)."""
        if self._from is not None and self._into is not None:
            self._into[start:stop].copy_(self._from[start:stop])

    def mask(self, elements: int) -> np.ndarray:
        if self._mask.size < elements:
            self._mask = np.empty(elements, dtype=np.bool_)
        return self._mask[:elements]

    def rows(self, count: int) -> np.ndarray:
        """Room for the positions of ``count`` changes (a blob holds at most 2**20 elements)."""
        if self._rows.size < count:
            self._rows = np.empty(count, dtype=np.int32)
        return self._rows[:count]

    def found(self, elements: int, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
        """Room for the values (the copy's unsigned words of ``itemsize``) and positions of as
        many changes as a piece of ``elements`` can hold, where the fused kernel writes them
        (``itemsize`` + 4 bytes an element)."""
        if self._values.size < elements * itemsize:
            self._values = np.empty(elements * itemsize, dtype=np.uint8)
        return self._values[: elements * itemsize].view(f"u{itemsize}"), self.rows(elements)


_NONE_FOUND = (np.empty(0, dtype=np.uint16), np.empty(0, dtype=np.int32))


class _Found:
    """The changes of one piece as a scan finds them, a range of spans at a time: by the fused
    kernel while it applies (each change's value and position left in ``scratch.found``),
    else the NumPy way (the piece in the workers' dtype, ``new``, and its mask left in the
    scratch). A NaN met by the kernel sends the whole piece the NumPy way, its spans counted
    before included, so that one way holds all of it for encoding."""

    def __init__(
        self, kernels: ModuleType | None, piece: _Piece, held: np.ndarray, scratch: _Scratch
    ) -> None:
        self._piece, self._held, self._scratch = piece, held, scratch
        self.kernel = kernels if kernels is not None and fusable(piece.flat, piece.meta) else None
        self.new: np.ndarray | None = None
        self.counts: list[int] = []  # per span, from the piece's first
        # Where the kernel writes each change's value and position, and how many it has.
        found = (
            _NONE_FOUND
            if self.kernel is None
            else scratch.found(piece.stop - piece.start, piece.meta.itemsize)
        )
        self.values: np.ndarray = found[0]
        self.rows: np.ndarray = found[1]
        self.written = 0

    def count(self, stop: int) -> None:
        """Count the spans from where ``counts`` ends up to element ``stop`` of the piece."""
        piece, scratch = self._piece, self._scratch
        start = len(self.counts) * SPAN
        if start >= stop:
            return
        if self.kernel is not None:
            counts = np.empty(spans_of(stop - start), dtype=np.int64)
            room = self.rows.size - self.written
            assert room >= stop - start and self.values.size == self.rows.size
            written = self.kernel.scan(
                _trainer_words(piece.flat, piece.start + start, piece.start + stop),
                _unsigned(self._held[start:stop]),
                self.values[self.written :],
                self.rows[self.written :],
                counts,
                SPAN,
                start,
            )
            if written >= 0:
                self.counts += counts.tolist()
                self.written += written
                return
            self.kernel, self.counts, start = None, [], 0  # a NaN: NumPy, from the first span
        if self.new is None:
            self.new = scratch.begin(piece.flat, piece.meta, piece.start, piece.stop)
        scratch.fill(start, stop)
        mask = scratch.mask(piece.stop - piece.start)[start:stop]
        differ(self.new[start:stop], self._held[start:stop], mask)
        self.counts += mask_span_counts(mask)


def kept_bytes(blob: int) -> int:
    """The room a kept blob of ``blob`` bytes takes: the next one starts aligned for values."""
    return align_up(blob, VALUES_ALIGNMENT)


def fusable(flat: torch.Tensor, meta: TensorMeta) -> bool:
    """Whether the fused kernels compare this flattened tensor: on the host, contiguous, and
    either fp32 pushed as bf16 (rounded as torch rounds), or 2 or 4 bytes an element pushed in
    its own dtype (compared bit for bit)."""
    if flat.device.type != "cpu" or not flat.is_contiguous():
        return False
    if flat.dtype == meta.torch_dtype:
        return meta.itemsize in (2, 4)
    return flat.dtype == torch.float32 and meta.torch_dtype == torch.bfloat16


def _trainer_words(flat: torch.Tensor, start: int, stop: int) -> np.ndarray:
    """Elements ``start:stop`` of a flattened host tensor of 2 or 4 bytes an element, as
    unsigned words (NumPy has no bf16: the tensor is viewed as integers first)."""
    piece = flat[start:stop].detach()
    return _unsigned(words(piece.view(torch.uint8), piece.element_size()).numpy())


def _unsigned(array: np.ndarray) -> np.ndarray:
    """NumPy ``words`` as unsigned integers of their width (what the kernels take)."""
    return array.view(f"u{array.itemsize}")


class _Sources(Sequence[torch.Tensor]):
    """The tensors ``Packer`` reads for a delta layout, blobs made on demand, each once: a blob
    is kept until the packer reads a blob of a later bucket than its last (a blob split over
    buckets is read again in the next one, and not necessarily first there: the packer copies a
    bucket's whole small blobs before the rest), since encoding a sparse blob again would find
    nothing left to send.

    Blobs not encoded by the scan are encoded ahead of the packer, in the order it reads them,
    on up to ``Baseline.threads`` threads and at most two buckets' worth ahead: while a bucket is
    on the wire (and far hosts pass on and patch the one before), the next ones are being
    compared. ``close`` stops that (the caller's, whatever happened)."""

    def __init__(
        self,
        baseline: Baseline,
        layout: DeltaLayout,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        sums: list[int] | None,
    ) -> None:
        self._baseline, self._layout, self._plan, self._tensors = baseline, layout, plan, tensors
        self._sums = sums
        # The first and last bucket each blob is packed into.
        self._buckets: dict[int, tuple[int, int]] = {}
        for number, bucket in enumerate(layout.plan.buckets):
            for seg in bucket.segments:
                if seg.tensor in layout.blobs:
                    first, _ = self._buckets.get(seg.tensor, (number, number))
                    self._buckets[seg.tensor] = (first, number)
        self._made: dict[int, torch.Tensor] = {}  # blobs made, kept until past their last bucket
        # The blobs with work to do (not encoded by the scan), in the order the packer reads.
        self._order = [
            index
            for index, blob in sorted(layout.blobs.items())
            if blob.dense
            or (plan.tensors[blob.tensor].name, blob.first_span) not in baseline._encoded
        ]
        self._next = 0  # the next of ``_order`` to encode ahead
        self._ahead: dict[int, Future[tuple[torch.Tensor, int | None]]] = {}
        self._ahead_bytes = 0
        self._taken: set[int] = set()  # encoded here before their turn ahead came
        self._budget = 2 * max((bucket.nbytes for bucket in layout.plan.buckets), default=0)
        self._pool = (
            ThreadPoolExecutor(baseline.threads, thread_name_prefix="weight-sync-encode")
            if baseline.threads > 1 and len(self._order) > 1
            else None
        )
        # One flattened tensor cached for each of the two readers (a non-contiguous one is
        # copied to flatten it: once, as blobs of a tensor come one after another).
        self._flat_here = _Flat(tensors)
        self._flat_ahead = _Flat(tensors)

    def __len__(self) -> int:
        return len(self._layout.plan.tensors)

    def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        whole = self._layout.whole.get(index)
        if whole is not None:
            return self._tensors[whole]
        made = self._made.get(index)
        if made is not None:
            return made
        first, _ = self._buckets[index]
        for done in [i for i in self._made if self._buckets[i][1] < first]:
            del self._made[done]
        self._fill()
        future = self._ahead.pop(index, None)
        if future is None:  # not ahead (encoded by the scan, no threads, out of order): here
            self._taken.add(index)
            data, crc = self._encode(index, self._flat_here.of(self._layout.blobs[index].tensor))
        else:
            data, crc = future.result()
            self._ahead_bytes -= self._layout.plan.tensors[index].nbytes
            self._fill()
        if crc is not None and self._sums is not None:
            self._sums.append(crc)
        self._made[index] = data
        return data

    def close(self) -> None:
        """Stop encoding ahead: what has not started never will, and what has is waited for."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _fill(self) -> None:
        """Encode ahead until two buckets' worth are on the way."""
        while (
            self._pool is not None
            and self._next < len(self._order)
            and self._ahead_bytes < self._budget
        ):
            index = self._order[self._next]
            self._next += 1
            if index in self._taken:
                continue
            self._ahead[index] = self._pool.submit(
                self._encode, index, self._flat_ahead.of(self._layout.blobs[index].tensor)
            )
            self._ahead_bytes += self._layout.plan.tensors[index].nbytes

    def _encode(self, index: int, flat: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """Blob ``index`` of the tensor ``flat`` (flattened), as ``Baseline.encode`` makes it."""
        blob = self._layout.blobs[index]
        meta = self._plan.tensors[blob.tensor]
        return self._baseline.encode(blob, meta, flat, self._sums is not None)


class _Flat:
    """A tensor of ``tensors`` flattened, the last one asked for kept."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = tensors
        self._kept: tuple[int, torch.Tensor] | None = None

    def of(self, index: int) -> torch.Tensor:
        if self._kept is None or self._kept[0] != index:
            self._kept = (index, self._tensors[index].reshape(-1))
        return self._kept[1]


def _bytes(flat: torch.Tensor, meta: TensorMeta, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` of a flattened tensor as the workers will hold them: on the host,
    in the wire dtype, as contiguous uint8 (a view where nothing needs converting)."""
    return flat[start:stop].to(device="cpu", dtype=meta.torch_dtype).contiguous().view(torch.uint8)
