"""The protocol both rings speak: the host ring (``shm``) and the CUDA ring (``cuda_ipc``).

A ring is ``SLOTS`` slots of memory that the trainer (rank 0) writes once and every reader maps.
What differs between the two rings is only the memory -- a memfd in host memory handed over as a
file descriptor, or a CUDA allocation on the trainer's GPU handed over as an IPC handle -- and how
a chunk gets into a slot and out of it. Everything else lives here, once:

* **the handshake**, over a Unix socket in the abstract namespace (no file, nothing to clean up):
  the reader says ``HELLO(group id, rank)``; the writer answers with the ring (``offer``); the
  reader maps it and answers ``JOINED(status, reason)``, so a reader that cannot map the ring
  (no CUDA IPC in its container, another GPU) says why during the handshake, and ``accept``
  raises the ring's ``RingUnavailableError`` naming every such rank;
* **flow control**: ``READY(seq, nbytes)`` from the writer once chunk ``seq`` is in its slot (for
  the CUDA ring: once the copy is *queued* and the slot's event recorded after it),
  ``DONE(seq)`` from each reader once its copy of the chunk out has finished; a slot is reused
  only when every reader is done with it. A reader on a GPU queues its copies and says DONE as
  it finds them finished, waiting for one only when the writer needs its slot back (at most
  ``SLOTS`` copies in flight) and before the bucket is used: no host wait per chunk;
* **votes**: a vote travels in place of a DONE, its outcome in place of a READY, marked by the
  sequence number's top bit;
* **liveness and bounds**: a dead peer is an EOF at once, a frozen one the collective timeout.

The writer's copy of chunk k+1 overlaps the readers' copies of chunk k.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from abc import ABC, abstractmethod
from collections import deque
from typing import ClassVar

import torch

from weight_sync.control.futures import Backoff
from weight_sync.errors import SyncTimeoutError, TransportError, WeightSyncError
from weight_sync.wire.metadata import GroupSpec
from weight_sync.wire.planner import align_up

logger = logging.getLogger(__name__)

SLOTS = 4  # the ring holds one bucket in four slots: the trainer writes one while readers read
HELLO = struct.Struct("!16sI")  # group id, rank
READY = struct.Struct("!QQ")  # chunk sequence number, bytes in its slot
DONE = struct.Struct("!Q")  # chunk sequence number
JOINED = struct.Struct("!BH")  # status (JOINED_OK or JOINED_REFUSED), length of the reason
JOINED_OK, JOINED_REFUSED = 0, 1
# A vote travels in place of a DONE (reader to trainer) and its outcome in place of a READY
# (trainer to readers), marked by the sequence number's top bit.
VOTE = 1 << 63
_SETTLE_S = 2.0  # how long a closing reader waits for copies still queued out of the ring
_GREET_S = 5.0  # an honest reader says hello as it connects; a silent caller must not hold the door


class RingUnavailableError(TransportError):
    """A ring cannot be used here (no memory for it, or readers that cannot map it); the caller
    should send those members another way. ``ranks`` are the readers that refused (empty when
    the trainer's side failed)."""

    def __init__(self, message: str, ranks: list[int] | tuple[int, ...] = ()) -> None:
        self.ranks = list(ranks)
        super().__init__(message)

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.ranks)


