"""Real Gloo groups on spawned ranks: both ways of building the group, and the dtype zoo through
the real sender and receiver."""

from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import RankContext, receive_plan, run_ranks, send_plan
from tests.zoo import zoo
from weight_sync import SyncConfig
from weight_sync.wire.checksums import state_dict_digests
from weight_sync.errors import SyncTimeoutError, TransportError, WeightSyncError
from weight_sync.wire.metadata import PrepareRequest, TensorMeta
from weight_sync.wire.planner import make_plan
from weight_sync.receive.receiver import Receiver, accept_all
from weight_sync.wire.state_dict import Entries
from weight_sync.send.sender import PushPlanner, Sender
from weight_sync.transport import TorchGroup
from weight_sync.transport.rendezvous import open_store, unreachable_hint

pytestmark = pytest.mark.timeout(180)


def push_zoo(ctx: RankContext, mode: str, bucket_bytes: int) -> dict[str, str]:
    """Rank 0 sends the zoo; the others receive it through a Receiver. Returns digests."""
    tensors = zoo(seed=11)
    plan = make_plan([TensorMeta.of(n, t) for n, t in tensors.items()], bucket_bytes, 64)
    if ctx.rank == 0:
        send_plan(ctx, ctx.spec(mode), plan, list(tensors.values()))
        return state_dict_digests(tensors)
    expected = {n: TensorMeta.of(n, t) for n, t in tensors.items()}
    return state_dict_digests(receive_plan(ctx.spec(mode), plan, expected))


def direct_rank(ctx: RankContext, staging: str) -> tuple[dict[str, str], int]:
    """Large contiguous tensors go direct; workers land everything in a 'model' of their own
    (streaming: as the bytes arrive; atomic: from the staging area, on commit)."""
    tensors = zoo(seed=13, big=40_000)
    config = SyncConfig(bucket_bytes=4096, direct_min_bytes=10_000)
    plan = PushPlanner(config, torch.device("cpu")).plan(
        Entries(list(tensors), list(tensors.values()))
    )
    if ctx.rank == 0:
        send_plan(ctx, ctx.spec("standalone"), plan, list(tensors.values()))
        return state_dict_digests(tensors), sum(b.direct for b in plan.buckets)
    model = {n: torch.zeros_like(t.contiguous()) for n, t in tensors.items()}
    got = receive_plan(ctx.spec("standalone"), plan, destinations=model, staging=staging)
    assert all(got[n] is model[n] for n in model)  # every tensor landed in place
    return state_dict_digests(got), 0


@pytest.mark.parametrize("staging", ["stream", "atomic"])
def test_direct_buckets_land_in_place(staging: str) -> None:
    results = run_ranks(direct_rank, 3, staging)
    assert results[0][1] >= 2  # the plan really had direct buckets
    assert results[1][0] == results[2][0] == results[0][0]


def cast_rank(ctx: RankContext) -> dict[str, str]:
    """fp32 master weights sent as bf16: the workers get exactly a local cast, bit for bit.
    (NaN payloads excepted: torch's own cast kernels disagree on those, so the zoo's random bit
    patterns are made finite first.)"""
    tensors = {
        n: torch.nan_to_num(t)
        if t.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        else t
        for n, t in zoo(seed=17, big=40_000).items()
    }
    config = SyncConfig(bucket_bytes=8192, direct_min_bytes=10_000, cast_dtype="bfloat16")
    plan = PushPlanner(config, torch.device("cpu")).plan(
        Entries(list(tensors), list(tensors.values()))
    )
    if ctx.rank == 0:
        send_plan(ctx, ctx.spec("standalone"), plan, list(tensors.values()))
        castable = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        return state_dict_digests(
            {n: t.to(torch.bfloat16) if t.dtype in castable else t for n, t in tensors.items()}
        )
    return state_dict_digests(receive_plan(ctx.spec("standalone"), plan))


def test_sender_side_cast_over_gloo() -> None:
    results = run_ranks(cast_rank, 3)
    assert results[1] == results[2] == results[0]


def world_mode_rank(ctx: RankContext, bucket_bytes: int) -> tuple[dict[str, str], bool]:
    digests = push_zoo(ctx, "world", bucket_bytes)
    return digests, dist.is_initialized()


@pytest.mark.parametrize(("world_size", "bucket_bytes"), [(4, 512), (2, 1 << 20)])
def test_world_mode_moves_the_zoo_bit_exactly(world_size: int, bucket_bytes: int) -> None:
    results = run_ranks(world_mode_rank, world_size, bucket_bytes)
    sent = results[0][0]
    for rank, (digests, still_initialized) in enumerate(results):
        assert digests == sent, f"rank {rank} differs"
        assert not still_initialized, f"rank {rank}: closing must destroy the sync world"


def beside_default_group_rank(ctx: RankContext) -> dict:
    """Every rank already lives in a default world (an 'FSDP world') on its own store."""
    ctx.ports(2)
    world_store = open_store("127.0.0.1", ctx.ports()[1], ctx.world_size, 30, ctx.listener(1))
    dist.init_process_group(
        "gloo",
        store=world_store,
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=datetime.timedelta(seconds=30),
    )
    default_before = dist.group.WORLD
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    digests = push_zoo(ctx, "standalone", 700)
    after = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(after)  # the default group still works, with its own numbering
    same_default = dist.group.WORLD is default_before and dist.get_world_size() == ctx.world_size
    dist.destroy_process_group()
    return {
        "digests": digests,
        "sum_before": value.item(),
        "sum_after": after.item(),
        "same_default": same_default,
    }


def test_standalone_group_beside_an_existing_default_group() -> None:
    results = run_ranks(beside_default_group_rank, 3)
    expected_sum = float(1 + 2 + 3)
    for rank, result in enumerate(results):
        assert result["digests"] == results[0]["digests"], f"rank {rank} differs"
        assert result["sum_before"] == result["sum_after"] == expected_sum
        assert result["same_default"]


