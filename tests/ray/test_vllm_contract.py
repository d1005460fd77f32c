"""CONTRACT TEST for the vLLM adapter -- vLLM itself is not installed here.

``tests/ray/vllm_host.py`` calls the adapter the way vLLM does (extension loading,
``collective_rpc``, ``model.load_weights``, ``reset_prefix_cache``); this checks that a push
reaches the engine's model through that path, with generation paused around it. Passing says
the adapter keeps to that contract, not that it has run inside a real vLLM.
"""

from __future__ import annotations

import pytest
import ray
import torch

from tests.ray.actors import LMTrainer
from tests.ray.vllm_host import HostedEngine

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("ray_cluster")]
TIMEOUT = 120


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_push_reaches_the_engine_model_through_load_weights(tensor_parallel: int) -> None:
    engines = [HostedEngine.remote(workers=tensor_parallel) for _ in range(2)]
    trainer = LMTrainer.remote(engines, bucket_bytes=2048, checksum=True)
    try:
        assert ray.get(engines[0].weights_version.remote(), timeout=TIMEOUT) is None
        # The trainer sends its own names (q/k/v apart); the engine stacks them itself.
        result = ray.get(trainer.push.remote(fuse=False), timeout=TIMEOUT)
        want = ray.get(trainer.fused_state.remote(), timeout=TIMEOUT)
        for engine in engines:  # every worker of every engine, tensor-parallel ones too
            for got in ray.get(engine.engine_states.remote(), timeout=TIMEOUT):
                assert got.keys() == want.keys()
                assert all(torch.equal(got[n], want[n]) for n in want)
        outputs, version = ray.get(engines[0].generate.remote(torch.arange(8)[None]), timeout=TIMEOUT)
        assert version == result.version and outputs.shape == (1, 8)
        events = ray.get(engines[0].events.remote(), timeout=TIMEOUT)
        push = events[events.index("weight_sync_prepare"):]
        assert push == ["weight_sync_prepare", "pause_generation", "weight_sync_receive",
                        "weight_sync_commit", "reset_prefix_cache", "resume_generation"]
    finally:
        for actor in [trainer, *engines]:
            ray.kill(actor)



def test_a_tensor_parallel_worker_left_behind_is_not_hidden() -> None:
    engine = HostedEngine.remote(workers=2)
    trainer = LMTrainer.remote([engine])
    try:
        first = ray.get(trainer.push.remote(fuse=False), timeout=TIMEOUT)
        assert ray.get(engine.weights_version.remote(), timeout=TIMEOUT) == first.version
        ray.get(engine.forget_on_worker.remote(1), timeout=TIMEOUT)
        assert ray.get(engine.weights_version.remote(), timeout=TIMEOUT) is None
    finally:
        for actor in [trainer, engine]:
            ray.kill(actor)
