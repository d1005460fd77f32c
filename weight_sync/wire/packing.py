"""Pure packing: tensors -> uint8 buckets on the sender, buckets -> named tensors on the receiver.

Everything travels as bytes, so any dtype crosses any backend (Gloo refuses bf16 and fp8 as
element types, but not uint8), and what arrives is bit-for-bit what was sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weight_sync.wire.metadata import BucketMeta, Segment, SyncPlan, TensorMeta
from weight_sync.wire.planner import align_up

NamedTensors = list[tuple[str, torch.Tensor]]


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy)."""
    assert tensor.is_contiguous(), "byte_view needs a contiguous tensor"
    return tensor.reshape(-1).view(torch.uint8)


def typed_view(data: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """View ``meta.nbytes`` uint8 bytes as the tensor ``meta`` describes (no copy)."""
    return data.view(meta.torch_dtype).view(meta.shape)


def copy_all(
    destinations: list[torch.Tensor], sources: list[torch.Tensor], non_blocking: bool = False
) -> None:
    """Pairwise byte copies in one call: with thousands of small tensors per bucket, a Python
    loop of ``copy_`` costs more than the copying (3x on a 2-core CPU; one kernel on CUDA).
    ``non_blocking``: copies between a GPU and pinned host memory are queued on the current
    stream instead of each waiting for the GPU (aten/src/ATen/native/cuda/Copy.cu,
    ``copy_kernel_cuda``: ``cudaMemcpyAsync`` when non_blocking, else ``memcpy_and_sync``); the
    caller synchronises once before the host reads or reuses the memory."""
    if destinations:
        torch._foreach_copy_(destinations, sources, non_blocking=non_blocking)


# Dtypes that ``copy_`` (and so one batched copy) moves between typed views, casts included;
# the rest (fp8, fp4, unsigned, complex32) are copied as bytes, one segment at a time.
_BATCHED = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)


@dataclass
class _Fill:
    """How a packed bucket is filled: the segments that hold a whole tensor of a batched dtype
    (their tensors' indices and typed views of the bucket where they go), packed with one
    batched copy that also casts, gathers strided tensors and moves across devices; ``rest``,
    the other segments; and ``gaps``, views of the bytes between segments (alignment padding).

    The gaps are zeroed on every pack: a staging buffer is reused by buckets of other layouts,
    so a gap would otherwise carry whatever an earlier bucket left there -- the user's weights
    -- onto the wire and into the checksums. Zeroed, a bucket's bytes are a function of the
    pushed tensors alone."""

    sources: list[int]
    targets: list[torch.Tensor]
    rest: list[Segment]
    gaps: list[torch.Tensor]

    @classmethod
    def of(cls, plan: SyncPlan, bucket_index: int, out: torch.Tensor) -> _Fill:
        fill = cls([], [], [], [])
        bucket = plan.buckets[bucket_index]
        for seg in bucket.segments:
            meta = plan.tensors[seg.tensor]
            if seg.nbytes == meta.nbytes and meta.torch_dtype in _BATCHED:
                fill.sources.append(seg.tensor)
                fill.targets.append(
                    typed_view(out[seg.bucket_offset : seg.bucket_offset + seg.nbytes], meta)
                )
            else:
                fill.rest.append(seg)
        fill.gaps = [out[start:end] for start, end in gaps(bucket)]
        return fill


def gaps(bucket: BucketMeta) -> list[tuple[int, int]]:
    """The byte ranges ``[start, end)`` of a bucket that no segment covers (pure)."""
    found: list[tuple[int, int]] = []
    end = 0
    for seg in sorted(bucket.segments, key=lambda seg: seg.bucket_offset):
        if seg.bucket_offset > end:
            found.append((end, seg.bucket_offset))
        end = max(end, seg.bucket_offset + seg.nbytes)
    if bucket.nbytes > end:
        found.append((end, bucket.nbytes))
    return found


class Staging:
    """A plan's staging buffers (see ``bucket_buffers``) and what ``Packer`` works out per
    bucket to fill them: made once per plan and kept by the sender across pushes, so a push of
    thousands of tensors packs each bucket with one batched copy and no work per tensor.

    ``pinned``: host buffers in page-locked memory, for GPU tensors sent over a host transport
    (Gloo): their bytes then cross with asynchronous copies, one synchronisation per bucket,
    instead of one synchronous pageable copy per tensor."""

    def __init__(self, plan: SyncPlan, device: torch.device, pinned: bool = False) -> None:
        self.plan = plan
        self.pinned = pinned
        self.buffers = bucket_buffers(plan, device, pinned)
        self._fills: dict[tuple[int, int], _Fill] = {}

    def fill(self, bucket_index: int, out: torch.Tensor) -> _Fill:
        key = (bucket_index, out.data_ptr())
        if key not in self._fills:
            self._fills[key] = _Fill.of(self.plan, bucket_index, out)
        return self._fills[key]


