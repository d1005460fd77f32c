import itertools
import random

import pytest

from weight_sync.wire.metadata import TensorMeta
from weight_sync.wire.packing import pinned_chunks
from weight_sync.wire.planner import align_up, direct_threshold, make_plan


def metas(*sizes_and_dtypes: tuple[int, str]) -> list[TensorMeta]:
    return [
        TensorMeta(name=f"t{i}", dtype=dtype, shape=(n,))
        for i, (n, dtype) in enumerate(sizes_and_dtypes)
    ]


def layout(plan) -> list[list[tuple[int, int, int, int]]]:
    return [
        [(s.tensor, s.tensor_offset, s.bucket_offset, s.nbytes) for s in bucket.segments]
        for bucket in plan.buckets
    ]


@pytest.mark.parametrize(
    ("tensors", "bucket", "align", "expected"),
    [
        # packed with alignment padding
        (metas((3, "uint8"), (5, "uint8")), 64, 16, [[(0, 0, 0, 3), (1, 0, 16, 5)]]),
        # does not fit in what is left: a new bucket, never split
        (metas((10, "float32"), (10, "float32")), 64, 16, [[(0, 0, 0, 40)], [(1, 0, 0, 40)]]),
        # exactly full
        (metas((8, "float32"), (8, "float32")), 64, 16, [[(0, 0, 0, 32), (1, 0, 32, 32)]]),
        # larger than a bucket: fills the rest of the current bucket, then spills over
        (
            metas((4, "uint8"), (40, "float32")),
            64,
            16,
            [[(0, 0, 0, 4), (1, 0, 16, 48)], [(1, 48, 0, 64)], [(1, 112, 0, 48)]],
        ),
        # split on element boundaries (8-byte elements, 60 bytes of room -> 56)
        (
            metas((1, "uint8"), (20, "float64")),
            76,
            16,
            [[(0, 0, 0, 1), (1, 0, 16, 56)], [(1, 56, 0, 72)], [(1, 128, 0, 32)]],
        ),
        # empty tensors get no segment; the bucket after them is unaffected
        (metas((0, "float32"), (2, "int64"), (0, "bool")), 64, 16, [[(1, 0, 0, 16)]]),
        # nothing to send at all
        (metas((0, "float32")), 64, 16, []),
        (metas(), 64, 16, []),
    ],
)
def test_layout_table(tensors, bucket, align, expected) -> None:
    assert layout(make_plan(tensors, bucket, align)) == expected


@pytest.mark.parametrize(
    ("tensors", "direct", "expected", "direct_buckets"),
    [
        # a direct tensor gets a bucket of its own; the packed bucket stays open across it
        (
            metas((3, "uint8"), (100, "float32"), (5, "uint8")),
            [False, True, False],
            [[(1, 0, 0, 400)], [(0, 0, 0, 3), (2, 0, 16, 5)]],
            [True, False],
        ),
        # direct ignores bucket_bytes: never split
        (metas((1000, "float64")), [True], [[(0, 0, 0, 8000)]], [True]),
        # an empty tensor flagged direct still needs no transfer
        (metas((0, "float32"), (4, "uint8")), [True, False], [[(1, 0, 0, 4)]], [False]),
    ],
)
def test_direct_layout_table(tensors, direct, expected, direct_buckets) -> None:
    plan = make_plan(tensors, 64, 16, direct)
    assert layout(plan) == expected
    assert [b.direct for b in plan.buckets] == direct_buckets


def test_direct_flags_must_match_the_tensors() -> None:
    with pytest.raises(ValueError, match="2 flags for 1 tensors"):
        make_plan(metas((1, "uint8")), 64, 16, [True, False])


def test_plan_is_deterministic_and_keeps_order() -> None:
    tensors = metas(*[(n, "float32") for n in (100, 7, 3000, 1, 0, 512)])
    first, second = make_plan(tensors, 1024, 64), make_plan(tensors, 1024, 64)
    assert first == second and first.digest == second.digest
    assert [m.name for m in first.tensors] == [m.name for m in tensors]


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_cover_every_byte_once(seed: int) -> None:
    rng = random.Random(seed)
    dtypes = ["uint8", "float16", "float32", "float64", "complex128", "bool"]
    tensors = metas(
        *[(rng.choice([0, 1, 3, 17, 100, 1000, 5000]), rng.choice(dtypes)) for _ in range(40)]
    )
    bucket = rng.choice([16, 48, 256, 4096, 1 << 20])
    plan = make_plan(tensors, bucket, 16)  # SyncPlan's own validator checks coverage and order
    assert all(b.nbytes <= bucket for b in plan.buckets)
    assert plan.nbytes >= sum(m.nbytes for m in tensors)
    whole = [m for m in tensors if 0 < m.nbytes <= bucket]
    single = {
        s.tensor for b in plan.buckets for s in b.segments if s.nbytes == tensors[s.tensor].nbytes
    }
    assert {tensors.index(m) for m in whole} <= single  # a tensor that fits is never split


