"""Several senders over one group, point to point, on spawned ranks (``transport.rounds``): the
data plane of the NCCL design for pushes from many senders, run here over Gloo as written.
Ranks ``0..K-1`` send, each bucket to its route's targets as one batch (what a lane's
``SendLane.broadcast`` posts); the others take every sender's buckets round by round through
``Rounds``, a thread per lane, as a push's lanes do."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.distributed.harness import RankContext, run_ranks
from weight_sync.errors import WeightSyncError
from weight_sync.transport import TorchGroup, rounds

pytestmark = pytest.mark.timeout(180)


def sizes_of(lane: int, buckets: int) -> list[int]:
    """Lane ``lane``'s bucket sizes: uneven, and different in every lane."""
    return [1000 + 337 * lane + 911 * k for k in range(buckets)]


def bucket(lane: int, k: int, size: int) -> torch.Tensor:
    """The bytes of lane ``lane``'s k-th bucket, the same wherever they are made."""
    generator = torch.Generator().manual_seed(1000 * lane + k)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)


def ended(group: TorchGroup, run: Callable[[], None]) -> tuple[str, float]:
    """``run`` this rank's part, then vote as a push ends (nobody leaves while another still
    receives), and leave ``group``: how the rank ended and how long it took."""
    started = time.monotonic()
    try:
        run()
        group.vote(0)
    except WeightSyncError as exc:
        return type(exc).__name__, time.monotonic() - started
    finally:
        group.close()
    return "done", time.monotonic() - started


def send_lane(
    group: TorchGroup,
    counts: list[int],
    receivers: Sequence[int],
    device: torch.device,
    fault: str | None = None,
    timeout_s: float = 30,
) -> None:
    """A sender's part (its lane: its rank): its buckets to ``receivers``. The last sender,
    with ``fault``, dies (``"die"``) or freezes (``"freeze"``) after its first bucket."""
    lane = group.rank
    made = [bucket(lane, k, n).to(device) for k, n in enumerate(sizes_of(lane, counts[lane]))]
    if fault in ("die", "freeze") and lane == len(counts) - 1:
        group.exchange([(made[0], rank) for rank in receivers], []).wait()
        if fault == "die":
            os._exit(9)
        time.sleep(timeout_s + 30)  # frozen: the receivers' bound ends their wait
    for work in [group.exchange([(b, rank) for rank in receivers], []) for b in made]:
        work.wait()


def rounds_rank(
    ctx: RankContext,
    counts: list[int],
    fault: str | None = None,
    timeout_s: float = 30,
    backend: str = "gloo",
) -> tuple[str, float]:
    """``relay_rank`` with every rank on a host of its own: each sender's buckets go straight
    to every receiving rank, nothing relayed. With ``fault``, the last sender dies (``"die"``)
    or freezes (``"freeze"``) after its first bucket. NCCL: rank r on GPU r."""
    hosts = [f"host {rank}" for rank in range(ctx.world_size)]
    return relay_rank(ctx, counts, hosts, fault, backend, timeout_s)


@pytest.mark.parametrize(
    ("counts", "receivers"),
    [
        ([3], 2),  # one sender: a broadcast made of sends
        ([4, 2], 2),  # a lane with fewer buckets drops out of the later rounds
        ([2, 0, 3], 1),  # a sender the layout gives nothing
    ],
)
def test_every_receiver_gets_every_senders_buckets_bit_exact(
    counts: list[int], receivers: int
) -> None:
    results = run_ranks(rounds_rank, len(counts) + receivers, counts)
    assert [outcome for outcome, _ in results] == ["done"] * (len(counts) + receivers)


def test_a_sender_that_dies_mid_push_fails_every_receiver_at_once() -> None:
    counts = [3, 3]
    results = run_ranks(rounds_rank, 4, counts, "die", timeout_s=90, expect_dead={1})
    for rank in (2, 3):  # the closed connection ends their wait, not the 30 s bound
        outcome, elapsed = results[rank]
        assert outcome == "TransportError" and elapsed < 15, (rank, results[rank])
    assert results[0][0] in ("TransportError", "SyncTimeoutError"), results[0]


def test_a_frozen_sender_costs_the_receivers_their_bound_and_no_more() -> None:
    counts, bound = [2, 2], 4.0
    results = run_ranks(rounds_rank, 4, counts, "freeze", bound, timeout_s=90, expect_dead={1})
    for rank in (2, 3):
        outcome, elapsed = results[rank]
        assert outcome in ("SyncTimeoutError", "TransportError"), (rank, results[rank])
        assert elapsed < 3 * bound + 5, (rank, results[rank])
    assert any(results[rank][0] == "SyncTimeoutError" for rank in (2, 3)), results


