"""How many calls a push costs each worker: one in the steady state (prepare, receive and commit
agreed by votes over the group), the long way when a worker lacks the plan or checksums are on,
and a refusal in one call that still stops the push before any byte moves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
import torch

from tests.ray.actors import BIG, Counting, Trainer, ZooWorker
from tests.zoo import zoo
from weight_sync import PlanMismatchError, PushResult
from weight_sync.wire.checksums import state_dict_digests

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("ray_cluster")]
TIMEOUT = 120
WORKERS = 3
CALLS = ("info", "join", "prepare", "receive", "commit", "push", "lanes_push")


@ray.remote(num_cpus=0)
class CountingWorker(Counting, ZooWorker.__ray_actor_class__):  # type: ignore[misc]
    """Counts the protocol's calls it is sent (``actors.Counting``)."""

    def counted(self) -> dict[str, int]:
        calls = self.__dict__.pop("_protocol_calls", {})
        return {name: calls.get(f"_weight_sync_{name}", 0) for name in CALLS}

    def reshape(self, name: str, shape: tuple[int, ...]) -> None:
        """The model's tensor ``name`` takes another shape (the next push no longer fits it)."""
        old = getattr(self.model, name)
        setattr(self.model, name, torch.zeros(shape, dtype=old.dtype))

    def forget_plans(self) -> None:
        self._weight_sync_state()._plans.clear()


@pytest.fixture(scope="module")
def fleet(ray_cluster: None) -> Iterator[tuple[list, list]]:
    """One trainer and three workers for the module (each test starts by pushing, and leaves
    every worker able to take the next push); the last test brings a trainer of its own."""
    workers = [CountingWorker.remote(seed=300 + i) for i in range(WORKERS)]
    trainers = [Trainer.remote(workers, bucket_bytes=256 << 10)]
    try:
        yield trainers, workers
    finally:
        ray.get([trainer.close.remote() for trainer in trainers], timeout=TIMEOUT)
        for actor in [*trainers, *workers]:
            ray.kill(actor)


def counted(workers: list) -> list[dict[str, int]]:
    return ray.get([w.counted.remote() for w in workers], timeout=TIMEOUT)


def calls(**counts: int) -> dict[str, int]:
    return {name: counts.get(name, 0) for name in CALLS}


def assert_holds(workers: list, seed: int, version: int) -> None:
    versions = ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT)
    digests = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
    assert versions == [version] * len(workers)
    assert digests == [state_dict_digests(zoo(seed, big=BIG))] * len(workers)


def test_the_steady_state_costs_one_call_per_worker(fleet: tuple[list, list]) -> None:
    (trainer, *_), workers = fleet
    first: PushResult = ray.get(trainer.push_zoo.remote(1), timeout=TIMEOUT)
    # The first push asks what each worker brings (the probe), forms the group (a join) and
    # sends the plan: a prepare round, then a receive that ends in the commit.
    assert counted(workers) == [calls(info=1, join=1, prepare=1, receive=1)] * WORKERS
    assert set(first.phases) == {"group", "prepare", "transfer", "total"}
    for seed in (2, 3, 4):
        result: PushResult = ray.get(trainer.push_zoo.remote(seed), timeout=TIMEOUT)
        assert counted(workers) == [calls(push=1)] * WORKERS
        assert set(result.phases) == {"group", "push", "total"}
        assert_holds(workers, seed, result.version)


def test_a_refusal_in_one_call_stops_the_push_before_any_byte(fleet: tuple[list, list]) -> None:
    (trainer, *_), workers = fleet
    held = ray.get(trainer.push_zoo.remote(5), timeout=TIMEOUT)
    ray.get(workers[1].reshape.remote("float32_matrix", (13, 7)), timeout=TIMEOUT)
    counted(workers)
    with pytest.raises(PlanMismatchError) as info:
        ray.get(trainer.push_zoo.remote(6), timeout=TIMEOUT)
    assert list(info.value.problems) == [1] and "float32_matrix" in str(info.value)
    assert counted(workers) == [calls(push=1)] * WORKERS  # refused within the one call
    # Nobody took a byte of it: the others keep version and weights; worker 1 its version.
    versions = ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT)
    assert versions == [held.version] * WORKERS
    digests = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
    assert digests[0] == digests[2] == state_dict_digests(zoo(5, big=BIG))
    # The group was kept, and the next push that fits goes through in one call again.
    statuses = ray.get([w.sync_status.remote() for w in workers], timeout=TIMEOUT)
    assert all(status.in_group and status.phase == "idle" for status in statuses)
    ray.get(workers[1].reshape.remote("float32_matrix", (7, 13)), timeout=TIMEOUT)
    result = ray.get(trainer.push_zoo.remote(7), timeout=TIMEOUT)
    assert counted(workers) == [calls(push=1)] * WORKERS
    assert_holds(workers, 7, result.version)


