"""The rounds every receiving rank posts when several senders push over one group (pure): each
round holds the k-th bucket of every sender that has one, in sender order."""

from __future__ import annotations

import random

import pytest
import torch

from weight_sync.errors import SyncTimeoutError, TransportError, WeightSyncError
from weight_sync.transport.rounds import LanePath, Rounds, lane_paths, schedule


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


@pytest.mark.parametrize(
    ("senders", "hosts", "expected"),
    [
        # Every rank on one host (these tests' machines): every lane straight to every rank.
        (2, "aaaa", [((2, 3), {2: 0, 3: 0}), ((2, 3), {2: 1, 3: 1})]),
        # The receiving ranks on a host of their own: each lane enters at another rank, which
        # relays it to the rest (here: ranks 2 and 3 relay to each other).
        (2, "abcc", [((2,), {2: 0, 3: 2}), ((3,), {2: 3, 3: 1})]),
        (2, "aabb", [((2,), {2: 0, 3: 2}), ((3,), {2: 3, 3: 1})]),  # one trainer host
        (1, "abbb", [((1,), {1: 0, 2: 1, 3: 1})]),  # one sender: into the host once
        (
            3,
            "abcddd",
            [((3,), {3: 0, 4: 3, 5: 3}), ((4,), {3: 4, 4: 1, 5: 4}), ((5,), {3: 5, 4: 5, 5: 2})],
        ),
        # More lanes than ranks on the host: lane 2 enters where lane 0 did.
        (3, "aaabb", [((3,), {3: 0, 4: 3}), ((4,), {3: 4, 4: 1}), ((3,), {3: 2, 4: 3})]),
        # Two receiving hosts: once into each; a host of one rank takes it straight.
        (2, "abccd", [((2, 4), {2: 0, 3: 2, 4: 0}), ((3, 4), {2: 3, 3: 1, 4: 1})]),
        # A sender on a host with receiving ranks: straight to those, relayed elsewhere.
        (
            2,
            "abaabb",
            [((2, 3, 4), {2: 0, 3: 0, 4: 0, 5: 4}), ((3, 4, 5), {2: 3, 3: 1, 4: 1, 5: 1})],
        ),
    ],
)
def test_lane_paths_table(
    senders: int, hosts: str, expected: list[tuple[tuple[int, ...], dict[int, int]]]
) -> None:
    assert lane_paths(senders, list(hosts)) == [LanePath(targets, via) for targets, via in expected]


def test_lane_paths_reach_every_receiving_rank_once_per_lane_and_cross_each_host_once() -> None:
    chance = random.Random(0)
    for _ in range(200):
        senders, receivers = chance.randint(1, 6), chance.randint(1, 9)
        hosts = [chance.choice("abcd") for _ in range(senders + receivers)]
        for lane, route in enumerate(lane_paths(senders, hosts)):
            assert sorted(route.via) == list(range(senders, senders + receivers))
            for rank, source in route.via.items():  # from the sender, or one hop from it
                assert source == lane or route.via[source] == lane, (hosts, lane, rank)
                assert source == lane or hosts[source] == hosts[rank]
            crossing = [hosts[r] for r in route.targets if hosts[r] != hosts[lane]]
            assert len(crossing) == len(set(crossing))  # into another host once
            relayed = [r for r in route.via if route.via[r] != lane]
            assert sorted(r for t in route.targets for r in route.forwards(t)) == sorted(relayed)


@pytest.mark.parametrize(("senders", "ranks"), [(0, 3), (3, 3), (4, 3)])
def test_lane_paths_need_a_sender_and_a_receiving_rank(senders: int, ranks: int) -> None:
    with pytest.raises(ValueError, match="cannot have"):
        lane_paths(senders, ["a"] * ranks)


