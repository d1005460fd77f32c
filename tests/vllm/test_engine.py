"""Pushes into real vLLM engines (the CPU build), checked against what the trainer's own
``transformers`` model computes with the weights it pushed.

Tolerance for log-probabilities, float32: 1e-4 (absolute). vLLM's CPU kernels (oneDNN GEMMs,
its own attention) round differently from PyTorch's; measured here the two agree to ~5e-7, and
a weight that did not land, or a stale cache entry, moves log-probabilities by 1e-2 or more.
Greedy tokens must agree except where the reference's two best tokens are within the tolerance
of each other (a tie that rounding may break either way).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

import pytest
import ray

from tests.vllm.models import LLAMA, LONG, QWEN2, Trainer
from weight_sync import PlanMismatchError, SyncTimeoutError, TransportError, WeightSyncError
from weight_sync.wire.metadata import LaneCheck, LanePush

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("ray_cluster")]
TIMEOUT = 120
TOLERANCE = 1e-4
PROMPTS = [list(range(1, 9)), list(range(100, 130)), [7, 300, 21, 9, 480, 3, 3, 3, 64, 200]]


def greedy(tokens: int) -> dict[str, Any]:
    """SamplingParams' fields (the engine builds them: no vLLM import needed here)."""
    return {"temperature": 0.0, "max_tokens": tokens, "logprobs": 0, "ignore_eos": True,
            "detokenize": False}  # fmt: skip


def generate(
    engine: Any, prompts: list[list[int]], tokens: int = 8
) -> tuple[list, list, int | None]:
    """(generated token ids, their log-probabilities, the version vLLM labelled them with)."""
    outputs, version = ray.get(
        engine.generate.remote([{"prompt_token_ids": p} for p in prompts], greedy(tokens)),
        timeout=TIMEOUT,
    )
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, i, strict=True)]
                for o, i in zip(outputs, ids, strict=True)]  # fmt: skip
    return ids, logprobs, version


def assert_matches(engine: Any, trainer: Any, prompts: list[list[int]] = PROMPTS, tokens: int = 8,
                   tolerance: float = TOLERANCE, **reference: Any) -> int | None:  # fmt: skip
    """The engine generates what the trainer's model, with the weights it pushed, would
    (``reference``: options of the trainer's ``reference``)."""
    ids, logprobs, version = generate(engine, prompts, tokens)
    reference = ray.get(trainer.reference.remote(prompts, ids, **reference), timeout=TIMEOUT)
    for got_ids, got, want in zip(ids, logprobs, reference, strict=True):
        for step, (token, logprob) in enumerate(zip(got_ids, got, strict=True)):
            assert abs(logprob - want["logprobs"][step]) <= tolerance, (step, logprob, want)
            assert token == want["greedy"][step] or want["gap"][step] <= tolerance, (step, want)
    return version


def largest_difference(engine: Any, trainer: Any) -> float:
    """How far the engine's log-probabilities are from the trainer's current weights'."""
    ids, logprobs, _ = generate(engine, PROMPTS)
    reference = ray.get(trainer.reference.remote(PROMPTS, ids, current=True), timeout=TIMEOUT)
    return max(abs(a - b) for got, want in zip(logprobs, reference, strict=True)
               for a, b in zip(got, want["logprobs"], strict=True))  # fmt: skip


def close(trainer: Any) -> None:
    ray.get(trainer.close.remote(), timeout=TIMEOUT)


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_every_push_lands_after_an_optimizer_step(
    name: str, engines: dict[str, Any], trainer_of: Any
) -> None:
    """Offline LLM (Qwen2, tied embeddings, q/k/v biases) and AsyncLLM (Llama, untied head):
    the trainer pushes its own names, vLLM stacks q/k/v and gate/up itself."""
    engine = engines[name]
    trainer = trainer_of(QWEN2 if name == "qwen2" else LLAMA, [engine])
    try:
        for _ in range(3):
            ray.get(trainer.step.remote(), timeout=TIMEOUT)
            assert largest_difference(engine, trainer) > 100 * TOLERANCE  # a push must show
            result = ray.get(trainer.push.remote(), timeout=TIMEOUT)
            assert assert_matches(engine, trainer) == result.version  # vLLM's own label
            assert ray.get(engine.weights_version.remote(), timeout=TIMEOUT) == result.version
    finally:
        close(trainer)


