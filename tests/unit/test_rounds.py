"""The rounds every receiving rank posts when several senders push over one group (pure): each
round holds the k-th bucket of every sender that has one, in sender order."""

from __future__ import annotations

import random

import pytest
import torch

from weight_sync.errors import SyncTimeoutError, TransportError, WeightSyncError
from weight_sync.transport.rounds import Rounds, schedule


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


class _FakeGroup:
    """Records the batches ``Rounds`` posts (pure: no process group)."""

    rank, timeout_s, is_nccl, device = 9, 5.0, False, torch.device("cpu")

    def __init__(self) -> None:
        self.batches: list[list[tuple[int, int]]] = []  # per round: (sender rank, buffer size)
        self.aborted: list[str] = []

    def exchange(self, sends: list, receives: list, timeout_s: float | None) -> object:
        assert not sends
        self.batches.append([(rank, buffer.numel()) for buffer, rank in receives])
        return _DoneWork()

    def abort(self, reason: str) -> None:
        self.aborted.append(reason)


class _RefusingGroup(_FakeGroup):
    def exchange(self, sends: list, receives: list, timeout_s: float | None) -> object:
        raise ValueError("a buffer on cuda:1")  # as _check_buffer refuses one


class _DoneWork:
    def wait(self) -> None:
        pass

    def after(self) -> None:
        pass


def _buffer(lane: int, k: int) -> torch.Tensor:
    return torch.empty(100 * lane + k + 1, dtype=torch.uint8)


@pytest.mark.parametrize("counts", [[3], [2, 2], [1, 3], [4, 1, 2], [1, 1, 1, 5]])
@pytest.mark.parametrize("seed", range(4))
def test_rounds_are_posted_in_schedule_order_however_the_lanes_hand_in(
    counts: list[int], seed: int
) -> None:
    """The lanes' threads hand their buffers in any interleaving (each in its own order), each
    done once its rounds are posted (a lane's receive returns only then): the batches posted
    are ``schedule``'s rounds, each lane's k-th buffer in round k."""
    group = _FakeGroup()
    senders = [10 + lane for lane in range(len(counts))]  # a lane's sender, as a group rank
    rounds = Rounds(group, senders)  # type: ignore[arg-type]
    rounds.begin(range(len(counts)))
    chance = random.Random(seed)
    handed: dict[int, list] = {lane: [] for lane in range(len(counts))}
    left = set(range(len(counts)))
    while left:
        ready = [
            lane
            for lane in sorted(left)
            if len(handed[lane]) < counts[lane] or all(h._ready.is_set() for h in handed[lane])
        ]
        lane = chance.choice(ready)
        if len(handed[lane]) < counts[lane]:
            handed[lane].append(rounds.hand(lane, _buffer(lane, len(handed[lane])), None))
        else:
            rounds.done(lane)
            left.remove(lane)
    expected = [
        [(senders[lane], _buffer(lane, k).numel()) for lane in present]
        for k, present in enumerate(schedule(counts))
    ]
    assert group.batches == expected and not group.aborted
    for works in handed.values():
        for work in works:
            work.wait()  # every buffer's round was posted


def test_a_lane_that_fails_mid_push_aborts_the_group_and_its_stranded_buffers_fail() -> None:
    group = _FakeGroup()
    rounds = Rounds(group, [0, 1])  # type: ignore[arg-type]
    rounds.begin([0, 1])
    rounds.hand(0, _buffer(0, 0), None)
    stranded = rounds.hand(0, _buffer(0, 1), None)  # lane 1 never hands: no round is posted
    rounds.done(0, failed=True)
    assert group.batches == [] and len(group.aborted) == 1
    with pytest.raises(TransportError, match="before its round was posted"):
        stranded.wait()
    rounds.hand(1, _buffer(1, 0), None)  # lane 1 goes on alone: its round is posted
    assert group.batches == [[(1, 101)]]


def test_a_lane_that_fails_before_handing_anything_leaves_the_group_whole() -> None:
    """Refused before any byte (its sender then sends nothing): the others go on."""
    group = _FakeGroup()
    rounds = Rounds(group, [0, 1])  # type: ignore[arg-type]
    rounds.begin([0, 1])
    rounds.done(1, failed=True)
    rounds.hand(0, _buffer(0, 0), None).wait()
    assert group.batches == [[(0, 1)]] and not group.aborted


def test_a_lane_that_fails_once_its_members_agreed_aborts_the_group() -> None:
    """Its sender sends once they agreed, though this rank took nothing yet: abort now."""
    group = _FakeGroup()
    rounds = Rounds(group, [0, 1])  # type: ignore[arg-type]
    rounds.begin([0, 1])
    rounds.agreed(1)
    rounds.done(1, failed=True)
    assert len(group.aborted) == 1


def test_a_round_that_cannot_be_posted_fails_every_lane_in_it_and_aborts() -> None:
    group = _RefusingGroup()
    rounds = Rounds(group, [0, 1])  # type: ignore[arg-type]
    rounds.begin([0, 1])
    first = rounds.hand(0, _buffer(0, 0), None)
    second = rounds.hand(1, _buffer(1, 0), None)
    for handed in (first, second):
        with pytest.raises(TransportError, match="cuda:1"):
            handed.wait()
    assert len(group.aborted) == 1


def test_a_round_a_lane_never_completes_times_out_and_outside_a_push_is_refused() -> None:
    group = _FakeGroup()
    rounds = Rounds(group, [0, 1])  # type: ignore[arg-type]
    with pytest.raises(WeightSyncError, match="outside a push"):
        rounds.hand(0, _buffer(0, 0), None)
    rounds.begin([0, 1])
    with pytest.raises(SyncTimeoutError, match="not posted"):
        rounds.hand(0, _buffer(0, 0), 0.05).wait()
    with pytest.raises(ValueError, match="no lane 2"):
        rounds.lane(2, None)  # type: ignore[arg-type]
