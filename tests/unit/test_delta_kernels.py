"""The fused kernels. fp32 -> bf16 against torch's own cast, bit for bit: the values that round
in every way (ties to even, up into inf, subnormals, signed zeros), random bit patterns, NaN
(never decided: -1, nothing written), and blobs whose changes outnumber or fall short of the
room they were given. Words of one width (bf16, fp16, fp32 pushed as they are) against NumPy's
bitwise comparison, NaN payloads and signed zeros included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weight_sync.delta import kernels
from weight_sync.delta.layout import SPAN

# fp32 bit patterns, each with what torch rounds it to (checked below, not assumed).
EDGES = [
    0x00000000, 0x80000000,  # +-0
    0x3F800000, 0xBF800000,  # +-1
    0x7F800000, 0xFF800000,  # +-inf
    0x7F7FFFFF,  # the largest finite: rounds up to inf
    0x7F7F7FFF,  # just below the tie under it: rounds down
    0x3F808000, 0xBF808000,  # ties, even below: stay
    0x3F818000,  # a tie, odd below: rounds up
    0x3F807FFF, 0x3F808001,  # either side of a tie
    0x00000001, 0x007FFFFF, 0x00008000, 0x00018000,  # subnormals, ties among them
]  # fmt: skip
NAN = 0x7FC00000


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """torch's fp32 -> bf16 of ``x`` (fp32 bits as uint32), as uint16 bits."""
    return (
        torch.from_numpy(x.view(np.float32))
        .to(torch.bfloat16)
        .view(torch.int16)
        .numpy()
        .view(np.uint16)
    )


def random_finite(n: int, seed: int) -> np.ndarray:
    bits = np.random.default_rng(seed).integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    bits[nan] &= 0xFF7FFFFF  # exponent no longer all ones: finite
    return bits