class _FakeGroup:
    """Records the batches ``Rounds`` posts (pure: no process group)."""

    rank, timeout_s, is_nccl, device = 9, 5.0, False, torch.device("cpu")

    def __init__(self) -> None:
        self.batches: list[list[tuple[int, int]]] = []  # per round: (sender rank, buffer size)
        self.sends: list[list[tuple[int, int]]] = []  # per batch: (receiving rank, size)
        self.aborted: list[str] = []

    def exchange(self, sends: list, receives: list, timeout_s: float | None) -> object:
        self.sends.append([(rank, buffer.numel()) for buffer, rank in sends])
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
    assert not any(group.sends)
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


class _RelayingGroup(_FakeGroup):
    rank = 3  # of "abcc": lane 0 relayed from rank 2, lane 1 sent here and relayed to rank 2

    def __init__(self) -> None:
        super().__init__()
        self.waited: list[int] = []  # the batches waited on, in order

    def exchange(self, sends: list, receives: list, timeout_s: float | None) -> object:
        super().exchange(sends, receives, timeout_s)
        return _CountedWork(self, len(self.batches) - 1)


class _CountedWork(_DoneWork):
    def __init__(self, group: _RelayingGroup, index: int) -> None:
        self.group, self.index = group, index

    def wait(self) -> None:
        self.group.waited.append(self.index)

    def after(self) -> None:
        self.wait()


def test_a_relaying_rank_takes_its_lanes_then_sends_them_on_and_takes_what_is_relayed() -> None:
    """Over Gloo the second batch of a round is posted only once the first is in: it sends the
    buffers the first received into."""
    group = _RelayingGroup()
    rounds = Rounds(group, [0, 1], lane_paths(2, list("abcc")))  # type: ignore[arg-type]
    rounds.begin([0, 1])
    zero, one = rounds.hand(0, _buffer(0, 0), None), rounds.hand(1, _buffer(1, 0), None)
    assert group.batches == [[(1, 101)]] and group.sends == [[]]  # lane 1 from its sender
    zero.wait()  # the first to wait posts the second batch
    assert group.batches == [[(1, 101)], [(2, 1)]]  # lane 0 from rank 2, which relays it
    assert group.sends == [[], [(2, 101)]]  # lane 1 on to rank 2
    assert group.waited == [0, 1]
    one.wait()
    assert group.waited == [0, 1, 0, 1] and len(group.batches) == 2 and not group.aborted


def test_a_rank_that_only_takes_relayed_lanes_posts_one_batch_a_round() -> None:
    group = _FakeGroup()
    group.rank = 4  # of "abccc": lanes 0 and 1 both relayed to it
    rounds = Rounds(group, [0, 1], lane_paths(2, list("abccc")))  # type: ignore[arg-type]
    rounds.begin([0, 1])
    rounds.hand(0, _buffer(0, 0), None)
    rounds.hand(1, _buffer(1, 0), None).wait()
    assert group.batches == [[(2, 1), (3, 101)]] and group.sends == [[]]


class _RelayRefusingGroup(_RelayingGroup):
    """Refuses its second relay: rank 2 left after round 1."""

    def exchange(self, sends: list, receives: list, timeout_s: float | None) -> object:
        if sends and sum(map(bool, self.sends)) == 1:
            raise ValueError("rank 2 is gone")
        return super().exchange(sends, receives, timeout_s)


def test_a_relay_that_cannot_be_posted_aborts_and_fails_its_round_for_every_lane() -> None:
    group = _RelayRefusingGroup()
    rounds = Rounds(group, [0, 1], lane_paths(2, list("abcc")))  # type: ignore[arg-type]
    rounds.begin([0, 1])
    for work in [rounds.hand(lane, _buffer(lane, 0), None) for lane in (0, 1)]:
        work.wait()  # round 1, relayed
    handed = [rounds.hand(lane, _buffer(lane, 1), None) for lane in (0, 1)]
    for lane in (0, 1):  # round 3 posted too, before round 2 is waited on (as staging does)
        rounds.hand(lane, _buffer(lane, 2), None)
    for work in handed:
        with pytest.raises(TransportError, match="relaying round 2 failed: rank 2 is gone"):
            work.wait()
    assert len(group.aborted) == 1
