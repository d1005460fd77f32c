"""Name mapping, tied weights and partial pushes, end to end: a trainer whose q/k/v are apart
pushes to workers that stack them, over real Ray actors and a Gloo group."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray

from tests.ray.actors import LMTrainer, LMWorker
from weight_sync import PlanMismatchError, PushResult

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("ray_cluster")]
TIMEOUT = 120
EMBED_BYTES = 64 * 16 * 4


@pytest.fixture
def fleet(ray_cluster: None) -> Iterator[tuple]:
    workers = [LMWorker.remote() for _ in range(2)]
    trainer = LMTrainer.remote(workers, bucket_bytes=4096)
    try:
        yield trainer, workers
    finally:
        for actor in [trainer, *workers]:
            ray.kill(actor)


def statuses(workers: list) -> list:
    return ray.get([w.sync_status.remote() for w in workers], timeout=TIMEOUT)


def digests(workers: list) -> list[dict[str, str]]:
    return ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)


def test_fused_names_and_tied_weights_sent_once(fleet: tuple) -> None:
    trainer, workers = fleet
    result: PushResult = ray.get(trainer.push.remote(), timeout=TIMEOUT)
    want = ray.get(trainer.digests.remote(), timeout=TIMEOUT)
    assert all(got == want for got in digests(workers))
    # embed + lm_head are one tensor: counted among the names, sent once
    qkv_and_adapter = (3 * 16 * 16 + 3 * 16 + 16 * 16 + 16) * 4
    assert result.tensors == 6 and result.nbytes == EMBED_BYTES + qkv_and_adapter
    assert all(ray.get([w.still_tied.remote() for w in workers], timeout=TIMEOUT))
    assert [(s.version, s.full_version) for s in statuses(workers)] == [(1, 1)] * 2


def test_partial_push_updates_a_subset_and_says_so(fleet: tuple) -> None:
    trainer, workers = fleet
    with pytest.raises(PlanMismatchError, match="push the full state dict first"):
        ray.get(trainer.push.remote(prefix="adapter.", partial=True), timeout=TIMEOUT)
    whole = ray.get(trainer.push.remote(), timeout=TIMEOUT)
    before = digests(workers)[0]
    ray.get(trainer.step.remote(), timeout=TIMEOUT)
    # A subset not announced as partial is refused: the worker would mix versions unannounced.
    with pytest.raises(PlanMismatchError, match="missing tensor 'embed.weight'"):
        ray.get(trainer.push.remote(prefix="adapter."), timeout=TIMEOUT)
    assert digests(workers)[0] == before
    result = ray.get(trainer.push.remote(prefix="adapter.", partial=True), timeout=TIMEOUT)
    assert result.partial and result.tensors == 2
    now, want = digests(workers), ray.get(trainer.digests.remote(), timeout=TIMEOUT)
    for got in now:
        assert {n: d for n, d in got.items() if n.startswith("adapter.")} == {
            n: d for n, d in want.items() if n.startswith("adapter.")
        }
        assert {n: d for n, d in got.items() if not n.startswith("adapter.")} == {
            n: d for n, d in before.items() if not n.startswith("adapter.")
        }
    # The refusals spent versions too: the partial push completes the full one it follows.
    assert [(s.version, s.full_version) for s in statuses(workers)] == [
        (result.version, whole.version)
    ] * 2
    full = ray.get(trainer.push.remote(), timeout=TIMEOUT)
    assert all(got == want for got in digests(workers))
    assert [(s.version, s.full_version) for s in statuses(workers)] == [(full.version,) * 2] * 2
