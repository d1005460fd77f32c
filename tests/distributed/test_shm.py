"""The shared-memory ring on spawned ranks: the dtype zoo and the direct path through the real
sender and receiver, a push mixing the ring with a Gloo group, and its failures -- a reader killed
or frozen mid-push, the trainer killed mid-push, a stranger at the socket, no room for the ring --
a reader that cannot map the ring -- each checked for what survives in /dev/shm."""

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
from weight_sync.wire.checksums import state_dict_digests
from weight_sync.errors import TransportError, WeightSyncError
from weight_sync.wire.metadata import TensorMeta
from weight_sync.wire.planner import make_plan
from weight_sync.receive.receiver import Receiver
from weight_sync.wire.state_dict import Entries
from weight_sync.send.formation import _open_ring
from weight_sync.send.sender import PushPlanner, Sender
from weight_sync.transport import Fanout, TorchGroup, ring, shm

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not shm.available(), reason="the ring needs Linux (memfd, fd passing)"),
]
BUCKET = 4096  # slots of 1 KiB: every push crosses the ring many times over


def dev_shm() -> set[str]:
    """What is in /dev/shm, less multiprocessing's semaphores (``sem.*``): processes of other
    test runs on the machine make and unlink those at any moment; the ring never does."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


def writer(
    ctx: RankContext, readers: int, timeout_s: float = 30, bucket: int = BUCKET
) -> shm.ShmWriter:
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
            transport = TorchGroup.join(
                ctx.spec("standalone", world_size=3, rank=ctx.rank - readers)
            )
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
    plan = PushPlanner(config, torch.device("cpu")).plan(
        Entries(list(tensors), list(tensors.values()))
    )
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
    long it took. The struck broadcast is bounded at 3 s; the first one by the group's 30 s,
    since a reader's clock starts as soon as it has joined, while the trainer may still wait
    for a slower reader to start (seconds, on a loaded 2-core machine)."""
    data = torch.ones(NBYTES, dtype=torch.uint8)
    if ctx.rank == 0:
        transport: shm.ShmWriter | shm.ShmReader = writer(ctx, ctx.world_size - 1, 30, 1 << 20)
    else:
        transport = join_ring(ctx, collective_timeout_s=30)
    try:
        transport.broadcast(data[: NBYTES // 4], 0).wait()
        if ctx.rank == victim:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        start = time.monotonic()
        try:
            transport.broadcast(data, 0, timeout_s=3).wait()
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
        with pytest.raises(
            shm.ShmUnavailableError, match=r"cannot claim 4\.0 MiB.*same_host='group'"
        ):
            shm.ShmWriter("cd" * 8, 1, 1 << 20, 30)
        with caplog.at_level(logging.WARNING, logger="weight_sync.send.formation"):
            assert _open_ring(SyncConfig(bucket_bytes=4 << 20), "cd" * 8, 2) is None
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "take the group instead" in caplog.text and "4.0 MiB" in caplog.text


def refusing_rank(ctx: RankContext) -> float | None:
    """Rank 0 offers its ring to two readers: rank 1 maps it; rank 2 -- a peer speaking the
    ring's protocol by hand, as a worker whose mapping failed does -- refuses it and says why.
    ``accept`` raises at once naming rank 2 and its reason, and rank 1 learns that the ring is
    gone from its very next wait."""
    if ctx.rank == 0:
        writer_ = shm.ShmWriter(ctx.group_id, 2, shm.slot_bytes_for(BUCKET), 30)
        ctx.ports()
        start = time.monotonic()
        try:
            refused = r"readers \[2\].*cannot map it here"
            with pytest.raises(shm.ShmUnavailableError, match=refused) as err:
                writer_.accept(30)
        finally:
            writer_.close()
        assert err.value.ranks == [2]
        return time.monotonic() - start
    ctx.ports()
    if ctx.rank == 1:
        reader = shm.ShmReader.join(ctx.shm_spec(world_size=3))
        try:
            hung_up = "the trainer closed its shared-memory connection"
            with pytest.raises(TransportError, match=hung_up):
                reader.broadcast(torch.zeros(8, dtype=torch.uint8), 0)
        finally:
            reader.close()
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)
    try:
        conn.connect(ring.socket_address(shm.socket_name(ctx.group_id)))
        conn.sendall(ring.HELLO.pack(ctx.group_id.encode()[:16], 2))
        _, fds, _, _ = socket.recv_fds(conn, 64, 1)
        for fd in fds:
            os.close(fd)
        assert len(fds) == 1, "the trainer did not offer the ring"
        conn.sendall(ring.pack_joined("cannot map it here"))
        assert conn.recv(1) == b"", "the trainer kept a reader that refused its ring"
    finally:
        conn.close()
    return None


def test_a_reader_that_cannot_map_the_ring_is_named_at_accept() -> None:
    before = dev_shm()
    seconds, _, _ = run_ranks(refusing_rank, 3)
    assert seconds < 10
    assert dev_shm() == before


def after_rank(ctx: RankContext) -> list[int]:
    """On the host ring ``after`` is ``wait``: once it returns, every reader has the bytes, and
    the trainer may overwrite its buffer at once (no stream to order on the CPU)."""
    data = torch.arange(5 * BUCKET // 8, dtype=torch.int64).view(torch.uint8)
    if ctx.rank == 0:
        transport: shm.ShmWriter | shm.ShmReader = writer(ctx, ctx.world_size - 1)
    else:
        transport = join_ring(ctx)
    try:
        for round_ in range(3):
            expected = data + round_
            buffer = expected.clone() if ctx.rank == 0 else torch.zeros_like(data)
            work = transport.broadcast(buffer, 0)
            work.after()
            if ctx.rank == 0:
                buffer.fill_(255)  # free again: the readers copied it out before after returned
            else:
                assert torch.equal(buffer, expected)
        return [transport.vote(3 if ctx.rank == 1 else 0, timeout_s=20)]
    finally:
        transport.close()


def test_after_on_the_host_ring_is_wait() -> None:
    assert run_ranks(after_rank, 3) == [[3]] * 3


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
