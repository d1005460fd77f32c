"""Buckets as SGLang receives them: pure planning and packing, no I/O.

SGLang's ``update_weights_from_distributed(load_format="flattened_bucket")`` allocates one
``uint8`` buffer for the names, dtypes and shapes it is given, receives one broadcast into it,
and cuts it back into tensors at offsets it computes itself: each tensor's bytes right after the
previous one's, no padding, every offset a multiple of its dtype's size
(``FlattenedTensorBucket.empty`` in ``sglang/srt/weight_sync/tensor_bucket.py``). So the layout
is not ours to choose, and two of our own rules give way:

* no alignment padding: a bucket lists its tensors by falling element size, which keeps every
  offset a multiple of the size of the dtype that starts there (sizes are powers of two);
* no tensor split across buckets: SGLang loads whole tensors only. A tensor larger than
  ``bucket_bytes`` travels alone, in a bucket of its own size, so the memory a push holds is
  the larger of ``bucket_bytes`` and the largest tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weight_sync.wire.metadata import dtype_name


@dataclass(frozen=True)
class Slot:
    """One tensor in a bucket: where its bytes go, and what SGLang is told about it."""

    index: int  # into the push's list of tensors
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    slots: tuple[Slot, ...]
    nbytes: int

    def request(self) -> dict[str, list]:
        """The bucket as ``update_weights_from_distributed`` takes it (JSON-ready)."""
        return {
            "names": [slot.name for slot in self.slots],
            "dtypes": [dtype_name(slot.dtype) for slot in self.slots],
            "shapes": [list(slot.shape) for slot in self.slots],
        }


def plan_buckets(
    tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int
) -> list[Bucket]:
    """Group ``(name, wire dtype, shape)`` into buckets of at most ``bucket_bytes`` (a larger
    tensor alone), in the order given, each laid out as SGLang computes it."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    groups: list[list[int]] = []
    filled = 0  # the open bucket's bytes
    for index, (_, dtype, shape) in enumerate(tensors):
        size = _nbytes(dtype, shape)
        if not groups or filled + size > bucket_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(index)
        filled += size
    return [_layout(tensors, group) for group in groups]


def _layout(
    tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], group: list[int]
) -> Bucket:
    ordered = sorted(group, key=lambda index: -tensors[index][1].itemsize)  # stable
    slots, offset = [], 0
    for index in ordered:
        name, dtype, shape = tensors[index]
        size = _nbytes(dtype, shape)
        assert offset % dtype.itemsize == 0, "falling element sizes keep offsets aligned"
        slots.append(Slot(index, name, dtype, tuple(shape), offset, size))
        offset += size
    return Bucket(tuple(slots), offset)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * dtype.itemsize


def pack(bucket: Bucket, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's tensors into the front of ``out`` (``uint8``, at least
    ``bucket.nbytes``), each cast to its slot's dtype; returns the filled view."""
    view = out[: bucket.nbytes]
    for slot in bucket.slots:
        source = tensors[slot.index]
        if slot.nbytes == 0:
            continue
        target = view[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        target.copy_(source)  # casts, and gathers a non-contiguous source
    return view
