"""A sharded trainer pushing from every rank to Ray workers: two FSDP2 ranks (a real Gloo world
in real Ray actors), each with a ``WeightUpdater(senders=...)`` over the same two workers, each
pushing its own shards at once; the workers put every tensor together in their models."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch.distributed as dist

from tests.ray.actors import BusyLMWorker, LMWorker, LoneTrainer, ShardedTrainer
from tests.ray.pool import Lease
from weight_sync.control.lane_store import NO_ONE_GROUP
from weight_sync.control.store import PREFIX
from weight_sync.transport.rendezvous import bind_listener, open_store
from weight_sync.wire.metadata import GroupSpec, LaneCheck, LanePush, PrepareReply, WorkerReply

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("ray_cluster")]
TIMEOUT = 120

DEATH = "trainer rank 1 died or left mid-push"  # what every survivor says first


class Pool:
    """The two trainer ranks (FSDP2 over a Gloo world of two Ray actors), started once and
    reused by the tests that take ``lanes``, each test making a ``WeightUpdater`` on every rank,
    closed at its end (a start costs ~4 s of the 2 cores for the pair: most of such a test).
    What a test may have left unsound -- a rank killed on purpose, a close that failed, the test
    itself failed -- is replaced. The workers come from the module's pool (``take``,
    tests/ray/pool.py), each started over in place (``LMWorker.renew``)."""

    def __init__(self) -> None:
        self._ranks: list = []

    def ranks(self) -> list:
        """The pair, started if there is none (held from the start, so that ``drop_ranks``
        kills a pair whose setup failed)."""
        if not self._ranks:
            self._ranks = ranks = [ShardedTrainer.remote(rank, 2) for rank in range(2)]
            port = ray.get(ranks[0].port.remote(), timeout=TIMEOUT)
            ray.get([rank.setup.remote(port, None) for rank in ranks], timeout=TIMEOUT)
        return self._ranks

    def drop_ranks(self) -> None:
        kill(self._ranks)
        self._ranks = []

    def close(self) -> None:
        self.drop_ranks()


def kill(actors: list) -> None:
    for actor in actors:
        ray.kill(actor)


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    held = Pool()
    try:
        yield held
    finally:
        held.close()


@pytest.fixture
def lanes(request: pytest.FixtureRequest, pool: Pool, take: Lease) -> Iterator[tuple[list, list]]:
    """Two trainer ranks with a WeightUpdater each (senders: their group), and two workers as
    new; ``param``: (``fused``: their models stack q, k and v in one tensor, which a trainer's
    push does not fit; the ``SyncConfig`` of every rank, or a list: each rank's own)."""
    fused, config = getattr(request, "param", ((False, False), {}))
    workers = take(LMWorker, [{"fused": f} for f in fused])
    failed = request.session.testsfailed
    passed = closed = False
    try:
        ranks = pool.ranks()
        configs = config if isinstance(config, list) else [config] * len(ranks)
        setups = [rank.lanes_setup.remote(workers, **c) for rank, c in zip(ranks, configs)]
        ray.get(setups, timeout=TIMEOUT)
        yield ranks, workers
        passed = request.session.testsfailed == failed
        try:
            ray.get([rank.lanes_close.remote() for rank in ranks], timeout=TIMEOUT)
            closed = True
        except ray.exceptions.RayActorError:  # a rank the test killed
            pass
    finally:
        if not (passed and closed):
            pool.drop_ranks()


# Each case also over one group of the senders and the workers, the lanes' buckets taken in
# rounds (``WeightUpdater(senders=..., one_group=True)``), rather than over a Gloo group per lane.
ONE_GROUP = {"one_group": True}
LANES_AND_ONE_GROUP = pytest.mark.parametrize(
    "lanes",
    [((False, False), {}), ((False, False), ONE_GROUP)],
    ids=["lanes", "one_group"],
    indirect=True,
)


def on_all(ranks: list, method: str, *args: object) -> list:
    return ray.get([getattr(rank, method).remote(*args) for rank in ranks], timeout=TIMEOUT)


@LANES_AND_ONE_GROUP
def test_a_push_from_many_senders_costs_each_worker_one_call(
    lanes: tuple[list, list], request: pytest.FixtureRequest
) -> None:
    """Past the first push (which has the workers follow the lanes), each push reaches a worker
    in one call: its check, then its lanes -- over Gloo lanes each lane's push in one step rides
    that call, nothing of it in its sender's store, not even its frame (over one group the
    lanes go the long way, their steps in the store)."""
    ranks, workers = lanes
    first = on_all(ranks, "lanes_push")[0].version
    ray.get([w.protocol_calls.remote() for w in workers], timeout=TIMEOUT)
    for more in (1, 2):  # no step between: the pair's model is the next tests' (see Pool)
        assert [r.version for r in on_all(ranks, "lanes_push")] == [first + more] * 2
        calls = ray.get([w.protocol_calls.remote() for w in workers], timeout=TIMEOUT)
        assert calls == [{"_weight_sync_lanes_push": 1}] * 2, calls
        ops = on_all(ranks, "lane_ops")
        if "one_group" in request.node.name:
            assert all("start" in posted and "push" not in posted for posted in ops), ops
        else:
            assert ops == [[]] * 2, ops


@LANES_AND_ONE_GROUP
def test_every_rank_pushes_its_shards_and_workers_hold_the_whole_model(
    lanes: tuple[list, list],
) -> None:
    ranks, workers = lanes
    for step in range(1, 4):
        on_all(ranks, "step")  # FSDP's own collectives, between pushes
        results = on_all(ranks, "lanes_push")
        assert [r.version for r in results] == [step, step], results
        assert results[0].nbytes == results[1].nbytes > 0  # every lane's bytes, on every rank
        want = on_all(ranks, "full_digests")[0]
        # The whole push's tensors on every rank, as its bytes (each lane sends blocks of all).
        assert results[0].tensors == results[1].tensors == len(want), results
        got = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
        assert all(g == want for g in got)
        held = ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT)
        assert held == [step, step]
        for status in ray.get([w.sync_status.remote() for w in workers], timeout=TIMEOUT):
            # Every lane's part, as one push: the bytes both senders put on the wire.
            assert (status.phase, status.dirty, status.full_version) == ("idle", False, step)
            assert status.last is not None and status.last.version == step, status
            assert status.last.nbytes == results[0].wire_bytes, (status, results[0])
            assert status.buckets_done == status.buckets_total == status.last.buckets >= 2
    assert all(ray.get([w.still_tied.remote() for w in workers], timeout=TIMEOUT))