def scan(x: np.ndarray, base: np.ndarray) -> tuple[int, list[int], np.ndarray, np.ndarray]:
    """``kernels.scan`` with room for every element: how many changed, per span, their values and
    positions."""
    values, rows = np.zeros(x.size, np.uint16), np.zeros(x.size, np.int32)
    counts = np.full(-(-x.size // SPAN), -5, np.int64)
    found = kernels.scan(x, base, values, rows, counts, SPAN, 0)
    return found, counts.tolist(), values[: max(found, 0)], rows[: max(found, 0)]


def extract(
    x: np.ndarray, base: np.ndarray, room: int
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    index, values, rows = (
        np.zeros(room, np.uint16),
        np.zeros(room, np.uint16),
        np.zeros(room, np.int32),
    )
    found = kernels.extract(x, base, index, values, rows)
    return found, index, values, rows


@pytest.mark.parametrize("n", [len(EDGES), 64, 64 * 7 + 5, SPAN + 100, 3 * SPAN])
def test_rounding_is_torchs_bit_for_bit(n: int) -> None:
    x = np.concatenate([np.array(EDGES, np.uint32), random_finite(n, seed=n)])[:n]
    rounded = bf16_bits(x)
    assert rounded[EDGES.index(0x7F7FFFFF)] == 0x7F80 and rounded[EDGES.index(0x3F818000)] == 0x3F82
    found, counts, _, _ = scan(x, rounded.copy())
    assert found == 0 and not any(counts)  # nothing changed
    base = rounded ^ np.uint16(1)  # every element differs in its last bit
    found, counts, values, rows = scan(x, base)
    assert found == n and counts == [min(SPAN, n - s * SPAN) for s in range(len(counts))]
    assert np.array_equal(values, rounded) and np.array_equal(rows, np.arange(n))
    assert np.array_equal(base, rounded ^ np.uint16(1))  # a scan leaves the copy as it is
    found, index, values, rows = extract(x, base, n)
    assert found == n
    assert np.array_equal(values, rounded) and np.array_equal(rows, np.arange(n))
    assert np.array_equal(index, np.arange(n) % SPAN)
    assert np.array_equal(base, rounded)  # brought up to date: every change fitted


@pytest.mark.parametrize("density", [0.0, 0.001, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("n", [63, 64 * 33, 200_003])
def test_changes_are_found_in_order(density: float, n: int) -> None:
    rng = np.random.default_rng(int(density * 1000) + n)
    x = random_finite(n, seed=n)
    base = bf16_bits(x).copy()
    picked = np.flatnonzero(rng.random(n) < density)
    base[picked] ^= np.uint16(0x0100)
    found, counts, values, rows = scan(x, base)
    assert found == picked.size
    assert counts == [
        int(((picked >= s * SPAN) & (picked < (s + 1) * SPAN)).sum()) for s in range(len(counts))
    ]
    assert np.array_equal(rows, picked) and np.array_equal(values, bf16_bits(x)[picked])
    copy, index, blob = base.copy(), np.zeros(found, np.uint16), np.zeros(found, np.uint16)
    kernels.emit(rows, values, copy, index, blob)
    assert np.array_equal(copy, bf16_bits(x)) and np.array_equal(index, picked % SPAN)
    assert np.array_equal(blob, values)
    found, index, values, rows = extract(x, base, picked.size)
    assert found == picked.size
    assert np.array_equal(rows, picked) and np.array_equal(values, bf16_bits(x)[picked])
    assert np.array_equal(index, picked % SPAN) and np.array_equal(base, bf16_bits(x))


def test_a_scan_from_an_offset_names_positions_from_the_piece() -> None:
    """A piece is scanned in two calls (its first span decides whether to go on): the second's
    positions count from the piece's first element."""
    x = random_finite(3 * SPAN, seed=1)
    base = bf16_bits(x) ^ np.uint16(1)
    values, rows = np.zeros(2 * SPAN, np.uint16), np.zeros(2 * SPAN, np.int32)
    counts = np.zeros(2, np.int64)
    assert kernels.scan(x[SPAN:], base[SPAN:], values, rows, counts, SPAN, SPAN) == 2 * SPAN
    assert counts.tolist() == [SPAN, SPAN] and np.array_equal(rows, np.arange(SPAN, 3 * SPAN))


@pytest.mark.parametrize("at", [0, 63, 64, 1000, SPAN + 3])
def test_a_nan_is_never_decided(at: int) -> None:
    """torch rounds NaN to 0x7FC0 or 0xFFFF depending on where it falls: the caller compares
    it the torch way. Nothing of ``base`` is written."""
    x = random_finite(SPAN + 10, seed=at)
    base = bf16_bits(x) ^ np.uint16(1)
    x[at] = NAN
    before = base.copy()
    assert scan(x, base)[0] == -1
    assert extract(x, base, x.size)[0] == -1
    assert np.array_equal(base, before)


@pytest.mark.parametrize("room", [0, 5, 9])
def test_more_or_fewer_changes_than_room_leave_the_copy_alone(room: int) -> None:
    """The caller expects the count its scan made; any other number is a push to fail (the
    weights changed meanwhile), and the copy is not half brought up to date."""
    x = random_finite(1000, seed=room)
    base = bf16_bits(x).copy()
    base[[3, 70, 128, 500, 999, 12, 13]] ^= np.uint16(4)  # 7 changes
    before = base.copy()
    found, _, _, rows = extract(x, base, room)
    assert found == 7
    assert np.array_equal(rows[: min(room, 7)], [3, 12, 13, 70, 128, 500, 999][:room])
    assert np.array_equal(base, before)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.5, 1.0])
@pytest.mark.parametrize("n", [63, 64 * 33 + 7, SPAN * 2 + 100])
def test_words_of_one_width_compare_bit_for_bit(dtype: type, density: float, n: int) -> None:
    """A tensor pushed in its own dtype: every differing word is a change -- NaNs of other
    payloads, -0.0 against 0.0 -- and nothing is left undecided (no -1)."""
    rng = np.random.default_rng(n + int(density * 100))
    info = np.iinfo(dtype)
    base = rng.integers(0, int(info.max) + 1, n, dtype=np.uint64).astype(dtype)
    nan, minus_zero = (0x7FC0, 0x8000) if dtype == np.uint16 else (0x7FC00000, 0x80000000)
    base[:4] = [nan, 0, nan | 1, nan]
    x = base.copy()
    x[:3] = [nan | 2, minus_zero, nan | 1]  # two changes (a NaN's payload, the zero's sign)
    picked = np.flatnonzero(rng.random(n) < density)
    picked = picked[picked >= 4]
    x[picked] ^= dtype(1 << int(rng.integers(0, 8 * np.dtype(dtype).itemsize)))
    expected = np.flatnonzero(x != base)
    assert expected[:2].tolist() == [0, 1]
    values, rows = np.zeros(n, dtype), np.zeros(n, np.int32)
    counts = np.full(-(-n // SPAN), -5, np.int64)
    found = kernels.scan(x, base, values, rows, counts, SPAN, 0)
    assert found == expected.size
    assert counts.tolist() == [
        int(((expected >= s * SPAN) & (expected < (s + 1) * SPAN)).sum())
        for s in range(len(counts))
    ]
    assert np.array_equal(rows[:found], expected) and np.array_equal(values[:found], x[expected])
    copy, index, blob = base.copy(), np.zeros(found, np.uint16), np.zeros(found, dtype)
    kernels.emit(rows[:found], values[:found], copy, index, blob)
    assert np.array_equal(copy, x) and np.array_equal(index, expected % SPAN)
    index, values, rows = (
        np.zeros(found, np.uint16),
        np.zeros(found, dtype),
        np.zeros(found, np.int32),
    )
    assert kernels.extract(x, base, index, values, rows) == found
    assert np.array_equal(base, x) and np.array_equal(values, x[expected])