def slot_bytes_for(bucket_bytes: int, alignment: int = 4096) -> int:
    """Slot size: the ring as a whole holds one bucket."""
    return align_up(-(-bucket_bytes // SLOTS), alignment)


def chunks(size: int, slot_bytes: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of each chunk a buffer of ``size`` bytes crosses the ring in."""
    if slot_bytes <= 0:
        raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
    return [(offset, min(slot_bytes, size - offset)) for offset in range(0, size, slot_bytes)]


def reusable_once_done(seq: int, slots: int = SLOTS) -> int:
    """Chunk ``seq`` goes into slot ``seq % slots``, which is free once every reader has copied
    out the chunks before ``seq - slots + 1`` (the slot's previous tenant is ``seq - slots``)."""
    return seq - slots + 1


def socket_address(name: str) -> str:
    """The abstract-namespace address of a ring's socket named ``name``."""
    return "\0" + name


class RingSent:
    """The writer's side of a broadcast in flight: done when every reader has copied it out.

    ``event`` (the CUDA ring) is recorded on the writer's stream after its last copy into a slot:
    ``after`` orders the caller's stream behind it without blocking the host, which is all the
    source buffer needs -- the readers' progress only matters to the next use of a slot, and
    the writer checks that itself before reusing one.
    """

    def __init__(
        self,
        writer: RingWriter,
        through: int,
        deadline: float,
        event: torch.cuda.Event | None = None,
    ) -> None:
        self._writer, self._through, self._deadline = writer, through, deadline
        self._event = event

    def wait(self) -> None:
        self._writer.await_done(self._through, self._deadline)

    def after(self) -> None:
        if self._event is None:  # host memory: nothing to order on a stream
            self.wait()
            return
        torch.cuda.current_stream(self._event.device).wait_event(self._event)


class Received:
    """A reader's broadcast, already complete when handed back (each chunk was copied out, and
    the copy finished, before its DONE)."""

    def wait(self) -> None:
        return None

    def after(self) -> None:
        return None


class Copying:
    """A reader's broadcast whose copies out of the ring may still be queued on its GPU (their
    private stream waits on the writer's slot events): done once every one has finished, and
    each is said DONE.

    ``after`` is ``wait`` -- a host wait, by ``deadline`` -- not a stream wait, and that is on
    purpose: a stream that waits on another process's event can never be released (an IPC
    event has no abort, unlike NCCL), so if the trainer died with its copy into a slot queued,
    the receive stream -- and every later push on this GPU, which queues behind it -- would
    wait forever. Waiting on the host keeps that dependency on the private stream, which a new
    group replaces. It costs one host wait per bucket, while the next bucket's copies are
    already queued behind it.
    """

    def __init__(self, reader: RingReader, through: int, deadline: float) -> None:
        self._reader, self._through, self._deadline = reader, through, deadline

    def wait(self) -> None:
        self._reader.report(self._through, self._deadline)

    def after(self) -> None:
        self.wait()


class Link:
    """One end of a ring's socket, and who is at the other: rank 0 is the ring's writer (the
    trainer, or the member relaying the push on its host: ``writer`` names it); None, a reader
    that has not said who it is yet. ``kind`` names the ring in messages."""

    def __init__(
        self, conn: socket.socket, peer: int | None, kind: str, writer: str = "the trainer"
    ) -> None:
        self.conn, self.peer, self.kind, self.writer = conn, peer, kind, writer

    def who(self) -> str:
        if self.peer is None:
            return "a joining reader"
        return self.writer if self.peer == 0 else f"{self.kind} reader {self.peer}"

    def recv(self, size: int, deadline: float) -> bytes:
        """Exactly ``size`` bytes, by ``deadline``; EOF and timeouts raise, naming the peer."""
        data = b""
        try:
            while len(data) < size:
                self.conn.settimeout(self.left(deadline))
                part = self.conn.recv(size - len(data))
                if not part:
                    raise TransportError(
                        f"{self.who()} closed its {self.kind} connection (it died or left)"
                    )
                data += part
        except TimeoutError as exc:
            raise SyncTimeoutError(
                f"timed out waiting for {self.who()} on the {self.kind} ring"
            ) from exc
        except OSError as exc:
            raise TransportError(f"{self.who()}: {self.kind} connection failed: {exc}") from exc
        return data

    def send(self, message: bytes) -> None:
        try:
            self.conn.sendall(message, socket.MSG_NOSIGNAL)
        except OSError as exc:  # BrokenPipeError / ConnectionResetError: the peer is gone
            raise TransportError(f"{self.who()} closed its {self.kind} connection: {exc}") from exc

    def left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SyncTimeoutError(f"{self.kind} ring: timed out waiting for {self.who()}")
        return left

    def hang_up(self) -> None:
        """End the connection both ways: the peer sees EOF at once, and so does a thread of
        ours blocked on it (``close`` alone does not wake a blocked ``recv`` on Linux)."""
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected, or already gone

    def close(self) -> None:
        self.hang_up()
        self.conn.close()


def deadline_for(limit_s: float, timeout_s: float | None) -> float:
    """When one broadcast must be done: within ``timeout_s`` if given, never past ``limit_s``."""
    return time.monotonic() + (limit_s if timeout_s is None else min(limit_s, timeout_s))


def pack_joined(reason: str | None) -> bytes:
    """A reader's answer to the offer: mapped (``None``), or refused and why."""
    if reason is None:
        return JOINED.pack(JOINED_OK, 0)
    text = reason.encode()[:4000]
    return JOINED.pack(JOINED_REFUSED, len(text)) + text


class RingWriter(ABC):
    """The trainer's end of a ring (rank 0; implements ``Transport`` for its readers).

    Subclasses own the memory: they hand it to a reader (``_offer``), put a chunk into a slot
    (``_fill``), and free it (``_release``).
    """

    kind: ClassVar[str]  # the ring's name in messages
    unavailable: ClassVar[type[RingUnavailableError]]

    def __init__(
        self, name: str, readers: int, slot_bytes: int, collective_timeout_s: float, group_id: str
    ) -> None:
        """Listens at the abstract socket ``name``; ``accept`` then takes the readers in.
        Raises ``unavailable`` if it cannot listen."""
        if readers < 1:
            raise ValueError(f"a ring needs at least one reader, got {readers}")
        self._group_id = group_id
        self.name = name  # the abstract socket readers dial: their GroupSpec's address
        self._readers = readers
        self._slot_bytes = slot_bytes
        self._timeout_s = collective_timeout_s
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(socket_address(name))
            listener.listen(readers)
        except OSError as exc:
            listener.close()
            raise self.unavailable(
                f"cannot listen for the {self.kind} ring's readers: {exc}"
            ) from exc
        self._listener: socket.socket | None = listener
        self._links: list[Link] = []
        self._written = 0  # chunks written since the group formed
        self._done = [0] * readers  # per reader: chunks it has copied out

    # -- what a ring's memory does ---------------------------------------------------------------

    @abstractmethod
    def _offer(self, link: Link) -> None:
        """Hand the ring to a reader that has said hello."""

    @abstractmethod
    def _fill(self, slot: int, chunk: torch.Tensor, deadline: float) -> None:
        """Put ``chunk`` into ``slot`` so that a reader told READY may copy it out."""

    def _sent(self) -> torch.cuda.Event | None:
        """What ``RingSent.after`` waits on for the broadcast just written (None: host memory)."""
        return None

    def _accepted(self) -> None:
        """Every reader holds the ring: what only the handshake needed can go."""

    @abstractmethod
    def _release(self) -> None:
        """Free the ring's memory (the readers' mappings are their own)."""

    # -- Transport -------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return self._readers + 1

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def accept(self, timeout_s: float) -> None:
        """Take every reader in (they connect while joining) and hand each the ring; returns once
        every one has mapped it.

        Raises ``SyncTimeoutError`` naming the readers that did not come or answer, and the
        ring's ``RingUnavailableError`` naming those that could not map it.
        """
        assert self._listener is not None, "accept runs once"
        deadline = time.monotonic() + timeout_s
        by_rank: dict[int, Link] = {}
        try:
            while len(by_rank) < self._readers:
                self._listener.settimeout(max(deadline - time.monotonic(), 1e-3))
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, self._readers + 1)) - set(by_rank))
                    raise SyncTimeoutError(
                        f"{self.kind} readers {missing} did not connect within "
                        f"{timeout_s:.1f}s; check that those workers are alive"
                    ) from None
                link = self._greet(conn, deadline)
                if link is None or link.peer in by_rank:
                    conn.close()  # not one of ours: a stale member of an older group, or worse
                else:
                    by_rank[link.peer] = link  # type: ignore[index]
            # The readers map the ring at once, all of them (a CUDA context can take seconds).
            refused = {rank: self._answer(link, deadline) for rank, link in sorted(by_rank.items())}
        except BaseException:
            for link in by_rank.values():
                link.close()
            raise
        finally:
            self._listener.close()
            self._listener = None
            self._accepted()
        refusals = {rank: reason for rank, reason in refused.items() if reason is not None}
        if refusals:
            for link in by_rank.values():
                link.close()
            shown = "; ".join(f"reader {rank}: {reason}" for rank, reason in refusals.items())
            raise self.unavailable(
                f"{self.kind} readers {sorted(refusals)} could not map the ring ({shown})",
                sorted(refusals),
            )
        self._links = [by_rank[rank] for rank in range(1, self._readers + 1)]
        logger.info(
            "%s ring of %d x %d bytes to %d readers",
            self.kind,
            SLOTS,
            self._slot_bytes,
            self._readers,
        )

    def _greet(self, conn: socket.socket, deadline: float) -> Link | None:
        """A connecting reader's link, once it has proved it was sent our group id and has been
        offered the ring; None for anyone else."""
        link = Link(conn, None, self.kind)
        try:
            greet_by = min(deadline, time.monotonic() + _GREET_S)
            group_id, rank = HELLO.unpack(link.recv(HELLO.size, greet_by))
            if group_id != self._group_id.encode()[:16] or not 1 <= rank <= self._readers:
                return None
            link.peer = rank
            self._offer(link)
        except (OSError, WeightSyncError):
            return None
        return link

    def _answer(self, link: Link, deadline: float) -> str | None:
        """A reader's answer to the offer: None once it has mapped the ring, else why not."""
        status, length = JOINED.unpack(link.recv(JOINED.size, deadline))
        reason = link.recv(length, deadline).decode(errors="replace") if length else ""
        if status == JOINED_OK:
            return None
        return reason or "no reason given"

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> RingSent:
        """Copy ``tensor`` into the ring chunk by chunk; waits only for slots to come free."""
        assert src == 0 and tensor.dtype == torch.uint8 and tensor.is_contiguous()
        deadline = deadline_for(self._timeout_s, timeout_s)
        flat = tensor.view(-1)
        for offset, count in chunks(tensor.numel(), self._slot_bytes):
            seq = self._written
            self.await_done(reusable_once_done(seq), deadline)  # the slot's previous chunk is read
            self._fill(seq % SLOTS, flat[offset : offset + count], deadline)
            ready = READY.pack(seq, count)
            for link in self._links:
                link.send(ready)
            self._written += 1
        return RingSent(self, self._written, deadline, self._sent())

    def await_done(self, through: int, deadline: float) -> None:
        """Wait until every reader has copied out chunks ``< through``."""
        for index, link in enumerate(self._links):
            while self._done[index] < through:
                (seq,) = DONE.unpack(link.recv(DONE.size, deadline))
                if seq != self._done[index]:
                    raise TransportError(
                        f"{link.who()} acknowledged chunk {seq}, expected {self._done[index]}"
                    )
                self._done[index] += 1

    tally_is_final = False  # the readers wait for announce

    def vote(self, code: int, timeout_s: float | None = None) -> int:
        return self.announce(self.tally(code, timeout_s), timeout_s)

    def tally(self, code: int, timeout_s: float | None = None) -> int:
        """The largest of ``code`` and every reader's vote (each reader has copied out every
        chunk first); the readers wait for ``announce``."""
        deadline = deadline_for(self._timeout_s, timeout_s)
        self.await_done(self._written, deadline)
        for link in self._links:
            (word,) = DONE.unpack(link.recv(DONE.size, deadline))
            if not word & VOTE:
                raise TransportError(
                    f"{link.who()} sent chunk {word} where a vote was due; it disagrees on the plan"
                )
            code = max(code, word & ~VOTE)
        return code

    def announce(self, code: int, timeout_s: float | None = None) -> int:
        result = READY.pack(VOTE | code, 0)
        for link in self._links:
            link.send(result)
        return code

    def hang_up(self) -> None:
        """End every reader's connection (each fails at once if it was waiting, and so does any
        wait here on them), keeping the ring's memory: a copy into it may still be running on
        another thread (see ``transport.relay``). ``close`` then frees it."""
        for link in self._links:
            link.hang_up()

    def close(self) -> None:
        """Hang up on every reader (each fails at once if it was waiting) and free the ring.
        Idempotent."""
        links, self._links = self._links, []
        for link in links:
            link.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            self._accepted()
        self._release()


class RingReader(ABC):
    """A worker's end of a ring (implements ``Transport``). Subclasses map the ring
    (``_map``), copy a chunk out of a slot (``_drain``) and unmap it (``_unmap``)."""

    kind: ClassVar[str]
    unavailable: ClassVar[type[RingUnavailableError]]

    def __init__(self, spec: GroupSpec, link: Link, slot_bytes: int, device: torch.device) -> None:
        self._spec = spec
        self._link: Link | None = link
        self._slot_bytes = slot_bytes
        self._device = device
        self._read = 0  # chunks copied out (or queued to be) since joining
        # Chunks whose copy out is queued but not yet said DONE, oldest first: (sequence
        # number, the event behind its copy (None: finished already), where it lands).
        self._pending: deque[tuple[int, torch.cuda.Event | None, torch.Tensor]] = deque()

    @classmethod
    def _connect(cls, spec: GroupSpec) -> Link:
        """Reach the ring's writer (``spec.address``) and say hello. The trainer's rings listen
        before their readers are asked to join; a relay's ring (``spec.transport == "relay"``)
        is opened by another member as it joins, so it is dialled again until it answers."""
        writer = "the relaying member's" if spec.transport == "relay" else "the trainer's"
        deadline = time.monotonic() + spec.rendezvous_timeout_s
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(max(deadline - time.monotonic(), 1e-3))  # one bound for the join
            try:
                conn.connect(socket_address(spec.address))
                conn.sendall(HELLO.pack(spec.group_id.encode()[:16], spec.rank))
                return Link(conn, 0, cls.kind, writer=writer.removesuffix("'s"))
            except (ConnectionRefusedError, FileNotFoundError) as exc:
                conn.close()
                if spec.transport == "relay" and time.monotonic() < deadline:
                    time.sleep(0.05)  # not listening yet
                    continue
                raise TransportError(
                    f"cannot reach {writer} {cls.kind} ring {spec.address!r}: {exc}; it must run "
                    "on this host, in this network namespace, and be alive"
                ) from exc
            except TimeoutError as exc:
                conn.close()
                raise SyncTimeoutError(
                    f"{writer} {cls.kind} ring did not answer within "
                    f"{spec.rendezvous_timeout_s}s; check that it is alive"
                ) from exc
            except OSError as exc:
                conn.close()
                raise TransportError(
                    f"cannot reach {writer} {cls.kind} ring {spec.address!r}: {exc}; it must run "
                    "on this host, in this network namespace"
                ) from exc

    @classmethod
    def _refuse(cls, spec: GroupSpec, link: Link, reason: str) -> RingUnavailableError:
        """Tell the trainer this reader cannot map its ring, and why; the error to raise here."""
        try:
            link.send(pack_joined(reason))
        except TransportError:
            pass  # the trainer is gone: the error below says what went wrong here anyway
        link.close()
        return cls.unavailable(
            f"{cls.kind} reader {spec.rank} cannot map the trainer's ring: {reason}", [spec.rank]
        )

    @classmethod
    def _joined(cls, spec: GroupSpec, link: Link) -> None:
        link.send(pack_joined(None))
        logger.info(
            "joined %s ring %s as reader %d/%d",
            cls.kind,
            spec.address,
            spec.rank,
            spec.world_size - 1,
        )

    @abstractmethod
    def _drain(self, slot: int, out: torch.Tensor, deadline: float) -> torch.cuda.Event | None:
        """Copy slot ``slot`` into ``out``: done when it returns (None), or queued on the
        device behind the writer's copy into the slot, with the event recorded after it."""

    def _abandon(self, out: torch.Tensor) -> None:
        """A queued copy into ``out`` did not finish in time but may still run: keep its
        memory from being reused meanwhile (see ``DeviceCopies.abandon``)."""

    @abstractmethod
    def _unmap(self) -> None:
        """Let go of the ring's memory."""

    @property
    def rank(self) -> int:
        return self._spec.rank

    @property
    def world_size(self) -> int:
        return self._spec.world_size

    @property
    def device(self) -> torch.device:
        """Where the buffers handed to ``broadcast`` live."""
        return self._device

    def _live(self) -> Link:
        if self._link is None:
            raise TransportError(f"this {self.kind} reader has left")
        return self._link

    def broadcast(
        self, tensor: torch.Tensor, src: int, timeout_s: float | None = None
    ) -> Received | Copying:
        """Receive into ``tensor``, chunk by chunk; returns when all of it has arrived."""
        link = self._live()
        deadline = deadline_for(self._spec.collective_timeout_s, timeout_s)
        flat = tensor.view(-1)
        for offset, count in chunks(tensor.numel(), self._slot_bytes):
            # The writer puts chunk _read into the slot of chunk _read - SLOTS: that one must
            # be out (and said so) before this reader waits for it.
            self.report(self._read - SLOTS, deadline)
            seq, sent = READY.unpack(link.recv(READY.size, deadline))
            if (seq, sent) != (self._read, count):
                raise TransportError(
                    f"{self.kind} ring out of step: got chunk {seq} of {sent} bytes, expected "
                    f"chunk {self._read} of {count}; the trainer and this worker disagree on the "
                    "plan"
                )
            out = flat[offset : offset + count]
            self._pending.append((seq, self._drain(seq % SLOTS, out, deadline), out))
            self._read += 1
        self.report(-1, deadline)  # those already finished, without waiting
        if not self._pending:
            return Received()
        return Copying(self, self._read - 1, deadline)

    def report(self, through: int, deadline: float) -> None:
        """Say DONE for each chunk copied out, in order: every one up to ``through`` -- waiting
        for its copy to finish, by ``deadline`` -- and any later one already finished."""
        link = self._live()
        while self._pending:
            seq, event, _ = self._pending[0]
            if event is not None and not event.query():
                if seq > through:
                    return
                try:
                    finish(
                        event,
                        deadline,
                        f"the copy of chunk {seq} out of {link.writer}'s {self.kind} slot (if it "
                        f"never ends, {link.writer} died or its GPU is stuck)",
                    )
                except SyncTimeoutError:
                    for _, _, queued in self._pending:
                        self._abandon(queued)
                    raise
            self._pending.popleft()
            link.send(DONE.pack(seq))

    tally_is_final = False

    def tally(self, code: int, timeout_s: float | None = None) -> int:
        raise TypeError("tally and announce are the trainer's halves of a vote; a reader votes")

    def announce(self, code: int, timeout_s: float | None = None) -> int:
        raise TypeError("tally and announce are the trainer's halves of a vote; a reader votes")

    def vote(self, code: int, timeout_s: float | None = None) -> int:
        link = self._live()
        deadline = deadline_for(self._spec.collective_timeout_s, timeout_s)
        self.report(self._read - 1, deadline)  # the writer counts every chunk out first
        link.send(DONE.pack(VOTE | code))
        word, _ = READY.unpack(link.recv(READY.size, deadline))
        if not word & VOTE:
            raise TransportError(
                f"{self.kind} ring out of step: got chunk {word} where the "
                "outcome of a vote was due"
            )
        return word & ~VOTE

    def close(self) -> None:
        """Hang up and unmap the ring -- but a copy still queued out of it (a push that failed
        mid-way) must not read a mapping that is gone: it is waited for, briefly, and if it is
        still queued then (the writer died or froze with its copy into the slot queued), the
        mapping is kept for the process's life instead (``_strand``). Safe from another thread
        than the one receiving (the pending copies are taken over first)."""
        link, self._link = self._link, None
        if link is not None:
            link.close()
        pending, self._pending = self._pending, deque()
        queued = [(event, out) for _, event, out in pending if event is not None]
        settle_by = time.monotonic() + _SETTLE_S
        try:
            for event, _ in queued:
                finish(event, settle_by, "a copy out of the ring queued when it was closed")
        except SyncTimeoutError:
            for _, out in queued:
                self._abandon(out)
            self._strand()
            return
        self._unmap()

    def _strand(self) -> None:
        """Keep the ring mapped for the process's life: a copy out of it may still run."""
        raise AssertionError(f"a {self.kind} reader with copies queued must say how to strand")


class DeviceCopies:
    """Copies between ring slots and buffers on one CUDA device, on a private stream that
    first waits for the caller's current stream (the buffers may have just been allocated or
    written there), so the stream an engine serves on never waits on the trainer.

    ``copy`` returns once its copy has finished (the host ring's writer says READY only then);
    ``queue`` returns at once with an event behind the copy, one per slot (a ring's reader has
    at most ``SLOTS`` copies in flight, one per slot; see ``RingReader.report``). A copy is known
    finished by polling its event against the collective's deadline, never by a blocking CUDA
    call: the work it waits on may belong to another process (the trainer's copy into a CUDA
    slot) that can die or freeze.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device)
        self._done = torch.cuda.Event()
        self._queued = [torch.cuda.Event() for _ in range(SLOTS)]

    def queue(
        self,
        out: torch.Tensor,
        source: torch.Tensor,
        slot: int,
        after: torch.cuda.Event | None = None,
    ) -> torch.cuda.Event:
        """Queue ``out.copy_(source)`` behind ``after`` if given (an event recorded by the
        trainer); returns slot ``slot``'s event, recorded behind the copy."""
        return self._queue(out, source, self._queued[slot], after)

    def copy(
        self,
        out: torch.Tensor,
        source: torch.Tensor,
        deadline: float,
        what: str,
        after: torch.cuda.Event | None = None,
    ) -> None:
        """``out.copy_(source)`` behind ``after`` if given; returns once the copy has finished,
        by ``deadline``."""
        done = self._queue(out, source, self._done, after)
        try:
            finish(done, deadline, what)
        except SyncTimeoutError:
            for tensor in (out, source):
                self.abandon(tensor)
            raise

    def abandon(self, tensor: torch.Tensor) -> None:
        """A copy into or out of ``tensor`` may still run some day: the caching allocator must
        not hand its memory to anyone before it has (record_stream; a no-op for memory it does
        not own)."""
        if tensor.is_cuda:
            tensor.record_stream(self._stream)

    def _queue(
        self,
        out: torch.Tensor,
        source: torch.Tensor,
        done: torch.cuda.Event,
        after: torch.cuda.Event | None,
    ) -> torch.cuda.Event:
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            out.copy_(source, non_blocking=True)
            done.record(stream)
        return done


def copies_on(copies: DeviceCopies | None, device: torch.device) -> DeviceCopies:
    """``copies`` if it serves ``device``, else new copies for it (made once per ring end)."""
    if copies is not None and copies.device == device:
        return copies
    return DeviceCopies(device)


def finish(event: torch.cuda.Event, deadline: float, what: str) -> None:
    """Wait for ``event`` by ``deadline`` without a blocking CUDA call that no timeout bounds:
    a query, then polls that back off from 50 us to 1 ms (a slot's copy takes well under a
    millisecond on device memory, a few on PCIe). ``what`` says what the event stands for."""
    backoff = Backoff(5e-5, 1e-3)
    while not event.query():
        if time.monotonic() >= deadline:
            raise SyncTimeoutError(f"{what} did not finish within the collective's timeout")
        backoff.sleep()
