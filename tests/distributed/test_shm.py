"""The shared-memory ring on spawned ranks: the dtype zoo and the direct path through the real
sender and receiver, a push mixing the ring with a Gloo group, and its failures -- a reader killed
or frozen mid-push, the trainer killed mid-push, a stranger at the socket, no room for the ring --
each checked for what survives in /dev/shm."""

from __future__ import annotations

import logging
import os
import resource
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import RankContext, receive_plan, run_ranks
from tests.zoo import zoo
from weight_sync import SyncConfig
from weight_sync.errors import SyncTimeoutError, TransportError, WeightSyncError
from weight_sync.metadata import TensorMeta
from weight_sync.planner import make_plan
from weight_sync.protocol import _open_ring
from weight_sync.receiver import Receiver
from weight_sync.sender import Entries, PushPlanner, Sender
from weight_sync.transport import Fanout, TorchGroup, shm
from weight_sync.verify import state_dict_digests

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not shm.available(), reason="the ring needs Linux (memfd, fd passing)"),
]
BUCKET = 4096  # slots of 1 KiB: every push crosses the ring many times over


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def writer(ctx: RankContext, readers: int, timeout_s: float = 30, bucket: int = BUCKET) -> shm.ShmWriter:
    ring = shm.ShmWriter(ctx.group_id, readers, shm.slot_bytes_for(bucket), timeout_s)
    ctx.ports()  # the ring listens: the readers may come (see join_ring)
    ring.accept(30)
    return ring


def join_ring(ctx: RankContext, **overrides: object) -> shm.ShmReader:
    """A reader joins once rank 0 listens, as the updater sends specs only then."""
    ctx.ports()
    return shm.ShmReader.join(ctx.shm_spec(**overrides))


def zoo_rank(ctx: RankContext) -> dict[str, str]:
    """Rank 0 sends the zoo to a mixed group: ranks 1 and 2 read the ring (streaming, and atomic
    staging), rank 3 takes a Gloo group with rank 0. A stranger knocks on the ring first."""
    tensors = zoo(seed=11)
    plan = make_plan([TensorMeta.of(n, t) for n, t in tensors.items()], BUCKET, 64)
    readers = 2
    if ctx.rank == 0:
        ring = shm.ShmWriter(ctx.group_id, readers, shm.slot_bytes_for(BUCKET), 30)
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stranger.connect("\0" + shm.socket_name(ctx.group_id))
        stranger.sendall(b"0" * 20)  # the right size, the wrong group id
        ctx.ports()  # the ring listens: the readers may come (see join_ring)
        ring.accept(30)
        stranger.settimeout(5)
        assert stranger.recv(64) == b"", "the stranger was handed the ring"
        stranger.close()
        group_spec = ctx.spec("standalone", world_size=2, rank=0)
        transport = Fanout([TorchGroup.join(group_spec, ctx.listener(0)), ring])
        try:
            Sender(transport).send(plan, list(tensors.values()))
        finally:
            transport.close()
        return state_dict_digests(tensors)
    ctx.ports()  # only once rank 0 listens on the ring (ctx.spec would ask for ports sooner)
    if ctx.rank <= readers:
        spec = ctx.shm_spec(world_size=readers + 1)
    else:
        spec = ctx.spec("standalone", world_size=2, rank=1)
    expected = {n: TensorMeta.of(n, t) for n, t in tensors.items()}
    staging = "atomic" if ctx.rank == 2 else "stream"
    return state_dict_digests(receive_plan(spec, plan, expected, staging=staging))


def test_zoo_through_the_ring_and_a_group_at_once() -> None:
    before = dev_shm()
    results = run_ranks(zoo_rank, 4)
    assert all(result == results[0] for result in results[1:])
    assert dev_shm() == before  # the ring never has a name


def voting_rank(ctx: RankContext) -> list[int]:
    """A mixed group (ranks 1 and 2 on the ring, 3 and 4 in a Gloo group with rank 0) votes
    between broadcasts: every rank gets the largest code, and the bytes stay in step."""
    readers = 2
    data = torch.arange(3 * BUCKET, dtype=torch.int64).view(torch.uint8)[: 3 * BUCKET]
    if ctx.rank == 0:
        ring = shm.ShmWriter(ctx.group_id, readers, shm.slot_bytes_for(BUCKET), 30)
        ctx.ports()
        ring.accept(30)
        group_spec = ctx.spec("standalone", world_size=3, rank=0)
        transport: Fanout | TorchGroup | shm.ShmReader = Fanout(
            [TorchGroup.join(group_spec, ctx.listener(0)), ring]
        )
    else:
        ctx.ports()
        if ctx.rank <= readers:
            transport = shm.ShmReader.join(ctx.shm_spec(world_size=readers + 1))
        else:
            transport = TorchGroup.join(ctx.spec("standalone", world_size=3, rank=ctx.rank - readers))
    outcomes = []
    try:
        for round_ in range(3):
            buffer = data.clone() if ctx.rank == 0 else torch.zeros_like(data)
            transport.broadcast(buffer, 0).wait()
            assert torch.equal(buffer, data)
            # Round 0: everyone agrees (0); then the largest code comes from a ring reader, then
            # from a member of the Gloo group.
            voter = {0: None, 1: 2, 2: 4}[round_]
            outcomes.append(transport.vote(10 + round_ if ctx.rank == voter else 0, timeout_s=20))
    finally:
        transport.close()
    return outcomes


