"""Real Gloo groups on spawned ranks: both ways of building the group, and the dtype zoo through
the real sender and receiver."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import RankContext, run_ranks
from tests.zoo import zoo
from weight_sync.errors import TransportError
from weight_sync.metadata import PrepareRequest, TensorMeta
from weight_sync.planner import make_plan
from weight_sync.receiver import Receiver
from weight_sync.sender import Sender
from weight_sync.transport import TorchGroup
from weight_sync.transport.rendezvous import open_store
from weight_sync.verify import state_dict_digests

pytestmark = pytest.mark.timeout(180)


def push_zoo(ctx: RankContext, mode: str, bucket_bytes: int) -> dict[str, str]:
    """Rank 0 sends the zoo; the others receive it through a Receiver. Returns digests."""
    tensors = zoo(seed=11)
    plan = make_plan([TensorMeta.of(n, t) for n, t in tensors.items()], bucket_bytes, 64)
    spec = ctx.spec(mode)
    if ctx.rank == 0:
        group = TorchGroup.join(spec, ctx.listener(0))
        Sender(group).send(plan, list(tensors.values()))
        group.close()
        return state_dict_digests(tensors)
    receiver = Receiver()
    receiver.join(spec, max_metadata_bytes=1 << 20)
    request = PrepareRequest(version=1, plan_digest=plan.digest, plan=plan).model_dump_json()
    expected = {n: TensorMeta.of(n, t) for n, t in tensors.items()}
    assert receiver.prepare(request, lambda: expected).accepted
    got: dict[str, torch.Tensor] = {}
    receiver.receive(1, lambda items: got.update((n, t.clone()) for n, t in items))
    assert receiver.version is None and receiver.dirty  # nothing claimed before commit
    receiver.commit(1)
    assert receiver.version == 1 and not receiver.dirty
    receiver.leave()
    return state_dict_digests(got)


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
    dist.init_process_group("gloo", store=world_store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=30))
    default_before = dist.group.WORLD
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    digests = push_zoo(ctx, "standalone", 700)
    after = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(after)  # the default group still works, with its own numbering
    same_default = dist.group.WORLD is default_before and dist.get_world_size() == ctx.world_size
    dist.destroy_process_group()
    return {"digests": digests, "sum_before": value.item(), "sum_after": after.item(),
            "same_default": same_default}


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
