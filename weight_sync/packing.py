"""Pure packing: tensors -> uint8 buckets on the sender, buckets -> named tensors on the receiver.

Everything travels as bytes, so any dtype crosses any backend (Gloo refuses bf16 and fp8 as
element types, but not uint8), and what arrives is bit-for-bit what was sent.
"""

from __future__ import annotations

from collections.abc import Sequence

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


class Packer:
    """Fills bucket buffers from the sender's tensors, one bucket at a time.

    A tensor placed whole goes into its bucket with a single ``copy_`` that also handles
    non-contiguous layouts and device transfers. A tensor split across buckets is read as bytes,
    so a non-contiguous one is made contiguous once and kept only until its last piece is packed.
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
        for seg in bucket.segments:
            meta = self._plan.tensors[seg.tensor]
            dest = out[seg.bucket_offset : seg.bucket_offset + seg.nbytes]
            if seg.nbytes == meta.nbytes:
                typed_view(dest, meta).copy_(self._tensors[seg.tensor])
            else:
                source = byte_view(self._contiguous(seg.tensor))
                dest.copy_(source[seg.tensor_offset : seg.tensor_offset + seg.nbytes])
                if seg.tensor_offset + seg.nbytes == meta.nbytes:
                    self._split_source = None
        return out[: bucket.nbytes]

    def _contiguous(self, index: int) -> torch.Tensor:
        tensor = self._tensors[index]
        if tensor.is_contiguous():
            return tensor
        if self._split_source is None or self._split_source[0] != index:
            self._split_source = (index, tensor.contiguous())
        return self._split_source[1]


class Unpacker:
    """Turns received buckets back into named tensors.

    Tensors that arrived whole are returned as views into the bucket buffer (valid until that
    buffer is reused); tensors split across buckets are reassembled and returned when complete.
    """

    def __init__(self, plan: SyncPlan) -> None:
        self._plan = plan
        self._partial: dict[int, torch.Tensor] = {}

    def empty_tensors(self, device: torch.device) -> NamedTensors:
        """Tensors with no bytes: they need no transfer, only their shape and dtype."""
        return [
            (meta.name, torch.empty(meta.shape, dtype=meta.torch_dtype, device=device))
            for meta in self._plan.tensors
            if meta.nbytes == 0
        ]

    def unpack(self, bucket_index: int, data: torch.Tensor) -> NamedTensors:
        bucket = self._plan.buckets[bucket_index]
        assert data.dtype == torch.uint8 and data.numel() == bucket.nbytes
        done: NamedTensors = []
        for seg in bucket.segments:
            meta = self._plan.tensors[seg.tensor]
            piece = data[seg.bucket_offset : seg.bucket_offset + seg.nbytes]
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
        return done


def bucket_buffers(plan: SyncPlan, device: torch.device) -> list[torch.Tensor]:
    """Two reusable buffers (one if the plan has one bucket): one in flight, one being
    packed or applied. This is all the extra memory a push takes, on either side."""
    count = min(2, len(plan.buckets))
    return [
        torch.empty(plan.max_bucket_bytes, dtype=torch.uint8, device=device) for _ in range(count)
    ]