@pytest.mark.parametrize("staging", ["stream", "atomic"])
def test_buckets_far_smaller_than_a_layer(staging: str, qwen2: Any, trainer_of: Any) -> None:
    """4 KiB buckets, everything packed: every layer's tensors span many buckets, and vLLM must
    get one reload for the whole push (a reload per bucket would rebuild layers half-loaded)."""
    trainer = trainer_of(QWEN2, [qwen2], bucket_bytes=4096, direct_min_bytes=None,
                         staging=staging, checksum=True)  # fmt: skip
    try:
        for _ in range(2):
            ray.get(trainer.step.remote(), timeout=TIMEOUT)
            result = ray.get(trainer.push.remote(), timeout=TIMEOUT)
            assert result.buckets > 50
            assert assert_matches(qwen2, trainer) == result.version
    finally:
        close(trainer)


def test_a_prompt_longer_than_a_kv_block_sees_the_new_weights(qwen2: Any, trainer_of: Any) -> None:
    """The first 128 tokens of a long prompt fill a KV block that vLLM caches by prefix; if the
    push did not clear the cache, the next request would reuse keys and values computed with
    the old weights."""
    long_prompts = [[(7 * i + 3) % 500 for i in range(200)], [(11 * i) % 500 for i in range(180)]]
    trainer = trainer_of(QWEN2, [qwen2])
    try:
        ray.get(trainer.push.remote(), timeout=TIMEOUT)
        assert_matches(qwen2, trainer, long_prompts)  # now their prefixes are cached
        ray.get(trainer.step.remote(), timeout=TIMEOUT)
        result = ray.get(trainer.push.remote(), timeout=TIMEOUT)
        assert assert_matches(qwen2, trainer, long_prompts) == result.version
    finally:
        close(trainer)


def test_a_partial_push_must_cover_what_vllm_stacks(qwen2: Any, trainer_of: Any) -> None:
    trainer = trainer_of(QWEN2, [qwen2])
    try:
        first = ray.get(trainer.push.remote(), timeout=TIMEOUT)
        ray.get(trainer.step.remote(), timeout=TIMEOUT)
        # q_proj alone is a strict part of vLLM's qkv_proj: refused before any byte moves.
        with pytest.raises(PlanMismatchError, match="qkv_proj"):
            ray.get(trainer.push.remote("layers.0.self_attn.q_proj", partial=True), timeout=TIMEOUT)
        with pytest.raises(PlanMismatchError, match="gate_up_proj"):
            ray.get(trainer.push.remote("layers.1.mlp.up_proj", partial=True), timeout=TIMEOUT)
        assert assert_matches(qwen2, trainer) == first.version  # nothing changed
        # Whole stacked modules: accepted, and only they change.
        result = ray.get(trainer.push.remote("layers.0.self_attn.", partial=True), timeout=TIMEOUT)
        assert result.partial and assert_matches(qwen2, trainer) == result.version
        status = ray.get(qwen2.sync_status.remote(), timeout=TIMEOUT)
        assert (status.version, status.full_version) == (result.version, first.version)
    finally:
        close(trainer)


def test_a_push_the_engine_cannot_load_changes_nothing(qwen2: Any, trainer_of: Any) -> None:
    trainer = trainer_of(QWEN2, [qwen2])
    try:
        first = ray.get(trainer.push.remote(), timeout=TIMEOUT)
        ray.get(trainer.step.remote(), timeout=TIMEOUT)
        name = "model.layers.1.mlp.down_proj.weight"
        with pytest.raises(PlanMismatchError, match=name.replace(".", r"\.")):
            ray.get(trainer.push.remote(reshape=name), timeout=TIMEOUT)
        with pytest.raises(PlanMismatchError, match="missing tensor"):
            ray.get(trainer.push.remote("layers.1."), timeout=TIMEOUT)  # not announced as partial
        assert ray.get(qwen2.weights_version.remote(), timeout=TIMEOUT) == first.version
        assert assert_matches(qwen2, trainer) == first.version  # still the old weights
        after = ray.get(trainer.push.remote(), timeout=TIMEOUT)  # the group survived the refusals
        assert assert_matches(qwen2, trainer) == after.version
    finally:
        close(trainer)