@pytest.mark.parametrize(
    "lanes", [((False, False), [{}, {"same_host": "group"}])], ids=["rank_1_group"], indirect=True
)
def test_each_lane_takes_the_routes_its_senders_config_says(lanes: tuple[list, list]) -> None:
    """``same_host`` may differ between senders: rank 0's lane reaches the workers on its host
    through a shared-memory ring of its own (the default, as one sender's push), rank 1's
    (``same_host="group"``) through its group; both land bit for bit, push after push. No
    training step between them: the pool's ranks keep their model for the module's later tests
    (``test_a_partial_push_completes_the_version_the_workers_hold`` needs a step to change
    every tensor, which enough earlier steps stop doing)."""
    ranks, workers = lanes
    for step in (1, 2):
        assert [r.version for r in on_all(ranks, "lanes_push")] == [step, step]
        want = on_all(ranks, "full_digests")[0]
        got = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
        assert got == [want, want]
    assert on_all(ranks, "lanes_routes") == [(["shm", "shm"], True), (["group", "group"], True)]


def test_a_state_dict_one_rank_refuses_sends_nothing_anywhere(lanes: tuple[list, list]) -> None:
    """A version named below the last: refused on every rank before any byte moves; the
    workers keep what they hold, and the next push lands."""
    ranks, workers = lanes
    on_all(ranks, "lanes_push")
    before = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
    on_all(ranks, "step")
    refused = on_all(ranks, "lanes_push", 1)
    assert all(
        kind == "ValueError" and why.startswith("version 1 is not past") for kind, why in refused
    ), refused
    assert ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT) == before
    assert ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT) == [1, 1]
    assert [r.version for r in on_all(ranks, "lanes_push", 5)] == [5, 5]


def test_a_partial_push_completes_the_version_the_workers_hold(lanes: tuple[list, list]) -> None:
    """A partial push of the adapter alone after a step that changed every parameter: the
    workers take it on top of version 1 (their adapter now the trainer's, the rest as pushed
    in version 1) and say so: version 2, full_version 1. A partial push of nothing before it
    moves nothing, on every rank: the version stays 1."""
    ranks, workers = lanes
    on_all(ranks, "lanes_push")
    first = on_all(ranks, "full_digests")[0]
    empty = on_all(ranks, "lanes_push", None, False, [])
    assert [(r.version, r.nbytes, r.buckets) for r in empty] == [(1, 0, 0), (1, 0, 0)], empty
    on_all(ranks, "step")
    only = ["adapter.weight", "adapter.bias"]
    assert [r.version for r in on_all(ranks, "lanes_push", None, False, only)] == [2, 2]
    now = on_all(ranks, "full_digests")[0]
    for got in ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT):
        assert {n: got[n] for n in only} == {n: now[n] for n in only}
        assert {n: got[n] for n in got if n not in only} == {
            n: first[n] for n in got if n not in only
        }
        assert got["embed.weight"] != now["embed.weight"]  # the step changed it; not pushed
    statuses = ray.get([w.sync_status.remote() for w in workers], timeout=TIMEOUT)
    assert [(s.version, s.full_version) for s in statuses] == [(2, 1), (2, 1)]


