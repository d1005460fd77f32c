import pytest
import torch

from tests.zoo import zoo
from weight_sync import SyncConfig
from weight_sync.wire.checksums import (
    checksum,
    checksum_of,
    device_checksum,
    read_checksums,
    tensor_digest,
)
from weight_sync.wire.metadata import BucketMeta, Segment, SyncPlan, TensorMeta
from weight_sync.wire.packing import (
    Packer,
    Staging,
    Unpacker,
    bucket_buffers,
    byte_view,
    gaps,
    staging_slots,
)
from weight_sync.wire.planner import make_plan
from weight_sync.wire.state_dict import Entries, check_state_dict
from weight_sync.send.sender import PushPlanner, Sender


def round_trip(
    tensors: dict[str, torch.Tensor],
    bucket_bytes: int = 0,
    alignment: int = 16,
    direct_min_bytes: int | None = None,
    destinations: dict[str, torch.Tensor] | None = None,
    plan: SyncPlan | None = None,
) -> dict[str, torch.Tensor]:
    """Send every bucket through a fresh buffer as a wire would, and unpack: what reaches
    ``load_weights`` merged with what landed in ``destinations``. Plans from the arguments
    unless ``plan`` is given."""
    if plan is None:
        metas = [TensorMeta.of(n, t) for n, t in tensors.items()]
        direct = [
            direct_min_bytes is not None and m.nbytes >= direct_min_bytes and t.is_contiguous()
            for m, t in zip(metas, tensors.values(), strict=True)
        ]
        plan = make_plan(metas, bucket_bytes, alignment, direct)
    destinations = destinations or {}
    cpu = torch.device("cpu")
    packer, unpacker = Packer(plan, list(tensors.values())), Unpacker(plan, destinations, cpu)
    send, recv, slots = bucket_buffers(plan, cpu), bucket_buffers(plan, cpu), staging_slots(plan)
    out = {name: t.clone() for name, t in unpacker.empty_tensors(cpu)}
    for index, bucket in enumerate(plan.buckets):
        slot = slots[index]
        if slot is None:
            wire = byte_view(list(tensors.values())[bucket.segments[0].tensor])
            landed = unpacker.direct_target(index, cpu)
        else:
            wire = packer.pack(index, send[slot])
            landed = recv[slot][: wire.numel()]
        landed.copy_(wire)
        out.update((name, t.clone()) for name, t in unpacker.unpack(index, landed))
    assert not out.keys() & destinations.keys(), "tensors that landed must not be applied again"
    return {**out, **destinations}


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
    views = dict(Unpacker(plan, {}, torch.device("cpu")).unpack(0, data))
    assert views["a"].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert torch.equal(views["a"], tensors["a"]) and torch.equal(views["b"], tensors["b"])


def test_split_tensor_arrives_only_when_complete() -> None:
    big = torch.arange(100, dtype=torch.float32)
    plan = make_plan([TensorMeta.of("big", big)], 64, 16)
    assert len(plan.buckets) == 7
    packer, unpacker = Packer(plan, [big]), Unpacker(plan, {}, torch.device("cpu"))
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


@pytest.mark.parametrize("direct_min_bytes", [1, 1000, 50_000])
@pytest.mark.parametrize("land", [False, True])
def test_zoo_round_trips_with_direct_buckets_and_destinations(
    direct_min_bytes: int, land: bool
) -> None:
    tensors = zoo(seed=direct_min_bytes)
    destinations = None
    if land:  # a model's own storage: contiguous, same dtype and shape
        destinations = {n: torch.zeros_like(t.contiguous()) for n, t in tensors.items()}
    out = round_trip(tensors, 256, direct_min_bytes=direct_min_bytes, destinations=destinations)
    for name, tensor in tensors.items():
        assert tensor_digest(out[name]) == tensor_digest(tensor), name


def test_split_tensor_with_a_destination_is_assembled_in_place() -> None:
    big = torch.arange(100, dtype=torch.float32)
    destination = torch.zeros(100)
    plan = make_plan([TensorMeta.of("big", big)], 64, 16)
    packer, unpacker = (
        Packer(plan, [big]),
        Unpacker(plan, {"big": destination}, torch.device("cpu")),
    )
    buffer = torch.empty(64, dtype=torch.uint8)
    for index in range(len(plan.buckets)):
        assert unpacker.unpack(index, packer.pack(index, buffer)) == []
    assert not unpacker._partial and torch.equal(destination, big)


