import pytest
import torch

from tests.zoo import zoo
from weight_sync.metadata import TensorMeta
from weight_sync.packing import Packer, Unpacker, bucket_buffers
from weight_sync.planner import make_plan
from weight_sync.verify import tensor_digest


def round_trip(tensors: dict[str, torch.Tensor], bucket_bytes: int, alignment: int = 16) -> dict[str, torch.Tensor]:
    """Pack every bucket, copy it through a fresh buffer as a wire would, unpack."""
    plan = make_plan([TensorMeta.of(n, t) for n, t in tensors.items()], bucket_bytes, alignment)
    packer, unpacker = Packer(plan, list(tensors.values())), Unpacker(plan)
    send, recv = bucket_buffers(plan, torch.device("cpu")), bucket_buffers(plan, torch.device("cpu"))
    out = {name: t.clone() for name, t in unpacker.empty_tensors(torch.device("cpu"))}
    for index in range(len(plan.buckets)):
        wire = packer.pack(index, send[index % 2])
        landed = recv[index % 2][: wire.numel()]
        landed.copy_(wire)
        out.update((name, t.clone()) for name, t in unpacker.unpack(index, landed))
    return out


@pytest.mark.parametrize("bucket_bytes", [16, 100, 4096, 1 << 20])
def test_zoo_round_trips_bit_exactly(bucket_bytes: int) -> None:
    tensors = zoo(seed=bucket_bytes)
    out = round_trip(tensors, bucket_bytes)
    assert list(out) == list(tensors) or set(out) == set(tensors)
    for name, tensor in tensors.items():
        got = out[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert got.is_contiguous(), name
        assert tensor_digest(got) == tensor_digest(tensor), name


def test_whole_tensors_are_views_into_the_bucket() -> None:
    tensors = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64)}
    plan = make_plan([TensorMeta.of(n, t) for n, t in tensors.items()], 1024, 64)
    buffer = bucket_buffers(plan, torch.device("cpu"))[0]
    data = Packer(plan, list(tensors.values())).pack(0, buffer)
    views = dict(Unpacker(plan).unpack(0, data))
    assert views["a"].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert torch.equal(views["a"], tensors["a"]) and torch.equal(views["b"], tensors["b"])


def test_split_tensor_arrives_only_when_complete() -> None:
    big = torch.arange(100, dtype=torch.float32)
    plan = make_plan([TensorMeta.of("big", big)], 64, 16)
    assert len(plan.buckets) == 7
    packer, unpacker = Packer(plan, [big]), Unpacker(plan)
    buffer = torch.empty(64, dtype=torch.uint8)
    arrived = [unpacker.unpack(i, packer.pack(i, buffer).clone()) for i in range(7)]
    assert [len(a) for a in arrived] == [0, 0, 0, 0, 0, 0, 1]
    assert torch.equal(arrived[-1][0][1], big)


def test_non_contiguous_split_source_is_made_contiguous_once() -> None:
    source = torch.arange(600, dtype=torch.float32).view(20, 30).t()
    plan = make_plan([TensorMeta.of("t", source)], 256, 16)
    packer = Packer(plan, [source])
    buffer = torch.empty(256, dtype=torch.uint8)
    packer.pack(0, buffer)
    cached = packer._split_source
    assert cached is not None
    for index in range(1, len(plan.buckets) - 1):
        packer.pack(index, buffer)
        assert packer._split_source is cached  # no second copy of the tensor
    packer.pack(len(plan.buckets) - 1, buffer)
    assert packer._split_source is None  # released after its last piece
