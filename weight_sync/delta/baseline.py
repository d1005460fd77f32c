"""The trainer's copy of what its workers hold, and the delta pushes computed against it.

With ``SyncConfig(delta=True)`` the trainer keeps, in host memory, the bytes of every tensor as
it last pushed them -- after ``cast_dtype``, i.e. exactly what the workers hold: the model's size
in the workers' dtype (for a GPU trainer, host memory). A delta push then compares each tensor
with that copy, sends what changed (see ``weight_sync.delta.layout``), and brings the copy up to
date as it goes. A dense push brings it up to date too, from the very bytes it sends.

Memory beyond the copy stays small: comparisons run over pieces of ``PIECE`` elements in one
reused scratch buffer; the sparse blobs encoded while comparing are kept for sending only up to
an eighth of the push's size (past that they are found again while packing, at the cost of a
second comparison); any other blob exists only while it is packed. Nothing is a second copy of
the model.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from weight_sync.delta.codec import changed, encode_sparse, span_counts, words
from weight_sync.delta.layout import (
    DENSE,
    RUN_SPANS,
    SPAN,
    SPARSE,
    Blob,
    DeltaLayout,
    encoding,
    span_elements,
    span_runs,
    spans_of,
    sparse_bytes,
)
from weight_sync.delta.lineage import base_name, next_base
from weight_sync.errors import WeightSyncError
from weight_sync.metadata import SyncPlan, TensorMeta
from weight_sync.packing import checksum

logger = logging.getLogger(__name__)

PIECE = RUN_SPANS * SPAN  # elements compared at once; a blob never crosses a piece boundary
_ENCODED_BUDGET = 8  # blobs encoded while scanning take at most 1/8 of the push's bytes


class Baseline:
    """What the workers hold, as of base ``id`` (None while the copy is being changed, or
    before any push completed)."""

    def __init__(self) -> None:
        self._token = secrets.token_hex(8)
        self._bytes: dict[str, torch.Tensor] = {}  # name -> its bytes as the workers hold them
        self._metas: dict[str, TensorMeta] = {}
        self.id: str | None = None
        self._built_on: str | None = None
        # Sparse blobs encoded while scanning, by (tensor name, first span); see ``scan``.
        self._encoded: dict[tuple[str, int], torch.Tensor] = {}

    def name_for(self, version: int) -> str:
        return base_name(self._token, version)

    # -- one push ------------------------------------------------------------------------------

    def begin(self) -> str | None:
        """A push starts changing the copy: until ``finish`` it describes no version. Returns
        the base the push is built on."""
        self._built_on, self.id = self.id, None
        self._encoded.clear()
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
        self.id = None
        self._bytes.clear()
        self._metas.clear()
        self._encoded.clear()

    def scan(self, plan: SyncPlan, tensors: Sequence[torch.Tensor]) -> list[int]:
        """Changed elements per span of every tensor of ``plan`` (the delta header).

        A tensor the copy lacks (or holds with another dtype or shape) counts as all changed.
        So does one whose first span is dense: the density of an update is much the same across
        a tensor, and this keeps a push where everything changed from comparing everything.

        While a piece's new values are at hand, its sparse blobs are encoded and the copy is
        brought up to date there (as long as the encoded blobs stay within an eighth of the
        push's size; past that, ``encode`` compares those pieces again).
        """
        counts: list[int] = []
        budget = plan.payload_bytes // _ENCODED_BUDGET
        scratch = _Scratch()
        for meta, tensor in zip(plan.tensors, tensors, strict=True):
            numel = math.prod(meta.shape)
            base = self._held(meta)
            if base is None or not numel:
                counts.extend(span_elements(numel, s) for s in range(spans_of(numel)))
                continue
            flat, held = tensor.reshape(-1), words(base, meta.itemsize)
            tensor_counts: list[int] = []
            parts: list[tuple[np.ndarray, np.ndarray]] = []  # (indices in the piece, values)
            for start, stop in _pieces(numel):
                new = scratch.words(flat, meta, start, stop)
                indices = changed(new, held[start:stop], scratch.mask(stop - start)).numpy()
                part_counts = span_counts(indices, stop - start)
                if (
                    start == 0
                    and encoding(part_counts[0], span_elements(numel, 0), meta.itemsize) == DENSE
                ):
                    tensor_counts = [span_elements(numel, s) for s in range(spans_of(numel))]
                    break
                tensor_counts += part_counts
                parts.append((indices + start % PIECE, new.numpy()[indices]))
                if stop % PIECE == 0 or stop == numel:  # a piece is whole: encode its sparse runs
                    first_span = (stop - 1) // PIECE * RUN_SPANS
                    budget -= self._keep(
                        meta, first_span, tensor_counts[first_span:], parts, budget
                    )
                    parts = []
            counts += tensor_counts
        return counts

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
            new = words(_bytes(flat, meta, blob.first, stop), size)
            indices = changed(new, base)
            if indices.numel() != blob.changed:
                raise WeightSyncError(
                    f"{meta.name!r} changed while it was being pushed ({indices.numel()} changed "
                    f"elements found, {blob.changed} counted); do not step the optimizer during a push"
                )
            values = new[indices]
            base.index_copy_(0, indices, values)
            data = encode_sparse(indices, values, size)
        assert data.numel() == sparse_bytes(blob.changed, size)
        updated = self._bytes[meta.name][blob.first * size : stop * size]
        return data, checksum(updated) if crc else None

    def _keep(
        self, meta: TensorMeta, first_span: int, piece_counts: list[int],
        parts: list[tuple[np.ndarray, np.ndarray]], budget: int,
    ) -> int:  # fmt: skip
        """Encode the sparse runs of one piece from its changes (``parts``: indices relative to
        the piece, and the new values) if they fit in ``budget`` bytes, bringing the copy up to
        date there; returns the bytes kept."""
        size, numel = meta.itemsize, math.prod(meta.shape)
        ways = [
            encoding(c, span_elements(numel, first_span + s), size)
            for s, c in enumerate(piece_counts)
        ]
        runs = [(start, stop) for start, stop, way in span_runs(ways) if way == SPARSE]
        kept = sum(sparse_bytes(sum(piece_counts[start:stop]), size) for start, stop in runs)
        if not runs or kept > budget:
            return 0
        indices = np.concatenate([part[0] for part in parts])
        values = np.concatenate([part[1] for part in parts])
        ends = np.cumsum([0, *piece_counts]).tolist()
        held = words(self._bytes[meta.name], size).numpy()[first_span * SPAN :]
        for start, stop in runs:
            run_indices, run_values = (
                indices[ends[start] : ends[stop]],
                values[ends[start] : ends[stop]],
            )
            held[run_indices] = run_values
            blob = encode_sparse(torch.from_numpy(run_indices), torch.from_numpy(run_values), size)
            self._encoded[(meta.name, first_span + start)] = blob
        return kept


class _Scratch:
    """Host buffers a scan reuses piece after piece. Memory fresh from the allocator has its
    pages faulted in on first touch: a cast into new memory cost 1.5 ns per element, into memory
    already touched 0.4 ns (fp32 -> bf16, one thread), and the cast is most of a scan."""

    def __init__(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8)
        self._mask = np.empty(0, dtype=np.bool_)

    def words(self, flat: torch.Tensor, meta: TensorMeta, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of a flattened tensor as the workers will hold them, as
        ``words``: a view where nothing needs converting, else in the scratch buffer."""
        piece = flat[start:stop]
        if piece.device.type == "cpu" and piece.dtype == meta.torch_dtype and piece.is_contiguous():
            return words(piece.detach().view(torch.uint8), meta.itemsize)
        nbytes = (stop - start) * meta.itemsize
        if self._bytes.numel() < nbytes:
            self._bytes = torch.empty(nbytes, dtype=torch.uint8)
        out = self._bytes[:nbytes]
        out.view(meta.torch_dtype).copy_(piece)
        return words(out, meta.itemsize)

    def mask(self, elements: int) -> np.ndarray:
        if self._mask.size < elements:
            self._mask = np.empty(elements, dtype=np.bool_)
        return self._mask[:elements]


class _Sources(Sequence[torch.Tensor]):
    """The tensors ``Packer`` reads for a delta layout, blobs made on demand (each once: a blob
    split over buckets is asked for again, and the last one made is kept)."""

    def __init__(
        self, baseline: Baseline, layout: DeltaLayout, plan: SyncPlan,
        tensors: Sequence[torch.Tensor], sums: list[int] | None,
    ) -> None:  # fmt: skip
        self._baseline, self._layout, self._plan, self._tensors = baseline, layout, plan, tensors
        self._sums = sums
        self._last: tuple[int, torch.Tensor] | None = None
        self._flat: tuple[int, torch.Tensor] | None = None  # the blobs' tensor, flattened once

    def __len__(self) -> int:
        return len(self._layout.plan.tensors)

    def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        whole = self._layout.whole.get(index)
        if whole is not None:
            return self._tensors[whole]
        if self._last is not None and self._last[0] == index:
            return self._last[1]
        blob = self._layout.blobs[index]
        if self._flat is None or self._flat[0] != blob.tensor:
            self._flat = (blob.tensor, self._tensors[blob.tensor].reshape(-1))
        meta = self._plan.tensors[blob.tensor]
        data, crc = self._baseline.encode(blob, meta, self._flat[1], self._sums is not None)
        if crc is not None and self._sums is not None:
            self._sums.append(crc)
        self._last = (index, data)
        return data


def _pieces(numel: int) -> list[tuple[int, int]]:
    """Where counting compares: the first span alone (it decides whether to go on), then the
    rest of the first piece, then whole pieces."""
    bounds = [0, min(SPAN, numel), *range(PIECE, numel, PIECE), numel]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def _bytes(flat: torch.Tensor, meta: TensorMeta, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` of a flattened tensor as the workers will hold them: on the host,
    in the wire dtype, as contiguous uint8 (a view where nothing needs converting)."""
    return flat[start:stop].to(device="cpu", dtype=meta.torch_dtype).contiguous().view(torch.uint8)
