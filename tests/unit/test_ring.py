"""Pure pieces of the rings (``transport.ring``, ``transport.cuda_ipc``): how a buffer is cut into
chunks and when a slot may be reused, the CUDA ring's offer on the wire, a reader's answer, the
errors that name ranks, and which devices each end and a ``Fanout`` take."""

from __future__ import annotations

import pickle
import secrets
import socket
import struct
import threading
from collections import deque

import pytest
import torch

from weight_sync.errors import SyncTimeoutError, TransportError
from weight_sync.wire.metadata import GroupSpec
from weight_sync.transport import Fanout, cuda_ipc, ring, shm

SLOTS = ring.SLOTS


@pytest.mark.parametrize(
    ("size", "slot", "expected"),
    [
        (0, 1024, []),
        (1, 1024, [(0, 1)]),
        (1024, 1024, [(0, 1024)]),
        (1025, 1024, [(0, 1024), (1024, 1)]),
        (2500, 1024, [(0, 1024), (1024, 1024), (2048, 452)]),
    ],
)  # fmt: skip
def test_a_buffer_crosses_the_ring_in_slot_sized_chunks(
    size: int, slot: int, expected: list[tuple[int, int]]
) -> None:
    got = ring.chunks(size, slot)
    assert got == expected
    assert sum(count for _, count in got) == size


def test_slots_must_have_room() -> None:
    with pytest.raises(ValueError, match="slot_bytes must be positive"):
        ring.chunks(10, 0)


@pytest.mark.parametrize(
    ("seq", "through"),
    [(0, 1 - SLOTS), (SLOTS - 1, 0), (SLOTS, 1), (10, 11 - SLOTS)],
)  # fmt: skip
def test_a_slot_is_reused_once_its_previous_chunk_is_read(seq: int, through: int) -> None:
    """Chunk ``seq`` waits for every chunk before ``through``: its slot's previous tenant,
    ``seq - SLOTS``, is the last of them (none for the first lap round the ring)."""
    assert ring.reusable_once_done(seq) == through
    tenant = seq - SLOTS
    assert tenant < through and (tenant < 0 or tenant % SLOTS == seq % SLOTS)


def test_the_ring_sockets_differ_so_one_push_can_hold_both() -> None:
    assert shm.socket_name("ab" * 8) != cuda_ipc.socket_name("ab" * 8)
    assert ring.socket_address("x") == "\0x"  # abstract namespace: no file to clean up


def offer(**fields: object) -> cuda_ipc.IpcOffer:
    base = {
        "gpu": "GPU-7d6f3c1e-0000-1111-2222-333344445555", "slot_bytes": 1 << 20, "device": 3,
        "handle": b"\x03c" + bytes(range(64)), "size_bytes": 4 << 20, "offset_bytes": 2 << 20,
        "events": tuple(bytes([i]) * 64 for i in range(SLOTS)),
    }  # fmt: skip
    return cuda_ipc.IpcOffer(**{**base, **fields})  # type: ignore[arg-type]


def body(message: bytes) -> bytes:
    (size,) = struct.unpack_from("!I", message)
    assert size == len(message) - 4
    return message[4:]


@pytest.mark.parametrize(
    "fields",
    [{}, {"handle": b"\x00" * 64}, {"gpu": ""}, {"offset_bytes": 0, "size_bytes": 4 << 20},
     {"device": -1}, {"slot_bytes": 1, "size_bytes": SLOTS}],
)  # fmt: skip
def test_an_offer_survives_the_wire_field_by_field(fields: dict) -> None:
    sent = offer(**fields)
    assert cuda_ipc.IpcOffer.unpack(body(sent.pack())) == sent


def corrupt(message: bytes, at: int, value: bytes) -> bytes:
    data = bytearray(body(message))
    data[at : at + len(value)] = value
    return bytes(data)


@pytest.mark.parametrize(
    ("mangle", "why"),
    [
        (lambda m: body(m)[:10], "too short"),
        (lambda m: corrupt(m, 0, b"XXXX"), "magic"),
        (lambda m: corrupt(m, 4, b"\x00\x09"), "version 9"),
        (lambda m: body(m)[:-1], "ends inside a field"),
        (lambda m: body(m) + b"\x00", "1 bytes follow"),
        (lambda m: body(offer(events=(b"e" * 64,)).pack()), "1 slot events"),
        (lambda m: body(offer(size_bytes=(4 << 20) - 1).pack()), "cannot hold"),
        (lambda m: body(offer(slot_bytes=0).pack()), "cannot hold"),
    ],
)  # fmt: skip
def test_a_malformed_offer_is_a_transport_error_that_says_what_to_check(mangle, why: str) -> None:
    expected = f"malformed CUDA IPC ring offer.*{why}.*same weight_sync"
    with pytest.raises(TransportError, match=expected):
        cuda_ipc.IpcOffer.unpack(mangle(offer().pack()))