def test_a_worker_that_lost_the_plan_is_sent_it_the_long_way(fleet: tuple[list, list]) -> None:
    (trainer, *_), workers = fleet
    ray.get(trainer.push_zoo.remote(8), timeout=TIMEOUT)
    ray.get(workers[2].forget_plans.remote(), timeout=TIMEOUT)
    counted(workers)
    result = ray.get(trainer.push_zoo.remote(9), timeout=TIMEOUT)
    # Everyone was asked in one call; worker 2 asked for the plan, so the push was called off
    # before any byte and went the long way: a prepare round (with the plan) and a receive.
    assert counted(workers) == [calls(push=1, prepare=1, receive=1)] * WORKERS
    assert_holds(workers, 9, result.version)
    ray.get(trainer.push_zoo.remote(10), timeout=TIMEOUT)
    assert counted(workers) == [calls(push=1)] * WORKERS


def test_pushes_alternating_between_plans_stay_at_one_call(fleet: tuple[list, list]) -> None:
    """A full push and a partial one in turn (two plans): each worker keeps both, and so does
    the trainer's record of what it holds."""
    (trainer, *_), workers = fleet
    ray.get(trainer.push_zoo.remote(13), timeout=TIMEOUT)
    ray.get(
        trainer.push_partial_zoo.remote(14, ["float32_matrix", "int64_matrix"]), timeout=TIMEOUT
    )
    counted(workers)
    for seed in (15, 16):
        full = ray.get(trainer.push_zoo.remote(seed), timeout=TIMEOUT)
        assert counted(workers) == [calls(push=1)] * WORKERS
        part = ray.get(trainer.push_partial_zoo.remote(seed + 10, ["float32_matrix", "int64_matrix"]),
                       timeout=TIMEOUT)  # fmt: skip
        assert counted(workers) == [calls(push=1)] * WORKERS
        assert part.partial and part.version == full.version + 1


def test_checksums_keep_the_commit_round(fleet: tuple[list, list]) -> None:
    trainers, workers = fleet
    ray.get(trainers[0].close.remote(), timeout=TIMEOUT)  # the workers join the new one's group
    trainers.append(Trainer.remote(workers, bucket_bytes=256 << 10, checksum=True))
    counted(workers)
    for seed, first in ((31, 1), (32, 0)):  # the first probes and forms the group
        result = ray.get(trainers[-1].push_zoo.remote(seed), timeout=TIMEOUT)
        # The trainer compares every worker's CRCs before anyone commits.
        every = calls(info=first, join=first, prepare=1, receive=1, commit=1)
        assert counted(workers) == [every] * WORKERS
        assert_holds(workers, seed, result.version)


def test_the_k1_front_costs_one_call_per_worker_too(fleet: tuple[list, list]) -> None:
    """The many-senders front's K = 1 case (``senders=OneRank()``), which one sender's pushes
    are becoming: its first push asks each worker what it brings, then takes the push in one
    call (the layout read from rank 0's store, the lane formed and planned through the
    sender's); every push after it is one call per worker -- full and partial in turn (two
    layouts) -- and a refusal stops the push in that call before any byte."""
    trainers, workers = fleet
    for trainer in trainers:  # the workers take the new front's lanes
        ray.get(trainer.close.remote(), timeout=TIMEOUT)
    trainers.append(Trainer.remote(workers, lanes=True, bucket_bytes=256 << 10))
    counted(workers)
    ray.get(trainers[-1].push_zoo.remote(40), timeout=TIMEOUT)
    assert counted(workers) == [calls(info=1, lanes_push=1)] * WORKERS
    for seed in (41, 42):
        full = ray.get(trainers[-1].push_zoo.remote(seed), timeout=TIMEOUT)
        assert counted(workers) == [calls(lanes_push=1)] * WORKERS
        assert_holds(workers, seed, full.version)
        part = ray.get(
            trainers[-1].push_partial_zoo.remote(seed + 10, ["float32_matrix", "int64_matrix"]),
            timeout=TIMEOUT,
        )
        assert counted(workers) == [calls(lanes_push=1)] * WORKERS
        assert part.partial and part.version == full.version + 1
    ray.get(workers[1].reshape.remote("float32_matrix", (13, 7)), timeout=TIMEOUT)
    with pytest.raises(PlanMismatchError) as info:
        ray.get(trainers[-1].push_zoo.remote(43), timeout=TIMEOUT)
    assert list(info.value.problems) == [1] and "float32_matrix" in str(info.value)
    assert counted(workers) == [calls(lanes_push=1)] * WORKERS
    ray.get(workers[1].reshape.remote("float32_matrix", (7, 13)), timeout=TIMEOUT)
    result = ray.get(trainers[-1].push_zoo.remote(44), timeout=TIMEOUT)
    assert counted(workers) == [calls(lanes_push=1)] * WORKERS
    assert_holds(workers, 44, result.version)
