"""The fast GPU paths: one host synchronisation per push, pinned staging, device-side checks.

Runs as written on a machine with one NVIDIA GPU, Python 3.12, a CUDA build of torch and no Ray
(nothing here imports Ray, directly or through tests.distributed.harness); skipped elsewhere
(see tests/conftest.py). The NCCL group lives in a spawned rank, so a watchdog that killed its
process shows as a rank that never reported, not as a dead pytest.

    pytest -m gpu tests/gpu/test_gpu_paths.py -v
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import RankContext, run_ranks
from weight_sync import SyncConfig
from weight_sync.wire.checksums import checksum, device_checksum, state_dict_digests
from weight_sync.wire.metadata import PrepareRequest, SyncPlan, TensorMeta
from weight_sync.wire.packing import (
    Packer,
    Staging,
    Unpacker,
    bucket_buffers,
    byte_view,
    gaps,
    read_values,
    staging_slots,
)
from weight_sync.wire.planner import make_plan
from weight_sync.receive.receiver import Receiver, accept_all
from weight_sync.wire.state_dict import check_state_dict, device_finite_flags, is_finite
from weight_sync.send.sender import PushPlanner, Sender
from weight_sync.transport import TorchGroup

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

DEVICE = torch.device("cuda", 0)
BUCKET = 1 << 20


def model(device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Many small tensors (packed), some of a bucket or more (direct under 'auto'), mixed dtypes."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for layer in range(16):
        out[f"l{layer}.w"] = torch.randn(256, 256, generator=g)  # 256 KiB: packed
        out[f"l{layer}.b"] = torch.randn(256, generator=g).to(torch.bfloat16)
        out[f"l{layer}.n"] = torch.randint(0, 100, (33,), generator=g)
    out["embed"] = torch.randn(1024, 512, generator=g)  # 2 MiB: direct on a GPU
    out["head"] = torch.randn(512, 512, generator=g)  # exactly one bucket: direct
    return {name: tensor.to(device) for name, tensor in out.items()}


def host_checksums(plan: SyncPlan, tensors: list[torch.Tensor]) -> list[int]:
    """Every bucket's checksum, packed and summed on the host: what the GPU must match."""
    host = [tensor.cpu() for tensor in tensors]
    packer, buffers, slots = (
        Packer(plan, host),
        bucket_buffers(plan, torch.device("cpu")),
        staging_slots(plan),
    )
    sums = []
    for index, bucket in enumerate(plan.buckets):
        slot = slots[index]
        data = (
            byte_view(host[bucket.segments[0].tensor])
            if slot is None
            else packer.pack(index, buffers[slot])
        )
        sums.append(checksum(data))
    return sums