def test_a_vote_reaches_every_rank_of_a_mixed_group() -> None:
    assert run_ranks(voting_rank, 5) == [[0, 11, 12]] * 5


def direct_rank(ctx: RankContext) -> dict[str, str]:
    """Tensors far larger than the ring go direct and land in the reader's own tensors."""
    tensors = zoo(seed=13, big=40_000)
    config = SyncConfig(bucket_bytes=BUCKET, direct_min_bytes=10_000)
    plan = PushPlanner(config, torch.device("cpu")).plan(Entries(list(tensors), list(tensors.values())))
    assert sum(b.direct for b in plan.buckets) >= 2
    if ctx.rank == 0:
        ring = writer(ctx, ctx.world_size - 1)
        try:
            Sender(ring).send(plan, list(tensors.values()))
        finally:
            ring.close()
        return state_dict_digests(tensors)
    model = {n: torch.zeros_like(t.contiguous()) for n, t in tensors.items()}
    ctx.ports()
    got = receive_plan(ctx.shm_spec(), plan, destinations=model)
    assert all(got[n] is model[n] for n in model)
    return state_dict_digests(got)


def test_direct_tensors_land_in_place() -> None:
    results = run_ranks(direct_rank, 2)
    assert results[1] == results[0]


# -- failures --------------------------------------------------------------------------------

NBYTES = 64 << 20


def struck_rank(ctx: RankContext, victim: int, how: str) -> tuple[str, float] | None:
    """One broadcast goes through; then rank ``victim`` is killed (or frozen) and the others
    start a 64 MiB broadcast over 256 KiB slots. Every survivor reports the error it saw and how
    long it took."""
    data = torch.ones(NBYTES, dtype=torch.uint8)
    if ctx.rank == 0:
        transport: shm.ShmWriter | shm.ShmReader = writer(ctx, ctx.world_size - 1, 3, 1 << 20)
    else:
        transport = join_ring(ctx, collective_timeout_s=3)
    try:
        transport.broadcast(data[: NBYTES // 4], 0).wait()
        if ctx.rank == victim:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        start = time.monotonic()
        try:
            transport.broadcast(data, 0).wait()
        except WeightSyncError as exc:
            return type(exc).__name__, time.monotonic() - start
        return None
    finally:
        transport.close()


@pytest.mark.parametrize(("victim", "how"), [(1, "kill"), (1, "freeze"), (0, "kill")])
def test_a_strike_mid_push_fails_every_survivor_quickly(victim: int, how: str) -> None:
    """A reader killed: the trainer fails at once (EOF), and the other readers once it hangs up.
    A reader frozen: the trainer at its 3 s timeout. The trainer killed: every reader at once.
    Nothing is left in /dev/shm either way."""
    before = dev_shm()
    world = 3
    results = run_ranks(struck_rank, world, victim, how, timeout_s=60, expect_dead={victim})
    for rank in set(range(world)) - {victim}:
        assert results[rank] is not None, f"rank {rank} finished a push that lost a member"
        name, seconds = results[rank]
        expected = "SyncTimeoutError" if how == "freeze" and rank == 0 else None
        if expected:
            assert name == expected and 2.5 < seconds < 6, results[rank]
        else:
            assert name in ("TransportError", "SyncTimeoutError"), results[rank]
            assert seconds < (6 if how == "freeze" else 2), results[rank]
    assert dev_shm() == before


def test_no_room_is_a_clear_error_and_the_updater_falls_back_to_the_group(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a 1 MiB file-size limit the ring's 4 MiB cannot be claimed (fallocate fails): the
    ring says so, naming the size, and the updater sends those workers through the group."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(shm.ShmUnavailableError, match=r"cannot claim 4\.0 MiB.*same_host='group'"):
            shm.ShmWriter("cd" * 8, 1, 1 << 20, 30)
        with caplog.at_level(logging.WARNING, logger="weight_sync.protocol"):
            assert _open_ring(SyncConfig(bucket_bytes=4 << 20), "cd" * 8, 2) is None
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "take the group instead" in caplog.text and "4.0 MiB" in caplog.text


def test_a_reader_that_cannot_reach_the_ring_fails_fast() -> None:
    spec = RankContext(1, 2, None, "ab" * 8).shm_spec(rendezvous_timeout_s=5)  # type: ignore[arg-type]
    start = time.monotonic()
    with pytest.raises(TransportError, match="must run on this host"):
        Receiver().join(spec, 1 << 20)
    assert time.monotonic() - start < 2


def test_host_key_names_this_kernel_and_network_namespace() -> None:
    key = shm.host_key()
    assert key is not None
    assert Path("/proc/sys/kernel/random/boot_id").read_text().strip() in key
    assert os.readlink("/proc/self/ns/net") in key