def test_direct_bucket_is_received_straight_into_its_destination() -> None:
    tensor, destination = torch.arange(50.0), torch.zeros(50)
    plan = make_plan([TensorMeta.of("t", tensor)], 64, 16, [True])
    target = Unpacker(plan, {"t": destination}, torch.device("cpu")).direct_target(
        0, torch.device("cpu")
    )
    assert target.data_ptr() == destination.data_ptr() and target.numel() == 200


@pytest.mark.parametrize(
    ("direct", "slots"),
    [
        ([False, False, False], [0, 1, 0]),
        # the packed bucket holding t1 stays open while the direct t2 goes out
        ([True, False, True, False, False], [None, None, 0, 1, 0]),
        ([True, True], [None, None]),
    ],
)
def test_staging_slots_alternate_over_packed_buckets_only(direct: list[bool], slots: list) -> None:
    plan = make_plan(
        [TensorMeta(name=f"t{i}", dtype="float32", shape=(30,)) for i in range(len(direct))],
        120,
        16,
        direct,
    )
    assert staging_slots(plan) == slots


@pytest.mark.parametrize("target", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("bucket_bytes", [64, 4096, 1 << 20])
def test_sender_side_cast_gives_exactly_a_local_cast(target: str, bucket_bytes: int) -> None:
    gen = torch.Generator().manual_seed(7)
    tensors = {
        "fp32": torch.randn(33, 17, generator=gen),
        "fp32_transposed": torch.randn(40, 30, generator=gen).t(),  # strided, split across buckets
        "fp64_big": torch.randn(3000, generator=gen, dtype=torch.float64)
        * 1e6,  # split, overflows fp16
        "fp16": torch.randn(50, generator=gen).half(),
        "bf16": torch.randn(50, generator=gen).bfloat16(),
        "int64": torch.arange(20),
        "bool": torch.rand(9, generator=gen) > 0.5,
        "fp8": torch.randn(16, generator=gen).to(torch.float8_e4m3fn),
    }
    config = SyncConfig(
        cast_dtype=target, bucket_bytes=bucket_bytes, alignment=16, direct_min_bytes=64
    )
    plan = PushPlanner(config, torch.device("cpu")).plan(
        Entries(list(tensors), list(tensors.values()))
    )
    out = round_trip(tensors, plan=plan)
    want_dtype = getattr(torch, target)
    for name, tensor in tensors.items():
        castable = tensor.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        want = tensor.to(want_dtype) if castable else tensor
        assert out[name].dtype == want.dtype and out[name].shape == want.shape, name
        assert tensor_digest(out[name]) == tensor_digest(want.contiguous()), name
    for bucket in plan.buckets:  # a cast tensor cannot be sent from its own storage
        if bucket.direct:
            source = tensors[plan.tensors[bucket.segments[0].tensor].name]
            assert source.dtype == want_dtype or source.dtype not in (
                torch.float64,
                torch.float32,
                torch.float16,
                torch.bfloat16,
            )
    assert plan.payload_bytes < sum(t.nbytes for t in tensors.values()) or target == "float32"


def test_a_cast_keeps_nan_and_inf_where_they_were() -> None:
    tensor = torch.tensor([1.5, float("nan"), float("inf"), -float("inf"), 3e38])
    config = SyncConfig(cast_dtype="float16", bucket_bytes=1024, alignment=16)
    plan = PushPlanner(config, torch.device("cpu")).plan(Entries(["w"], [tensor]))
    got = round_trip({"w": tensor}, plan=plan)["w"]
    want = tensor.half()  # 3e38 overflows to inf, as a local cast does
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])


@pytest.mark.parametrize("bucket_bytes", [64, 4096])
@pytest.mark.parametrize("direct_min_bytes", [None, 256])
@pytest.mark.parametrize("landing", ["none", "tied", "separate", "source_only"])
def test_tied_names_arrive_with_their_tensor(
    bucket_bytes: int, direct_min_bytes: int | None, landing: str
) -> None:
    embed = torch.randn(30, 8)  # 960 bytes: split over 64-byte buckets, direct at 256
    tensors = {"embed": embed, "norm": torch.randn(8), "head": embed}
    config = SyncConfig(bucket_bytes=bucket_bytes, alignment=16, direct_min_bytes=direct_min_bytes)
    entries = check_state_dict(tensors, config)
    plan = PushPlanner(config, torch.device("cpu")).plan(entries)
    assert [t.name for t in plan.tensors] == ["embed", "norm"] and plan.payload_bytes == 992
    shared = torch.zeros(30, 8)
    destinations = {
        "none": {},
        "tied": {
            "embed": shared,
            "head": shared,
            "norm": torch.zeros(8),
        },  # a model tied the same way
        "separate": {"embed": torch.zeros(30, 8), "head": torch.zeros(30, 8)},
        "source_only": {"embed": shared},
    }[landing]
    out = round_trip(
        dict(zip(entries.names, entries.tensors, strict=True)), plan=plan, destinations=destinations
    )
    for name in ("embed", "head"):
        assert torch.equal(out[name], embed), name
    if landing == "tied":
        assert out["head"] is out["embed"] is shared


