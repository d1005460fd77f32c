"""Shared memory for the workers on the trainer's host: one write by the trainer, one read each.

Over loopback Gloo moves every byte through the kernel's TCP stack on each hop of its tree (a copy
into the kernel and one out, per hop, ceil(log2(N+1)) hops). Here the trainer copies each chunk
once into a small ring of slots that every local worker maps, and each worker copies it once out
-- for a tensor on the direct path, straight into that tensor. That is the memory-bandwidth floor
of a broadcast on one host: one write and N reads.

The ring is a memfd: anonymous shared memory with no name, handed to each worker as a file
descriptor over a Unix socket in the abstract namespace, which has no file either. Nothing is ever
created in ``/dev/shm``, so nothing can be left there by a process killed at any moment: the
memory goes when the last process that maps it does. Room is claimed up front
(``posix_fallocate``), so a host without it fails at group formation, naming the size, instead of
crashing a worker with SIGBUS mid-push.

The same sockets carry the flow control -- ``READY(seq, nbytes)`` from the trainer once a chunk is
in its slot, ``DONE(seq)`` from each worker once it has copied it out; a slot is reused only when
every worker is done with it -- and the liveness of both ends: a dead peer is an EOF at once, a
frozen one the collective timeout. The trainer's copy of chunk k+1 overlaps the workers' copies of
chunk k. That protocol is shared with the CUDA ring and lives in ``transport.ring``.

With CUDA weights (a ring beside an NCCL group, or the fallback where CUDA IPC is refused) the
writer copies device-to-host into the slots and each reader host-to-device out of them. The
mapping is then registered with CUDA (``cudaHostRegister``) in each process, so those copies are
DMA from pinned memory rather than staged through a pageable bounce buffer; it is unregistered
before it is unmapped. On the CPU nothing of that happens.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import sys
import threading
from pathlib import Path

import torch

from weight_sync.errors import SyncTimeoutError, TransportError
from weight_sync.transport.ring import (
    SLOTS,
    DeviceCopies,
    Link,
    RingReader,
    RingUnavailableError,
    RingWriter,
    copies_on,
    slot_bytes_for,
)
from weight_sync.wire.metadata import GroupSpec

__all__ = [
    "SLOTS",
    "ShmReader",
    "ShmUnavailableError",
    "ShmWriter",
    "available",
    "host_key",
    "slot_bytes_for",
    "socket_name",
]

logger = logging.getLogger(__name__)

_RING = struct.Struct("!QI")  # slot bytes, slots: sent with the memfd
_KIND = "shared-memory"
_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class ShmUnavailableError(RingUnavailableError):
    """This host cannot give the ring its memory (or has no memfd), or a reader could not map
    it: use the group instead."""


def available() -> bool:
    """Whether this platform has what the ring needs (Linux: memfd and fd passing)."""
    return sys.platform == "linux" and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


def host_key() -> str | None:
    """Processes with equal keys can share a ring: one running kernel (its boot id) and one
    network namespace (abstract Unix sockets are per namespace). None where there is no ring."""
    if not available():
        return None
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/net')}"
    except OSError:
        return None


def socket_name(group_id: str) -> str:
    return f"weight_sync-{group_id}"


def _checked_device(device: torch.device | str | None) -> torch.device:
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the host ring copies from and to CPU or CUDA buffers, not {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"the host ring was asked for buffers on {device}, but CUDA is not available"
        )
    return device


class _Ring:
    """A mapping of the ring and its slots as uint8 tensors; with ``pin``, registered with CUDA
    for as long as it is mapped.

    A slot is used only inside ``copy``, and ``close`` waits for that copy to end: the tensors
    over the mapping do not keep it alive (``torch.frombuffer`` holds no buffer export), so an
    end closed from another thread (a member leaving, a relay closing) while a copy runs would
    otherwise copy into unmapped memory and crash the process."""

    def __init__(self, fd: int, slot_bytes: int, slots: int, pin: bool) -> None:
        self.map = mmap.mmap(fd, slot_bytes * slots, mmap.MAP_SHARED)
        flat = torch.frombuffer(self.map, dtype=torch.uint8)
        self._slots = list(flat.split(slot_bytes))
        self.slot_bytes = slot_bytes
        self._lock = threading.Lock()
        self._pinned: int | None = None
        if pin:
            self._pin(flat.data_ptr(), flat.numel())

    def copy(
        self,
        index: int,
        tensor: torch.Tensor,
        into: bool,
        copies: DeviceCopies | None,
        deadline: float,
    ) -> DeviceCopies | None:
        """Copy ``tensor`` into slot ``index`` (``into``), or the slot's first bytes out into
        ``tensor``; done when it returns, by ``deadline`` for a GPU copy. Returns the device
        copies used (``copies``, or new ones for ``tensor``'s device)."""
        with self._lock:
            if not self._slots:
                raise TransportError("the shared-memory ring was closed (this end left)")
            memory = self._slots[index][: tensor.numel()]
            out, source = (memory, tensor) if into else (tensor, memory)
            if not tensor.is_cuda:
                out.copy_(source)
                return copies
            copies = copies_on(copies, tensor.device)
            way = f"from {tensor.device} into" if into else f"into {tensor.device} out of"
            copies.copy(out, source, deadline, f"the copy of a chunk {way} the shared-memory ring")
            return copies

    def _pin(self, address: int, size: int) -> None:
        # As torch pins shared-memory tensors for its own device copies (torch/cuda/
        # _pin_memory_utils.py pin_memory, used by torch/distributed/_state_dict_utils.py
        # _create_cpu_state_dict): cudaHostRegister on the mapping, flag Portable.
        cudart = torch.cuda.cudart()
        code = int(cudart.cudaHostRegister(address, size, _CUDA_HOST_REGISTER_PORTABLE))
        if code != 0:
            logger.warning(
                "cannot pin the %d-byte shared-memory ring for CUDA (cudaHostRegister error %d): "
                "its copies to and from the GPU go through pageable staging, more slowly",
                size,
                code,
            )
            return
        self._pinned = address

    def close(self) -> None:
        with self._lock:  # a copy in a slot ends first
            if not self._slots:
                return
            self._slots = []
            self._unmap()

    def _unmap(self) -> None:
        if self._pinned is not None:  # before unmapping: the driver holds the pages until then
            code = int(torch.cuda.cudart().cudaHostUnregister(self._pinned))
            if code != 0:
                logger.warning(
                    "cudaHostUnregister of the shared-memory ring failed (error %d)", code
                )
            self._pinned = None
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass


class ShmWriter(RingWriter):
    """The trainer's end (rank 0): writes each broadcast once into the ring. Implements
    ``Transport`` for the workers of its host."""

    kind = _KIND
    unavailable = ShmUnavailableError

    def __init__(
        self,
        group_id: str,
        readers: int,
        slot_bytes: int,
        collective_timeout_s: float,
        device: torch.device | str | None = None,
    ) -> None:
        """Claims the ring's memory and listens; ``accept`` then takes the readers in.

        ``device`` is where the buffers handed to ``broadcast`` live (default: the CPU). On a
        CUDA device the ring is pinned and chunks are copied device-to-host into it (CPU
        buffers are taken as well; see ``takes``).

        Raises ``ShmUnavailableError`` (naming the size) where the host cannot give the memory.
        """
        self._device = _checked_device(device)
        self._copies: DeviceCopies | None = None
        size = slot_bytes * SLOTS
        if not available():
            raise ShmUnavailableError("shared memory needs Linux (memfd_create and fd passing)")
        fd = os.memfd_create(socket_name(group_id), os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)
            self._ring = _Ring(fd, slot_bytes, SLOTS, pin=self._device.type == "cuda")
        except OSError as exc:
            os.close(fd)
            raise ShmUnavailableError(
                f"cannot claim {size / 2**20:.1f} MiB of shared memory for the ring "
                f"({SLOTS} slots of a quarter bucket): {exc}; free memory, lower bucket_bytes, "
                "or set same_host='group' in SyncConfig"
            ) from exc
        self._fd: int | None = fd
        try:
            name = socket_name(group_id)
            super().__init__(name, readers, slot_bytes, collective_timeout_s, group_id)
        except BaseException:
            self._release()
            raise

    @property
    def device(self) -> torch.device:
        return self._device

    def takes(self, device: torch.device) -> bool:
        """Whether ``broadcast`` takes buffers on ``device`` (see ``Fanout``): host memory and
        any CUDA device alike, since a chunk is copied into the ring either way."""
        return device.type in ("cpu", "cuda")

    def _offer(self, link: Link) -> None:
        assert self._fd is not None
        socket.send_fds(link.conn, [_RING.pack(self._ring.slot_bytes, SLOTS)], [self._fd])

    def _fill(self, slot: int, chunk: torch.Tensor, deadline: float) -> None:
        # A reader reads the slot as soon as it hears READY: the bytes must be in host memory.
        self._copies = self._ring.copy(slot, chunk, True, self._copies, deadline)

    def _accepted(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the readers hold the ring's mapping now
            self._fd = None

    def _release(self) -> None:
        self._accepted()
        self._ring.close()


class ShmReader(RingReader):
    """A worker's end: copies each broadcast out of the ring. Implements ``Transport``."""

    kind = _KIND
    unavailable = ShmUnavailableError

    def __init__(self, spec: GroupSpec, link: Link, ring: _Ring, device: torch.device) -> None:
        super().__init__(spec, link, ring.slot_bytes, device)
        self._ring = ring
        self._copies: DeviceCopies | None = None

    @classmethod
    def join(cls, spec: GroupSpec, device: torch.device | str | None = None) -> ShmReader:
        """Connect to the trainer's ring (``spec.transport == 'shm'``), or to the ring of the
        member that relays the push on this host (``'relay'``), and map it.

        ``device`` is where the buffers handed to ``broadcast`` live (default: the CPU); on a
        CUDA device the mapping is pinned and chunks are copied host-to-device out of it.
        """
        assert spec.transport in ("shm", "relay")
        device = _checked_device(device)
        link = cls._connect(spec)
        writer = link.writer
        try:
            message, fds, _, _ = socket.recv_fds(link.conn, _RING.size, 1)
        except TimeoutError as exc:
            link.close()
            raise SyncTimeoutError(
                f"{writer}'s shared-memory ring did not answer within "
                f"{spec.rendezvous_timeout_s}s; check that {writer} is alive"
            ) from exc
        except OSError as exc:
            link.close()
            raise TransportError(f"{writer}'s shared-memory ring failed: {exc}") from exc
        if len(message) != _RING.size or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            link.close()
            raise TransportError(f"{writer} hung up while handing over the ring")
        slot_bytes, slots = _RING.unpack(message)
        if slots != SLOTS:
            os.close(fds[0])
            link.close()
            raise TransportError(
                f"{writer}'s ring has {slots} slots, this worker counts {SLOTS}; check that "
                "both run the same weight_sync version"
            )
        try:
            ring = _Ring(fds[0], slot_bytes, slots, pin=device.type == "cuda")
        except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: CUDA, pinning it
            raise cls._refuse(spec, link, f"cannot map {slot_bytes * slots} bytes: {exc}") from exc
        except BaseException:
            link.close()
            raise
        finally:
            os.close(fds[0])
        try:
            cls._joined(spec, link)
        except BaseException:
            link.close()
            ring.close()
            raise
        return cls(spec, link, ring, device)

    def _drain(self, slot: int, out: torch.Tensor, deadline: float) -> None:
        self._copies = self._ring.copy(slot, out, False, self._copies, deadline)

    def _unmap(self) -> None:
        self._ring.close()
