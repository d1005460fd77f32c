"""The colocated route on one GPU: two processes on the same device, the trainer's end and a
member's, over the CUDA ring (``transport.cuda_ipc``) and over the host ring carrying CUDA
tensors (``transport.shm`` with a CUDA device on both sides, the fallback where IPC is refused).

Written to run as is on a machine with one NVIDIA GPU, Python 3.12, a CUDA torch and no Ray:
nothing here imports Ray, directly or through ``tests.distributed.harness`` (spawned ranks with
a hard deadline, every rank killed on the way out). Skipped where there is no GPU.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time

import pytest
import torch

from tests.distributed.harness import RankContext, run_ranks
from weight_sync.errors import SyncTimeoutError, TransportError, WeightSyncError
from weight_sync.wire.metadata import GroupSpec
from weight_sync.transport import cuda_ipc, ring, shm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not shm.available(), reason="the rings need Linux (abstract sockets)"),
]
GPU = torch.device("cuda", 0)
BUCKET = 1 << 16  # a ring of four 16 KiB slots
End = ring.RingWriter | ring.RingReader
SIZES = [3 * BUCKET + 123, BUCKET, 5 * BUCKET, 17]  # each bucket crosses the ring several times


def payload(index: int) -> torch.Tensor:
    """Bucket ``index``'s bytes, the same in every process (made on the CPU from a seed)."""
    generator = torch.Generator().manual_seed(1000 + index)
    return torch.randint(0, 256, (SIZES[index],), dtype=torch.uint8, generator=generator)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest()


def ipc_spec(ctx: RankContext, **overrides: object) -> GroupSpec:
    return ctx.shm_spec(transport="cuda_ipc", address=cuda_ipc.socket_name(ctx.group_id),
                        backend="nccl", **overrides)  # fmt: skip


def open_end(ctx: RankContext, route: str) -> End:
    """This rank's end of ``route``: rank 0 writes (its buffers on the GPU), the others read
    into buffers on the same GPU."""
    torch.cuda.set_device(GPU)
    slot = ring.slot_bytes_for(BUCKET)
    if ctx.rank == 0:
        end: ring.RingWriter
        if route == "cuda_ipc":
            end = cuda_ipc.CudaIpcWriter(ctx.group_id, ctx.world_size - 1, slot, 30, GPU)
        else:
            end = shm.ShmWriter(ctx.group_id, ctx.world_size - 1, slot, 30, device=GPU)
        ctx.ports()  # the ring listens: the readers may come
        end.accept(30)
        return end
    ctx.ports()
    if route == "cuda_ipc":
        return cuda_ipc.CudaIpcReader.join(ipc_spec(ctx), GPU)
    return shm.ShmReader.join(ctx.shm_spec(backend="nccl"), GPU)


def pushing_rank(ctx: RankContext, route: str) -> tuple[list[str], int, bool]:
    """Every bucket of ``SIZES`` from rank 0's GPU buffers into the readers' GPU buffers, then a
    vote (rank 1 votes 7). On the trainer, the sent buffer is overwritten on another stream
    right after ``after()``, while its copies into the ring are held back by a sleep on the
    sending stream: the bytes arrive intact only if ``after`` orders that stream behind them."""
    end = open_end(ctx, route)
    try:
        host = end if isinstance(end, (shm.ShmWriter, shm.ShmReader)) else None
        pinned = host is not None and all(slot.is_pinned() for slot in host._ring._slots)
        got = []
        for index in range(len(SIZES)):
            if ctx.rank == 0:
                buffer = payload(index).to(GPU)
                torch.cuda._sleep(50_000_000)  # ~tens of ms: the ring's copies wait behind it
                work = end.broadcast(buffer, 0)
                other = torch.cuda.Stream(GPU)
                with torch.cuda.stream(other):
                    work.after()
                    buffer.fill_(0)
                buffer.record_stream(other)  # freed next round: not before the fill has run
                work.wait()
                got.append(digest(payload(index)))
            else:
                buffer = torch.full((SIZES[index],), 255, dtype=torch.uint8, device=GPU)
                end.broadcast(buffer, 0).wait()
                assert buffer.device == GPU
                got.append(digest(buffer))
        outcome = end.vote(7 if ctx.rank == 1 else 0, timeout_s=20)
        torch.cuda.synchronize()
        return got, outcome, pinned
    finally:
        end.close()


@pytest.mark.parametrize("route", ["cuda_ipc", "shm"])
def test_a_colocated_push_is_bit_exact(route: str) -> None:
    """Two processes on the one GPU. Over the CUDA ring the bytes never leave the device; over
    the host ring they go device-to-host-to-device through pinned slots."""
    (sent, vote0, _), (received, vote1, pinned) = run_ranks(pushing_rank, 2, route, timeout_s=180)
    assert received == sent
    assert vote0 == vote1 == 7
    if route == "shm":
        assert pinned, "the host ring was not registered with CUDA: its copies would be pageable"