@pytest.mark.parametrize(
    ("reason", "expected"),
    [(None, b"\x00\x00\x00"), ("no IPC", b"\x01\x00\x06no IPC"),
     ("é" * 3000, b"\x01\x0f\xa0" + ("é" * 2000).encode())],
)  # fmt: skip
def test_a_reader_answers_the_offer(reason: str | None, expected: bytes) -> None:
    assert ring.pack_joined(reason) == expected


@pytest.mark.parametrize("cls", [ring.RingUnavailableError, shm.ShmUnavailableError,
                                 cuda_ipc.IpcUnavailableError])  # fmt: skip
def test_an_unavailable_ring_names_its_ranks_across_processes(
    cls: type[ring.RingUnavailableError],
) -> None:
    error = cls("readers [2] could not map the ring", [2])
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls and back.ranks == [2] and str(back) == str(error)
    assert isinstance(back, TransportError)
    assert cls("the trainer could not").ranks == []


@pytest.mark.parametrize("device", ["cpu", "cuda", "meta", torch.device("cuda", 1)])
def test_the_cuda_ring_wants_an_indexed_cuda_device(device: object) -> None:
    reason = "CUDA is not available" if device == torch.device("cuda", 1) else "with its index"
    if torch.cuda.is_available() and reason == "CUDA is not available":
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match=reason):
        cuda_ipc.CudaIpcWriter("ab" * 8, 1, 4096, 5, device)  # type: ignore[arg-type]


@pytest.mark.skipif(not shm.available(), reason="the ring needs Linux (memfd, fd passing)")
def test_a_fanout_sends_from_where_every_part_can_read() -> None:
    """The host ring takes CPU and CUDA buffers alike (it copies into its slots either way), so
    a Fanout may send from a GPU through it; a device no part can read is refused up front."""
    host_ring = shm.ShmWriter("cd" * 8, 1, 4096, 5)
    try:
        assert host_ring.device == torch.device("cpu")
        assert host_ring.takes(torch.device("cuda", 0))
        assert not host_ring.takes(torch.device("meta"))
        assert Fanout([host_ring]).device == torch.device("cpu")
        assert Fanout([host_ring], device=torch.device("cuda", 0)).device == torch.device("cuda", 0)
        with pytest.raises(ValueError, match=r"\['ShmWriter'\] cannot send buffers on meta"):
            Fanout([host_ring], device=torch.device("meta"))
    finally:
        host_ring.close()
    with pytest.raises(ValueError, match="CPU or CUDA buffers"):
        shm.ShmWriter("ce" * 8, 1, 4096, 5, device="meta")


