"""Pure packing: tensors -> uint8 buckets on the sender, buckets -> named tensors on the receiver.

Everything travels as bytes, so any dtype crosses any backend (Gloo refuses bf16 and fp8 as
element types, but not uint8), and what arrives is bit-for-bit what was sent.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import torch

from weight_sync.metadata import SyncPlan, TensorMeta

NamedTensors = list[tuple[str, torch.Tensor]]


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy)."""
    assert tensor.is_contiguous(), "byte_view needs a contiguous tensor"
    return tensor.reshape(-1).view(torch.uint8)


def typed_view(data: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """View ``meta.nbytes`` uint8 bytes as the tensor ``meta`` describes (no copy)."""
    return data.view(meta.torch_dtype).view(meta.shape)


def copy_all(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Pairwise byte copies in one call: with thousands of small tensors per bucket, a Python
    loop of ``copy_`` costs more than the copying (3x on a 2-core CPU; one kernel on CUDA)."""
    if destinations:
        torch._foreach_copy_(destinations, sources)


class Packer:
    """Fills staging buffers from the sender's tensors, one packed bucket at a time.

    A tensor placed whole goes into its bucket with a single ``copy_`` that also handles
    non-contiguous layouts, device transfers and casts (where the plan's dtype differs from the
    tensor's). A tensor split across buckets is read piece by piece, so a non-contiguous one is
    made contiguous once and kept only until its last piece is packed.
    """

    def __init__(self, plan: SyncPlan, tensors: Sequence[torch.Tensor]) -> None:
        assert len(plan.tensors) == len(tensors)
        self._plan = plan
        self._tensors = tensors
        self._split_source: tuple[int, torch.Tensor] | None = None

    def pack(self, bucket_index: int, out: torch.Tensor) -> torch.Tensor:
        """Pack bucket ``bucket_index`` into ``out``; returns the filled prefix of ``out``.

        Alignment padding between tensors is left as it was: it is never read back.
        """
        bucket = self._plan.buckets[bucket_index]
        assert not bucket.direct, "direct buckets are sent from the tensor itself"
        batch: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for seg in bucket.segments:
            meta = self._plan.tensors[seg.tensor]
            dest = out[seg.bucket_offset : seg.bucket_offset + seg.nbytes]
            source = self._tensors[seg.tensor]
            same_bytes = source.dtype == meta.torch_dtype and source.device == out.device
            if seg.nbytes == meta.nbytes and same_bytes and source.is_contiguous():
                batch[0].append(dest)
                batch[1].append(byte_view(source))
            elif seg.nbytes == meta.nbytes:  # strided, elsewhere or cast: copy_ does all three
                typed_view(dest, meta).copy_(source)
            elif source.dtype != meta.torch_dtype:  # a piece of a cast tensor: cast that piece
                first = seg.tensor_offset // meta.itemsize
                piece = self._contiguous(seg.tensor).reshape(-1)[first : first + seg.nbytes // meta.itemsize]
                dest.view(meta.torch_dtype).copy_(piece)
                if seg.tensor_offset + seg.nbytes == meta.nbytes:
                    self._split_source = None
            else:
                source = byte_view(self._contiguous(seg.tensor))
                dest.copy_(source[seg.tensor_offset : seg.tensor_offset + seg.nbytes])
                if seg.tensor_offset + seg.nbytes == meta.nbytes:
                    self._split_source = None
        copy_all(*batch)
        return out[: bucket.nbytes]

    def _contiguous(self, index: int) -> torch.Tensor:
        tensor = self._tensors[index]
        if tensor.is_contiguous():
            return tensor
        if self._split_source is None or self._split_source[0] != index:
            self._split_source = (index, tensor.contiguous())
        return self._split_source[1]


def can_land_in(destination: torch.Tensor, meta: TensorMeta, device: torch.device) -> bool:
    """Whether received bytes for ``meta`` may be written straight into ``destination``."""
    return (
        destination.is_contiguous()
        and destination.dtype == meta.torch_dtype
        and tuple(destination.shape) == meta.shape
        and destination.device == device
    )


class Unpacker:
    """Turns received bytes back into named tensors.

    ``destinations`` (tensor index -> tensor that passed ``can_land_in``) are written in place
    and never handed back. Every other tensor is returned for ``load_weights``: a whole one as a
    view into the receive buffer (valid until that buffer is reused), a split one reassembled in
    a temporary once its last piece arrives.
    """

    def __init__(self, plan: SyncPlan, destinations: Mapping[int, torch.Tensor]) -> None:
        self._plan = plan
        self._destinations = destinations
        self._partial: dict[int, torch.Tensor] = {}

    def empty_tensors(self, device: torch.device) -> NamedTensors:
        """Tensors with no bytes: they need no transfer, only their shape and dtype."""
        return [
            (meta.name, torch.empty(meta.shape, dtype=meta.torch_dtype, device=device))
            for index, meta in enumerate(self._plan.tensors)
            if meta.nbytes == 0 and index not in self._destinations
        ]

    def direct_target(self, bucket_index: int, device: torch.device) -> torch.Tensor:
        """Where a direct bucket is received: its destination's bytes, else a fresh tensor."""
        bucket = self._plan.buckets[bucket_index]
        assert bucket.direct
        index = bucket.segments[0].tensor
        destination = self._destinations.get(index)
        if destination is not None:
            return byte_view(destination)
        return torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)

    def unpack(self, bucket_index: int, data: torch.Tensor) -> NamedTensors:
        bucket = self._plan.buckets[bucket_index]
        assert data.dtype == torch.uint8 and data.numel() == bucket.nbytes
        done: NamedTensors = []
        batch: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for seg in bucket.segments:
            meta = self._plan.tensors[seg.tensor]
            piece = data[seg.bucket_offset : seg.bucket_offset + seg.nbytes]
            destination = self._destinations.get(seg.tensor)
            if bucket.direct:
                if destination is None:  # received into a temporary of its own
                    done.append((meta.name, typed_view(piece, meta)))
                elif piece.data_ptr() != destination.data_ptr():  # staged (atomic), not landed
                    batch[0].append(byte_view(destination))
                    batch[1].append(piece)
                continue
            if destination is not None:
                batch[0].append(byte_view(destination)[seg.tensor_offset : seg.tensor_offset + seg.nbytes])
                batch[1].append(piece)
                continue
            if seg.nbytes == meta.nbytes:
                done.append((meta.name, typed_view(piece, meta)))
                continue
            whole = self._partial.get(seg.tensor)
            if whole is None:
                whole = torch.empty(meta.nbytes, dtype=torch.uint8, device=data.device)
                self._partial[seg.tensor] = whole
            whole[seg.tensor_offset : seg.tensor_offset + seg.nbytes].copy_(piece)
            if seg.tensor_offset + seg.nbytes == meta.nbytes:
                done.append((meta.name, typed_view(self._partial.pop(seg.tensor), meta)))
        copy_all(*batch)
        return done


def checksum(data: torch.Tensor) -> int:
    """CRC32 of a uint8 buffer (copied to the host first if it lives on a GPU)."""
    assert data.dtype == torch.uint8 and data.is_contiguous()
    host = data.cpu() if data.device.type != "cpu" else data
    return zlib.crc32(host.numpy().data)


def bucket_buffers(plan: SyncPlan, device: torch.device) -> list[torch.Tensor]:
    """Two reusable staging buffers (one if the plan has one packed bucket, none if it has
    none): one in flight, one being packed or applied. With direct buckets landing in place,
    this is all the extra memory a push takes, on either side."""
    count = min(2, plan.packed_buckets)
    return [
        torch.empty(plan.max_packed_bytes, dtype=torch.uint8, device=device) for _ in range(count)
    ]


def staging_slots(plan: SyncPlan) -> list[int | None]:
    """Which staging buffer each bucket uses (None for direct buckets).

    Packed buckets alternate between the two buffers, so a buffer is reused only by the packed
    bucket after next -- by then the one before it has been sent (sender) or applied (receiver).
    """
    slots: list[int | None] = []
    packed = 0
    for bucket in plan.buckets:
        if bucket.direct:
            slots.append(None)
        else:
            slots.append(packed % 2)
            packed += 1
    return slots
