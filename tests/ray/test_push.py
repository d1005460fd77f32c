"""End to end with real Ray actors: a trainer actor pushes to 7 worker actors over Gloo."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import ray

from tests.ray.actors import BIG, FlakyWorker, RecordingWorker, Trainer, ZooWorker
from tests.ray.pool import Lease
from tests.zoo import zoo
from weight_sync import PlanMismatchError, PushResult, WorkerFailedError
from weight_sync.wire.checksums import state_dict_digests
from weight_sync.wire.metadata import LaneCheck, LanePush

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("ray_cluster")]
TIMEOUT = 120
WORKERS = 7


@pytest.fixture(scope="module")
def fleet(ray_cluster: None) -> Iterator[tuple]:
    workers = [ZooWorker.remote(seed=100 + i) for i in range(WORKERS)]
    # BIG contiguous tensors go direct and land in the workers' models; the rest are packed.
    trainer = Trainer.remote(workers, bucket_bytes=256 << 10, direct_min_bytes=512 << 10)
    try:
        yield trainer, workers
    finally:
        ray.get(trainer.close.remote(), timeout=TIMEOUT)
        for actor in [trainer, *workers]:
            ray.kill(actor)


def state(workers: list) -> tuple[list, list]:
    versions = ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT)
    digests = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
    return versions, digests


def test_pushes_land_bit_exact_with_versions_one_apart(fleet: tuple) -> None:
    trainer, workers = fleet
    versions, digests = state(workers)
    assert versions == [None] * WORKERS
    assert all(d != state_dict_digests(zoo(1, big=BIG)) for d in digests)
    for seed in (1, 2):  # the second push carries different values and must land too
        before = ray.get(trainer.version.remote(), timeout=TIMEOUT)
        result: PushResult = ray.get(trainer.push_zoo.remote(seed), timeout=TIMEOUT)
        assert result.version == before + 1
        assert result.buckets > 1 and result.nbytes == sum(
            t.nbytes for t in zoo(seed, big=BIG).values()
        )
        assert result.tensors == len(zoo(seed, big=BIG))
        versions, digests = state(workers)
        assert versions == [result.version] * WORKERS
        want = state_dict_digests(zoo(seed, big=BIG))
        for index, got in enumerate(digests):
            assert got == want, f"worker {index} differs after push of seed {seed}"


@pytest.mark.parametrize(
    ("mutation", "problem"),
    [
        ("extra", "unknown tensor 'not_in_model'"),
        ("missing", "missing tensor 'float32_matrix'"),
        ("shape", "'float32_matrix': sent float32[13, 7], model has float32[7, 13]"),
        ("dtype", "'float32_matrix': sent float64[7, 13], model has float32[7, 13]"),
    ],
)
def test_mismatch_is_refused_before_any_broadcast(
    fleet: tuple, mutation: str, problem: str
) -> None:
    trainer, workers = fleet
    ray.get(trainer.push_zoo.remote(3), timeout=TIMEOUT)
    versions, digests = state(workers)
    with pytest.raises(PlanMismatchError) as info:
        ray.get(trainer.push_zoo.remote(4, mutation), timeout=TIMEOUT)
    assert problem in str(info.value)
    assert f"worker {WORKERS - 1}:" in str(info.value)  # every worker reports
    assert state(workers) == (versions, digests)  # nothing changed anywhere
    assert ray.get(trainer.version.remote(), timeout=TIMEOUT) == versions[0]
    ray.get(trainer.push_zoo.remote(4), timeout=TIMEOUT)  # and the group is still usable
    assert state(workers)[1][0] == state_dict_digests(zoo(4, big=BIG))


@pytest.mark.parametrize(
    ("bad", "error"), [({"w": "not a tensor"}, TypeError), ({1: None}, TypeError)]
)
def test_bad_input_is_a_caller_error(fleet: tuple, bad: dict, error: type) -> None:
    trainer, workers = fleet
    versions, _ = state(workers)
    with pytest.raises(error):
        ray.get(trainer.push.remote(bad), timeout=TIMEOUT)
    assert state(workers)[0] == versions


def test_empty_state_dict_is_a_no_op(fleet: tuple) -> None:
    trainer, workers = fleet
    versions, _ = state(workers)
    result = ray.get(trainer.push.remote({}), timeout=TIMEOUT)
    assert (result.version, result.nbytes, result.buckets) == (versions[0], 0, 0)
    assert state(workers)[0] == versions


def test_concurrent_pushes_are_serialised(fleet: tuple) -> None:
    trainer, workers = fleet
    before = ray.get(trainer.version.remote(), timeout=TIMEOUT)
    pairs = ray.get(trainer.push_from_threads.remote([11, 12, 13]), timeout=TIMEOUT)
    assert sorted(version for _, version in pairs) == [before + 1, before + 2, before + 3]
    last_seed = max(pairs, key=lambda pair: pair[1])[0]
    versions, digests = state(workers)
    assert versions == [before + 3] * WORKERS  # the last push to run is what every worker holds
    assert digests == [state_dict_digests(zoo(last_seed, big=BIG))] * WORKERS


def test_custom_load_weights_on_a_standalone_group(take: Lease) -> None:
    workers = take(RecordingWorker, [{}, {}])
    # Direct buckets without a destination: received into temporaries, then load_weights.
    config = {"bucket_bytes": 64 << 10, "direct_min_bytes": 100_000, "group_mode": "standalone"}
    [trainer] = take(Trainer, [{"workers": workers, **config}])
    result = ray.get(trainer.push_zoo.remote(5), timeout=TIMEOUT)
    want = state_dict_digests(zoo(5, big=BIG))
    for worker in workers:
        assert ray.get(worker.received_digests.remote(), timeout=TIMEOUT) == want
        assert ray.get(worker.weights_version.remote(), timeout=TIMEOUT) == result.version
        # load_weights runs per bucket (plus once for the empty tensors), not per tensor
        assert ray.get(worker.load_calls.remote(), timeout=TIMEOUT) <= result.buckets + 1


def test_a_worker_failing_mid_push_leaves_no_one_claiming_the_version(
    take: Lease,
) -> None:
    workers = take(FlakyWorker, [{"seed": 200 + i} for i in range(3)])
    config = {"bucket_bytes": 64 << 10, "collective_timeout_s": 20, "rpc_timeout_s": 30}
    [trainer] = take(Trainer, [{"workers": workers, **config}])
    first = ray.get(trainer.push_zoo.remote(6), timeout=TIMEOUT)
    ray.get(workers[1].fail_next_push.remote(2), timeout=TIMEOUT)  # fails on its 3rd bucket
    with pytest.raises(WorkerFailedError) as info:
        ray.get(trainer.push_zoo.remote(7), timeout=TIMEOUT)
    assert 1 in info.value.workers and "injected load_weights failure" in str(info.value)
    versions, _ = state(workers)
    assert first.version not in versions  # partly updated weights claim no version
    assert versions[1] is None
    assert ray.get(trainer.version.remote(), timeout=TIMEOUT) == first.version
    again = ray.get(trainer.push_zoo.remote(8), timeout=TIMEOUT)  # a new group, all healthy
    assert again.version > first.version  # the failed push may have spent a number
    versions, digests = state(workers)
    assert versions == [again.version] * 3
    assert digests == [state_dict_digests(zoo(8, big=BIG))] * 3

    # A commit that fails on one worker: the others hold the version, so it is never reused.
    ray.get(workers[2].fail_next_commit.remote(), timeout=TIMEOUT)
    with pytest.raises(WorkerFailedError, match="injected commit failure"):
        ray.get(trainer.push_zoo.remote(9), timeout=TIMEOUT)
    spent = again.version + 1
    assert state(workers)[0] == [spent, spent, None]
    final = ray.get(trainer.push_zoo.remote(10), timeout=TIMEOUT)
    assert final.version == spent + 1
    assert state(workers) == ([final.version] * 3, [state_dict_digests(zoo(10, big=BIG))] * 3)


def test_a_worker_whose_hook_fails_as_a_push_begins_refuses_it_before_any_byte(
    take: Lease,
) -> None:
    """A worker's ``weight_sync_destinations`` raises as a push begins. A worker asks its hooks
    once a push, in its check before any byte moves, so the push is refused everywhere at once
    (``PlanMismatchError`` naming that worker and the hook's error, well inside the bounds of
    60 s), no worker's weights or version change, and the next push lands."""
    workers = take(FlakyWorker, [{"seed": 300 + i} for i in range(3)])
    [trainer] = take(
        Trainer, [{"workers": workers, "collective_timeout_s": 60, "rpc_timeout_s": 60}]
    )
    ray.get(trainer.push_zoo.remote(1), timeout=TIMEOUT)
    before = state(workers)
    ray.get(workers[1].fail_destinations.remote(), timeout=TIMEOUT)
    start = time.monotonic()
    with pytest.raises(PlanMismatchError) as info:
        ray.get(trainer.push_zoo.remote(3), timeout=TIMEOUT)
    assert time.monotonic() - start < 30
    assert list(info.value.problems) == [1], str(info.value)
    assert "injected weight_sync_destinations failure" in str(info.value)
    assert state(workers) == before
    again = ray.get(trainer.push_zoo.remote(4), timeout=TIMEOUT)
    assert state(workers) == ([again.version] * 3, [state_dict_digests(zoo(4, big=BIG))] * 3)


