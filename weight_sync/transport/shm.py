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
chunk k.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import sys
import time
from pathlib import Path

import torch

from weight_sync.errors import SyncTimeoutError, TransportError
from weight_sync.metadata import GroupSpec
from weight_sync.planner import align_up

logger = logging.getLogger(__name__)

SLOTS = 4  # the ring holds one bucket in four slots: the trainer writes one while workers read
_HELLO = struct.Struct("!16sI")  # group id, rank
_RING = struct.Struct("!QI")  # slot bytes, slots
_READY = struct.Struct("!QQ")  # chunk sequence number, bytes in its slot
_DONE = struct.Struct("!Q")  # chunk sequence number
# A vote travels in place of a DONE (reader to trainer) and its outcome in place of a READY
# (trainer to readers), marked by the sequence number's top bit.
_VOTE = 1 << 63


class ShmUnavailableError(TransportError):
    """This host cannot give the ring its memory (or has no memfd): use the group instead."""


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


def slot_bytes_for(bucket_bytes: int, alignment: int = 4096) -> int:
    """Slot size: the ring as a whole holds one bucket."""
    return align_up(-(-bucket_bytes // SLOTS), alignment)


class _Done:
    def wait(self) -> None:
        return None


class _Acks:
    """The writer's side of a broadcast in flight: done when every reader has copied it out."""

    def __init__(self, writer: ShmWriter, through: int, deadline: float) -> None:
        self._writer, self._through, self._deadline = writer, through, deadline

    def wait(self) -> None:
        self._writer.await_done(self._through, self._deadline)


class _Ring:
    """A mapping of the ring and its slots as uint8 tensors."""

    def __init__(self, fd: int, slot_bytes: int, slots: int) -> None:
        self.map = mmap.mmap(fd, slot_bytes * slots, mmap.MAP_SHARED)
        flat = torch.frombuffer(self.map, dtype=torch.uint8)
        self.slots = list(flat.split(slot_bytes))
        self.slot_bytes = slot_bytes

    def close(self) -> None:
        self.slots = []
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass


class ShmWriter:
    """The trainer's end (rank 0): writes each broadcast once into the ring. Implements
    ``Transport`` for the workers of its host."""

    def __init__(self, group_id: str, readers: int, slot_bytes: int, collective_timeout_s: float) -> None:
        """Claims the ring's memory and listens; ``accept`` then takes the readers in.

        Raises ``ShmUnavailableError`` (naming the size) where the host cannot give the memory.
        """
        assert readers >= 1
        self._group_id = group_id
        self._readers = readers
        self._timeout_s = collective_timeout_s
        size = slot_bytes * SLOTS
        if not available():
            raise ShmUnavailableError("shared memory needs Linux (memfd_create and fd passing)")
        fd = os.memfd_create(socket_name(group_id), os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)
            self._ring = _Ring(fd, slot_bytes, SLOTS)
        except OSError as exc:
            os.close(fd)
            raise ShmUnavailableError(
                f"cannot claim {size / 2**20:.1f} MiB of shared memory for the ring "
                f"({SLOTS} slots of a quarter bucket): {exc}; free memory, lower bucket_bytes, "
                "or set same_host='group' in SyncConfig"
            ) from exc
        self._fd: int | None = fd
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + socket_name(group_id))
            listener.listen(readers)
        except OSError as exc:
            listener.close()
            self._fd = None
            os.close(fd)
            self._ring.close()
            raise ShmUnavailableError(f"cannot listen for the ring's readers: {exc}") from exc
        self._listener: socket.socket | None = listener
        self._conns: list[socket.socket] = []
        self._written = 0  # chunks written since the group formed
        self._done = [0] * readers  # per reader: chunks it has copied out

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return self._readers + 1

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def accept(self, timeout_s: float) -> None:
        """Take every reader in (they connect while joining), and hand each the ring."""
        assert self._listener is not None and self._fd is not None
        deadline = time.monotonic() + timeout_s
        by_rank: dict[int, socket.socket] = {}
        try:
            while len(by_rank) < self._readers:
                self._listener.settimeout(max(deadline - time.monotonic(), 1e-3))
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, self._readers + 1)) - set(by_rank))
                    raise SyncTimeoutError(
                        f"shared-memory readers {missing} did not connect within "
                        f"{timeout_s:.1f}s; check that those workers are alive"
                    ) from None
                rank = self._greet(conn, deadline)
                if rank is None or rank in by_rank:
                    conn.close()  # not one of ours: a stale member of an older group, or worse
                else:
                    by_rank[rank] = conn
        except BaseException:
            for conn in by_rank.values():
                conn.close()
            raise
        finally:
            self._listener.close()
            self._listener = None
            os.close(self._fd)  # the readers hold the ring's mapping now
            self._fd = None
        self._conns = [by_rank[rank] for rank in range(1, self._readers + 1)]
        logger.info("shared-memory ring of %d x %d bytes to %d readers", SLOTS,
                    self._ring.slot_bytes, self._readers)  # fmt: skip

    def _greet(self, conn: socket.socket, deadline: float) -> int | None:
        """A connecting reader's rank, once it has proved it was sent our group id and has been
        handed the ring; None for anyone else."""
        assert self._fd is not None
        try:
            # An honest reader says hello as it connects; a silent caller must not hold the door.
            conn.settimeout(min(max(deadline - time.monotonic(), 1e-3), 5.0))
            group_id, rank = _HELLO.unpack(_recv_exact(conn, _HELLO.size, None))
            if group_id != self._group_id.encode()[:16] or not 1 <= rank <= self._readers:
                return None
            socket.send_fds(conn, [_RING.pack(self._ring.slot_bytes, SLOTS)], [self._fd])
        except (OSError, TransportError):
            return None
        return rank

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> _Acks:
        """Copy ``tensor`` into the ring chunk by chunk; waits only for slots to come free."""
        assert src == 0 and tensor.dtype == torch.uint8 and tensor.is_contiguous()
        deadline = _deadline(self._timeout_s, timeout_s)
        flat, size = tensor.view(-1), tensor.numel()
        slot_bytes = self._ring.slot_bytes
        for offset in range(0, size, slot_bytes):
            count = min(slot_bytes, size - offset)
            chunk = self._written
            self.await_done(chunk - SLOTS + 1, deadline)  # the slot's previous chunk is read
            self._ring.slots[chunk % SLOTS][:count].copy_(flat[offset : offset + count])
            ready = _READY.pack(chunk, count)
            for rank, conn in enumerate(self._conns, start=1):
                _send(conn, ready, rank)
            self._written += 1
        return _Acks(self, self._written, deadline)

    def await_done(self, through: int, deadline: float) -> None:
        """Wait until every reader has copied out chunks ``< through``."""
        for index, conn in enumerate(self._conns):
            while self._done[index] < through:
                conn.settimeout(_left(deadline, index + 1))
                (chunk,) = _DONE.unpack(_recv_exact(conn, _DONE.size, index + 1))
                if chunk != self._done[index]:
                    raise TransportError(
                        f"shared-memory reader {index + 1} acknowledged chunk {chunk}, expected "
                        f"{self._done[index]}"
                    )
                self._done[index] += 1

    tally_is_final = False  # the readers wait for announce

    def vote(self, code: int, timeout_s: float | None = None) -> int:
        return self.announce(self.tally(code, timeout_s), timeout_s)

    def tally(self, code: int, timeout_s: float | None = None) -> int:
        """The largest of ``code`` and every reader's vote (each reader has copied out every
        chunk first); the readers wait for ``announce``."""
        deadline = _deadline(self._timeout_s, timeout_s)
        self.await_done(self._written, deadline)
        for index, conn in enumerate(self._conns):
            conn.settimeout(_left(deadline, index + 1))
            (word,) = _DONE.unpack(_recv_exact(conn, _DONE.size, index + 1))
            if not word & _VOTE:
                raise TransportError(f"shared-memory reader {index + 1} sent chunk {word} where a "
                                     "vote was due; it disagrees on the plan")  # fmt: skip
            code = max(code, word & ~_VOTE)
        return code

    def announce(self, code: int, timeout_s: float | None = None) -> int:
        result = _READY.pack(_VOTE | code, 0)
        for rank, conn in enumerate(self._conns, start=1):
            _send(conn, result, rank)
        return code

    def close(self) -> None:
        """Hang up on every reader (each fails at once if it was waiting) and unmap. Idempotent."""
        conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._ring.close()