@pytest.mark.parametrize(
    "lanes",
    [((False, True), {}), ((False, True), ONE_GROUP)],
    ids=["lanes", "one_group"],
    indirect=True,
)
def test_a_worker_whose_model_does_not_fit_refuses_before_any_byte(
    lanes: tuple[list, list],
) -> None:
    """Refused on every rank before any byte, push after push. Over one group, the group stays
    as it is: a refusal leaves it whole (forming it again would cost a rendezvous each time)."""
    ranks, workers = lanes
    before = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
    group = on_all(ranks, "lanes_one_group")
    for _ in range(2):
        (kind, why), (other, _) = on_all(ranks, "lanes_push")
        assert kind == other == "PlanMismatchError", why
        assert "worker 1: unknown tensor 'q_proj.weight'" in why  # rank 0 names the worker
    assert on_all(ranks, "lanes_one_group") == group
    assert ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT) == before
    assert ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT) == [None, None]


@LANES_AND_ONE_GROUP
def test_a_sender_that_dies_is_named_and_no_worker_claims_the_version(
    lanes: tuple[list, list],
) -> None:
    """Rank 1 dies once the senders agreed, before its lane moves a byte: rank 0's lane lands,
    and rank 0 names rank 1 at once (a worker saw its store close); the workers hold no
    version (half of every sharded tensor is new, half old)."""
    ranks, workers = lanes
    on_all(ranks, "lanes_push")
    on_all(ranks, "step")
    first, second = ranks[0].lanes_push.remote(), ranks[1].lanes_push.remote(die=True)
    kind, why = ray.get(first, timeout=TIMEOUT)
    assert kind == "SenderFailedError" and why.startswith(DEATH), why  # said first, as it is
    assert "its store closed on worker" in why, why  # the symptom, as the reason
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(second, timeout=TIMEOUT)
    assert ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT) == [None, None]


@pytest.mark.parametrize(
    "lanes",
    [
        ((False, False), {"bucket_bytes": 1024, "direct_min_bytes": None}),
        ((False, False), {"bucket_bytes": 1024, "direct_min_bytes": None, **ONE_GROUP}),
    ],
    ids=["lanes", "one_group"],
    indirect=True,
)
def test_a_sender_that_dies_while_its_bytes_flow_is_named_and_no_worker_claims_the_version(
    lanes: tuple[list, list],
) -> None:
    """Rank 1 dies as its lane starts its second bucket, the first already on every worker
    (1 KiB buckets: each lane sends several): rank 0 names rank 1, and the workers, which
    hold part of rank 1's bytes of this push, hold no version and say it was not whole."""
    ranks, workers = lanes
    on_all(ranks, "lanes_push")
    on_all(ranks, "step")
    first, second = ranks[0].lanes_push.remote(), ranks[1].lanes_push.remote(die="mid")
    kind, why = ray.get(first, timeout=TIMEOUT)
    assert kind == "SenderFailedError" and why.startswith(DEATH), why
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(second, timeout=TIMEOUT)
    assert ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT) == [None, None]
    for status in ray.get([w.sync_status.remote() for w in workers], timeout=TIMEOUT):
        assert status.dirty and status.full_version is None, status
        assert status.last_error is not None, status
        assert status.last_error.startswith(f"SenderFailedError: {DEATH}"), status


@LANES_AND_ONE_GROUP
def test_a_worker_failing_after_the_lanes_fails_the_push_on_every_rank(
    lanes: tuple[list, list],
) -> None:
    """Worker 1 raises once every lane committed on it: rank 0 names it, and rank 1, whose
    lanes all landed, raises too (rank 0's word): every rank of a training loop sees the same
    outcome. The version is spent; the next push lands past it (over one group, forming the
    group again first)."""
    ranks, workers = lanes
    on_all(ranks, "lanes_push")
    ray.get(workers[1].fail_after_lanes.remote(True), timeout=TIMEOUT)
    on_all(ranks, "step")
    (kind, why), (other, said) = on_all(ranks, "lanes_push")
    assert kind == other == "WorkerFailedError", (why, said)
    assert "worker 1:" in why and "worker 0" not in why, why
    assert "see rank 0's error" in said, said
    ray.get(workers[1].fail_after_lanes.remote(False), timeout=TIMEOUT)
    assert [r.version for r in on_all(ranks, "lanes_push")] == [3, 3]


# Short bounds: a worker that died is found at the lanes' collective bound (see the test).
SHORT = {"collective_timeout_s": 4, "rpc_timeout_s": 10, "rendezvous_timeout_s": 10}


