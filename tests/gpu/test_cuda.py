"""CUDA paths. Skipped where no GPU is present (see tests/conftest.py); on a one-GPU machine the
NCCL group test is skipped too, since two NCCL ranks may not share a device."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import RankContext, receive_plan, run_ranks, send_plan
from tests.zoo import zoo
from weight_sync.wire.checksums import checksum, state_dict_digests
from weight_sync.wire.metadata import TensorMeta
from weight_sync.wire.packing import Packer, Unpacker, bucket_buffers
from weight_sync.wire.planner import make_plan

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]


def cuda_zoo(seed: int) -> dict[str, torch.Tensor]:
    # complex32 copies are not implemented for every CUDA kernel; everything else is.
    return {n: t.cuda() for n, t in zoo(seed).items() if t.dtype != torch.complex32}


def test_pack_unpack_on_cuda_buffers_is_bit_exact() -> None:
    tensors = cuda_zoo(21)
    plan = make_plan([TensorMeta.of(n, t) for n, t in tensors.items()], 4096, 64)
    device = torch.device("cuda")
    packer, unpacker = Packer(plan, list(tensors.values())), Unpacker(plan, {}, device)
    send, recv = bucket_buffers(plan, device), bucket_buffers(plan, device)
    out = {n: t for n, t in unpacker.empty_tensors(device)}
    for index in range(len(plan.buckets)):
        wire = packer.pack(index, send[index % 2])
        landed = recv[index % 2][: wire.numel()]
        landed.copy_(wire)
        out.update((n, t.clone()) for n, t in unpacker.unpack(index, landed))
    assert state_dict_digests(out) == state_dict_digests(tensors)


def cuda_source_over_gloo(ctx: RankContext) -> dict[str, str]:
    tensors = (
        cuda_zoo(22)
        if ctx.rank == 0
        else {n: t for n, t in zoo(22).items() if t.dtype != torch.complex32}
    )
    plan = make_plan([TensorMeta.of(n, t) for n, t in tensors.items()], 2048, 64)
    if ctx.rank == 0:
        send_plan(
            ctx, ctx.spec("world"), plan, list(tensors.values())
        )  # device -> host while packing
        return state_dict_digests(tensors)
    return state_dict_digests(receive_plan(ctx.spec("world"), plan))


def test_cuda_weights_over_gloo() -> None:
    sent, received = run_ranks(cuda_source_over_gloo, 2)
    assert sent == received


def nccl_rank(ctx: RankContext) -> dict[str, str]:
    torch.cuda.set_device(ctx.rank)
    tensors = cuda_zoo(23)
    plan = make_plan([TensorMeta.of(n, t) for n, t in tensors.items()], 1 << 16, 64)
    spec = ctx.spec("standalone", backend="nccl")
    if ctx.rank == 0:
        send_plan(ctx, spec, plan, list(tensors.values()))
        return state_dict_digests(tensors)
    return state_dict_digests(receive_plan(spec, plan))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one per rank)")
def test_nccl_standalone_group_is_bit_exact() -> None:
    sent, received = run_ranks(nccl_rank, 2)
    assert sent == received


def test_checksum_of_a_cuda_buffer_matches_the_host_copy() -> None:
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    assert checksum(data.cuda()) == checksum(data)
