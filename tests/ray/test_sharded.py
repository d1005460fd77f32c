"""A sharded trainer: two FSDP2 ranks (real Gloo world, real Ray actors) push to two workers,
gathering tensor by tensor; only rank 0 talks to the workers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray

from tests.ray.actors import LMWorker, ShardedTrainer

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("ray_cluster")]
TIMEOUT = 120


@pytest.fixture
def trainers(ray_cluster: None) -> Iterator[tuple[list, list]]:
    """Rank 0 pushes as the one sender (``WeightUpdater(workers)``: the K = 1 case of the
    protocol), gathering every DTensor from the other rank."""
    workers = [LMWorker.remote(fused=False) for _ in range(2)]
    ranks = [ShardedTrainer.remote(rank, 2) for rank in range(2)]
    port = ray.get(ranks[0].port.remote(), timeout=TIMEOUT)
    config = {"bucket_bytes": 1024, "check_finite": True}
    ray.get(
        [
            ranks[0].setup.remote(port, workers, **config),
            ranks[1].setup.remote(port, None),
        ],
        timeout=TIMEOUT,
    )
    try:
        yield ranks, workers
    finally:
        ray.get([rank.close.remote() for rank in ranks], timeout=TIMEOUT)
        for actor in [*ranks, *workers]:
            ray.kill(actor)


def on_all(ranks: list, method: str) -> list:
    return ray.get([getattr(rank, method).remote() for rank in ranks], timeout=TIMEOUT)


def test_sharded_push_gathers_as_it_sends(trainers: tuple[list, list]) -> None:
    ranks, workers = trainers
    for step in range(1, 3):
        on_all(ranks, "step")  # FSDP's own collectives, between pushes
        (result, peak), (served, _) = on_all(ranks, "push")
        assert served == result.version == step
        want = on_all(ranks, "full_digests")[0]
        got = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
        assert all(g == want for g in got)
    # No rank held the whole model: at most about a bucket plus one tensor at a time.
    model_bytes = ray.get(ranks[0].model_bytes.remote(), timeout=TIMEOUT)
    assert 0 < peak <= 1024 + 64 * 16 * 4 < model_bytes
    assert all(ray.get([w.still_tied.remote() for w in workers], timeout=TIMEOUT))


def test_nan_on_another_rank_stops_every_rank_before_sending(trainers: tuple[list, list]) -> None:
    ranks, workers = trainers
    on_all(ranks, "push_sharded")
    before = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
    ray.get([rank.step.remote(poison=True) for rank in ranks], timeout=TIMEOUT)
    sending, serving = [rank.push_sharded.remote() for rank in ranks]
    with pytest.raises(ray.exceptions.RayTaskError, match="NaN or Inf in the trainer's shards"):
        ray.get(sending, timeout=TIMEOUT)
    with pytest.raises(ray.exceptions.RayTaskError, match="the push from trainer rank 0 failed"):
        ray.get(serving, timeout=TIMEOUT)
    assert ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT) == before
    assert ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT) == [1, 1]