@pytest.mark.parametrize(
    "lanes",
    [((False, False), SHORT), ((False, False), {**SHORT, **ONE_GROUP})],
    ids=["lanes", "one_group"],
    indirect=True,
)
def test_a_worker_that_dies_is_dropped_on_every_rank_and_a_replacement_takes_every_lane(
    lanes: tuple[list, list], take: Lease
) -> None:
    """Worker 1 is killed between pushes: the next push fails on every rank, rank 0 naming it
    dead and dropping it as one sender drops a dead worker (at once: the other ranks as the
    next push begins); that push lands on worker 0 alone, and a replacement added on every
    rank takes every lane in full at the push after."""
    ranks, workers = lanes
    on_all(ranks, "lanes_push")
    take.spoil(workers[1])
    ray.kill(workers[1])
    on_all(ranks, "step")
    started = time.monotonic()
    (kind, why), (other, said) = on_all(ranks, "lanes_push")
    print(f"{time.monotonic() - started:.2f}s: {kind}: {why} / {other}: {said}")
    assert kind == "WorkerFailedError" and "worker 1: actor died" in why, why
    assert "dropped worker(s) [1]" in why, why
    assert other in ("WorkerFailedError", "SenderFailedError"), said
    assert on_all(ranks, "lanes_workers") == [1, 2]
    on_all(ranks, "step")
    pushed = on_all(ranks, "lanes_push")
    assert pushed[0].version == pushed[1].version, pushed
    assert on_all(ranks, "lanes_workers") == [1, 1]
    want = on_all(ranks, "full_digests")[0]
    assert ray.get(workers[0].weight_sync_digests.remote(), timeout=TIMEOUT) == want
    [replacement] = take(LMWorker, [{"fused": False}])
    on_all(ranks, "lanes_add", [replacement])
    on_all(ranks, "step")
    again = on_all(ranks, "lanes_push")
    assert again[0].version == again[1].version > pushed[0].version, again
    want = on_all(ranks, "full_digests")[0]
    held = [workers[0], replacement]
    assert ray.get([w.weight_sync_digests.remote() for w in held], timeout=TIMEOUT) == [want] * 2
    assert on_all(ranks, "lanes_workers") == [2, 2]


# A worker killed mid-push: 1 KiB buckets (each lane sends several), and bounds long enough that
# a wait for the dead worker's answers to them would show.
MID = {"bucket_bytes": 1024, "direct_min_bytes": None, "rpc_timeout_s": 60}


@pytest.mark.parametrize(
    "lanes",
    [((False, False), MID), ((False, False), {**MID, **ONE_GROUP})],
    ids=["lanes", "one_group"],
    indirect=True,
)
def test_a_worker_killed_while_the_bytes_flow_is_named_at_once_on_every_rank(
    lanes: tuple[list, list], take: Lease
) -> None:
    """Worker 1's process ends as rank 1's second bucket is to reach it, the first already
    there: every rank raises at once, naming worker 1 dead -- rank 0 from its call on it, rank
    1 told by rank 0 (its own store cannot tell a dead member from a slow one: its lane waited
    for worker 1's answers until its bound, 60 s here) -- rank 0 drops it, worker 0, which took
    part of the push, claims no version, and the next push lands on it."""
    ranks, workers = lanes
    first = on_all(ranks, "lanes_push")[0].version
    take.spoil(workers[1])
    ray.get(workers[1].die_mid_push.remote(1), timeout=TIMEOUT)
    on_all(ranks, "step")
    started = time.monotonic()
    (kind, why), (other, said) = on_all(ranks, "lanes_push")
    seconds = time.monotonic() - started
    print(f"{seconds:.2f}s: {kind}: {why} / {other}: {said}")
    assert kind == "WorkerFailedError" and "worker 1: actor died" in why, why
    assert "dropped worker(s) [1]" in why, why
    assert other == "WorkerFailedError" and "worker 1: actor died" in said, said
    assert seconds < 10, seconds  # 0.1-0.2 s here; the bound it waited for before, 60 s
    held = ray.get(workers[0].weights_version.remote(), timeout=TIMEOUT)
    assert held is None or held == first, held
    on_all(ranks, "step")
    pushed = on_all(ranks, "lanes_push")
    assert pushed[0].version == pushed[1].version > first, pushed
    assert on_all(ranks, "lanes_workers") == [1, 1]
    want = on_all(ranks, "full_digests")[0]
    assert ray.get(workers[0].weight_sync_digests.remote(), timeout=TIMEOUT) == want


@LANES_AND_ONE_GROUP
def test_a_worker_that_fails_as_the_bytes_begin_fails_the_push_at_once(
    lanes: tuple[list, list],
) -> None:
    """Worker 1 accepted the push, then its lane from rank 1 fails as rank 1's bytes are about
    to flow, before it takes one: every rank raises at once, not at the push's bound (rank 1's
    sends to it would otherwise wait for a receive that never comes), no worker claims the
    version, and the next push lands (over one group, forming it again first)."""
    ranks, workers = lanes
    on_all(ranks, "lanes_push")
    ray.get(workers[1].fail_before_bytes.remote(1), timeout=TIMEOUT)
    on_all(ranks, "step")
    started = time.monotonic()
    (kind, why), (other, said) = on_all(ranks, "lanes_push")
    assert time.monotonic() - started < 30  # the push's bound is 900 s
    # Rank 1's lane names the worker. Rank 0's landed, and rank 0 names the lane that did not
    # (over one group its own lane failed with it, the group aborted): both say why.
    assert other == "WorkerFailedError" and "worker 1: " in said and "fault injection" in said
    assert kind == "SenderFailedError" and why.startswith("trainer rank 1 did not land"), why
    assert "worker 1: " in why, why
    assert "fault injection" in why, why
    assert ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT)[1] != 2
    ray.get(workers[1].fail_before_bytes.remote(None), timeout=TIMEOUT)
    results = on_all(ranks, "lanes_push")
    assert results[0].version == results[1].version == 3, results
    want = on_all(ranks, "full_digests")[0]
    assert ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT) == [want] * 2