def test_the_trainer_killed_mid_push_leaves_no_version_until_a_push_repairs_it(
    qwen2: Any, trainer_of: Any
) -> None:
    trainer = Trainer.remote(QWEN2, [qwen2], bucket_bytes=4096, direct_min_bytes=None,
                             collective_timeout_s=20, push_timeout_s=60)  # fmt: skip
    try:
        first = ray.get(trainer.push.remote(), timeout=TIMEOUT)
        ray.get(trainer.slow_link.remote(0.05), timeout=TIMEOUT)  # ~100 buckets: ~5 s
        ray.get(trainer.step.remote(), timeout=TIMEOUT)
        pid = ray.get(trainer.pid.remote(), timeout=TIMEOUT)
        pushing = trainer.push.remote()
        deadline = time.monotonic() + 30
        while ray.get(qwen2.weights_version.remote(), timeout=TIMEOUT) == first.version:
            assert time.monotonic() < deadline, "the push never started"
            time.sleep(0.05)
        time.sleep(0.5)  # well inside the broadcast
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(pushing, timeout=TIMEOUT)
        deadline = time.monotonic() + 60
        while ray.get(qwen2.sync_status.remote(), timeout=TIMEOUT).in_group:
            assert time.monotonic() < deadline, "the engine never left the dead trainer's group"
            time.sleep(0.2)
        assert ray.get(qwen2.weights_version.remote(), timeout=TIMEOUT) is None
        _, _, version = generate(qwen2, PROMPTS)  # still serving; its outputs claim no version
        assert version is None
    finally:
        ray.kill(trainer)
    repair = trainer_of(QWEN2, [qwen2])
    try:
        result = ray.get(repair.push.remote(), timeout=TIMEOUT)
        assert result.version > first.version
        assert assert_matches(qwen2, repair) == result.version
    finally:
        close(repair)


def test_bfloat16_and_tensor_parallel(qwen2_tp2_bf16: Any, trainer_of: Any) -> None:
    """fp32 master weights cast to bf16 on the trainer into a bf16 engine whose two workers each
    hold half of every sharded tensor. Reference: the trainer's model in bf16. The tolerance is
    bf16's: two bf16 implementations round differently, by up to ~1e-2 in log-probability."""
    trainer = trainer_of(QWEN2, [qwen2_tp2_bf16], cast_dtype="bfloat16")
    try:
        for _ in range(2):
            ray.get(trainer.step.remote(), timeout=TIMEOUT)
            result = ray.get(trainer.push.remote(), timeout=TIMEOUT)
            assert (
                assert_matches(qwen2_tp2_bf16, trainer, tokens=4, tolerance=5e-2) == result.version
            )
        status = ray.get(qwen2_tp2_bf16.sync_status.remote(), timeout=TIMEOUT)
        assert status.version == result.version and not status.dirty
    finally:
        close(trainer)


def test_a_request_in_flight_finishes_with_the_new_weights(llama: Any, trainer_of: Any) -> None:
    """AsyncLLM, pause_mode='keep': a push lands while a long request is generating; the request
    is frozen, its KV entries dropped with the caches, and it resumes -- recomputed -- with the
    new weights. vLLM's labels say which tokens came from which version."""
    trainer = trainer_of(LLAMA, [llama])
    try:
        first = ray.get(trainer.push.remote(), timeout=TIMEOUT)
        ray.get(trainer.step.remote(), timeout=TIMEOUT)
        request = llama.generate.remote([{"prompt_token_ids": PROMPTS[0]}], greedy(LONG))
        time.sleep(1.0)
        second = ray.get(trainer.push.remote(), timeout=TIMEOUT)
        outputs, version = ray.get(request, timeout=TIMEOUT)
        spans = outputs[0].outputs[0].weight_versions
        assert len(outputs[0].outputs[0].token_ids) == LONG
        assert [s.version for s in spans] == [str(first.version), str(second.version)], spans
        assert 0 < spans[1].start < LONG and version is None  # two versions: no single one
    finally:
        close(trainer)


def test_errors_from_a_worker_keep_their_type(qwen2: Any) -> None:
    """A push whose sender's store the engine's workers cannot reach fails on vLLM's worker;
    the engine raises it as weight_sync's own error, not as vLLM's RuntimeError."""
    with socket.socket() as bound:  # bound, never listening: nobody answers there
        bound.bind(("127.0.0.1", 0))
        check = LaneCheck(push=1, version=10**9, digest="0" * 64, max_metadata_bytes=1 << 20)
        call = LanePush(endpoints=(bound.getsockname(),), slot=1, check=check, wait_s=3.0,
                        firsts=(None,)).model_dump_json()  # fmt: skip
        with pytest.raises(WeightSyncError, match="cannot reach the rendezvous store") as raised:
            ray.get(qwen2._weight_sync_lanes_push.remote(call, timeout_s=30), timeout=TIMEOUT)
    assert isinstance(raised.value, (TransportError, SyncTimeoutError)), raised.value


