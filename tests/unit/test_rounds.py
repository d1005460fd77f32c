"""The rounds every receiving rank posts when several senders push over one group (pure): each
round holds the k-th bucket of every sender that has one, in sender order."""

from __future__ import annotations

import pytest

from weight_sync.transport.rounds import schedule


@pytest.mark.parametrize(
    ("counts", "rounds"),
    [
        ([], []),
        ([0], []),
        ([3], [(0,), (0,), (0,)]),
        ([2, 2], [(0, 1), (0, 1)]),
        ([1, 3], [(0, 1), (1,), (1,)]),  # a lane with fewer buckets drops out of later rounds
        ([3, 0, 2], [(0, 2), (0, 2), (0,)]),  # a sender the layout gives nothing
        ([0, 0], []),
    ],
)
def test_schedule_table(counts: list[int], rounds: list[tuple[int, ...]]) -> None:
    assert schedule(counts) == rounds


def test_every_bucket_is_in_exactly_one_round_in_its_lanes_order() -> None:
    counts = [5, 1, 4, 0, 2]
    seen: dict[int, int] = {}
    for k, lanes in enumerate(schedule(counts)):
        for lane in lanes:
            assert seen.get(lane, 0) == k  # the k-th bucket of the lane, in round k
            seen[lane] = k + 1
    assert [seen.get(lane, 0) for lane in range(len(counts))] == counts


def test_a_negative_count_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        schedule([2, -1])