class ShmReader:
    """A worker's end: copies each broadcast out of the ring. Implements ``Transport``."""

    def __init__(self, spec: GroupSpec, conn: socket.socket, ring: _Ring) -> None:
        self._spec = spec
        self._conn: socket.socket | None = conn
        self._ring = ring
        self._read = 0  # chunks copied out since joining

    @classmethod
    def join(cls, spec: GroupSpec) -> ShmReader:
        """Connect to the trainer's ring (``spec.transport == 'shm'``) and map it."""
        assert spec.transport == "shm"
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(spec.rendezvous_timeout_s)
        try:
            conn.connect("\0" + spec.address)
            conn.sendall(_HELLO.pack(spec.group_id.encode()[:16], spec.rank))
            message, fds, _, _ = socket.recv_fds(conn, _RING.size, 1)
            if len(message) != _RING.size or len(fds) != 1:
                raise TransportError("the trainer hung up while handing over the ring")
            slot_bytes, slots = _RING.unpack(message)
            try:
                ring = _Ring(fds[0], slot_bytes, slots)
            finally:
                os.close(fds[0])
        except TimeoutError as exc:
            conn.close()
            raise SyncTimeoutError(
                f"the trainer's shared-memory ring did not answer within "
                f"{spec.rendezvous_timeout_s}s; check that the trainer is alive"
            ) from exc
        except OSError as exc:
            conn.close()
            raise TransportError(
                f"cannot reach the trainer's shared-memory ring {spec.address!r}: {exc}; the "
                "trainer must run on this host, in this network namespace"
            ) from exc
        logger.info("joined shared-memory ring %s as reader %d/%d", spec.address, spec.rank,
                    spec.world_size - 1)  # fmt: skip
        return cls(spec, conn, ring)

    @property
    def rank(self) -> int:
        return self._spec.rank

    @property
    def world_size(self) -> int:
        return self._spec.world_size

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> _Done:
        """Receive into ``tensor``, chunk by chunk; returns when all of it has arrived."""
        conn = self._conn
        if conn is None:
            raise TransportError("this shared-memory reader has left")
        deadline = _deadline(self._spec.collective_timeout_s, timeout_s)
        flat, size = tensor.view(-1), tensor.numel()
        slot_bytes = self._ring.slot_bytes
        for offset in range(0, size, slot_bytes):
            count = min(slot_bytes, size - offset)
            conn.settimeout(_left(deadline, 0))
            chunk, sent = _READY.unpack(_recv_exact(conn, _READY.size, 0))
            if (chunk, sent) != (self._read, count):
                raise TransportError(
                    f"shared-memory ring out of step: got chunk {chunk} of {sent} bytes, expected "
                    f"chunk {self._read} of {count}; the trainer and this worker disagree on the plan"
                )
            slots = self._ring.slots
            flat[offset : offset + count].copy_(slots[chunk % len(slots)][:count])
            _send(conn, _DONE.pack(chunk), 0)
            self._read += 1
        return _Done()

    def vote(self, code: int, timeout_s: float | None = None) -> int:
        conn = self._conn
        if conn is None:
            raise TransportError("this shared-memory reader has left")
        deadline = _deadline(self._spec.collective_timeout_s, timeout_s)
        _send(conn, _DONE.pack(_VOTE | code), 0)
        conn.settimeout(_left(deadline, 0))
        word, _ = _READY.unpack(_recv_exact(conn, _READY.size, 0))
        if not word & _VOTE:
            raise TransportError(f"shared-memory ring out of step: got chunk {word} where the "
                                 "outcome of a vote was due")  # fmt: skip
        return word & ~_VOTE

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        self._ring.close()