@pytest.mark.parametrize(
    ("offset", "alignment", "expected"), [(0, 64, 0), (1, 64, 64), (64, 64, 64), (65, 16, 80)]
)
def test_align_up(offset: int, alignment: int, expected: int) -> None:
    assert align_up(offset, alignment) == expected


def test_bucket_smaller_than_alignment_is_refused() -> None:
    with pytest.raises(ValueError, match="alignment"):
        make_plan(metas((1, "uint8")), 8, 16)


@pytest.mark.parametrize(
    ("setting", "device_type", "bucket_bytes", "threshold"),
    [
        ("auto", "cpu", 32 << 20, 1 << 20),  # host buffers: the 1 MiB measured best on Gloo
        ("auto", "cuda", 32 << 20, 32 << 20),  # GPU buffers: only what fills a bucket goes alone
        ("auto", "cuda", 4096, 4096),
        (5000, "cuda", 32 << 20, 5000),  # an explicit value wins, anywhere
        (5000, "cpu", 32 << 20, 5000),
        (None, "cuda", 32 << 20, None),  # direct sends switched off
        (None, "cpu", 32 << 20, None),
    ],
)
def test_direct_threshold_follows_where_the_buffers_live(
    setting: int | str | None, device_type: str, bucket_bytes: int, threshold: int | None
) -> None:
    assert direct_threshold(setting, device_type, bucket_bytes) == threshold


@pytest.mark.parametrize(
    ("setting", "device_type", "collective", "threshold"),
    [
        ("auto", "cuda", True, 256 << 20),  # an NCCL member: only what fills a bucket
        ("auto", "cuda", False, 1 << 20),  # rings only (colocated): copies cost more than messages
        ("auto", "cpu", False, 1 << 20),
        ("auto", "cpu", True, 1 << 20),
        (5000, "cuda", False, 5000),  # an explicit value wins
        (None, "cuda", False, None),
    ],
)
def test_a_gpu_push_over_rings_only_sends_megabyte_tensors_alone(
    setting: int | str | None, device_type: str, collective: bool, threshold: int | None
) -> None:
    assert direct_threshold(setting, device_type, 256 << 20, collective) == threshold


@pytest.mark.parametrize(
    ("sizes", "alignment", "chunks"),
    [
        ([], 64, []),
        ([100], 64, [128]),
        ([1 << 20] * 4, 64, [1 << 20] * 4),  # full buckets: no rounding at all
        ([1000, 1000, 1000], 64, [1024] * 3),  # padded to 1024: one per chunk
        (
            [3000, 500, 500, 500],
            64,
            [4096, 512],
        ),  # first fit; the last chunk only as large as needed
        ([(1 << 20) - 64] * 3 + [5 << 20], 64, [8 << 20]),  # a large direct bucket sets the chunk
    ],
)
def test_pinned_chunks_are_powers_of_two_and_hold_every_buffer(
    sizes: list[int], alignment: int, chunks: list[int]
) -> None:
    got, where = pinned_chunks(sizes, alignment)
    assert got == chunks
    assert all(size & (size - 1) == 0 for size in got)
    spans = sorted(
        (chunk, offset, offset + size) for (chunk, offset), size in zip(where, sizes, strict=True)
    )
    for (chunk, start, end), (next_chunk, next_start, _) in itertools.pairwise(spans):
        assert next_chunk != chunk or next_start >= end  # no two buffers overlap
    for (chunk, offset), size in zip(where, sizes, strict=True):
        assert offset % alignment == 0 and offset + size <= got[chunk]


def test_pinned_chunks_waste_at_most_about_twice_the_largest_buffer() -> None:
    rng = random.Random(5)
    for _ in range(50):
        sizes = [rng.randint(1, 1 << 20) for _ in range(rng.randint(1, 60))]
        chunks, _ = pinned_chunks(sizes, 64)
        padded = sum(align_up(size, 64) for size in sizes)
        biggest = 1 << (align_up(max(sizes), 64) - 1).bit_length()
        # first-fit leaves at most half a chunk per chunk, the last one's rounding at most one
        assert sum(chunks) - padded <= len(chunks) * biggest // 2 + biggest