class Packer:
    """Fills staging buffers from the sender's tensors, one packed bucket at a time.

    A tensor placed whole goes into its bucket with a single ``copy_`` that also handles
    non-contiguous layouts, device transfers and casts (where the plan's dtype differs from the
    tensor's). A tensor split across buckets is read piece by piece, so a non-contiguous one is
    made contiguous once and kept only until its last piece is packed.
    """

    def __init__(
        self, plan: SyncPlan, tensors: Sequence[torch.Tensor], staging: Staging | None = None
    ) -> None:
        assert len(plan.tensors) == len(tensors)
        assert staging is None or staging.plan is plan
        self._plan = plan
        self._tensors = tensors
        self._staging = staging
        self._split_source: tuple[int, torch.Tensor] | None = None
        # Into pinned host memory, copies from a GPU are queued, not waited for (see copy_all).
        self._non_blocking = staging is not None and staging.pinned

    def pack(self, bucket_index: int, out: torch.Tensor) -> torch.Tensor:
        """Pack bucket ``bucket_index`` into ``out``; returns the filled prefix of ``out``.

        The alignment padding between tensors is zeroed (see ``_Fill``).
        """
        bucket = self._plan.buckets[bucket_index]
        assert not bucket.direct, "direct buckets are sent from the tensor itself"
        if self._staging is not None:
            fill = self._staging.fill(bucket_index, out)
        else:
            fill = _Fill.of(self._plan, bucket_index, out)
        if fill.gaps:  # one call, on the current stream for a GPU buffer
            torch._foreach_zero_(fill.gaps)
        non_blocking = self._non_blocking
        if fill.sources:
            tensors = self._tensors
            copy_all(fill.targets, [tensors[index] for index in fill.sources], non_blocking)
        for seg in fill.rest:
            meta = self._plan.tensors[seg.tensor]
            dest = out[seg.bucket_offset : seg.bucket_offset + seg.nbytes]
            source = self._tensors[seg.tensor]
            if (
                seg.nbytes == meta.nbytes
                and source.dtype == meta.torch_dtype
                and source.is_contiguous()
                and source.device == out.device
            ):
                dest.copy_(byte_view(source))  # a dtype copy_ may not know: its bytes
            elif seg.nbytes == meta.nbytes:  # strided, elsewhere or cast: copy_ does all three
                typed_view(dest, meta).copy_(source, non_blocking=non_blocking)
            elif source.dtype != meta.torch_dtype:  # a piece of a cast tensor: cast that piece
                first = seg.tensor_offset // meta.itemsize
                piece = self._contiguous(seg.tensor).reshape(-1)[
                    first : first + seg.nbytes // meta.itemsize
                ]
                dest.view(meta.torch_dtype).copy_(piece, non_blocking=non_blocking)
                if seg.tensor_offset + seg.nbytes == meta.nbytes:
                    self._split_source = None
            else:
                source = byte_view(self._contiguous(seg.tensor))
                dest.copy_(
                    source[seg.tensor_offset : seg.tensor_offset + seg.nbytes],
                    non_blocking=non_blocking,
                )
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


def can_land_in(destination: torch.Tensor, meta: TensorMeta, device: torch.device) -> bool:
    """Whether received bytes for ``meta`` may be written straight into ``destination``."""
    return (
        destination.is_contiguous()
        and destination.dtype == meta.torch_dtype
        and tuple(destination.shape) == meta.shape
        and destination.device == device
    )


@dataclass
class _Landing:
    """A packed bucket whose every segment lands whole in a destination: the sizes that split
    its bytes into segments and the gaps between them, which parts are segments (None: all, for
    want of gaps), each segment's byte range in its destination -- and, once seen, the segments'
    views into the buffer the bucket arrives in (by its address: the same every push once the
    buffers are kept), so that a push of thousands of tensors unpacks with one batched copy."""

    sizes: list[int]
    pieces: list[int] | None
    targets: list[torch.Tensor]
    sources: tuple[int, list[torch.Tensor]] | None = None

    def land(self, data: torch.Tensor) -> None:
        if self.sources is None or self.sources[0] != data.data_ptr():
            parts = torch.split(data, self.sizes)
            chosen = list(parts) if self.pieces is None else [parts[i] for i in self.pieces]
            self.sources = (data.data_ptr(), chosen)
        copy_all(self.targets, self.sources[1])


