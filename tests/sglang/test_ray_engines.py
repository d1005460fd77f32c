"""Real ``sglang.Engine``s in Ray actors (``SGLangEngine``, run with SGLang's interpreter as
their ``py_executable``) taking pushes from an ``SGLangUpdater`` in this process.

Two engines of a tied Qwen2 start once for the module (about 25 s each on 2 cores); the last
test kills one, so it runs last.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.sglang.helpers import ENV, PROMPTS, Trainer, assert_matches, engine_kwargs, of_output
from tests.vllm.models import QWEN2
from weight_sync import PlanMismatchError, SyncConfig
from weight_sync.adapters.sglang import ServerError
from weight_sync.wire.versions import unlabelled

ray = pytest.importorskip("ray")

from weight_sync.adapters.sglang.engine import ActorEngine, SGLangUpdater, start_engine

pytestmark = pytest.mark.timeout(900)
TOLERANCE = 1e-4
START_S = 600


@pytest.fixture(scope="module")
def engines(ray_cluster: None, sglang: str, models: dict[str, str]) -> Iterator[list[Any]]:
    actors = [start_engine(python=sglang, env=ENV, **engine_kwargs(models["qwen2"]))
              for _ in range(2)]  # fmt: skip
    try:
        assert ray.get([a.weights_version.remote() for a in actors], timeout=START_S) == [None] * 2
        yield actors
    finally:
        for actor in actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=60)
            except Exception:  # killed by a test, or already gone
                pass
            ray.kill(actor)


def generate(actor: Any, prompt: list[int]) -> dict[str, Any]:
    outputs = ray.get(actor.generate.remote(
        [prompt], {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}, return_logprob=True,
    ), timeout=120)  # fmt: skip
    return of_output(outputs[0])


def assert_serves(actor: Any, trainer: Trainer, version: int) -> None:
    assert ray.get(actor.weights_version.remote(), timeout=60) == version
    for prompt in PROMPTS:
        output = generate(actor, prompt)
        assert output["version"] == str(version), output
        assert_matches(output, prompt, trainer, TOLERANCE)


def test_pushes_after_optimizer_steps_reach_every_engine(engines: list[Any]) -> None:
    trainer = Trainer(QWEN2)
    with SGLangUpdater(engines, SyncConfig(bucket_bytes=4096)) as updater:
        for _ in range(3):
            trainer.step()
            result = updater.push(trainer.model.state_dict())
            trainer.landed()
            assert updater.version == result.version
            for actor in engines:
                assert_serves(actor, trainer, result.version)


def test_a_push_the_engines_cannot_load_is_refused_and_changes_nothing(engines: list[Any]) -> None:
    trainer = Trainer(QWEN2)
    with SGLangUpdater(engines, SyncConfig(bucket_bytes=4096)) as updater:
        version = updater.push(trainer.model.state_dict()).version
        trainer.landed()
        state = dict(trainer.model.state_dict())
        state["model.norm.weight"] = state["model.norm.weight"][:-1]
        with pytest.raises(PlanMismatchError, match="model.norm.weight"):
            updater.push(state)
        assert updater.versions() == [version, version]
        for actor in engines:
            assert_serves(actor, trainer, version)


class Striking(ActorEngine):
    def __init__(self, actor: Any, at: int) -> None:
        super().__init__(actor)
        self.at, self.buckets = at, 0

    def call(self, route: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        if route == "update_weights_from_distributed":
            self.buckets += 1
            if self.buckets == self.at:
                ray.kill(self.actor)  # the actor, and with it its engine's processes
        return super().call(route, body, timeout_s)


def test_an_engine_killed_mid_push_is_named_in_bound(engines: list[Any]) -> None:
    """An engine's actor dies on the third bucket: the push raises ``ServerError`` naming it
    within its bound; the other engine says ``"none (past N)"`` (it may hold half-new weights
    of version N) and generates again."""
    from weight_sync.adapters.sglang.pusher import SGLangPusher

    trainer = Trainer(QWEN2)
    config = SyncConfig(bucket_bytes=4096, push_timeout_s=60)
    with SGLangUpdater(engines, config) as updater:
        served = updater.push(trainer.model.state_dict()).version
    trainer.step()
    survivor, victim = ActorEngine(engines[0]), Striking(engines[1], 3)
    with SGLangPusher([survivor, victim], config) as pusher:
        started = time.monotonic()
        with pytest.raises(ServerError) as caught:
            pusher.push(trainer.model.state_dict())
        assert time.monotonic() - started < config.push_timeout_s
    assert victim.name in caught.value.servers and survivor.name not in caught.value.servers
    output = generate(engines[0], PROMPTS[0])
    assert output["version"] == unlabelled(served + 1)
    assert ray.get(engines[0].weights_version.remote(), timeout=60) is None