def world_mode_refused_rank(ctx: RankContext) -> str:
    store = open_store("127.0.0.1", ctx.ports(2)[1], 1, 30, ctx.listener(1))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        TorchGroup.join(ctx.spec("world", world_size=2), ctx.listener(0))
    except TransportError as exc:
        return str(exc)
    finally:
        dist.destroy_process_group()
    return "joined"


def test_world_mode_is_refused_inside_an_existing_world() -> None:
    [message] = run_ranks(world_mode_refused_rank, 1)
    assert "group_mode='standalone'" in message


def listening_addresses(pid: int) -> set[str]:
    """Local addresses of this process's listening TCP sockets (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = (
            os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.exists(f"/proc/{pid}/fd/{fd}") else ""
        )
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                    found.add(fields[1].rsplit(":", 1)[0])
    return found


def listeners_rank(ctx: RankContext, mode: str) -> set[str]:
    group = TorchGroup.join(ctx.spec(mode), ctx.listener(0))
    # One collective before either rank closes: Gloo's join is no barrier, and a rank that
    # closed as soon as its own join returned once failed its slower peer's, still connecting
    # ("Connection closed by peer", a fresh-clone run of 2026-12-02).
    group.vote(1)
    addresses = listening_addresses(os.getpid())
    env_left_behind = "GLOO_SOCKET_IFNAME" in os.environ
    group.close()
    assert not env_left_behind
    return addresses


@pytest.mark.parametrize("mode", ["world", "standalone"])
def test_group_listens_on_loopback_only(mode: str) -> None:
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 in /proc format
    for rank, addresses in enumerate(run_ranks(listeners_rank, 2, mode)):
        assert addresses, f"rank {rank} has no listening socket at all?"
        assert addresses <= loopback, f"rank {rank} listens on {addresses}"


def test_a_member_that_cannot_reach_a_store_on_loopback_is_told_to_name_an_interface() -> None:
    """Across nodes with the default config the trainer listens on 127.0.0.1, and a member on
    another node dials its own loopback: the error says what to set, not only that it failed."""
    with socket.socket() as held:  # bound, never listening: every connection to it is refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        with pytest.raises((SyncTimeoutError, TransportError)) as caught:
            open_store("127.0.0.1", port, 2, 1.0, None)
    message = str(caught.value)
    assert f"cannot reach the rendezvous store at 127.0.0.1:{port}" in message, message
    assert "SyncConfig(interface='eth0')" in message and "master_addr=" in message, message


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1", True), ("127.0.1.1", True), ("::1", True), ("localhost", True),
     ("10.0.0.5", False), ("trainer-0.cluster", False)],
)  # fmt: skip
def test_the_hint_for_an_unreachable_store_follows_the_address(address: str, loopback: bool) -> None:
    hint = unreachable_hint(address)
    assert ("only members on the trainer's own node reach" in hint) == loopback, hint
    assert "interface" in hint and "master_addr" in hint, hint


# The peers of a failed member hear of it within this, where the collective timeout is 30 s:
# 0.07-0.16 s beside a 2-process CPU hog (2026-12-02, eight runs), so 2 s keeps a 12x margin;
# every rank stays alive past it.
HEARD_WITHIN_S = 2


def failing_member_rank(ctx: RankContext, mode: str) -> tuple[str, float]:
    """Rank 2's load fails on its third bucket; every process stays alive afterwards (as Ray
    actors do), so only an explicit close can tell the peers."""
    tensors = zoo(seed=12, big=50_000)
    plan = make_plan([TensorMeta.of(n, t) for n, t in tensors.items()], 16 << 10, 64)
    spec = ctx.spec(mode, collective_timeout_s=30)
    start = time.monotonic()
    if ctx.rank == 0:
        group = TorchGroup.join(spec, ctx.listener(0))
        try:
            Sender(group).send(plan, list(tensors.values()))
            outcome = "sent"
        except WeightSyncError as exc:
            outcome = type(exc).__name__
            group.close()  # what WeightUpdater does: leave first, so that the others hear
        elapsed = time.monotonic() - start
        time.sleep(HEARD_WITHIN_S + 2)  # alive past the bound: process exit cannot be what tells
        return outcome, elapsed
    receiver = Receiver()
    receiver.join(spec, max_metadata_bytes=1 << 20)
    request = PrepareRequest(version=1, plan_digest=plan.digest, plan=plan).model_dump_json()
    assert receiver.prepare(request, accept_all).accepted
    calls = []

    def apply(items) -> None:
        calls.append(len(items))
        if ctx.rank == 2 and len(calls) == 3:
            raise RuntimeError("injected")

    try:
        receiver.receive(1, apply)
        outcome = "received"
    except Exception as exc:  # the exception and its traceback stay alive while we sleep
        outcome = type(exc).__name__
        elapsed = time.monotonic() - start
        time.sleep(HEARD_WITHIN_S + 2)
        assert receiver.version is None and receiver.dirty
        return outcome, elapsed
    return outcome, time.monotonic() - start


@pytest.mark.parametrize("mode", ["world", "standalone"])
def test_a_failing_member_makes_every_peer_fail_long_before_the_timeout(mode: str) -> None:
    results = run_ranks(failing_member_rank, 4, mode)
    assert results[2][0] == "RuntimeError"
    assert results[0][0] in ("TransportError", "sent")
    for rank in (1, 3):
        assert results[rank][0] == "TransportError", f"rank {rank}: {results[rank]}"
    # The collective timeout is 30 s; hearing of the failure must not wait for it.
    assert all(elapsed < HEARD_WITHIN_S for _, elapsed in results), results