@pytest.mark.parametrize(("bucket_bytes", "alignment"), [(4096, 64), (1 << 20, 16), (100, 16)])
def test_staging_and_unpacker_kept_across_pushes_of_one_plan(
    bucket_bytes: int, alignment: int
) -> None:
    """The steady state: the sender keeps its staging (buffers and what it packs them with) and
    the worker its unpacker (receive buffers, landings), one plan pushed three times with new
    values; every push lands bit-exactly, every dtype, gaps of alignment between tensors."""
    cpu = torch.device("cpu")
    first = zoo(seed=1)
    metas = [TensorMeta.of(n, t) for n, t in first.items()]
    plan = make_plan(metas, bucket_bytes, alignment)
    staging = Staging(plan, cpu)
    model = {n: torch.zeros_like(t.contiguous()) for n, t in first.items()}
    unpacker = Unpacker(plan, model, cpu)
    slots = staging_slots(plan)
    for seed in (1, 2, 3):
        tensors = zoo(seed=seed)
        packer = Packer(plan, list(tensors.values()), staging)
        for index, bucket in enumerate(plan.buckets):
            slot = slots[index]
            assert slot is not None
            landed = unpacker.buffers()[slot][: bucket.nbytes]
            landed.copy_(packer.pack(index, staging.buffers[slot]))
            assert unpacker.unpack(index, landed) == []  # everything lands in the model
        assert {n: tensor_digest(t) for n, t in model.items()} == {
            n: tensor_digest(t) for n, t in tensors.items()
        }, f"push {seed}"
    assert unpacker.buffers() is unpacker.buffers()


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 1000, 8191, 8192, 8193, 3 << 20])
@pytest.mark.parametrize("offset", [0, 1, 8])
def test_host_and_device_checksums_agree(size: int, offset: int) -> None:
    """The trainer and every worker compute one value whatever device each holds the bytes on:
    the NumPy path (host buffers) and the torch path (what a GPU runs), here on the CPU."""
    data = torch.randint(
        0, 256, (size + offset,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)
    )
    view = data[offset:]
    assert checksum(view) == int(device_checksum(view).item()) == checksum(view.clone())


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d.__setitem__(5, d[5] ^ 1),  # one bit
        lambda d: d.__setitem__(slice(0, 16), d[0:16].flip(0)),  # bytes reordered in place
        lambda d: d.__setitem__(slice(0, 16), d[8 * 1024 : 8 * 1024 + 16].clone()),  # a word moved
        lambda d: d.__setitem__(
            slice(None), d.view(-1, 8 * 1024).flip(0).reshape(-1)
        ),  # rows swapped
        lambda d: d.__setitem__(slice(None), d.view(-1, 8).flip(0).reshape(-1)),  # words reversed
    ],
)
def test_checksum_sees_damage(damage) -> None:
    data = torch.randint(
        0, 256, (64 << 10,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    before = checksum(data)
    damage(data)
    assert checksum(data) != before


def test_queued_checksums_are_read_in_order() -> None:
    buffers = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (10, 5000, 1 << 16)]
    queued = [device_checksum(buffers[0]), 7, checksum_of(buffers[1]), device_checksum(buffers[2])]
    assert read_checksums(queued) == [
        checksum(buffers[0]),
        7,
        checksum(buffers[1]),
        checksum(buffers[2]),
    ]


def _bucket(nbytes: int, *spans: tuple[int, int]) -> BucketMeta:
    return BucketMeta(nbytes=nbytes, segments=tuple(
        Segment(tensor=i, tensor_offset=0, bucket_offset=start, nbytes=size)
        for i, (start, size) in enumerate(spans)))  # fmt: skip


@pytest.mark.parametrize(("bucket", "expected"), [
    (_bucket(8, (0, 8)), []),                                   # one segment, no padding
    (_bucket(128, (0, 60), (64, 64)), [(60, 64)]),               # padding after a segment
    (_bucket(328, (0, 264), (320, 8)), [(264, 320)]),            # an int64[33] then a tensor
    (_bucket(100, (16, 84)), [(0, 16)]),                         # a gap before the first
    (_bucket(200, (0, 10), (64, 10), (128, 72)), [(10, 64), (74, 128)]),
    (_bucket(200, (128, 72), (0, 10)), [(10, 128)]),             # segments out of order
])  # fmt: skip
def test_gaps_are_the_bytes_no_segment_covers(bucket: BucketMeta, expected: list) -> None:
    assert gaps(bucket) == expected


def odd_sizes(seed: int) -> dict[str, torch.Tensor]:
    """Tensors whose sizes leave alignment padding after them (an int64[33] is 264 bytes: 56 of
    padding at 64), of every kind the packer handles: batched dtypes, bytes-only dtypes,
    strided, cast, split across buckets."""
    g = torch.Generator().manual_seed(seed)
    out = zoo(seed=seed, big=1001)
    for layer in range(6):
        out[f"l{layer}_w"] = torch.randn(17, 19, generator=g)
        out[f"l{layer}_n"] = torch.randint(-99, 99, (33,), generator=g)
        out[f"l{layer}_b"] = torch.randn(13, generator=g).to(torch.bfloat16)
        out[f"l{layer}_t"] = torch.randn(9, 11, generator=g).t()
    return out


@pytest.mark.parametrize("cast", [None, torch.bfloat16])
@pytest.mark.parametrize(("bucket_bytes", "alignment"), [(4096, 64), (1000, 64), (1 << 20, 256)])
def test_every_gap_is_zero_on_every_pack_through_reused_staging(
    cast: torch.dtype | None, bucket_bytes: int, alignment: int
) -> None:
    """Different data through the same staging buffers, which start full of other bytes: every
    gap of every packed bucket is zero, and each bucket is byte for byte what a pack into a
    fresh zeroed buffer gives -- a function of the pushed tensors alone."""
    first = odd_sizes(seed=1)
    metas = [
        TensorMeta.of(n, t, cast if t.dtype == torch.float32 else None) for n, t in first.items()
    ]
    plan = make_plan(metas, bucket_bytes, alignment)
    assert any(gaps(bucket) for bucket in plan.buckets)
    staging = Staging(plan, torch.device("cpu"))
    for buffer in staging.buffers:
        buffer.fill_(0xA5)  # what a reused buffer may hold: anything
    slots = staging_slots(plan)
    for seed in (1, 2, 3):
        tensors = list(odd_sizes(seed).values())
        packer, fresh = Packer(plan, tensors, staging), Packer(plan, tensors)
        for index, bucket in enumerate(plan.buckets):
            slot = slots[index]
            assert slot is not None
            packed = packer.pack(index, staging.buffers[slot])
            for start, end in gaps(bucket):
                assert not packed[start:end].any(), (seed, index, start, end)
            clean = fresh.pack(index, torch.zeros(bucket.nbytes, dtype=torch.uint8))
            assert torch.equal(packed, clean), (seed, index)


class Recording:
    """A one-process transport that keeps a copy of every broadcast: what would go on the wire
    (a fake for this pure check of the sender's bytes; the real transports are tested apart)."""

    rank, world_size, device, tally_is_final = 0, 1, torch.device("cpu"), True

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(
        self, tensor: torch.Tensor, src: int, timeout_s: float | None = None
    ) -> "Recording":
        self.sent.append(tensor.clone())
        return self

    def after(self) -> None:
        pass

    def wait(self) -> None:
        pass


def test_what_the_sender_puts_on_the_wire_and_checksums_depends_on_the_tensors_alone() -> None:
    """Two pushes of one plan with different values, then the first values again: the third
    push's buckets and checksums equal the first's, though the staging buffers held the second
    push's bytes in between."""
    config = SyncConfig(bucket_bytes=2048, alignment=64, direct_min_bytes=None)
    planner, transport = PushPlanner(config, torch.device("cpu")), Recording()
    sender = Sender(transport)  # type: ignore[arg-type]
    pushes = []
    for seed in (1, 2, 1):
        entries = check_state_dict(odd_sizes(seed), config)
        sums = sender.send(planner.plan(entries), entries.tensors, with_checksums=True)
        pushes.append((transport.sent, sums))
        transport.sent = []
    (first, first_sums), (second, _), (third, third_sums) = pushes
    assert len(first) > 2 and first_sums == third_sums
    assert all(torch.equal(a, b) for a, b in zip(first, third, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
