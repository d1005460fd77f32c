"""Delta pushes of a real transformers model through the public API: after optimizer steps the
workers hold, bit for bit, what a dense push would have given them; newcomers, a new trainer and
a damaged push all end in dense bytes where a delta would be wrong, never in a wrong delta."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from tests.ray.actors import _receivers, _Tampered
from tests.ray.pool import Lease, start_over
from weight_sync import PushResult, SyncConfig, WeightUpdater
from weight_sync.adapters.hf import HFWorker, load_model
from weight_sync.errors import WeightSyncError
from weight_sync.wire.checksums import state_dict_digests

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("ray_cluster")]
TIMEOUT = 120
POLICY = {  # embeddings of 4 spans, matrices of 1-2: blobs, whole tensors and ties all occur
    "model_type": "qwen2", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "tie_word_embeddings": True,
}  # fmt: skip


@ray.remote(num_cpus=0)
class Policy:
    """fp32 master weights and Adam; pushes cast to bf16, as deltas where the workers allow."""

    def __init__(self, workers: list, **config: Any) -> None:
        torch.manual_seed(0)
        torch.set_num_threads(1)
        self.model = load_model(POLICY)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-6)
        # On one host delta=True would go dense (see weight_sync.delta.choice): 'always' is what
        # exercises the deltas here.
        fields = {"delta": "always", "cast_dtype": "bfloat16", "bucket_bytes": 64 << 10, **config}
        self.config = SyncConfig(**fields)
        self.updater = WeightUpdater(workers, self.config)

    def step(self, seed: int) -> None:
        ids = torch.randint(
            0, POLICY["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(seed)
        )
        self.optimizer.zero_grad()
        self.model(ids, labels=ids).loss.backward()
        self.optimizer.step()

    def shift_everything(self) -> None:
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.add_(0.01)

    def push(self, names: list[str] | None = None) -> PushResult:
        state = self.model.state_dict()
        if names is not None:
            return self.updater.push({n: state[n] for n in names}, partial=True)
        return self.updater.push(state)

    def digests(self) -> dict[str, str]:
        return state_dict_digests(
            {n: t.to(torch.bfloat16) for n, t in self.model.state_dict().items()}
        )

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """What a dense push would make the workers compute: this model in their dtype."""
        return logits_of(copy.deepcopy(self.model).to(torch.bfloat16), ids)

    def restart(self, workers: list) -> None:
        """A new trainer process: a new updater, no copy of anything."""
        self.updater.close()
        self.updater = WeightUpdater(workers, self.config)

    def baseline_bytes(self) -> int:
        """Bytes of the trainer's copy of the weights (SyncConfig.delta)."""
        baseline = self.updater._pushes._lanes.out.pusher._wire._baseline
        return 0 if baseline is None else baseline.nbytes

    def add_workers(self, workers: list) -> None:
        self.updater.add_workers(workers)

    def renew(self, **init: Any) -> None:
        """Start over as ``Policy(**init)`` would (tests/ray/pool.py), its updater closed first."""
        self.close()
        start_over(self, **init)

    def close(self) -> None:
        self.updater.close()


@ray.remote(num_cpus=0)
class Worker(HFWorker):
    def __init__(self) -> None:
        torch.set_num_threads(1)
        super().__init__(POLICY, dtype=torch.bfloat16)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return logits_of(self.model, ids)

    def damage_next_push(self) -> None:
        """Flip a byte of the first bucket after the delta header (see tests/ray/actors.py)."""
        state = _receivers(self)[-1]  # its lane's
        inner = _Tampered(state.transport, flip=False, delay_s=0.0)
        outer = self

        class SecondBroadcast(_Tampered):
            def broadcast(
                self, tensor: torch.Tensor, src: int, timeout_s: float | None = None
            ) -> Any:
                self.calls = getattr(self, "calls", 0) + 1
                self._flip = self.calls == 2
                return super().broadcast(tensor, src, timeout_s)

        state._transport = SecondBroadcast(inner._inner, False, 0.0)
        del outer


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def check(policy: Any, workers: list, logits: bool = False) -> None:
    want = ray.get(policy.digests.remote(), timeout=TIMEOUT)
    got = ray.get([w.weight_sync_digests.remote() for w in workers], timeout=TIMEOUT)
    assert all(g == want for g in got)
    if logits:
        ids = torch.randint(
            0, POLICY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(7)
        )
        expected = ray.get(policy.logits.remote(ids), timeout=TIMEOUT)
        for worker_logits in ray.get([w.logits.remote(ids) for w in workers], timeout=TIMEOUT):
            assert torch.equal(worker_logits, expected)


@pytest.fixture(scope="module")
def fleet(ray_cluster: None) -> Iterator[list]:
    """Shared by the tests: each starts with a new trainer, whose first push is dense for all."""
    workers = [Worker.remote() for _ in range(3)]
    yield workers
    for worker in workers:
        ray.kill(worker)