@LANES_AND_ONE_GROUP
def test_a_worker_whose_weights_cannot_be_had_as_its_lanes_begin_refuses_the_push(
    lanes: tuple[list, list],
) -> None:
    """Worker 1's ``weight_sync_destinations`` raises as a push begins (its one call of the
    push, as the worker checks the layout against it): its lanes refuse the push, so every
    rank raises at once (before, the senders waited for answers that never came, until their
    rpc bound), nothing moved anywhere, and the next push lands."""
    ranks, workers = lanes
    on_all(ranks, "lanes_push")
    before = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
    ray.get(workers[1].fail_assembly.remote(True), timeout=TIMEOUT)
    on_all(ranks, "step")
    started = time.monotonic()
    refused = on_all(ranks, "lanes_push")
    assert time.monotonic() - started < 30, refused  # the rpc bound is 120 s
    for kind, why in refused:
        assert kind == "PlanMismatchError" and "worker 1: " in why, why
        assert "could not check the push" in why and "fault injection" in why, why
    assert ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT) == before
    assert ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT) == [1, 1]
    ray.get(workers[1].fail_assembly.remote(False), timeout=TIMEOUT)
    results = on_all(ranks, "lanes_push")
    assert [r.version for r in results] == [3, 3], results
    want = on_all(ranks, "full_digests")[0]
    assert ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT) == [want] * 2


def test_a_worker_failing_once_the_one_group_formed_fails_every_sender_at_once() -> None:
    """Worker 1 raises once it joined the one group: rank 0 names it, and rank 1, whose own
    join went through, raises with it rather than waiting for rank 0 until its bound."""
    workers = [LMWorker.remote(fused=False) for _ in range(2)]
    ranks = [ShardedTrainer.remote(rank, 2) for rank in range(2)]
    try:
        ray.get(workers[1].fail_after_join.remote(), timeout=TIMEOUT)
        port = ray.get(ranks[0].port.remote(), timeout=TIMEOUT)
        ray.get([rank.setup.remote(port, None) for rank in ranks], timeout=TIMEOUT)
        started = time.monotonic()
        setups = [rank.lanes_setup.remote(workers, one_group=True) for rank in ranks]
        errors = []
        for setup in setups:
            with pytest.raises(ray.exceptions.RayTaskError) as raised:
                ray.get(setup, timeout=TIMEOUT)
            errors.append(str(raised.value))
        assert time.monotonic() - started < 60  # not the 900 s push_timeout_s of rank 1's wait
        assert "WorkerFailedError" in errors[0] and "joining the one group failed" in errors[0]
        assert "rank 0 failed before the push" in errors[1], errors[1]
    finally:
        kill([*ranks, *workers])


@pytest.mark.parametrize("lanes", [((False, False), ONE_GROUP)], ids=["one_group"], indirect=True)
def test_a_worker_that_lost_the_one_group_refuses_the_push_and_the_next_forms_it_again(
    lanes: tuple[list, list],
) -> None:
    """A worker whose lanes another updater's took the place of refuses the next push over
    the one group in its layout check: every rank raises at once, the senders never waiting
    out their bound on a member that will not answer, and the worker keeps its version. The
    push after it forms the group again, every worker rejoining, and lands."""
    ranks, workers = lanes
    assert [r.version for r in on_all(ranks, "lanes_push")] == [1, 1]
    ray.get(workers[0].lose_lanes.remote(), timeout=TIMEOUT)
    started = time.monotonic()
    (kind, why), (other, _) = on_all(ranks, "lanes_push")
    assert time.monotonic() - started < 30
    assert kind == other == "PlanMismatchError", why
    assert "worker 0: this worker holds no one group with these senders" in why
    assert ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT) == [1, 1]
    group = on_all(ranks, "lanes_one_group")
    on_all(ranks, "step")
    results = on_all(ranks, "lanes_push")
    assert on_all(ranks, "lanes_one_group") != group  # formed again: every worker rejoined
    assert results[0].version == results[1].version > 1, results
    want = on_all(ranks, "full_digests")[0]
    assert ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT) == [want] * 2
    held = ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT)
    assert held == [results[0].version] * 2