NBYTES = 64 << 20


def struck_rank(ctx: RankContext, route: str) -> tuple[str, float] | None:
    """A first broadcast goes through; then the reader kills itself and the trainer starts a
    64 MiB broadcast over 16 KiB slots, bounded at 3 s."""
    end = open_end(ctx, route)
    data = torch.ones(NBYTES, dtype=torch.uint8, device=GPU)
    try:
        end.broadcast(data[:BUCKET], 0).wait()
        if ctx.rank == 1:
            torch.cuda.synchronize()
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            end.broadcast(data, 0, timeout_s=3).wait()
        except WeightSyncError as exc:
            return type(exc).__name__, time.monotonic() - start
        return None
    finally:
        end.close()


@pytest.mark.parametrize("route", ["cuda_ipc", "shm"])
def test_a_reader_killed_mid_broadcast_fails_the_trainer_in_time(route: str) -> None:
    result, _ = run_ranks(struck_rank, 2, route, timeout_s=90, expect_dead={1})
    assert result is not None, "the trainer finished a broadcast to a dead reader"
    name, seconds = result
    assert name in (TransportError.__name__, SyncTimeoutError.__name__), result
    assert seconds < 6, result


def same_process_rank(ctx: RankContext) -> tuple[list[int], str]:
    """CUDA does not open an IPC handle in the process that exported it (cudaIpcOpenMemHandle
    fails there), so a reader in the trainer's own process is refused: the reader says so in
    the handshake and ``accept`` raises ``IpcUnavailableError`` naming it -- the path a member
    in a container without a shared IPC namespace takes."""
    torch.cuda.set_device(GPU)
    writer = cuda_ipc.CudaIpcWriter(ctx.group_id, 1, ring.slot_bytes_for(BUCKET), 10, GPU)
    refused: list[BaseException] = []

    def join() -> None:
        try:
            cuda_ipc.CudaIpcReader.join(ipc_spec(ctx, world_size=2, rank=1), GPU).close()
        except BaseException as exc:
            refused.append(exc)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    try:
        with pytest.raises(cuda_ipc.IpcUnavailableError, match="could not map the ring") as err:
            writer.accept(30)
    finally:
        writer.close()
    thread.join(30)
    assert refused and isinstance(refused[0], cuda_ipc.IpcUnavailableError), refused
    return err.value.ranks, str(refused[0])


def test_a_reader_that_cannot_open_the_handle_is_named_at_accept() -> None:
    ((ranks, reason),) = run_ranks(same_process_rank, 1, timeout_s=90)
    assert ranks == [1]
    assert "cudaIpcOpenMemHandle" in reason


SPIN_CYCLES = 2_000_000_000  # about a second on a GPU at 1.5-2 GHz


def spun_rank(ctx: RankContext) -> tuple[float, float, str] | str:
    """The trainer holds its copies into the ring behind a spin of about a second and sends
    ``SLOTS - 1`` chunks (READY goes out at once: no host sync). The reader's ``broadcast``
    returns while its copies still wait on the GPU; its ``wait`` returns after the spin."""
    end = open_end(ctx, "cuda_ipc")
    size = (ring.SLOTS - 1) * ring.slot_bytes_for(BUCKET)
    try:
        if ctx.rank == 0:
            buffer = payload(0).repeat(size // SIZES[0] + 1)[:size].to(GPU)
            torch.cuda.synchronize()
            torch.cuda._sleep(SPIN_CYCLES)
            end.broadcast(buffer, 0).wait()
            torch.cuda.synchronize()
            return digest(buffer)
        buffer = torch.zeros(size, dtype=torch.uint8, device=GPU)
        torch.cuda.synchronize()
        start = time.monotonic()
        work = end.broadcast(buffer, 0)
        returned = time.monotonic() - start
        work.wait()
        waited = time.monotonic() - start
        return returned, waited, digest(buffer)
    finally:
        end.close()


def test_a_reader_queues_its_copies_and_waits_once_per_bucket() -> None:
    """No host wait per chunk on the reader: chunks whose slot is not needed back are said
    DONE as they are found finished, and the one wait is the bucket's, before it is used."""
    sent, (returned, waited, received) = run_ranks(spun_rank, 2, timeout_s=120)
    assert received == sent
    assert waited > 0.3, (returned, waited)  # the spin ran: the copies did wait on it
    assert returned < waited / 3, (returned, waited)
