"""A relay on spawned ranks (weight_sync.transport.relay): rank 0 is the trainer, rank 1 the only
other rank of the Gloo group, and it passes every broadcast on to ranks 2.. through a ring of its
own -- the real sender and receiver, votes across both hops, and a strike on either side of it.
Which members relay is decided by host keys (weight_sync.send.routes, tested as a table); that the
payload then crosses a real link once is measured on namespaces in tests/deploy."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.distributed.harness import RankContext, receive_plan, run_ranks
from tests.distributed.test_shm import dev_shm
from tests.zoo import zoo
from weight_sync.wire.checksums import state_dict_digests
from weight_sync.transport.devices import CPU
from weight_sync.errors import WeightSyncError
from weight_sync.wire.metadata import GroupSpec, RelaySpec, TensorMeta
from weight_sync.wire.planner import make_plan
from weight_sync.receive.receiver import _join
from weight_sync.send.sender import Sender
from weight_sync.transport import TorchGroup, Transport, shm

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not shm.available(), reason="the ring needs Linux (memfd, fd passing)"),
]
BUCKET = 4096  # slots of 1 KiB: every bucket crosses the relay's ring in several chunks


def relay_id(ctx: RankContext) -> str:
    return ctx.group_id[::-1]  # the relay's ring: an id of its own, known to every rank


def spec_of(ctx: RankContext, timeout_s: float = 30, bucket: int = BUCKET) -> GroupSpec:
    """Rank 1 joins the group and relays to ranks 2..; those join rank 1's ring (with no port
    to wait for: they dial the ring until rank 1 opens it)."""
    followers = ctx.world_size - 2
    if ctx.rank >= 2:
        ring = relay_id(ctx)
        return GroupSpec(group_id=ring, address=shm.socket_name(ring), port=0, transport="relay",
                         world_size=followers + 1, rank=ctx.rank - 1, backend="gloo",
                         mode="standalone", rendezvous_timeout_s=30,
                         collective_timeout_s=timeout_s)  # fmt: skip
    relay = None
    if ctx.rank == 1:
        relay = RelaySpec(group_id=relay_id(ctx), readers=followers,
                          slot_bytes=shm.slot_bytes_for(bucket))  # fmt: skip
    return ctx.spec("standalone", world_size=2, collective_timeout_s=timeout_s, relay=relay)


def zoo_rank(ctx: RankContext) -> dict[str, str]:
    tensors = zoo(seed=17)
    plan = make_plan([TensorMeta.of(n, t) for n, t in tensors.items()], BUCKET, 64)
    if ctx.rank == 0:
        group = TorchGroup.join(spec_of(ctx), ctx.listener(0))
        try:
            Sender(group).send(plan, list(tensors.values()))
        finally:
            group.close()
        return state_dict_digests(tensors)
    expected = {n: TensorMeta.of(n, t) for n, t in tensors.items()}
    staging = "atomic" if ctx.rank == 3 else "stream"
    return state_dict_digests(receive_plan(spec_of(ctx), plan, expected, staging=staging))


def test_the_zoo_through_a_relay_lands_bit_exact_on_every_follower() -> None:
    before = dev_shm()
    results = run_ranks(zoo_rank, 5)
    assert all(result == results[0] for result in results[1:])
    assert dev_shm() == before


def voting_rank(ctx: RankContext) -> list[int]:
    """Broadcasts and votes in turn: the largest code comes from the trainer, a follower, then
    the relaying member; every rank hears it, and the bytes stay in step."""
    data = torch.arange(3 * BUCKET, dtype=torch.int64).view(torch.uint8)[: 5 * BUCKET]
    if ctx.rank == 0:
        transport: Transport = TorchGroup.join(spec_of(ctx), ctx.listener(0))
    else:
        transport = _join(spec_of(ctx), CPU)
    outcomes = []
    try:
        for round_ in range(3):
            buffer = data.clone() if ctx.rank == 0 else torch.zeros_like(data)
            works = [transport.broadcast(part, 0) for part in buffer.split(BUCKET)]
            for work in works:
                work.wait()
            assert torch.equal(buffer, data)
            voter = (0, 3, 1)[round_]
            outcomes.append(transport.vote(10 + round_ if ctx.rank == voter else 0, timeout_s=20))
    finally:
        transport.close()
    return outcomes


def test_a_vote_crosses_the_relay_both_ways() -> None:
    assert run_ranks(voting_rank, 4) == [[10, 11, 12]] * 4


NBYTES = 32 << 20


def struck_rank(ctx: RankContext, victim: int) -> tuple[str, float] | None:
    """One broadcast goes through; then ``victim`` is killed and the others start a 32 MiB
    broadcast and a vote (as a push ends), each bounded at 5 s. Every survivor reports the
    error it saw and how long it took."""
    data = torch.ones(NBYTES, dtype=torch.uint8)
    if ctx.rank == 0:
        transport: Transport = TorchGroup.join(spec_of(ctx, 30, 1 << 20), ctx.listener(0))
    else:
        transport = _join(spec_of(ctx, 30, 1 << 20), CPU)
    try:
        transport.broadcast(data[: NBYTES // 8], 0).wait()
        if ctx.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            transport.broadcast(data, 0, timeout_s=5).wait()
            transport.vote(0, timeout_s=5)
        except WeightSyncError as exc:
            return type(exc).__name__, time.monotonic() - start
        return None
    finally:
        transport.close()


@pytest.mark.parametrize("victim", [1, 2])
def test_a_strike_on_either_side_of_the_relay_fails_every_survivor_at_once(victim: int) -> None:
    """The relaying member killed: the trainer's broadcast and its followers fail at once. A
    follower killed: the relaying member's forward fails and it leaves, so the trainer's vote
    fails too -- none waits for the 5 s bound. Nothing is left in /dev/shm."""
    before = dev_shm()
    results = run_ranks(struck_rank, 4, victim, timeout_s=90, expect_dead={victim})
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        assert result is not None, f"rank {rank} finished a broadcast that lost rank {victim}"
        name, seconds = result
        assert seconds < 4, (rank, name, seconds)
    assert dev_shm() == before
