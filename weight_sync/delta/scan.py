"""A scan: every tensor of a delta push compared with the trainer's copy, on a few threads.

Each piece of ``PIECE`` elements is cast into the workers' dtype, compared with the copy and
counted per span (``Scan``); the sparse blobs found on the way are encoded into room the
``Baseline`` keeps from push to push, up to an eighth of the push's size. The counts, the
blobs kept and the copy come out exactly as one thread would leave them.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from weight_sync.delta.codec import (
    differ,
    encode_sparse_rows,
    mask_span_counts,
    sparse_blob,
    words,
)
from weight_sync.delta.layout import (
    DENSE,
    RUN_SPANS,
    SPAN,
    SPARSE,
    VALUES_ALIGNMENT,
    encoding,
    span_elements,
    span_runs,
    span_ways,
    spans_of,
    sparse_bytes,
)
from weight_sync.wire.metadata import SyncPlan, TensorMeta
from weight_sync.wire.planner import align_up

if TYPE_CHECKING:
    from weight_sync.delta.baseline import Baseline

logger = logging.getLogger(__name__)

PIECE = RUN_SPANS * SPAN  # elements compared at once; a blob never crosses a piece boundary
ENCODED_BUDGET = 8  # blobs encoded while scanning take at most 1/8 of the push's bytes
PARALLEL_MIN = 2 * PIECE  # elements to compare below which a scan stays on the calling thread


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


class Scan:
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
        scratches += [Scratch() for _ in range(workers - len(scratches))]
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

    def _work(self, scratch: Scratch, errors: list[BaseException]) -> None:
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

    def _compare(self, piece: _Piece, scratch: Scratch) -> None:
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
                    unsigned(held),
                    index,
                    unsigned(blob_values),
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


class Scratch:
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
        self, kernels: ModuleType | None, piece: _Piece, held: np.ndarray, scratch: Scratch
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
                trainer_words(piece.flat, piece.start + start, piece.start + stop),
                unsigned(self._held[start:stop]),
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


def trainer_words(flat: torch.Tensor, start: int, stop: int) -> np.ndarray:
    """Elements ``start:stop`` of a flattened host tensor of 2 or 4 bytes an element, as
    unsigned words (NumPy has no bf16: the tensor is viewed as integers first)."""
    piece = flat[start:stop].detach()
    return unsigned(words(piece.view(torch.uint8), piece.element_size()).numpy())


def unsigned(array: np.ndarray) -> np.ndarray:
    """NumPy ``words`` as unsigned integers of their width (what the kernels take)."""
    return array.view(f"u{array.itemsize}")


def piece_bytes(flat: torch.Tensor, meta: TensorMeta, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` of a flattened tensor as the workers will hold them: on the host,
    in the wire dtype, as contiguous uint8 (a view where nothing needs converting)."""
    return flat[start:stop].to(device="cpu", dtype=meta.torch_dtype).contiguous().view(torch.uint8)
