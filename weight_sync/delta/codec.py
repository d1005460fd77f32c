"""The bytes of a delta: finding changed elements, writing a sparse blob, patching a tensor.

Elements are compared and copied as integers of their size (``words``), never as numbers: a
delta must reproduce the exact bits -- NaN payloads, -0.0 against 0.0 -- and every dtype has an
integer of its width (16-byte ones are compared as pairs of int64).
"""

from __future__ import annotations

import numpy as np
import torch

from weight_sync.delta.layout import (
    INDEX_BYTES,
    SPAN,
    VALUES_ALIGNMENT,
    Blob,
    spans_of,
    sparse_bytes,
)
from weight_sync.packing import checksum
from weight_sync.planner import align_up

_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def words(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Contiguous uint8 ``data`` as one integer row per element: shape (n,) for itemsizes up to
    8, (n, 2) of int64 for 16-byte elements (complex128)."""
    if itemsize == 16:
        return data.view(torch.int64).view(-1, 2)
    return data.view(_WORDS[itemsize])


def changed(new: torch.Tensor, base: torch.Tensor, mask: np.ndarray | None = None) -> torch.Tensor:
    """Indices (int64, ascending) of the rows of ``new`` that differ from ``base``, bit for bit.
    ``mask``: a bool array of one entry per row to compare into, reused from call to call.

    On the host this runs in NumPy: its ``flatnonzero`` is 3.5x faster than ``torch.nonzero``
    on one thread at the densities of an RL update (measured: 0.14 s against 0.48 s for 124M
    elements), and finding the changes is most of a delta push's cost on the trainer."""
    if new.device.type == "cpu" and base.device.type == "cpu":
        ours, theirs = new.numpy(), base.numpy()
        if ours.ndim == 2:
            diff = (ours != theirs).any(axis=1)
        else:
            diff = np.not_equal(ours, theirs, out=mask)
        return torch.from_numpy(np.flatnonzero(diff))
    diff = new != base
    if diff.dim() == 2:
        diff = diff.any(dim=1)
    return diff.nonzero().view(-1)


def span_counts(indices: np.ndarray, elements: int) -> list[int]:
    """How many of ``indices`` (ascending, relative to a span boundary, below ``elements``) fall
    in each span."""
    edges = np.arange(spans_of(elements) + 1) * SPAN
    return np.diff(np.searchsorted(indices, edges)).tolist()


def encode_sparse(indices: torch.Tensor, values: torch.Tensor, itemsize: int) -> torch.Tensor:
    """A sparse blob: the indices inside their spans as 16 bits each, then the values (``words``
    rows of the changed elements), aligned so that the values can be viewed in place."""
    count = indices.numel()
    blob = torch.empty(sparse_bytes(count, itemsize), dtype=torch.uint8)
    blob[: count * INDEX_BYTES].view(torch.int16).copy_(indices & (SPAN - 1))  # wraps to int16
    words(blob[align_up(count * INDEX_BYTES, VALUES_ALIGNMENT) :], itemsize).copy_(values)
    return blob


def patch(target: torch.Tensor, blob: Blob, data: torch.Tensor, itemsize: int) -> None:
    """Write ``blob`` (its bytes ``data``, as the trainer encoded them) into ``target``, the
    uint8 view of the whole tensor, in place: dense runs are copied, sparse ones scattered."""
    region = words(target, itemsize)[blob.first : blob.first + blob.elements]
    if blob.dense:
        region.copy_(words(data, itemsize))
        return
    count = blob.changed
    values = words(data[align_up(count * INDEX_BYTES, VALUES_ALIGNMENT) :], itemsize)
    local = data[: count * INDEX_BYTES].cpu().numpy().view(np.uint16).astype(np.int64)
    local += np.repeat(np.arange(len(blob.counts), dtype=np.int64) * SPAN, blob.counts)
    region.index_copy_(0, torch.from_numpy(local).to(region.device), values)


def region_checksum(target: torch.Tensor, blob: Blob, itemsize: int) -> int:
    """The checksum (``packing.checksum``, as for buckets) of the bytes ``blob`` covers in
    ``target`` (a uint8 view of the whole tensor)."""
    return checksum(target[blob.first * itemsize : (blob.first + blob.elements) * itemsize])