GOOD_CALL = LanePush(
    endpoints=(("127.0.0.1", 1),),
    slot=1,
    check=LaneCheck(push=1, version=1, digest="0" * 64, max_metadata_bytes=1 << 20),
    wait_s=1.0,
    firsts=(None,),
).model_dump_json()


@pytest.mark.parametrize(
    ("call", "problem"),
    [
        (GOOD_CALL[:40], "Invalid JSON"),
        (GOOD_CALL.replace('"version":1', '"version":-5'), "greater than or equal to 1"),
        (GOOD_CALL.replace('"0000', '"zzzz'), "should match pattern"),
        (GOOD_CALL.replace('"firsts":[null]', '"firsts":[null,null]'), "2 lane openings for 1"),
    ],
    ids=["truncated", "negative-version", "digest", "openings-for-no-sender"],
)
def test_a_corrupted_call_is_refused_and_changes_nothing(
    fleet: tuple, call: str, problem: str
) -> None:
    """A push's call on a worker (``LanePush``, JSON), damaged: refused as it is parsed, before
    the worker dials any sender or touches its weights; the pushes go on. (What a lane's own
    steps carry is checked where each is read: tests/unit/test_checks.py.)"""
    assert call != GOOD_CALL
    trainer, workers = fleet
    ray.get(trainer.push_zoo.remote(20), timeout=TIMEOUT)
    before = state(workers)
    with pytest.raises(ValueError, match=problem):
        ray.get(workers[0]._weight_sync_lanes_push.remote(call), timeout=TIMEOUT)
    assert state(workers) == before
    result = ray.get(trainer.push_zoo.remote(21), timeout=TIMEOUT)  # the protocol goes on
    assert state(workers) == (
        [result.version] * WORKERS,
        [state_dict_digests(zoo(21, big=BIG))] * WORKERS,
    )