def _peer(rank: int | None) -> str:
    """Who is at the other end of a connection: rank 0 is the trainer; None, a reader that has
    not said who it is yet."""
    if rank is None:
        return "a joining reader"
    return "the trainer" if rank == 0 else f"shared-memory reader {rank}"


def _deadline(limit_s: float, timeout_s: float | None) -> float:
    """When one broadcast must be done: within ``timeout_s`` if given, never past ``limit_s``."""
    return time.monotonic() + (limit_s if timeout_s is None else min(limit_s, timeout_s))


def _left(deadline: float, rank: int) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise SyncTimeoutError(f"shared-memory ring: timed out waiting for {_peer(rank)}")
    return left


def _recv_exact(conn: socket.socket, size: int, rank: int | None) -> bytes:
    peer = _peer(rank)
    data = b""
    try:
        while len(data) < size:
            part = conn.recv(size - len(data))
            if not part:
                raise TransportError(f"{peer} closed its shared-memory connection (it died or left)")
            data += part
    except TimeoutError as exc:
        raise SyncTimeoutError(f"timed out waiting for {peer} on the shared-memory ring") from exc
    except OSError as exc:
        raise TransportError(f"{peer}: shared-memory connection failed: {exc}") from exc
    return data


def _send(conn: socket.socket, message: bytes, rank: int) -> None:
    try:
        conn.sendall(message, socket.MSG_NOSIGNAL)
    except OSError as exc:  # BrokenPipeError / ConnectionResetError: the peer is gone
        raise TransportError(f"{_peer(rank)} closed its shared-memory connection: {exc}") from exc
