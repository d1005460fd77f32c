"""Pure pieces of the rings (``transport.ring``, ``transport.cuda_ipc``): how a buffer is cut into
chunks and when a slot may be reused, the CUDA ring's offer on the wire, a reader's answer, the
errors that name ranks, and which devices each end and a ``Fanout`` take."""

from __future__ import annotations

import pickle
import struct

import pytest
import torch

from weight_sync.errors import TransportError
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