def test_a_named_version_labels_the_push_and_one_not_past_the_workers_is_refused(
    fleet: tuple,
) -> None:
    """``version=`` (an RL loop's step) is the push's version; one not past what the workers
    were ever sent is refused before anything moves; without it the count goes on from there."""
    trainer, workers = fleet
    ray.get(trainer.push_zoo.remote(5), timeout=TIMEOUT)
    step = ray.get(trainer.version.remote(), timeout=TIMEOUT) + 10
    result = ray.get(trainer.push_zoo.remote(6, version=step), timeout=TIMEOUT)
    assert result.version == step and state(workers)[0] == [step] * WORKERS
    versions, digests = state(workers)
    for stale in (step, step - 5, 1):
        with pytest.raises(ValueError, match=f"version {stale} is not past .* at least {step + 1}"):
            ray.get(trainer.push_zoo.remote(7, version=stale), timeout=TIMEOUT)
        assert state(workers) == (versions, digests)  # nothing moved anywhere
    for bad, error in ((0, ValueError), (True, TypeError), ("3", TypeError)):
        with pytest.raises(error, match="version must be"):
            ray.get(trainer.push_zoo.remote(7, version=bad), timeout=TIMEOUT)
    assert ray.get(trainer.push_zoo.remote(7), timeout=TIMEOUT).version == step + 1


def test_a_new_trainer_continues_past_every_version_the_workers_were_sent(
    take: Lease,
) -> None:
    """Trainer A pushes three versions and goes; trainer B, new over the same workers, takes
    version 4 -- never one the workers served -- refuses a named version they were already
    sent, and takes a named one past them (a trainer restarted from a checkpoint at that step)."""
    workers = take(ZooWorker, [{"seed": 300 + i} for i in range(2)])
    [first] = take(Trainer, [{"workers": workers}])
    for seed in (1, 2, 3):
        ray.get(first.push_zoo.remote(seed), timeout=TIMEOUT)
    ray.get(first.close.remote(), timeout=TIMEOUT)
    [second] = take(Trainer, [{"workers": workers}])
    with pytest.raises(
        ValueError,
        match=r"version 2 is not past what these workers were already pushed \(up to 3\)",
    ):
        ray.get(second.push_zoo.remote(4, version=2), timeout=TIMEOUT)
    assert state(workers)[0] == [3, 3]
    assert ray.get(second.push_zoo.remote(4), timeout=TIMEOUT).version == 4
    assert ray.get(second.push_zoo.remote(5, version=40), timeout=TIMEOUT).version == 40
    assert state(workers) == ([40, 40], [state_dict_digests(zoo(5, big=BIG))] * 2)