def test_a_worker_without_the_one_group_refuses_a_push_over_it() -> None:
    """The refusal a worker that lost the one group gives: asked to take a push over a group it
    holds none of, it answers the lane's prepare in its sender's store through a client of its
    own (it follows no lane of that sender's to answer through) rather than listening on lanes
    of its own while the senders send over the group, and ends its call, holding what it held."""
    listener = bind_listener("127.0.0.1")
    address, port = listener.getsockname()[:2]
    store = open_store(address, port, 1, 30.0, listener)  # the sender's store, hosted here
    worker = LMWorker.remote(fused=False)
    try:
        check = LaneCheck(push=1, version=3, digest="0" * 64, max_metadata_bytes=1 << 20)
        asked = LanePush(
            endpoints=[(address, port)], slot=1, check=check, wait_s=10.0, firsts=[None]
        )
        call = worker._weight_sync_lanes_push.remote(asked.model_dump_json(), one_group=True)
        assert ray.get(call, timeout=TIMEOUT) is None  # it held nothing, and holds nothing
        raw = dist.PrefixStore(PREFIX, store).get("prepared/3/1")
        reply = PrepareReply.model_validate_json(WorkerReply.model_validate_json(raw).unwrap())
        assert not reply.accepted
        [problem] = reply.problems
        assert problem.startswith(NO_ONE_GROUP), problem
        info = ray.get(worker._weight_sync_info.remote(), timeout=TIMEOUT)
        assert info.version is None and info.highest_version == 3  # spent, as on the senders
    finally:
        ray.kill(worker)


@LANES_AND_ONE_GROUP
def test_closing_the_senders_has_the_workers_let_go_of_their_lanes(
    lanes: tuple[list, list],
) -> None:
    """``WeightUpdater.close`` on rank 0 has every worker leave the lanes (and the one group):
    no group held past the senders, the version they landed still reported."""
    ranks, workers = lanes
    assert [r.version for r in on_all(ranks, "lanes_push")] == [1, 1]
    before = ray.get([w.sync_status.remote() for w in workers], timeout=TIMEOUT)
    assert all(status.in_group for status in before)
    on_all(ranks, "lanes_close")
    after = ray.get([w.sync_status.remote() for w in workers], timeout=TIMEOUT)
    assert [(s.in_group, s.version, s.full_version) for s in after] == [(False, 1, 1)] * 2
    assert [s.last for s in after] == [s.last for s in before]


@pytest.mark.parametrize("lanes", [((False, False), ONE_GROUP)], ids=["one_group"], indirect=True)
def test_a_join_that_comes_too_late_leaves_the_workers_lanes_as_they_were(
    lanes: tuple[list, list],
) -> None:
    """A worker asked to join a one group whose senders gave up (its actor was busy past their
    rendezvous bound) fails that join and keeps the lanes it holds: the next push lands."""
    ranks, workers = lanes
    assert [r.version for r in on_all(ranks, "lanes_push")] == [1, 1]
    with socket.socket() as nobody:  # bound, never listening: the senders' rendezvous is gone
        nobody.bind(("127.0.0.1", 0))
        spec = GroupSpec(group_id="0" * 16, address="127.0.0.1", port=nobody.getsockname()[1],
                         world_size=4, rank=2, backend="gloo", mode="standalone",
                         rendezvous_timeout_s=1.0, collective_timeout_s=1.0)  # fmt: skip
        late = workers[0]._weight_sync_lanes_join.remote(
            spec.model_dump_json(), [("127.0.0.1", 1), ("127.0.0.1", 2)], 1
        )
        with pytest.raises(ray.exceptions.RayTaskError):
            ray.get(late, timeout=TIMEOUT)
    assert [r.version for r in on_all(ranks, "lanes_push")] == [2, 2]


def test_a_worker_busy_with_its_own_methods_joins_the_one_group_meanwhile(pool: Pool) -> None:
    """Joining touches no weight: on a worker made with ``remote_worker`` it runs beside the
    actor's own methods, not after them (the senders' rendezvous would time out first)."""
    workers = [BusyLMWorker.remote() for _ in range(2)]
    try:
        ranks = pool.ranks()
        ray.get([worker.weights_version.remote() for worker in workers], timeout=TIMEOUT)
        busy = workers[0].busy.remote(60)
        setups = [rank.lanes_setup.remote(workers, one_group=True) for rank in ranks]
        ray.get(setups, timeout=45)  # not after the 60 s the worker is busy
        assert not ray.wait([busy], timeout=0)[0]  # still busy: the join went beside it
        on_all(ranks, "lanes_close")
    except BaseException:
        pool.drop_ranks()
        raise
    finally:
        kill(workers)