def relay_rank(
    ctx: RankContext,
    counts: list[int],
    hosts: Sequence[str],
    fault: str | None = None,
    backend: str = "gloo",
    timeout_s: float = 30,
) -> tuple[str, float]:
    """Move every lane's buckets (``counts[s]`` for sender s) over the routes of ``hosts`` (a
    name per rank: ranks of one name share a host), each receiving rank taking its lanes as a
    push's lanes do: through ``Rounds``, a thread per lane, each waiting for its bucket before
    it hands the next (with ``fault="ahead"``: handing the next first, as an atomic push's
    receive does), and checking each byte. With ``fault="die"``/``"freeze"`` the last sender
    dies or freezes after its first bucket. NCCL: rank r on GPU r. Returns how the rank ended
    and how long it took."""
    senders = len(counts)
    paths = rounds.lane_paths(senders, list(hosts))
    spec = ctx.spec("standalone", collective_timeout_s=timeout_s, backend=backend)
    device = torch.device("cuda", ctx.rank) if backend == "nccl" else torch.device("cpu")
    group = TorchGroup.join(spec, ctx.listener(0), device)

    def run() -> None:
        rounds.connect(group, paths)  # every pair the routes join, each way, as one batch
        if ctx.rank < senders:
            send_lane(group, counts, paths[ctx.rank].targets, device, fault, timeout_s)
        else:
            taking = rounds.Rounds(group, range(senders), paths)
            taking.begin(range(senders))

            def take(lane: int) -> None:
                try:
                    sizes = sizes_of(lane, counts[lane])
                    buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
                    ahead = int(fault == "ahead")
                    works = [taking.hand(lane, b, None) for b in buffers[:ahead]]
                    for k, size in enumerate(sizes):
                        if k + ahead < len(sizes):
                            works.append(taking.hand(lane, buffers[k + ahead], None))
                        works[k].wait()
                        assert torch.equal(buffers[k].cpu(), bucket(lane, k, size)), (lane, k)
                except BaseException:
                    taking.done(lane, failed=True)
                    raise
                taking.done(lane)

            with ThreadPoolExecutor(senders) as pool:
                for call in [pool.submit(take, lane) for lane in range(senders)]:
                    call.result()

    return ended(group, run)


@pytest.mark.parametrize(
    ("counts", "hosts"),
    [
        ([3, 2], "abccc"),  # ranks 2 and 3 relay to each other, and both to rank 4
        ([2, 0, 3], "abcdd"),  # a lane with no buckets; lanes 0 and 2 enter at rank 3
        ([2, 2], "abccd"),  # two receiving hosts: rank 4, alone on its own, takes it straight
        ([2, 3], "acccd"),  # lane 0 relayed on host c; lane 1 straight to its own host's ranks
    ],
)
@pytest.mark.parametrize("ahead", [False, True], ids=["in_turn", "ahead"])
def test_relayed_lanes_reach_every_receiving_rank_bit_exact(
    counts: list[int], hosts: str, ahead: bool
) -> None:
    results = run_ranks(relay_rank, len(hosts), counts, hosts, "ahead" if ahead else None)
    assert [outcome for outcome, _ in results] == ["done"] * len(hosts)


def test_a_sender_that_dies_mid_push_fails_every_rank_it_was_relayed_to() -> None:
    results = run_ranks(relay_rank, 5, [3, 3], "abccc", "die", timeout_s=90, expect_dead={1})
    for rank in (2, 3, 4):  # within the bound (30 s), whether relayed to or not
        outcome, elapsed = results[rank]
        assert outcome in ("TransportError", "SyncTimeoutError") and elapsed < 25, results


def refusals(ctx: RankContext) -> list[str]:
    """An exchange with nobody, and one with this rank itself: refused before any op."""
    group = TorchGroup.join(ctx.spec("standalone"), ctx.listener(0))
    try:
        errors = []
        for sends in ([], [(torch.zeros(4, dtype=torch.uint8), ctx.rank)]):
            try:
                group.exchange(sends, [])
            except ValueError as exc:
                errors.append(str(exc))
        group.vote(0)  # the group is still whole: nothing was posted
        return errors
    finally:
        group.close()


def test_an_exchange_with_itself_or_nobody_is_refused() -> None:
    for errors in run_ranks(refusals, 2):
        assert len(errors) == 2 and "at least one" in errors[0] and "cannot" in errors[1]
