"""Every rank of a sharded trainer pushing its own shards into real vLLM engines on Ray
(``WeightUpdater(senders=...)`` to ``VLLMEngine`` actors): two trainer actors, the offline fp32
engine and the bf16 engine with tensor parallelism 2 (two members, each of its workers following
both lanes).

Checked as tests/vllm/test_engine.py checks one sender: each engine generates what the
trainer's whole model would, labelled with the push's version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from tests.vllm.models import QWEN2, LaneTrainer
from tests.vllm.test_engine import TIMEOUT, assert_matches

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("ray_cluster")]
RANKS = 2
BF16 = 5e-2  # tests/vllm/test_engine.py's tolerance for a bf16 engine


@pytest.fixture
def sharded(engines: dict[str, Any]) -> Iterator[list[Any]]:
    """Two trainer ranks with a WeightUpdater each (senders: their group), to the fp32 engine and
    the bf16 TP-2 one."""
    ranks = [LaneTrainer.remote(QWEN2, rank, RANKS) for rank in range(RANKS)]
    port = ray.get(ranks[0].port.remote(), timeout=TIMEOUT)
    targets = [engines["qwen2"], engines["qwen2_tp2_bf16"]]
    ray.get([rank.setup.remote(port, targets, push_timeout_s=60) for rank in ranks],
            timeout=TIMEOUT)  # fmt: skip
    try:
        yield ranks
    finally:
        for rank in ranks:  # one may have died on purpose
            with contextlib.suppress(Exception):
                ray.get(rank.close.remote(), timeout=30)
            ray.kill(rank)


def _push(ranks: list[Any], **options: Any) -> list[Any]:
    return ray.get([rank.push.remote(**options) for rank in ranks], timeout=TIMEOUT)


def _versions(engines: dict[str, Any]) -> list[int | None]:
    names = ("qwen2", "qwen2_tp2_bf16")
    return ray.get([engines[n].weights_version.remote() for n in names], timeout=TIMEOUT)


def test_every_rank_pushes_its_shards_into_both_engines(
    sharded: list[Any], engines: dict[str, Any]
) -> None:
    qwen2, tp2 = engines["qwen2"], engines["qwen2_tp2_bf16"]
    before = max(v or 0 for v in _versions(engines))
    seen = []
    for _ in range(2):
        ray.get([rank.step.remote() for rank in sharded], timeout=TIMEOUT)
        results = _push(sharded)
        assert all(not isinstance(r, tuple) for r in results), results
        version = results[0].version
        assert [r.version for r in results] == [version] * RANKS and version > before
        assert assert_matches(qwen2, sharded[0]) == version
        assert (
            assert_matches(tp2, sharded[0], tokens=4, tolerance=BF16, dtype="bfloat16") == version
        )
        seen.append(version)
    assert seen == sorted(set(seen))
    status = ray.get(tp2.sync_status.remote(), timeout=TIMEOUT)
    assert status.version == status.full_version == seen[-1] and not status.dirty, status
    # Every lane's part of the last push, as one: each worker took both senders' buckets.
    assert status.last is not None and status.last.version == seen[-1], status
    assert status.buckets_done == status.buckets_total == status.last.buckets >= RANKS, status
    assert status.in_group, status
    ray.get([rank.close.remote() for rank in sharded], timeout=TIMEOUT)  # rank 0: workers leave
    for engine in (qwen2, tp2):  # every worker let go of its lanes, keeping what they landed
        left = ray.get(engine.sync_status.remote(), timeout=TIMEOUT)
        assert (left.in_group, left.version, left.full_version) == (False, seen[-1], seen[-1])


def test_a_refusal_changes_nothing_and_a_dead_rank_leaves_no_version(
    sharded: list[Any], engines: dict[str, Any]
) -> None:
    """A tensor no engine can place: refused on both ranks before any byte moves, versions
    kept. Then rank 1 dies once the senders agreed: rank 0 names it, no engine claims the
    version."""
    ray.get([rank.step.remote() for rank in sharded], timeout=TIMEOUT)
    landed = _push(sharded)[0].version
    refused = _push(sharded, extra=True)
    for kind, why in refused:
        assert kind == "PlanMismatchError", why
    assert "extra" in refused[0][1]
    assert _versions(engines) == [landed, landed]
    assert_matches(engines["qwen2"], sharded[0])
    first = sharded[0].push.remote()
    second = sharded[1].push.remote(die=True)
    kind, why = ray.get(first, timeout=TIMEOUT)
    assert kind == "SenderFailedError" and why.startswith("trainer rank 1 died or left"), why
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(second, timeout=TIMEOUT)
    assert _versions(engines) == [None, None]
    targets = [engines["qwen2"], engines["qwen2_tp2_bf16"]]
    for status in ray.get([e.sync_status.remote() for e in targets], timeout=TIMEOUT):
        assert status.dirty and status.full_version is None and status.last_error, status


def test_buckets_far_smaller_than_a_layer_land_whole(engines: dict[str, Any]) -> None:
    """4 KiB buckets, streamed: each lane's receive buffers are reused bucket after bucket,
    while an engine's worker gathers the whole push for one reload -- so its lanes must hand it
    tensors of its own (``Assembly.keeps``), never views a later bucket overwrites (they did:
    the engine's logprobs were 2.4 off the trainer's)."""
    ranks = [LaneTrainer.remote(QWEN2, rank, RANKS) for rank in range(RANKS)]
    try:
        port = ray.get(ranks[0].port.remote(), timeout=TIMEOUT)
        small = {"bucket_bytes": 4096, "direct_min_bytes": None, "push_timeout_s": 60}
        ray.get([rank.setup.remote(port, [engines["qwen2"]], **small) for rank in ranks],
                timeout=TIMEOUT)  # fmt: skip
        for _ in range(2):
            ray.get([rank.step.remote() for rank in ranks], timeout=TIMEOUT)
            results = _push(ranks)
            assert all(not isinstance(r, tuple) for r in results), results
            assert results[0].buckets > 50, results[0]
            assert assert_matches(engines["qwen2"], ranks[0]) == results[0].version
    finally:
        for rank in ranks:
            with contextlib.suppress(Exception):
                ray.get(rank.close.remote(), timeout=30)
            ray.kill(rank)