def test_ranks_that_disagree_on_a_field_that_must_agree_are_told_on_every_rank(
    pool: Pool, take: Lease
) -> None:
    """Rank 1 gives another ``cast_dtype`` (and, over one group, the NCCL backend): every
    rank's ``WeightUpdater`` raises ``ValueError`` as it is made, naming the field and each
    rank's value, before anything forms -- and the ranks make one that lands right after."""
    workers = take(LMWorker, [{"fused": False}] * 2)
    ranks = pool.ranks()
    passed = False
    try:
        for one_group, said in [(False, "cast_dtype (rank 0: None, rank 1: 'bfloat16'"),
                                (True, "backend (rank 0: 'gloo', rank 1: 'nccl'")]:  # fmt: skip
            mine = [{}, {"cast_dtype": "bfloat16", "backend": "nccl" if one_group else "auto"}]
            setups = [
                rank.lanes_setup.remote(workers, one_group=one_group, **config)
                for rank, config in zip(ranks, mine, strict=True)
            ]
            for setup in setups:
                with pytest.raises(ray.exceptions.RayTaskError) as raised:
                    ray.get(setup, timeout=TIMEOUT)
                assert "ValueError" in str(raised.value) and said in str(raised.value)
        ray.get([rank.lanes_setup.remote(workers) for rank in ranks], timeout=TIMEOUT)
        assert [r.version for r in on_all(ranks, "lanes_push")] == [1, 1]
        on_all(ranks, "lanes_close")
        passed = True
    finally:
        if not passed:
            pool.drop_ranks()


def test_one_group_over_nccl_refuses_workers_without_a_gpu_of_their_own() -> None:
    """Asked of the workers as the senders form, before any rendezvous: a worker on the CPU
    would otherwise fail in the group's rendezvous, and every sender wait out its bound."""
    workers = [LMWorker.remote(fused=False) for _ in range(2)]
    ranks = [ShardedTrainer.remote(rank, 2) for rank in range(2)]
    try:
        port = ray.get(ranks[0].port.remote(), timeout=TIMEOUT)
        ray.get([rank.setup.remote(port, None) for rank in ranks], timeout=TIMEOUT)
        setups = [
            rank.lanes_setup.remote(workers, one_group=True, backend="nccl") for rank in ranks
        ]
        errors = []
        for setup in setups:
            with pytest.raises(ray.exceptions.RayTaskError) as raised:
                ray.get(setup, timeout=TIMEOUT)
            errors.append(str(raised.value))
        assert "ValueError" in errors[0] and "worker 0 does not receive on a GPU" in errors[0]
        assert "rank 0 failed" in errors[1], errors[1]
    finally:
        kill([*ranks, *workers])


@ray.remote(num_cpus=0)
class Plain:
    """An actor that is no ``WeightSyncWorker`` (as a ``VLLMEngine`` is not)."""

    def ping(self) -> bool:
        return True


@pytest.mark.parametrize("one_group", [False, True], ids=["lanes", "one_group"])
@pytest.mark.parametrize("trainer", [ShardedTrainer, LoneTrainer], ids=["mesh_of_one", "no_dist"])
def test_a_trainer_of_one_rank_pushes_through_the_same_front(
    take: Lease, one_group: bool, trainer: Any
) -> None:
    """``senders`` over a group of one rank -- the K = 1 case of a push from every rank: a
    trainer sharded over a mesh of one, or a trainer of one process with no torch.distributed
    at all (``OneRank``), its one lane landing bit for bit on both workers, twice, the front's
    ``routes`` and ``group`` its lane's, and the workers letting go of it when it closes. Past
    the first push (which forms the lane), each worker answers the lane in its call, as one
    sender's workers do -- over one group the lane goes the long way, through the store."""
    rank = trainer.remote(0, 1)
    workers = take(LMWorker, [{"fused": False}] * 2)
    try:
        ray.get(rank.setup.remote(ray.get(rank.port.remote(), timeout=TIMEOUT), None))
        ray.get(rank.lanes_setup.remote(workers, one_group=one_group), timeout=TIMEOUT)
        assert ray.get(rank.lanes_routes.remote(), timeout=TIMEOUT) == ([], False)  # not formed
        for version in (1, 2):
            ray.get(rank.step.remote(), timeout=TIMEOUT)
            result = ray.get(rank.lanes_push.remote(), timeout=TIMEOUT)
            assert result.version == version and result.tensors > 0, result
            want = ray.get(rank.full_digests.remote(), timeout=TIMEOUT)
            got = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
            assert got == [want] * 2
            # The front's routes and group are the lane's, as one sender's are its group's: the
            # workers on its host take the ring, except over one group (which carries them).
            route = "group" if one_group else "shm"
            assert ray.get(rank.lanes_routes.remote(), timeout=TIMEOUT) == ([route] * 2, True)
            answered = ray.get(rank.lanes_answered.remote(), timeout=TIMEOUT)
            assert answered == [version > 1 and not one_group] * 2, answered
        ray.get(rank.lanes_close.remote(), timeout=TIMEOUT)
        for status in ray.get([w.sync_status.remote() for w in workers], timeout=TIMEOUT):
            assert status.version == 2 and not status.in_group, status
    finally:
        kill([rank])