class Unpacker:
    """Turns received bytes back into named tensors.

    Tensors whose entry in ``destinations`` (name -> tensor) passes ``can_land_in`` are written
    there in place and never handed back. Every other tensor is returned for ``load_weights``:
    a whole one as a view into the receive buffer (valid until that buffer is reused), a split
    one reassembled in a temporary once its last piece arrives. A tied name is handed back (or
    copied into its own destination) with its tensor, once that tensor is complete -- unless
    its destination is the very tensor that was just written, as in a model whose weights are
    tied the same way.

    ``owned``: hand back only tensors that no later bucket will overwrite, for a consumer that
    keeps them (vLLM's layerwise reload holds a layer's tensors until the layer is complete). A
    packed bucket is then copied once, as a whole, and its tensors are views into the copy;
    direct buckets and reassembled tensors are fresh memory already. ``only``: the indices of
    the tensors wanted; the others are passed over (nothing is written or reassembled for them).
    """

    def __init__(
        self,
        plan: SyncPlan,
        destinations: Mapping[str, torch.Tensor] | None,
        device: torch.device,
        owned: bool = False,
        only: set[int] | None = None,
    ) -> None:
        self._plan = plan
        self._owned = owned
        self._only = only
        destinations = destinations or {}
        self._destinations = {
            index: destinations[meta.name]
            for index, meta in enumerate(plan.tensors)
            if meta.name in destinations and can_land_in(destinations[meta.name], meta, device)
        }
        self._tied: dict[int, list[tuple[str, torch.Tensor | None]]] = {}
        for tie in plan.tied:
            meta = plan.tensors[tie.tensor]
            target = destinations.get(tie.name)
            if target is not None and not can_land_in(target, meta, device):
                target = None
            self._tied.setdefault(tie.tensor, []).append((tie.name, target))
        self._partial: dict[int, torch.Tensor] = {}
        self._empty = [index for index, meta in enumerate(plan.tensors) if meta.nbytes == 0]
        # Worked out once per bucket; an unpacker is reused across pushes of one plan into the
        # same tensors (see Receiver), and keeps its receive buffers (``buffers``) meanwhile.
        self._landings: dict[int, _Landing | None] = {}
        self._device = device
        self._buffers: list[torch.Tensor] | None = None

    def buffers(self) -> list[torch.Tensor]:
        """This plan's receive buffers (see ``bucket_buffers``), made on first use and kept."""
        if self._buffers is None:
            self._buffers = bucket_buffers(self._plan, self._device)
        return self._buffers

    def empty_tensors(self, device: torch.device) -> NamedTensors:
        """Tensors with no bytes: they need no transfer, only their shape and dtype."""
        done: NamedTensors = []
        for index in self._empty:
            meta = self._plan.tensors[index]
            empty = self._destinations.get(index)
            if empty is None:
                empty = torch.empty(meta.shape, dtype=meta.torch_dtype, device=device)
                done.append((meta.name, empty))
            done.extend(self._ties_of(index, empty))
        return done

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
        landing = self._landing(bucket_index)
        if landing is not None:
            landing.land(data)
            return []
        if self._owned and not bucket.direct:
            data = data.clone()
        done: NamedTensors = []
        batch: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        completed: list[tuple[int, torch.Tensor]] = []  # tensors with ties, once whole
        for seg in bucket.segments:
            if self._only is not None and seg.tensor not in self._only:
                continue
            meta = self._plan.tensors[seg.tensor]
            piece = data[seg.bucket_offset : seg.bucket_offset + seg.nbytes]
            destination = self._destinations.get(seg.tensor)
            last = seg.tensor_offset + seg.nbytes == meta.nbytes
            if destination is not None:
                if piece.data_ptr() != destination.data_ptr() + seg.tensor_offset:  # not landed
                    batch[0].append(
                        byte_view(destination)[seg.tensor_offset : seg.tensor_offset + seg.nbytes]
                    )
                    batch[1].append(piece)
                whole = destination
            elif seg.nbytes == meta.nbytes:
                whole = typed_view(piece, meta)
                done.append((meta.name, whole))
            else:
                buffer = self._partial.get(seg.tensor)
                if buffer is None:
                    buffer = torch.empty(meta.nbytes, dtype=torch.uint8, device=data.device)
                    self._partial[seg.tensor] = buffer
                buffer[seg.tensor_offset : seg.tensor_offset + seg.nbytes].copy_(piece)
                if not last:
                    continue
                whole = typed_view(self._partial.pop(seg.tensor), meta)
                done.append((meta.name, whole))
            if last and seg.tensor in self._tied:
                completed.append((seg.tensor, whole))
        copy_all(*batch)
        for index, whole in completed:
            done.extend(self._ties_of(index, whole))
        return done

    def _landing(self, bucket_index: int) -> _Landing | None:
        if bucket_index not in self._landings:
            self._landings[bucket_index] = self._plan_landing(bucket_index)
        return self._landings[bucket_index]

    def _plan_landing(self, bucket_index: int) -> _Landing | None:
        """How bucket ``bucket_index`` lands when each of its segments goes whole into a
        destination: the sizes that split its bytes into segments and the gaps between them,
        which of the parts are segments (None: all, there being no gaps), and each segment's
        byte range in its destination."""
        bucket = self._plan.buckets[bucket_index]
        if bucket.direct or self._only is not None:
            return None
        sizes: list[int] = []
        pieces: list[int] = []
        targets: list[torch.Tensor] = []
        end = 0
        for seg in bucket.segments:
            destination = self._destinations.get(seg.tensor)
            if destination is None or seg.tensor in self._tied:
                return None
            if seg.bucket_offset > end:
                sizes.append(seg.bucket_offset - end)
            pieces.append(len(sizes))
            sizes.append(seg.nbytes)
            targets.append(
                byte_view(destination)[seg.tensor_offset : seg.tensor_offset + seg.nbytes]
            )
            end = seg.bucket_offset + seg.nbytes
        if bucket.nbytes > end:
            sizes.append(bucket.nbytes - end)
        return _Landing(sizes, pieces if len(pieces) < len(sizes) else None, targets)

    def _ties_of(self, index: int, whole: torch.Tensor) -> NamedTensors:
        """The names tied to tensor ``index``, now that it is complete as ``whole``: copied into
        their own destinations (unless that is ``whole`` itself), else handed back."""
        handed: NamedTensors = []
        for name, target in self._tied.get(index, ()):
            if target is None:
                handed.append((name, whole))
            elif target.data_ptr() != whole.data_ptr():
                target.copy_(whole)
        return handed