class _Event:
    """Stands in for a CUDA event behind a queued copy: finished after ``polls`` queries."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0


class _QueuingReader(ring.RingReader):
    """A reader whose copies out are queued (as a GPU reader's are), each finishing after the
    number of queries ``finishing`` gives it; the bytes are copied at once."""

    kind = "test"
    unavailable = ring.RingUnavailableError

    def __init__(self, link: ring.Link, slot_bytes: int, finishing: list[int]) -> None:
        spec = GroupSpec(group_id="ab" * 8, address="test", port=0, transport="shm",
                         world_size=2, rank=1, backend="gloo", mode="world",
                         rendezvous_timeout_s=5, collective_timeout_s=5)  # fmt: skip
        super().__init__(spec, link, slot_bytes, torch.device("cpu"))
        self.slots = torch.zeros(SLOTS, slot_bytes, dtype=torch.uint8)
        self.finishing = finishing
        self.abandoned = 0
        self.stranded = False

    def _drain(self, slot: int, out: torch.Tensor, deadline: float) -> object:
        out.copy_(self.slots[slot][: out.numel()])
        return _Event(self.finishing.pop(0))

    def _abandon(self, out: torch.Tensor) -> None:
        self.abandoned += 1

    def _unmap(self) -> None:
        pass

    def _strand(self) -> None:
        self.stranded = True


def _writer_end(slot_bytes: int, finishing: list[int]) -> tuple[socket.socket, _QueuingReader]:
    ours, theirs = socket.socketpair()
    ours.settimeout(5)
    reader = _QueuingReader(ring.Link(theirs, 0, "test"), slot_bytes, finishing)
    return ours, reader


def _readies(conn: socket.socket, first: int, sizes: list[int]) -> None:
    conn.sendall(b"".join(ring.READY.pack(first + i, n) for i, n in enumerate(sizes)))


def _dones(conn: socket.socket) -> list[int]:
    """Every DONE the reader has sent so far (votes marked by ``ring.VOTE``)."""
    conn.setblocking(False)
    data = b""
    try:
        while part := conn.recv(4096):
            data += part
    except BlockingIOError:
        pass
    conn.settimeout(5)
    return [word for (word,) in ring.DONE.iter_unpack(data)]


@pytest.mark.timeout(30)
def test_a_reader_says_done_as_it_finds_copies_finished_and_waits_only_for_a_slot() -> None:
    """Copies still running when a broadcast returns are said DONE later, in order: at the next
    broadcast as found finished, or at ``wait`` (the receive's end). The reader waits for a copy
    only when the writer needs that chunk's slot back -- before the chunk ``SLOTS`` on."""
    conn, reader = _writer_end(4, [5] * (SLOTS + 2))
    try:
        _readies(conn, 0, [4, 4, 4])
        first = reader.broadcast(torch.empty(12, dtype=torch.uint8), src=0)
        assert isinstance(first, ring.Copying)
        assert _dones(conn) == []  # three copies in flight, none waited for
        _readies(conn, 3, [4, 4, 4])
        second = reader.broadcast(torch.empty(12, dtype=torch.uint8), src=0)
        # Chunks SLOTS and SLOTS + 1 reuse the slots of chunks 0 and 1: those were waited for.
        assert _dones(conn)[:2] == [0, 1]
        first.wait()
        second.wait()
        assert _dones(conn) == [2, 3, 4, 5]
        assert reader._pending == deque()
    finally:
        reader.close()
        conn.close()


@pytest.mark.timeout(30)
def test_a_reader_votes_only_after_every_chunk_is_done() -> None:
    conn, reader = _writer_end(4, [3, 3])
    try:
        _readies(conn, 0, [4, 4])
        reader.broadcast(torch.empty(8, dtype=torch.uint8), src=0)
        conn.sendall(ring.READY.pack(ring.VOTE | 0, 0))  # the outcome, ahead of time
        assert reader.vote(0) == 0
        assert _dones(conn) == [0, 1, ring.VOTE | 0]
    finally:
        reader.close()
        conn.close()


@pytest.mark.timeout(30)
def test_a_copy_that_never_finishes_times_out_and_keeps_its_memory() -> None:
    """A copy stuck behind a frozen writer: the wait ends at the deadline, naming the chunk,
    and every copy still queued keeps its memory from the allocator (``_abandon``)."""
    conn, reader = _writer_end(4, [10**9, 10**9])
    try:
        _readies(conn, 0, [4, 4])
        work = reader.broadcast(torch.empty(8, dtype=torch.uint8), src=0, timeout_s=0.2)
        with pytest.raises(SyncTimeoutError, match="chunk 0 out of the trainer's test slot"):
            work.wait()
        assert reader.abandoned == 2
        assert _dones(conn) == []
        reader.close()  # the copies are still queued: the ring stays mapped
        assert reader.stranded
    finally:
        reader.close()
        conn.close()


@pytest.mark.timeout(30)
def test_a_reader_closed_mid_push_unmaps_once_its_queued_copies_have_finished() -> None:
    conn, reader = _writer_end(4, [3, 3])
    try:
        _readies(conn, 0, [4, 4])
        reader.broadcast(torch.empty(8, dtype=torch.uint8), src=0)  # never waited for
        reader.close()
        assert not reader.stranded and reader.abandoned == 0
    finally:
        conn.close()


class _HostWriter(ring.RingWriter):
    """A ring writer whose slots are the reader's own (one process): the real writer's
    protocol -- READY, waiting for DONE before reusing a slot, votes -- over a socket pair."""

    kind = "test"
    unavailable = ring.RingUnavailableError

    def __init__(self, slots: torch.Tensor, link: ring.Link) -> None:
        name = "weight_sync-test-" + secrets.token_hex(8)
        super().__init__(name, 1, slots.shape[1], 10, "ab" * 8)
        self.slots = slots
        self._links = [link]  # what accept would have found

    def _offer(self, link: ring.Link) -> None:
        raise AssertionError("no handshake here")

    def _fill(self, slot: int, chunk: torch.Tensor, deadline: float) -> None:
        self.slots[slot][: chunk.numel()].copy_(chunk)

    def _release(self) -> None:
        pass


@pytest.mark.timeout(60)
def test_a_queuing_reader_keeps_a_real_writer_going_over_many_laps() -> None:
    """The writer waits for DONE of a slot's previous chunk before it refills the slot: a
    reader that held that DONE back while it waited for the next READY would stall both ends
    until the timeout. Broadcasts of several laps round the ring, the reader keeping two in
    flight as a receive does; every byte arrives, and the vote follows."""
    ours, theirs = socket.socketpair()
    reader = _QueuingReader(ring.Link(theirs, 0, "test"), 4, [2] * 64)
    writer = _HostWriter(reader.slots, ring.Link(ours, 1, "test"))
    generator = torch.Generator().manual_seed(3)
    sent = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)
            for n in (16, 12, 20, 4, 33)]  # fmt: skip
    failures: list[BaseException] = []

    def write() -> None:
        try:
            for work in [writer.broadcast(tensor, 0) for tensor in sent]:
                work.wait()
            writer.vote(0)
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        got = [torch.empty_like(tensor) for tensor in sent]
        works = [reader.broadcast(got[0], 0)]
        for index in range(1, len(got)):
            works.append(reader.broadcast(got[index], 0))
            works[index - 1].after()
        works[-1].wait()
        assert reader.vote(0) == 0
        thread.join(10)
        assert not failures and not thread.is_alive(), failures
        assert all(torch.equal(a, b) for a, b in zip(sent, got, strict=True))
    finally:
        writer.close()
        reader.close()
