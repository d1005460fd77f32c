"""How many control round trips a push from one sender costs each worker: the Ray calls it is
sent, and the steps its lane reads from the sender's store (``store``) while the push's one
call runs. One call and no store step in the steady state; the first push, a worker that lacks
the plan, and checksums take their other steps through the store, inside that call, the first
of them riding with it; a refusal stops the push in that call before any byte.

Before one sender's pushes became the K = 1 case of the many-senders protocol (session 30),
each worker was sent, as Ray calls: info, join, prepare and receive on the first push (4), one
call in the steady state, push, prepare and receive where it lacked the plan (3), prepare,
receive and commit with checksums (3; info and join too on the first), and one call for a
refusal. The trainer waits on as many steps in turn now -- the call and its first store step
are one wait -- and on no more (docs/how-a-push-works.md)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from tests.ray.actors import BIG, Counting, Trainer, ZooWorker, _receivers
from tests.zoo import zoo
from weight_sync import PlanMismatchError, PushResult
from weight_sync.wire.checksums import state_dict_digests

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("ray_cluster")]
TIMEOUT = 120
WORKERS = 3
# ``apply``: the call a worker makes on itself to apply a staged push (none here).
# ``store``: steps read -- init (probe and join), start (prepare), update (receive, which may
# commit), finish (commit), and the end of a push that did not commit here.
CALLS = ("info", "lanes_push", "apply", "store")


@ray.remote(num_cpus=0)
class CountingWorker(Counting, ZooWorker.__ray_actor_class__):  # type: ignore[misc]
    """Counts the protocol's calls it is sent (``actors.Counting``) and the steps its lanes
    read from their senders' stores (``store``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from weight_sync.receive import inbound

        read = inbound.Inbound._command

        def command(lane: Any, *args: Any, **kwargs: Any) -> Any:
            self._store_steps = getattr(self, "_store_steps", 0) + 1
            return read(lane, *args, **kwargs)

        inbound.Inbound._command = command  # this actor's process only

    def counted(self) -> dict[str, int]:
        calls = self.__dict__.pop("_protocol_calls", {})
        calls["store"] = self.__dict__.pop("_store_steps", 0)
        return {name: calls.get(name, calls.get(f"_weight_sync_{name}", 0)) for name in CALLS}

    def reshape(self, name: str, shape: tuple[int, ...]) -> None:
        """The model's tensor ``name`` takes another shape (the next push no longer fits it)."""
        old = getattr(self.model, name)
        setattr(self.model, name, torch.zeros(shape, dtype=old.dtype))

    def forget_plans(self) -> None:
        for receiver in _receivers(self):
            receiver._plans.clear()


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
    # The first push asks what each worker brings (Ray's probe); its call then forms the lane
    # (init), sends the plan (start) and the bytes, which commit on receipt (update).
    assert counted(workers) == [calls(info=1, lanes_push=1, store=3)] * WORKERS
    assert set(first.phases) == {"agree", "group", "prepare", "transfer", "settle", "total"}
    for seed in (2, 3, 4):
        result: PushResult = ray.get(trainer.push_zoo.remote(seed), timeout=TIMEOUT)
        assert counted(workers) == [calls(lanes_push=1)] * WORKERS
        assert set(result.phases) == {"agree", "group", "push", "settle", "total"}
        assert_holds(workers, seed, result.version)


def test_a_refusal_in_one_call_stops_the_push_before_any_byte(fleet: tuple[list, list]) -> None:
    (trainer, *_), workers = fleet
    held = ray.get(trainer.push_zoo.remote(5), timeout=TIMEOUT)
    ray.get(workers[1].reshape.remote("float32_matrix", (13, 7)), timeout=TIMEOUT)
    counted(workers)
    with pytest.raises(PlanMismatchError) as info:
        ray.get(trainer.push_zoo.remote(6), timeout=TIMEOUT)
    assert list(info.value.problems) == [1] and "float32_matrix" in str(info.value)
    # Refused within the one call; the member then reads the push's end, waiting on no one.
    assert counted(workers) == [calls(lanes_push=1, store=1)] * WORKERS
    # Nobody took a byte of it: the others keep version and weights; worker 1 its version.
    versions = ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT)
    assert versions == [held.version] * WORKERS
    digests = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
    assert digests[0] == digests[2] == state_dict_digests(zoo(5, big=BIG))
    ray.get(workers[1].reshape.remote("float32_matrix", (7, 13)), timeout=TIMEOUT)
    statuses = ray.get([w.sync_status.remote() for w in workers], timeout=TIMEOUT)
    assert all(status.in_group and status.phase == "idle" for status in statuses)
    # The lanes were kept, and the next push that fits goes through in one call again.
    result = ray.get(trainer.push_zoo.remote(7), timeout=TIMEOUT)
    assert counted(workers) == [calls(lanes_push=1)] * WORKERS
    assert_holds(workers, 7, result.version)


def test_a_worker_that_lost_the_plan_is_sent_it_the_long_way(fleet: tuple[list, list]) -> None:
    (trainer, *_), workers = fleet
    ray.get(trainer.push_zoo.remote(8), timeout=TIMEOUT)
    ray.get(workers[2].forget_plans.remote(), timeout=TIMEOUT)
    counted(workers)
    result = ray.get(trainer.push_zoo.remote(9), timeout=TIMEOUT)
    # Everyone was asked in one call; worker 2 asked for the plan, so the push was called off
    # before any byte and went the long way through the store: a prepare with the plan, then
    # the bytes (every member's lane goes with it).
    assert counted(workers) == [calls(lanes_push=1, store=2)] * WORKERS
    assert_holds(workers, 9, result.version)
    ray.get(trainer.push_zoo.remote(10), timeout=TIMEOUT)
    assert counted(workers) == [calls(lanes_push=1)] * WORKERS


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
        assert counted(workers) == [calls(lanes_push=1)] * WORKERS
        part = ray.get(trainer.push_partial_zoo.remote(seed + 10, ["float32_matrix", "int64_matrix"]),
                       timeout=TIMEOUT)  # fmt: skip
        assert counted(workers) == [calls(lanes_push=1)] * WORKERS
        assert part.partial and part.version == full.version + 1


def test_checksums_keep_the_commit_round(fleet: tuple[list, list]) -> None:
    trainers, workers = fleet
    ray.get(trainers[0].close.remote(), timeout=TIMEOUT)  # the workers take the new one's lanes
    trainers.append(Trainer.remote(workers, bucket_bytes=256 << 10, checksum=True))
    counted(workers)
    for seed, first in ((31, 1), (32, 0)):  # the first probes and forms the lane
        result = ray.get(trainers[-1].push_zoo.remote(seed), timeout=TIMEOUT)
        # The trainer compares every worker's CRCs before anyone commits: prepare, receive and
        # commit are steps of their own (and init on the first push).
        every = calls(info=first, lanes_push=1, store=3 + first)
        assert counted(workers) == [every] * WORKERS
        assert "commit" in result.phases
        assert_holds(workers, seed, result.version)