def read_values(values: Sequence[torch.Tensor | Any]) -> list[Any]:
    """Values queued on devices (one-element tensors) read on the host in one go -- one copy
    per device, in the order given -- with any plain value passed through: how a push reads
    what it computed along the way (checksums, finiteness) at its one synchronisation."""
    pending: dict[torch.device, list[int]] = {}
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            pending.setdefault(value.device, []).append(index)
    out = list(values)
    for indices in pending.values():
        read = torch.cat([values[index].reshape(1) for index in indices]).tolist()
        for index, value in zip(indices, read, strict=True):
            out[index] = value
    return out


def bucket_buffers(
    plan: SyncPlan, device: torch.device, pinned: bool = False
) -> list[torch.Tensor]:
    """Two reusable staging buffers (one if the plan has one packed bucket, none if it has
    none): one in flight, one being packed or applied. With direct buckets landing in place,
    this is all the extra memory a push takes, on either side. ``pinned``: in page-locked host
    memory (``device`` must then be the CPU)."""
    count = min(2, plan.packed_buckets)
    return [
        torch.empty(plan.max_packed_bytes, dtype=torch.uint8, device=device, pin_memory=pinned)
        for _ in range(count)
    ]


def pinned_chunks(sizes: Sequence[int], alignment: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Where a staging area in pinned host memory puts buffers of ``sizes`` bytes: the chunks to
    allocate, and each buffer's (chunk, offset), offsets on ``alignment``.

    PyTorch's pinned allocator rounds every allocation up to a power of two
    (aten/src/ATen/core/CachingHostAllocator.h, ``CachingHostAllocatorImpl::allocate``): one
    area the size of a model could take twice that. So the area is cut into chunks whose sizes
    are powers of two already -- all of one size, the smallest power of two that holds the
    largest buffer, filled first-fit with the largest buffers first -- and the last, partly
    filled chunk is only as large as the power of two its contents need. What rounding leaves
    unused is then at most about one chunk (at most twice the largest buffer), not the model.
    """
    if not sizes:
        return [], []
    padded = [align_up(max(size, 1), alignment) for size in sizes]
    chunk = 1 << (max(padded) - 1).bit_length()
    used: list[int] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: -padded[i]):
        slot = next((c for c, fill in enumerate(used) if fill + padded[index] <= chunk), None)
        if slot is None:
            slot = len(used)
            used.append(0)
        where[index] = (slot, used[slot])
        used[slot] += padded[index]
    chunks = [chunk] * len(used)
    chunks[-1] = 1 << (used[-1] - 1).bit_length()
    return chunks, where


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