def test_deltas_after_adam_steps_land_bit_for_bit(fleet: list, take: Lease) -> None:
    [policy] = take(Policy, [{"workers": fleet, "checksum": True}])
    try:
        first = ray.get(policy.push.remote(), timeout=TIMEOUT)
        assert not first.delta and first.wire_bytes >= first.nbytes and "scan" not in first.phases
        check(policy, fleet)
        for step in range(3):
            ray.get(policy.step.remote(step), timeout=TIMEOUT)
            result = ray.get(policy.push.remote(), timeout=TIMEOUT)
            assert result.delta and result.wire_bytes < first.wire_bytes / 2, result
            assert 0 < result.phases["scan"] < result.seconds, result.phases  # within the push
            assert sum(result.phases.values()) == pytest.approx(2 * result.seconds), result.phases
            check(policy, fleet, logits=True)
        ray.get(policy.step.remote(9), timeout=TIMEOUT)
        partial = ray.get(
            policy.push.remote(["model.embed_tokens.weight", "model.norm.weight"]), timeout=TIMEOUT
        )
        assert partial.delta and partial.partial
        ray.get(policy.push.remote(), timeout=TIMEOUT)  # the rest catches up
        check(policy, fleet)
        ray.get(policy.shift_everything.remote(), timeout=TIMEOUT)
        worst = ray.get(policy.push.remote(), timeout=TIMEOUT)
        assert worst.wire_bytes <= first.wire_bytes * 1.01  # nothing worse than dense
        check(policy, fleet)
    finally:
        ray.get(policy.close.remote(), timeout=TIMEOUT)


def test_delta_true_with_every_worker_on_the_trainers_host_goes_dense(
    fleet: list, take: Lease
) -> None:
    """Where bytes cost memory speed a delta is no faster (docs/delta.md): delta=True pushes
    dense, says why, and keeps no copy of the weights."""
    [policy] = take(Policy, [{"workers": fleet[:2], "delta": True}])
    try:
        for step in range(3):
            ray.get(policy.step.remote(step), timeout=TIMEOUT)
            result = ray.get(policy.push.remote(), timeout=TIMEOUT)
            assert not result.delta and result.wire_bytes >= result.nbytes, result
            assert "trainer's host" in result.delta_reason, result
        assert ray.get(policy.baseline_bytes.remote(), timeout=TIMEOUT) == 0
        check(policy, fleet[:2])
    finally:
        ray.get(policy.close.remote(), timeout=TIMEOUT)


def test_newcomers_a_new_trainer_and_a_returning_worker_get_dense_bytes(
    fleet: list, take: Lease
) -> None:
    [policy] = take(Policy, [{"workers": fleet[:2], "staging": "atomic", "checksum": True}])
    try:
        ray.get(policy.push.remote(), timeout=TIMEOUT)
        ray.get(policy.step.remote(0), timeout=TIMEOUT)
        assert ray.get(policy.push.remote(), timeout=TIMEOUT).delta
        ray.get(policy.add_workers.remote(fleet[2:]), timeout=TIMEOUT)  # holds random weights
        ray.get(policy.step.remote(1), timeout=TIMEOUT)
        assert not ray.get(policy.push.remote(), timeout=TIMEOUT).delta
        check(policy, fleet)
        ray.get(policy.step.remote(2), timeout=TIMEOUT)
        assert ray.get(policy.push.remote(), timeout=TIMEOUT).delta  # everybody on the base again
        # A new trainer for two of them; the third keeps the old trainer's weights and base.
        ray.get(policy.restart.remote(fleet[:2]), timeout=TIMEOUT)
        ray.get(policy.step.remote(3), timeout=TIMEOUT)
        assert not ray.get(policy.push.remote(), timeout=TIMEOUT).delta
        ray.get(policy.step.remote(4), timeout=TIMEOUT)
        assert ray.get(policy.push.remote(), timeout=TIMEOUT).delta
        ray.get(policy.add_workers.remote(fleet[2:]), timeout=TIMEOUT)  # returns, one base behind
        ray.get(policy.step.remote(5), timeout=TIMEOUT)
        assert not ray.get(policy.push.remote(), timeout=TIMEOUT).delta
        check(policy, fleet)
    finally:
        ray.get(policy.close.remote(), timeout=TIMEOUT)


@pytest.mark.parametrize("staging", ["stream", "atomic"])
def test_a_damaged_delta_push_is_caught_and_the_next_push_repairs_it(
    fleet: list, take: Lease, staging: str
) -> None:
    [policy] = take(Policy, [{"workers": fleet, "checksum": True, "staging": staging}])
    try:
        first = ray.get(policy.push.remote(), timeout=TIMEOUT).version
        held = ray.get([w.weight_sync_digests.remote() for w in fleet], timeout=TIMEOUT)
        ray.get(policy.step.remote(0), timeout=TIMEOUT)
        ray.get(fleet[1].damage_next_push.remote(), timeout=TIMEOUT)
        with pytest.raises(WeightSyncError, match="checksum differs"):
            ray.get(policy.push.remote(), timeout=TIMEOUT)  # a delta, in sections
        versions = ray.get([w.weights_version.remote() for w in fleet], timeout=TIMEOUT)
        if staging == "stream":  # streamed in, never committed: nobody claims a version
            assert versions == [None] * 3
        else:  # staged section by section, never applied: the old version and weights
            assert versions == [first] * 3
            assert ray.get([w.weight_sync_digests.remote() for w in fleet], timeout=TIMEOUT) == held
        repaired = ray.get(policy.push.remote(), timeout=TIMEOUT)
        assert not repaired.delta
        check(policy, fleet)
        ray.get(policy.step.remote(1), timeout=TIMEOUT)
        assert ray.get(policy.push.remote(), timeout=TIMEOUT).delta
        check(policy, fleet)
    finally:
        ray.get(policy.close.remote(), timeout=TIMEOUT)
