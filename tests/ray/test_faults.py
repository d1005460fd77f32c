"""Fault injection with real Ray actors and real signals: workers killed (SIGKILL) or frozen
(SIGSTOP) mid-broadcast, a worker that never joins, the trainer killed mid-push, damaged bytes.

Every test checks what the issue promises: the push raises a typed error naming the worker
within push_timeout_s, no worker claims a version it does not fully hold, every live worker
agrees on the version, and the next push succeeds.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray

from tests.ray.actors import BIG, SlowWorker, Trainer
from tests.ray.pool import Lease
from tests.zoo import zoo
from weight_sync import ChecksumMismatchError, SyncStatus, WorkerFailedError
from weight_sync.wire.checksums import state_dict_digests

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("ray_cluster")]
TIMEOUT = 60
# Short bounds, so that a frozen worker is found in seconds. Many small buckets through a slow
# load_weights make a push last ~3 s: long enough to strike in the middle of it.
CONFIG: dict[str, Any] = dict(
    bucket_bytes=32 << 10, direct_min_bytes=None, collective_timeout_s=4, push_timeout_s=20,
    rendezvous_timeout_s=5, rpc_timeout_s=10,
)  # fmt: skip


class Fleet:
    """A trainer and its workers, taken from the module's actors (tests/ray/pool.py): started
    over in place for each test, handed on to the next if it passes -- less any this test
    struck (``strike``), which are killed, stopped ones woken first."""

    def __init__(self, take: Lease, workers: int, config: dict[str, Any]) -> None:
        self.take = take
        self.workers = take(SlowWorker, [{"seed": 300 + i} for i in range(workers)])
        self.trainer = self.new_trainer(self.workers, **config)
        self.pids = ray.get([w.pid.remote() for w in self.workers], timeout=TIMEOUT)

    def new_trainer(self, workers: list, **config: Any) -> Any:
        self.trainer = self.take(Trainer, [{"workers": workers, **config}])[0]
        return self.trainer

    def add_worker(self, seed: int) -> Any:
        [worker] = self.take(SlowWorker, [{"seed": seed}])
        self.workers.append(worker)
        self.pids.append(ray.get(worker.pid.remote(), timeout=TIMEOUT))
        return worker

    def strike(self, victim: int, sig: signal.Signals) -> None:
        """Send ``sig`` to worker ``victim``, never handed on after."""
        self.take.spoil(self.workers[victim])
        os.kill(self.pids[victim], sig)

    def kill_trainer(self, pid: int) -> None:
        """SIGKILL the trainer (``pid``: asked before it was busy), never handed on after."""
        self.take.spoil(self.trainer)
        os.kill(pid, signal.SIGKILL)

    def wake(self) -> None:
        for pid in self.pids:  # a stopped process must be woken (or killed) to go
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


@pytest.fixture
def fleet_of(take: Lease) -> Iterator[Callable[..., Fleet]]:
    """``fleet_of(workers, base, **config)``: a ``Fleet`` with ``{**base, **config}``."""
    fleets: list[Fleet] = []

    def make(workers: int = 3, base: dict[str, Any] = CONFIG, **config: Any) -> Fleet:
        fleets.append(Fleet(take, workers, {**base, **config}))
        return fleets[-1]

    yield make
    for fleet in fleets:
        fleet.wake()


def status(worker: Any) -> SyncStatus:
    return ray.get(worker.sync_status.remote(), timeout=TIMEOUT)


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def mid_push(worker: Any) -> Callable[[], bool]:
    def receiving() -> bool:
        now = status(worker)
        return now.phase == "receiving" and now.buckets_done >= 3

    return receiving


def versions(workers: list) -> list:
    return ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT)


def digests(workers: list) -> list:
    return ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)


def strike(
    fleet: Fleet, victim: int, sig: signal.Signals, seed: int
) -> tuple[WorkerFailedError, float]:
    """Start a push, send ``sig`` to worker ``victim`` in the middle of it; the error and how
    long after the signal it came."""
    pushing = fleet.trainer.push_zoo.remote(seed)
    wait_until(mid_push(fleet.workers[victim]), "the push to be under way")
    fleet.strike(victim, sig)
    struck = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        ray.get(pushing, timeout=TIMEOUT)
    seconds = time.monotonic() - struck
    print(f"{sig.name}: push raised {seconds:.2f}s after the signal: {info.value}")
    return info.value, seconds


def assert_next_push_lands(fleet: Fleet, workers: list, seed: int) -> int:
    # Nothing strikes this push: at full speed (~0.3 s, not ~3 s).
    ray.get([w.set_delay.remote(0.0) for w in workers], timeout=TIMEOUT)
    result = ray.get(fleet.trainer.push_zoo.remote(seed), timeout=TIMEOUT)
    assert versions(workers) == [result.version] * len(workers)
    assert digests(workers) == [state_dict_digests(zoo(seed, big=BIG))] * len(workers)
    return result.version


@pytest.mark.parametrize(
    ("sig", "victim", "same_host"),
    [
        (signal.SIGKILL, 1, "shm"),
        (signal.SIGSTOP, 2, "shm"),
        (signal.SIGSTOP, 1, "group"),
    ],
    # On the group, Gloo's broadcast is a tree: worker 1 (rank 2) forwards to worker 2 (rank 3).
    ids=["killed-ring", "frozen-ring", "frozen-inner-group"],
)
def test_worker_killed_or_frozen_mid_broadcast_is_named_dropped_and_replaced(
    fleet_of: Callable[..., Fleet], sig: signal.Signals, victim: int, same_host: str
) -> None:
    fleet = fleet_of(3, same_host=same_host)
    first = ray.get(fleet.trainer.push_zoo.remote(1), timeout=TIMEOUT)
    error, seconds = strike(fleet, victim, sig, seed=2)
    assert error.workers == [victim] and error.dropped == [victim], str(error)
    assert seconds < CONFIG["push_timeout_s"], f"error after {seconds:.1f}s"
    survivors = [w for i, w in enumerate(fleet.workers) if i != victim]
    assert ray.get(fleet.trainer.worker_count.remote(), timeout=TIMEOUT) == 2
    # Streaming: the survivors took part of the new weights, so they claim no version at all.
    assert versions(survivors) == [None, None]
    assert all(status(w).dirty and not status(w).in_group for w in survivors)
    assert first.version not in versions(survivors)

    again = assert_next_push_lands(fleet, survivors, seed=3)  # a new group over the survivors
    assert again > first.version

    # Up first: its process start (seconds on 2 busy cores) is no part of the push's rpc bound.
    replacement = fleet.add_worker(seed=399)
    ray.get(fleet.trainer.add_workers.remote([replacement]), timeout=TIMEOUT)
    assert_next_push_lands(fleet, [*survivors, replacement], seed=4)  # full weights to the newcomer


def test_push_timeout_alone_bounds_a_push_with_a_frozen_worker(
    fleet_of: Callable[..., Fleet],
) -> None:
    """Only push_timeout_s is set (the other bounds derive from it): a worker frozen in the middle
    of a broadcast is reported within push_timeout_s of the call, the teardown included (the
    trainer times the call itself, so the Ray call that asked for it does not count)."""
    push_timeout_s = 12.0
    base = {"bucket_bytes": 32 << 10, "direct_min_bytes": None}
    fleet = fleet_of(3, base=base, push_timeout_s=push_timeout_s)
    ray.get(fleet.trainer.push_zoo.remote(1), timeout=TIMEOUT)
    pushing = fleet.trainer.timed_push_zoo.remote(2)
    wait_until(mid_push(fleet.workers[1]), "the push to be under way")
    fleet.strike(1, signal.SIGSTOP)
    outcome, seconds = ray.get(pushing, timeout=TIMEOUT)
    print(f"frozen worker reported after {seconds:.2f}s of push_timeout_s={push_timeout_s}")
    assert outcome == "WorkerFailedError" and seconds < push_timeout_s, (outcome, seconds)
    assert ray.get(fleet.trainer.worker_count.remote(), timeout=TIMEOUT) == 2


@pytest.mark.parametrize("how", ["hangs-in-join", "stopped-before-push"])
def test_a_worker_that_never_joins_is_named_and_dropped(
    fleet_of: Callable[..., Fleet], how: str
) -> None:
    fleet = fleet_of(3)
    if how == "hangs-in-join":  # answers Ray's probe, then never reaches its lane
        fleet.take.spoil(fleet.workers[2])
        ray.get(fleet.workers[2].hang_in_next_join.remote(120), timeout=TIMEOUT)
    else:  # a stopped process answers nothing at all
        fleet.strike(2, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        ray.get(fleet.trainer.push_zoo.remote(5), timeout=TIMEOUT)
    assert time.monotonic() - start < CONFIG["push_timeout_s"]
    assert info.value.workers == [2] and info.value.dropped == [2], str(info.value)
    # Named at the step it missed: Ray's probe (stopped), or its lane's (it never dialled it).
    assert "probe" in str(info.value), str(info.value)
    assert versions(fleet.workers[:2]) == [None, None]  # never sent a byte: still the initial state
    assert_next_push_lands(fleet, fleet.workers[:2], seed=6)


@pytest.mark.parametrize("staging", ["stream", "atomic"])
def test_trainer_killed_mid_push_leaves_workers_able_to_join_a_new_updater(
    fleet_of: Callable[..., Fleet], staging: str
) -> None:
    fleet = fleet_of(2, staging=staging)
    first = ray.get(fleet.trainer.push_zoo.remote(7), timeout=TIMEOUT)
    trainer_pid = ray.get(fleet.trainer.pid.remote(), timeout=TIMEOUT)  # asked before it is busy
    # A slow link: staged (atomic) receives skip the slow load_weights, and were over before a
    # poll could see them under way on a busy machine.
    ray.get(fleet.workers[0].tamper.remote(delay_s=0.05), timeout=TIMEOUT)
    pushing = fleet.trainer.push_zoo.remote(8)
    wait_until(mid_push(fleet.workers[0]), "the push to be under way")
    fleet.kill_trainer(trainer_pid)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(pushing, timeout=TIMEOUT)
    wait_until(
        lambda: all(
            status(w).phase in ("idle", "received") and not status(w).in_group
            for w in fleet.workers
        ),
        "the workers to leave the dead group",
    )
    if staging == "atomic":  # the old weights and version, untouched
        assert versions(fleet.workers) == [first.version] * 2
        assert digests(fleet.workers) == [state_dict_digests(zoo(7, big=BIG))] * 2
    else:  # part-new weights: no version claimed
        assert versions(fleet.workers) == [None, None]
    fleet.new_trainer(fleet.workers, **CONFIG, staging=staging)
    assert assert_next_push_lands(fleet, fleet.workers, seed=9) > first.version


def test_damaged_bytes_fail_the_checksum_and_nothing_is_committed(
    fleet_of: Callable[..., Fleet],
) -> None:
    fleet = fleet_of(3, checksum=True, staging="atomic")
    first = ray.get(fleet.trainer.push_zoo.remote(10), timeout=TIMEOUT)
    ray.get(fleet.workers[1].tamper.remote(flip=True), timeout=TIMEOUT)
    with pytest.raises(ChecksumMismatchError) as info:
        ray.get(fleet.trainer.push_zoo.remote(11), timeout=TIMEOUT)
    assert info.value.workers == [1] and info.value.dropped == []
    # Atomic staging: nobody applied the damaged (or any) new bytes.
    assert versions(fleet.workers) == [first.version] * 3
    assert digests(fleet.workers) == [state_dict_digests(zoo(10, big=BIG))] * 3
    assert_next_push_lands(fleet, fleet.workers, seed=12)


def test_status_answers_during_a_push(fleet_of: Callable[..., Fleet]) -> None:
    fleet = fleet_of(2)
    first = ray.get(fleet.trainer.push_zoo.remote(13), timeout=TIMEOUT)
    pushing = fleet.trainer.push_zoo.remote(14)
    wait_until(mid_push(fleet.workers[0]), "the push to be under way")
    now = status(fleet.workers[0])
    assert now.dirty and now.version is None and now.pushing == first.version + 1
    assert 0 < now.buckets_done < now.buckets_total
    result = ray.get(pushing, timeout=TIMEOUT)
    after = status(fleet.workers[0])
    assert (after.version, after.dirty, after.phase) == (result.version, False, "idle")
    assert after.last is not None and after.last.version == result.version


def test_atomic_staging_serves_the_old_weights_during_a_push(
    fleet_of: Callable[..., Fleet],
) -> None:
    fleet = fleet_of(2, staging="atomic")
    first = ray.get(fleet.trainer.push_zoo.remote(19), timeout=TIMEOUT)
    old = state_dict_digests(zoo(19, big=BIG))
    ray.get(fleet.workers[0].tamper.remote(delay_s=0.05), timeout=TIMEOUT)  # a slow link: ~4 s
    pushing = fleet.trainer.push_zoo.remote(20)
    wait_until(mid_push(fleet.workers[0]), "the push to be under way")
    # The actor's own methods (default group) run beside the receive, on the old weights.
    start = time.monotonic()
    assert ray.get(fleet.workers[0].weight_sync_digests.remote(), timeout=TIMEOUT) == old
    assert time.monotonic() - start < 1.5
    now = status(fleet.workers[0])
    assert (now.phase, now.version, now.dirty) == ("receiving", first.version, False)
    result = ray.get(pushing, timeout=TIMEOUT)
    assert versions(fleet.workers) == [result.version] * 2
    assert digests(fleet.workers) == [state_dict_digests(zoo(20, big=BIG))] * 2


def test_nan_weights_are_refused_when_checked(fleet_of: Callable[..., Fleet]) -> None:
    fleet = fleet_of(2, check_finite=True)
    first = ray.get(fleet.trainer.push_zoo.remote(15, "finite"), timeout=TIMEOUT)
    landed = digests(fleet.workers)
    with pytest.raises(ValueError, match=r"NaN or Inf in 'float32_matrix'; nothing was sent"):
        ray.get(fleet.trainer.push_zoo.remote(16, "finite,nan"), timeout=TIMEOUT)
    assert versions(fleet.workers) == [first.version] * 2
    assert digests(fleet.workers) == landed
    again = ray.get(fleet.trainer.push_zoo.remote(17, "finite"), timeout=TIMEOUT)
    assert versions(fleet.workers) == [again.version] * 2 and digests(fleet.workers) != landed


def test_metadata_over_the_limit_is_refused_before_any_collective(
    fleet_of: Callable[..., Fleet],
) -> None:
    fleet = fleet_of(2, max_metadata_bytes=2000)
    with pytest.raises(ValueError, match="max_metadata_bytes=2000"):
        ray.get(fleet.trainer.push_zoo.remote(18), timeout=TIMEOUT)
    assert versions(fleet.workers) == [None, None]
    assert all(status(w).phase == "idle" for w in fleet.workers)
