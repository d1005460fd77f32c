"""The CUDA ring: members on the trainer's own GPU read the trainer's bucket memory directly.

The colocated deployment (an inference engine on the trainer's GPU, as OpenRLHF, verl and slime
default to) cannot use NCCL: two ranks on one device fail with "Duplicate GPU detected". Here the
ring's slots are CUDA memory on the trainer's GPU, allocated once per group and shared with each
reader once, at join, by IPC handle; a push then moves each chunk device-to-device twice (into a
slot, out of it) and never through the host.

Ordering is by one interprocess CUDA event per slot: the trainer queues its copy into the slot on
its current stream, records the slot's event behind it and sends ``READY`` -- no host sync; the
reader's private stream waits on that event, copies the chunk out, and the reader sends ``DONE``
once its copy has finished. Handshake, flow control, votes, timeouts and error messages are the
host ring's (``transport.ring``). A reader that cannot open the handle -- a container without a
shared IPC namespace, another GPU, an allocator whose handles it cannot import -- says so in the
handshake, and ``CudaIpcWriter.accept`` raises ``IpcUnavailableError`` naming it, so that the
caller can send those members over the host ring instead.

What it holds:

* **On the trainer's GPU**: the ring, ``SLOTS x slot_bytes`` (one bucket), from the caching
  allocator, for as long as the writer is open; one interprocess event per slot. The readers map
  that memory (``cudaIpcOpenMemHandle``) and allocate none of their own for it.
* **torch's ref-counter file**: ``UntypedStorage._share_cuda_`` (torch/csrc/StorageSharing.cpp
  ``THPStorage_shareCuda``) puts the shared storage behind a counter in a shared-memory file
  ``/dev/shm/torch_<pid>_<random>`` (torch/csrc/CudaIPCTypes.cpp ``GetNewRefCountedSentData``;
  80 KB, one per process) and, when the storage is freed while its counter is above zero, keeps
  the GPU memory in a limbo until a consumer decrements it (``CudaIPCSentDataDelete``). The
  counter protects a producer that lets go of memory a consumer may still read. Our readers
  read a slot only between READY and DONE, and the writer frees the ring only when it closes,
  after hanging up; the counter would only add a way to leak the ring (a reader killed before
  releasing it would keep the whole ring in limbo for the trainer's lifetime). So the writer
  releases its own count at once, the readers are never handed it, and ``close`` calls
  ``torch.cuda.ipc_collect()``, which removes the file once nothing else shared by the process
  is outstanding. A trainer killed by SIGKILL leaves that file behind, as any torch CUDA
  sharing does.

Nothing here has run on a GPU yet: it is written from PyTorch's source (cited where relied on);
``tests/gpu/test_colocated.py`` checks it on a one-GPU machine.
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass

import torch

from weight_sync.errors import SyncTimeoutError, TransportError
from weight_sync.transport.devices import gpu_uuid
from weight_sync.transport.ring import (
    SLOTS,
    DeviceCopies,
    Link,
    RingReader,
    RingUnavailableError,
    RingWriter,
)
from weight_sync.wire.metadata import GroupSpec

__all__ = ["CudaIpcReader", "CudaIpcWriter", "IpcOffer", "IpcUnavailableError", "socket_name"]

logger = logging.getLogger(__name__)

_KIND = "CUDA IPC"
_MAGIC = b"WSCI"
_VERSION = 1
# magic, version, slot bytes, the trainer's device index, storage bytes, storage offset in its
# allocation, number of byte strings that follow (GPU UUID, memory handle, one event per slot).
_HEAD = struct.Struct("!4sHQhQQH")
_LENGTH = struct.Struct("!I")  # the offer's size, ahead of it
_FIELD = struct.Struct("!H")  # one byte string's size, ahead of it
_MAX_OFFER = 1 << 16


# Rings a closing reader could not unmap: a copy out of them was still queued behind a trainer
# that died or froze, and may run some day. Kept for the process's life, on purpose: an
# unmapped source would make that copy fault in the engine's CUDA context.
_STRANDED: list[object] = []


class IpcUnavailableError(RingUnavailableError):
    """CUDA IPC cannot serve these members (``ranks``; empty when the trainer's side failed):
    send them over the host ring."""


def socket_name(group_id: str) -> str:
    """The CUDA ring's socket: distinct from the host ring's, as one push may use both."""
    return f"weight_sync-ipc-{group_id}"


@dataclass(frozen=True)
class IpcOffer:
    """What a reader needs to map the ring, as the writer sends it: the trainer's GPU, the
    slots' size, the fields of ``_share_cuda_`` the reader uses, and each slot's event handle.

    Serialised field by field (no pickle: a reader must not run code a peer sends). Of
    ``_share_cuda_``'s eight fields the reader takes the memory handle (opaque bytes from
    ``CUDACachingAllocator::shareIpcHandle``: a version, a type, the handle), the storage's size
    and its offset in the allocation; the ref counter stays with the writer (see the module
    docstring) and the sharing event is not needed: the ring holds nothing yet, and every chunk
    is ordered by its slot's event.
    """

    gpu: str  # the trainer GPU's UUID
    slot_bytes: int
    device: int  # the trainer's index of that GPU (for messages; the reader opens on its own)
    handle: bytes
    size_bytes: int
    offset_bytes: int
    events: tuple[bytes, ...]  # ``torch.cuda.Event.ipc_handle()`` of each slot's event

    def pack(self) -> bytes:
        fields = [self.gpu.encode(), self.handle, *self.events]
        body = _HEAD.pack(
            _MAGIC,
            _VERSION,
            self.slot_bytes,
            self.device,
            self.size_bytes,
            self.offset_bytes,
            len(fields),
        )
        body += b"".join(_FIELD.pack(len(field)) + field for field in fields)
        return _LENGTH.pack(len(body)) + body

    @classmethod
    def unpack(cls, body: bytes) -> IpcOffer:
        """The offer in ``body`` (without its length prefix). Raises ``TransportError`` for
        anything but a well-formed offer of ``SLOTS`` slots."""
        try:
            head = _HEAD.unpack_from(body)
        except struct.error:
            raise _malformed(f"{len(body)} bytes is too short") from None
        magic, version, slot_bytes, device, size_bytes, offset_bytes, count = head
        if magic != _MAGIC or version != _VERSION:
            raise _malformed(f"magic {magic!r} version {version}, expected {_MAGIC!r} {_VERSION}")
        fields, at = [], _HEAD.size
        for _ in range(count):
            if at + _FIELD.size > len(body):
                raise _malformed("it ends inside a field")
            (size,) = _FIELD.unpack_from(body, at)
            at += _FIELD.size
            if at + size > len(body):
                raise _malformed("it ends inside a field")
            fields.append(body[at : at + size])
            at += size
        if at != len(body):
            raise _malformed(f"{len(body) - at} bytes follow its last field")
        if count != 2 + SLOTS:
            raise _malformed(f"{count - 2} slot events, expected {SLOTS}")
        if slot_bytes == 0 or size_bytes < slot_bytes * SLOTS:
            raise _malformed(
                f"a {size_bytes}-byte storage cannot hold {SLOTS} slots of {slot_bytes}"
            )
        gpu, handle, *events = fields
        return cls(
            gpu.decode(errors="replace"),
            slot_bytes,
            device,
            handle,
            size_bytes,
            offset_bytes,
            tuple(events),
        )


def _malformed(why: str) -> TransportError:
    return TransportError(
        f"malformed CUDA IPC ring offer from the trainer ({why}); check that the trainer and "
        "this worker run the same weight_sync version"
    )


def _cuda_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda" or device.index is None:
        raise ValueError(
            f"the CUDA ring needs a CUDA device with its index (e.g. cuda:0), got {device}: an "
            "unindexed 'cuda' means the calling thread's current device, which may be another GPU"
        )
    if not torch.cuda.is_available():
        raise ValueError(f"the CUDA ring was asked for {device}, but CUDA is not available here")
    return device


class CudaIpcWriter(RingWriter):
    """The trainer's end (rank 0): each broadcast is copied once into slots on its GPU.
    Implements ``Transport`` for the members on that GPU."""

    kind = _KIND
    unavailable = IpcUnavailableError

    def __init__(
        self,
        group_id: str,
        readers: int,
        slot_bytes: int,
        collective_timeout_s: float,
        device: torch.device | str,
    ) -> None:
        """Allocates and shares the ring on ``device`` (the trainer's GPU, where the buffers
        handed to ``broadcast`` live) and listens; ``accept`` then takes the readers in.

        Raises ``ValueError`` for a device that is not an indexed CUDA device, and
        ``IpcUnavailableError`` where the ring cannot be allocated or shared.
        """
        self._device = _cuda_device(device)
        size = slot_bytes * SLOTS
        try:
            ring = torch.empty(size, dtype=torch.uint8, device=self._device)
        except torch.OutOfMemoryError as exc:
            raise IpcUnavailableError(
                f"cannot allocate {size / 2**20:.1f} MiB on {self._device} for the CUDA ring "
                f"({SLOTS} slots of a quarter bucket): {exc}; lower bucket_bytes"
            ) from exc
        self._ring: torch.Tensor | None = ring
        self._slots = list(ring.split(slot_bytes))
        # The stream the ring was allocated on, and those its slots were written on.
        self._home = torch.cuda.current_stream(self._device)
        self._streams: set[torch.cuda.Stream] = set()
        try:
            offer = self._share(slot_bytes)
        except RuntimeError as exc:
            self._ring, self._slots = None, []
            raise IpcUnavailableError(
                f"cannot share the CUDA ring on {self._device}: {exc}"
            ) from exc
        self._offered = offer.pack()
        try:
            name = socket_name(group_id)
            super().__init__(name, readers, slot_bytes, collective_timeout_s, group_id)
        except BaseException:
            self._release()
            raise

    def _share(self, slot_bytes: int) -> IpcOffer:
        """Make the slots' events and export the ring (torch/multiprocessing/reductions.py
        ``reduce_tensor`` does the same for a CUDA tensor it pickles)."""
        assert self._ring is not None
        # Interprocess events cannot time (cudaEventInterprocess needs cudaEventDisableTiming);
        # torch.cuda.Event creates the event at ipc_handle() on the current device, hence the
        # guard (torch/cuda/streams.py Event.ipc_handle).
        self._events = [torch.cuda.Event(interprocess=True) for _ in range(SLOTS)]
        with torch.cuda.device(self._device):
            events = tuple(bytes(event.ipc_handle()) for event in self._events)
        storage = self._ring.untyped_storage()
        # (device, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset,
        #  event_handle, event_sync_required): torch/csrc/StorageSharing.cpp THPStorage_shareCuda.
        shared = storage._share_cuda_()
        device, handle, size_bytes, offset_bytes, counter, counter_offset, _, _ = shared
        # Our own count, released at once (see the module docstring): the ring is freed when
        # the writer drops it, never kept in torch's limbo for a reader that may never return
        # it. StorageSharing.cpp THPStorage_releaseIPCCounter decrements exactly that counter.
        torch.UntypedStorage._release_ipc_counter_cuda(counter, counter_offset)
        gpu = gpu_uuid(self._device)
        assert gpu is not None  # a CUDA device
        return IpcOffer(gpu, slot_bytes, device, bytes(handle), size_bytes, offset_bytes, events)

    @property
    def device(self) -> torch.device:
        return self._device

    def takes(self, device: torch.device) -> bool:
        """Whether ``broadcast`` takes buffers on ``device`` (see ``Fanout``): only the ring's."""
        return device == self._device

    def _offer(self, link: Link) -> None:
        link.send(self._offered)

    def _fill(self, slot: int, chunk: torch.Tensor, deadline: float) -> None:
        if chunk.device != self._device:
            raise TransportError(
                f"the CUDA ring on {self._device} was handed a buffer on {chunk.device}; stage "
                "the push on the ring's device"
            )
        # Queued on the stream the buffer was packed on; the event behind it is what the
        # readers wait on. No host sync: the trainer learns the slot is free from DONE.
        stream = torch.cuda.current_stream(self._device)
        self._streams.add(stream)
        self._slots[slot][: chunk.numel()].copy_(chunk, non_blocking=True)
        self._events[slot].record(stream)

    def _sent(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _release(self) -> None:
        # Freed, the ring goes back to the caching allocator for work on the stream it was
        # allocated on: that stream first waits for copies still queued on any other (a
        # shared storage's DataPtr is no longer the allocator's, so record_stream would be a
        # no-op: c10/cuda/CUDACachingAllocator.cpp recordStream). A reader with a copy still in
        # flight (a push that failed) can only read stale bytes into a push that is failing
        # anyway: readers never write to the ring.
        for stream in self._streams - {self._home}:
            self._home.wait_stream(stream)
        self._streams = set()
        self._ring, self._slots, self._events = None, [], []
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # drops torch's ref-counter file once nothing is shared


class CudaIpcReader(RingReader):
    """A worker's end on the trainer's GPU: copies each broadcast out of the trainer's slots.
    Implements ``Transport``."""

    kind = _KIND
    unavailable = IpcUnavailableError

    def __init__(
        self,
        spec: GroupSpec,
        link: Link,
        ring: torch.Tensor,
        slot_bytes: int,
        events: list[torch.cuda.Event],
        device: torch.device,
    ) -> None:
        super().__init__(spec, link, slot_bytes, device)
        self._ring: torch.Tensor | None = ring
        self._slots = list(ring.split(slot_bytes))
        self._events = events
        self._copies = DeviceCopies(device)

    @classmethod
    def join(cls, spec: GroupSpec, device: torch.device | str) -> CudaIpcReader:
        """Connect to the trainer's CUDA ring (``spec.transport == 'cuda_ipc'``) and open it on
        ``device``, where the buffers handed to ``broadcast`` live.

        Raises ``ValueError`` for a device that is not an indexed CUDA device;
        ``IpcUnavailableError`` (after telling the trainer) where the ring cannot be opened
        here; ``TransportError`` or ``SyncTimeoutError`` if the trainer cannot be reached.
        """
        assert spec.transport == "cuda_ipc"
        device = _cuda_device(device)
        link = cls._connect(spec)
        try:
            deadline = time.monotonic() + spec.rendezvous_timeout_s
            (size,) = _LENGTH.unpack(link.recv(_LENGTH.size, deadline))
            if size > _MAX_OFFER:
                raise _malformed(f"{size} bytes announced")
            offer = IpcOffer.unpack(link.recv(size, deadline))
        except (TransportError, SyncTimeoutError):
            link.close()
            raise
        try:
            ring, events = _open(offer, device)
        except _Refused as refused:
            raise cls._refuse(spec, link, str(refused)) from refused.__cause__
        except BaseException:
            link.close()
            raise
        try:
            cls._joined(spec, link)
        except BaseException:
            link.close()
            raise
        return cls(spec, link, ring, offer.slot_bytes, events, device)

    def _drain(self, slot: int, out: torch.Tensor, deadline: float) -> torch.cuda.Event:
        # Queued behind the trainer's copy into the slot; said DONE once found finished.
        return self._copies.queue(out, self._slots[slot][: out.numel()], slot, self._events[slot])

    def _abandon(self, out: torch.Tensor) -> None:
        self._copies.abandon(out)

    def _unmap(self) -> None:
        # The storage's deleter (StorageSharing.cpp THPStorage_newSharedCuda) closes the IPC
        # mapping once no view is left, then syncs this device's current stream -- not the
        # private one the copies out ran on: ``close`` saw every one of them finish first.
        self._ring, self._slots, self._events = None, [], []

    def _strand(self) -> None:
        logger.warning(
            "closing a CUDA ring reader with copies out of the trainer's slots still queued "
            "(the trainer died or its GPU is stuck): its %.0f MiB mapping is kept until this "
            "process exits",
            SLOTS * self._slot_bytes / 2**20,
        )
        _STRANDED.append((self._ring, self._events, self._copies))
        self._ring, self._slots, self._events = None, [], []


class _Refused(Exception):
    """Why this reader cannot open the ring (said to the trainer, then raised as
    ``IpcUnavailableError``)."""


def _open(offer: IpcOffer, device: torch.device) -> tuple[torch.Tensor, list[torch.cuda.Event]]:
    """Map the trainer's ring and its slots' events on ``device``."""
    # Matched by UUID and opened on this process's own index of the GPU, as vLLM's IPC weight
    # transfer does (vllm/distributed/weight_transfer/ipc_engine.py receive_weights): indices
    # differ between processes under CUDA_VISIBLE_DEVICES.
    here = gpu_uuid(device)
    if here != offer.gpu:
        raise _Refused(
            f"the trainer's ring is on GPU {offer.gpu} (its cuda:{offer.device}); this worker "
            f"receives on {device}, GPU {here}: the CUDA ring serves the trainer's own GPU only"
        )
    try:
        torch.cuda._lazy_init()  # as torch/multiprocessing/reductions.py rebuild_cuda_tensor does
        # THPStorage_newSharedCuda (torch/csrc/StorageSharing.cpp) takes eight fields: the
        # device to open on (ours: the same GPU may have another index here), the handle, the
        # storage's size and offset, then the ref counter's file and offset -- none here, so
        # its deleter's decrement finds no file, which it tolerates ("resource deletion is best
        # effort basis") -- and the sharing event, not needed (see IpcOffer).
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index,
            offer.handle,
            offer.size_bytes,
            offer.offset_bytes,
            b"",
            0,
            bytes(64),
            False,
        )
        size = offer.slot_bytes * SLOTS
        # torch/_utils.py _rebuild_tensor: a tensor over a storage that is not its own.
        ring = torch.empty((0,), dtype=torch.uint8, device=device).set_(storage, 0, (size,), (1,))
        events = [torch.cuda.Event.from_ipc_handle(device, handle) for handle in offer.events]
    except RuntimeError as exc:
        raise _Refused(
            f"cudaIpcOpenMemHandle/cudaIpcOpenEventHandle failed on {device}: {exc}. CUDA IPC "
            "needs both processes in one IPC namespace (containers: --ipc=host or a shared pod), "
            "the trainer's GPU visible here, and an allocator whose handles this torch can open "
            "(PYTORCH_CUDA_ALLOC_CONF expandable_segments needs pidfd access to the trainer)"
        ) from exc
    return ring, events