def test_a_lane_that_cannot_form_lets_its_workers_go_at_once(take: Lease) -> None:
    """The push's one sender over NCCL (its lane runs on the backend its config names) with
    CPU weights and workers: the lane's routes are refused before any worker is told its place,
    and the push raises that at once -- while the workers, already waiting for their places
    as they answered the probe, are told there is none (``ClientPlane.unformed``): each
    answers its next call at once, not when the store's 60 s bound ends its wait."""
    rank = LoneTrainer.remote(0, 1)
    workers = take(LMWorker, [{"fused": False}] * 2)
    try:
        ray.get(rank.setup.remote(0, None), timeout=TIMEOUT)
        config = {"backend": "nccl", "rendezvous_timeout_s": 60}
        ray.get(rank.lanes_setup.remote(workers, **config), timeout=TIMEOUT)
        started = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError, match="backend='nccl' cannot be used"):
            ray.get(rank.lanes_push.remote(), timeout=TIMEOUT)
        versions = ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT)
        waited = time.monotonic() - started
        assert versions == [None, None] and waited < 30, (versions, waited)
    finally:
        kill([rank])


def test_one_group_takes_only_workers_that_can_join_it() -> None:
    """Refused in the constructor, before any group or collective: an engine's workers cannot
    join one group yet."""
    from weight_sync.actors import WeightUpdater

    plain = Plain.remote()
    try:
        assert ray.get(plain.ping.remote(), timeout=TIMEOUT)
        with pytest.raises(ValueError, match="one_group takes WeightSyncWorker actors"):
            WeightUpdater([plain], senders=object(), one_group=True)  # type: ignore[arg-type]
    finally:
        ray.kill(plain)


def test_pushes_from_one_sender_and_from_many_into_the_same_workers_build_on_each_other() -> None:
    """Rank 0 also pushes alone (a ``WeightUpdater`` over the same workers, deltas on), between
    pushes from both ranks: each kind of push is checked against what the other left. A delta
    built on what rank 0 pushed before the lanes' push does not land on the lanes' weights
    (the trainer's weights are put back as they were then: that delta would be empty and the
    workers would keep the lanes' bytes); a partial push completes the last full push of
    either kind."""
    workers = [LMWorker.remote(fused=False) for _ in range(2)]
    ranks = [ShardedTrainer.remote(rank, 2) for rank in range(2)]
    try:
        port = ray.get(ranks[0].port.remote(), timeout=TIMEOUT)
        ray.get(
            [
                rank.setup.remote(port, workers if i == 0 else None, delta="always")
                for i, rank in enumerate(ranks)
            ],
            timeout=TIMEOUT,
        )
        ray.get(
            [rank.lanes_setup.remote(workers, delta="always") for rank in ranks], timeout=TIMEOUT
        )

        def alone(version: int, only: list[str] | None = None, whole: bool = True) -> Any:
            """Rank 0's one-sender push (``whole``: of tensors gathered first; else rank 1
            serves its gathers); its result."""
            calls = [rank.push.remote(version, only, whole) for rank in ranks]
            result, _ = ray.get(calls[0], timeout=TIMEOUT)  # its error first, if it failed
            ray.get(calls[1], timeout=TIMEOUT)
            assert result.version == version, result
            return result

        def together(version: int, *only: list[str]) -> Any:
            pushed = on_all(ranks, "lanes_push", version, False, *only)
            assert [getattr(r, "version", r) for r in pushed] == [version] * 2, pushed
            return pushed[0]

        def holds(version: int, full: int, rest: dict | None = None) -> dict:
            """The workers hold the trainer's weights (``rest``: those of a partial push; the
            other tensors as ``rest`` says), as ``version`` completing ``full``."""
            want = on_all(ranks, "full_digests")[0]
            if rest is not None:
                want = {n: want[n] if n in only else rest[n] for n in want}
            got = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
            assert got == [want, want]
            statuses = ray.get([w.sync_status.remote() for w in workers], timeout=TIMEOUT)
            assert [(s.version, s.full_version) for s in statuses] == [(version, full)] * 2
            return want

        only = ["adapter.weight", "adapter.bias"]
        # A trainer whose ranks push both ways labels each push (its step): neither pusher
        # counts the other's versions.
        on_all(ranks, "step")
        assert not alone(1).delta
        holds(1, 1)
        on_all(ranks, "step")
        on_all(ranks, "keep")
        assert alone(2).delta  # the workers held its base: what a delta builds on
        holds(2, 2)
        on_all(ranks, "step")
        together(3)
        holds(3, 3)
        on_all(ranks, "restore")  # the weights of version 2 again: nothing changed since it
        assert not alone(4).delta  # the workers hold no base of it any more
        rest = holds(4, 4)
        on_all(ranks, "step")
        together(5, only)
        holds(5, 4, rest)  # the rest as version 4 left it
        on_all(ranks, "step")
        on_all(ranks, "keep")
        assert together(6).delta  # each lane's receivers held its base
        rest = holds(6, 6)
        on_all(ranks, "step")
        alone(7, only, whole=False)  # gathered bucket by bucket, as labelled
        holds(7, 6, rest)
        on_all(ranks, "restore")  # version 6's weights: the other way round
        assert not together(8).delta
        holds(8, 8)
    finally:
        for rank in ranks:
            ray.get([rank.lanes_close.remote(), rank.close.remote()], timeout=TIMEOUT)
        kill([*ranks, *workers])