def steady_state_push(ctx: RankContext) -> tuple[list[int], list[int], int]:
    torch.cuda.set_device(DEVICE)  # for the rank's own setup only: the library never reads it
    spec = ctx.spec("standalone", backend="nccl")
    group = TorchGroup.join(spec, ctx.listener(0), device=DEVICE)
    config = SyncConfig(bucket_bytes=BUCKET, check_finite=True, checksum=True)
    unchecked = config.model_copy(update={"check_finite": False})
    state = model(DEVICE)
    planner, sender = PushPlanner(config, group.device), Sender(group)
    entries = check_state_dict(state, config)  # the first push: plan, staging, allocator warm up
    sender.send(planner.plan(entries), entries.tensors, with_checksums=True)
    for tensor in state.values():  # the next optimizer step
        tensor.mul_(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises
    try:
        entries = check_state_dict(state, unchecked)
        finite = device_finite_flags(entries.tensors, config.cast_dtype)  # queued, not read
        plan = planner.plan(entries)
        flight = sender.start(plan, entries.tensors, with_checksums=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(read_values(finite))  # check_finite's one host read (before sending, in a push)
    sums = flight.finish()  # the push's one synchronisation
    assert sums is not None
    direct = sum(bucket.direct for bucket in plan.buckets)
    group.close()
    return sums, host_checksums(plan, entries.tensors), direct


def test_a_steady_state_push_over_nccl_synchronises_only_at_its_end() -> None:
    ((sums, expected, direct),) = run_ranks(steady_state_push, 1, timeout_s=240)
    assert sums == expected  # GPU checksums equal the host's, bucket by bucket
    assert direct == 2  # 'auto' on a GPU: only tensors of a bucket or more go alone


class Loopback:
    """A transport on the GPU whose broadcasts deliver a trainer's packed buckets, held in
    host memory (so that the trainer's side costs the GPU nothing): a one-GPU stand-in for the
    group, to exercise a GPU worker's receive paths bit for bit."""

    def __init__(self, buckets: list[torch.Tensor]) -> None:
        self._buckets, self._next = buckets, 0

    rank, world_size, device, tally_is_final = 1, 2, DEVICE, True

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> Loopback:
        tensor.copy_(self._buckets[self._next], non_blocking=True)  # on the current stream
        self._next += 1
        return self

    def after(self) -> None:
        pass  # the copy was queued on the current stream: later work is ordered after it

    def wait(self) -> None:
        pass

    def vote(self, code: int, timeout_s: float | None = None) -> int:
        return code

    def close(self) -> None:
        pass


def packed_buckets(plan: SyncPlan, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    host = [tensor.cpu() for tensor in tensors]
    packer, slots = Packer(plan, host), staging_slots(plan)
    out = []
    for index, bucket in enumerate(plan.buckets):
        if slots[index] is None:
            out.append(byte_view(host[bucket.segments[0].tensor]).clone().pin_memory())
        else:
            out.append(
                packer.pack(index, torch.empty(bucket.nbytes, dtype=torch.uint8))
                .clone()
                .pin_memory()
            )
    return out


@pytest.mark.parametrize("staging", ["atomic", "stream"])
def test_a_gpu_worker_receives_bit_exactly_and_atomic_staging_stays_off_the_gpu(
    staging: str,
) -> None:
    sent = model(torch.device("cpu"), seed=1)
    config = SyncConfig(bucket_bytes=BUCKET)
    plan = PushPlanner(config, DEVICE).plan(check_state_dict(sent, config))
    buckets = packed_buckets(plan, list(sent.values()))
    weights = {name: torch.zeros_like(tensor, device=DEVICE) for name, tensor in sent.items()}
    model_bytes = sum(tensor.nbytes for tensor in weights.values())
    receiver = Receiver(DEVICE)
    receiver._transport = Loopback(buckets)  # joined, as far as the receiver can tell
    receiver._max_metadata_bytes = 1 << 30
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(DEVICE)
    before = torch.cuda.memory_allocated(DEVICE)
    request = PrepareRequest(
        version=1, plan_digest=plan.digest, plan=plan, staging=staging, checksum=True
    )
    assert receiver.prepare(request.model_dump_json(), accept_all).accepted
    report = receiver.receive(1, lambda named: None, weights)
    if staging == "atomic":
        assert all(not tensor.any() for tensor in weights.values())  # nothing before commit
        receiver.commit(1, lambda named: None, weights)
    extra = torch.cuda.max_memory_allocated(DEVICE) - before
    assert state_dict_digests({n: t.cpu() for n, t in weights.items()}) == state_dict_digests(sent)
    assert report.checksums == tuple(checksum(bucket) for bucket in buckets)
    # Two bucket buffers and the largest direct bucket in passing -- not a model copy.
    assert extra < model_bytes / 2, (extra, model_bytes)


def test_pinned_staging_packs_gpu_tensors_for_a_host_transport_bit_exactly() -> None:
    """GPU tensors packed into pinned host staging (casts, a strided tensor, int64 tensors
    whose 264 bytes leave 56 of padding) read back, through a receiver's unpacker, as exactly
    the host's own cast of each tensor; and every gap of every bucket is zero, although the
    two staging buffers are reused by buckets of other layouts."""
    state = model(DEVICE, seed=2)
    state["strided"] = torch.randn(300, 200, device=DEVICE).t()
    tensors = list(state.values())
    wire = [torch.bfloat16 if t.dtype == torch.float32 else None for t in tensors]
    plan = make_plan([TensorMeta.of(n, t, w) for (n, t), w in zip(state.items(), wire, strict=True)],
                     4096 + 64, 64)  # fmt: skip
    staging = Staging(plan, torch.device("cpu"), pinned=True)
    assert all(buffer.is_pinned() for buffer in staging.buffers)
    for buffer in staging.buffers:
        buffer.fill_(0xA5)  # stale bytes, as a reused buffer holds
    packer = Packer(plan, tensors, staging)
    unpacker = Unpacker(plan, None, torch.device("cpu"))
    read: dict[str, torch.Tensor] = {}
    for index, slot in enumerate(staging_slots(plan)):
        assert slot is not None  # no direct buckets in this plan
        packed = packer.pack(index, staging.buffers[slot])
        torch.cuda.current_stream(DEVICE).synchronize()  # what the sender does per bucket for Gloo
        for start, end in gaps(plan.buckets[index]):
            assert not packed[start:end].any(), (index, start, end)
        read.update((name, t.clone()) for name, t in unpacker.unpack(index, packed.clone()))
    expected = {name: t.cpu().to(w) if w is not None else t.cpu()
                for (name, t), w in zip(state.items(), wire, strict=True)}  # fmt: skip
    assert read.keys() == expected.keys()
    for name, tensor in expected.items():
        assert read[name].dtype == tensor.dtype and torch.equal(
            read[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)
        ), name


def test_cuda_staging_zeroes_every_gap_on_every_pack() -> None:
    """The same on the GPU's own staging (what NCCL and the CUDA ring send): the padding after
    each tensor is zero in every bucket, whatever the buffers held before."""
    state = model(DEVICE, seed=3)
    plan = make_plan([TensorMeta.of(n, t) for n, t in state.items()], 4096 + 64, 64)
    staging = Staging(plan, DEVICE)
    for buffer in staging.buffers:
        buffer.fill_(0xA5)
    packer = Packer(plan, list(state.values()), staging)
    assert sum(len(gaps(bucket)) for bucket in plan.buckets) >= 16  # padding after each int64[33]
    for index, slot in enumerate(staging_slots(plan)):
        assert slot is not None
        packed = packer.pack(index, staging.buffers[slot])
        for start, end in gaps(plan.buckets[index]):
            assert not packed[start:end].any(), (index, start, end)


@pytest.mark.parametrize("size", [1, 9, 8192, 8193, (3 << 20) + 5])
def test_device_checksums_equal_the_hosts(size: int) -> None:
    data = torch.randint(0, 256, (size + 3,), dtype=torch.uint8)
    for view in (data[:size], data[3:]):
        assert int(device_checksum(view.to(DEVICE)).item()) == checksum(view)


@pytest.mark.parametrize("cast", [None, "float16", "bfloat16"])
def test_device_finiteness_equals_the_per_tensor_answer(cast: str | None) -> None:
    table = [
        torch.randn(1000), torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")]),
        torch.tensor([3e38, 3e38]), torch.tensor([1e5]), torch.randn(100).to(torch.bfloat16),
        torch.tensor([float("nan")], dtype=torch.float16), torch.randn(64, 64).t(),
        torch.tensor([1 + 1j, complex(0, float("inf"))], dtype=torch.complex64),
        torch.tensor([], dtype=torch.float32), torch.arange(5),
    ]  # fmt: skip
    expected = [is_finite(tensor, cast) for tensor in table]
    assert read_values(device_finite_flags([t.to(DEVICE) for t in table], cast)) == expected


def test_a_delta_push_of_gpu_weights_is_refused_before_anything_moves() -> None:
    with pytest.raises(ValueError, match="delta=True needs the weights in host memory"):
        check_state_dict({"w": torch.zeros(4, device=DEVICE)}, SyncConfig(delta=True))
