"""weight_sync as the backend of vLLM's own weight-transfer API, end to end: a plain vllm.LLM
built with ``weight_transfer_config={"backend": "weight_sync"}``, driven by vLLM's
``RayVLLMWeightSyncClient`` and ``WeightTransferTrainerFactory.trainer_init(...).send_weights()``
-- no WeightUpdater, no VLLMEngine. The same check as test_engine.py: the engine's greedy
tokens and log-probabilities equal the trainer's ``transformers`` model's."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from tests.vllm.models import QWEN2
from tests.vllm.test_engine import PROMPTS, TOLERANCE, close, greedy
from weight_sync import PlanMismatchError

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("ray_cluster")]
TIMEOUT = 120


def check(native: Any, trainer: Any) -> str:
    """As test_engine.assert_matches, through LLM.generate; returns vLLM's version label."""
    from vllm import SamplingParams

    outputs = ray.get(native.generate.remote([{"prompt_token_ids": p} for p in PROMPTS],
                                             SamplingParams(**greedy(8)), use_tqdm=False),
                      timeout=TIMEOUT)  # fmt: skip
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    reference = ray.get(trainer.reference.remote(PROMPTS, ids), timeout=TIMEOUT)
    for output, want in zip(outputs, reference, strict=True):
        completion = output.outputs[0]
        for step, token in enumerate(completion.token_ids):
            assert (
                abs(completion.logprobs[step][token].logprob - want["logprobs"][step]) <= TOLERANCE
            )
            assert token == want["greedy"][step] or want["gap"][step] <= TOLERANCE
    labels = {span.version for o in outputs for span in o.outputs[0].weight_versions}
    assert len(labels) == 1
    return labels.pop()


def test_vllm_weight_transfer_api_pushes_through_weight_sync(native: Any, trainer_of: Any) -> None:
    trainer = trainer_of(QWEN2, [native], vllm_workers=1)
    try:
        # vLLM's ModuleSource leaves the tied LM head out, and vLLM on CPU keeps a packed copy
        # of it that reloading the embedding would not refresh: refused before any byte moves.
        with pytest.raises(PlanMismatchError, match="'lm_head.weight' gets nothing"):
            ray.get(trainer.push_parameters.remote(), timeout=TIMEOUT)
        versions = []
        for _ in range(3):
            ray.get(trainer.step.remote(), timeout=TIMEOUT)
            result = ray.get(trainer.push.remote(), timeout=TIMEOUT)
            # vLLM's API leaves the prefix cache to the caller, as with its own engines.
            assert ray.get(native.reset_prefix_cache.remote(), timeout=TIMEOUT)
            assert check(native, trainer) == str(result.version)  # finish_weight_update's label
            versions.append(result.version)
        assert versions == sorted(set(versions))
    finally:
        close(trainer)
