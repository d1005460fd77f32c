"""The vLLM engine-side member's own logic, against fake engines (pure: no vLLM, no Ray calls):
bounded calls, errors raised as weight_sync's types, check / pause / clear / label / resume
around a push. The real engine is exercised in tests/vllm."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from weight_sync import SyncTimeoutError, TransportError, WeightSyncError
from weight_sync.adapters.vllm.engine import NO_VERSION, VLLMEngine
from weight_sync.adapters.vllm.reload import DryRun, problems
from weight_sync.wire.metadata import LaneCheck, LanePush, SyncStatus, WorkerReply


def reply(value: str | None = None, version: int | None = None, dirty: bool = False,
          error: Exception | None = None) -> str:  # fmt: skip
    status = SyncStatus(version=version, dirty=dirty, phase="idle")
    return WorkerReply(
        value=value, error=type(error).__name__ if error else None,
        message=str(error) if error else "", status=status,
    ).model_dump_json()  # fmt: skip


class FakeLLM:
    """What VLLMEngine uses of an offline vllm.LLM; answers collective_rpc from a script."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers
        self.answers: dict[str, Any] = {}
        self.events: list[str] = []
        self.clears = True
        self.delay_s = 0.0
        self.during: dict[str, Any] = {}  # method -> what to note while it runs

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list[str]:  # fmt: skip
        self.events.append(method)
        time.sleep(self.delay_s)
        if method in self.during:
            self.events.append(self.during[method]())
        answer = self.answers.get(method, reply())
        return answer if isinstance(answer, list) else [answer] * self.workers

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.events.append("reset_prefix_cache")
        return self.clears

    def update_weight_version(self, version: str) -> None:
        self.events.append(f"label {version}")


class FakeAsyncLLM(FakeLLM):
    """An AsyncLLM's coroutines, paused and resumed."""

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),  # type: ignore[override]
                             kwargs: dict | None = None) -> list[str]:  # fmt: skip
        self.events.append(method)
        await asyncio.sleep(self.delay_s)
        if method in self.during:
            self.events.append(self.during[method]())
        answer = self.answers.get(method, reply())
        return answer if isinstance(answer, list) else [answer] * self.workers

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.events.append(f"pause {mode} clear={clear_cache}")

    async def resume_generation(self) -> None:
        self.events.append("resume")

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:  # type: ignore[override]
        self.events.append("reset_prefix_cache")
        return self.clears

    async def update_weight_version(self, version: str) -> None:  # type: ignore[override]
        self.events.append(f"label {version}")


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


CALL = LanePush(
    endpoints=(("127.0.0.1", 1),), slot=1, wait_s=5.0, firsts=(None,),
    check=LaneCheck(push=1, version=3, digest="0" * 64, max_metadata_bytes=1 << 20),
).model_dump_json()  # fmt: skip


async def push(engine: VLLMEngine, fake: FakeLLM, version: int = 3) -> int | None:
    fake.answers["weight_sync_lanes_check"] = reply("[]", version=version - 1)
    fake.answers["weight_sync_lanes_push"] = reply(str(version), version=version)
    fake.during["weight_sync_lanes_push"] = lambda: f"claims {engine.weights_version()}"
    return await engine._weight_sync_lanes_push(CALL, timeout_s=5)


def test_a_push_checks_then_pauses_loads_clears_labels_and_resumes_in_that_order() -> None:
    fake = FakeAsyncLLM()
    engine = VLLMEngine(fake, pause_mode="wait")
    assert run(push(engine, fake)) == 3
    assert engine.weights_version() == 3
    assert fake.events == [
        "weight_sync_lanes_check", "label 2", "pause wait clear=True", "weight_sync_lanes_push",
        "claims None", "label 3", "reset_prefix_cache", "resume",
    ]  # fmt: skip


def test_the_offline_engine_needs_no_pause_but_gets_its_cache_cleared() -> None:
    fake = FakeLLM()
    engine = VLLMEngine(fake)
    assert run(push(engine, fake)) == 3
    assert [e for e in fake.events if not e.startswith("weight_sync")] == [
        "label 2",
        "claims None",
        "label 3",
        "reset_prefix_cache",
    ]


def test_a_push_one_worker_refused_never_pauses_and_keeps_the_version() -> None:
    """Every worker is still called to push (each refuses every lane as it opens, so the
    senders learn why); the engine neither paused nor cleared anything."""
    fake = FakeAsyncLLM(workers=2)
    engine = VLLMEngine(fake)
    run(push(engine, fake, version=2))  # the engine holds version 2
    fake.events.clear()
    fake.answers["weight_sync_lanes_check"] = [reply("[]", version=2),
                                               reply('["bad shape"]', version=2)]  # fmt: skip
    refusal = WeightSyncError("vLLM worker 1: bad shape")
    fake.answers["weight_sync_lanes_push"] = reply(error=refusal, version=2)
    with pytest.raises(WeightSyncError, match="bad shape"):
        run(engine._weight_sync_lanes_push(CALL, timeout_s=5))
    assert fake.events == ["weight_sync_lanes_check", "weight_sync_lanes_push", "claims 2"]
    assert engine.weights_version() == 2


def test_a_cache_that_cannot_be_cleared_fails_the_push_and_claims_no_version() -> None:
    fake = FakeAsyncLLM()
    fake.clears = False
    engine = VLLMEngine(fake)
    with pytest.raises(WeightSyncError, match="prefix cache"):
        run(push(engine, fake))
    assert engine.weights_version() is None
    assert fake.events[-2:] == [f"label {NO_VERSION}", "resume"]  # resumed all the same


@pytest.mark.parametrize("fake", [FakeLLM(), FakeAsyncLLM()], ids=["LLM", "AsyncLLM"])
def test_every_call_is_bounded_by_the_time_the_push_gives_it(fake: FakeLLM) -> None:
    fake.delay_s = 3.0  # a worker that does not answer in time
    engine = VLLMEngine(fake)
    start = time.monotonic()
    with pytest.raises(SyncTimeoutError, match="weight_sync_lanes_check within"):
        run(engine._weight_sync_lanes_push(CALL, timeout_s=1.5))
    assert time.monotonic() - start < 1.5  # inside the caller's bound, so it hears of it


@pytest.mark.parametrize(("error", "kind"), [
    (TransportError("peer closed"), TransportError),  # a lost collective: collateral
    (SyncTimeoutError("broadcast timed out"), SyncTimeoutError),
    (WeightSyncError("the lanes of push 1 were called off"), WeightSyncError),
    (AssertionError("shape"), WeightSyncError),  # anything else: ours, naming it
])  # fmt: skip
def test_a_worker_error_is_raised_as_weight_syncs_own_type(error: Exception, kind: type) -> None:
    fake = FakeLLM(workers=2)
    fake.answers["weight_sync_lanes_check"] = reply("[]")
    fake.answers["weight_sync_lanes_push"] = [reply("3"), reply(error=error)]
    engine = VLLMEngine(fake)
    with pytest.raises(kind, match=str(error)) as raised:
        run(engine._weight_sync_lanes_push(CALL, timeout_s=5))
    assert type(raised.value) is kind


def test_workers_that_disagree_give_the_engine_no_version() -> None:
    fake = FakeLLM(workers=2)
    fake.answers["weight_sync_info"] = [reply('{"has_default_group": true, "cuda": false, '
                                              '"version": 3, "hostname": "h", "pid": 1}', version=3),
                                        reply('{"has_default_group": true, "cuda": false, '
                                              '"version": 2, "hostname": "h", "pid": 2}', version=2)]  # fmt: skip
    engine = VLLMEngine(fake)
    info = run(engine._weight_sync_info(timeout_s=5))
    assert info.version is None and info.ranks == 2 and engine.weights_version() is None


def dry_run(error: str | None = None, filled: dict | None = None, parameters: set | None = None,
            loaded: set | None = None) -> DryRun:  # fmt: skip
    run = DryRun()
    run.error = error
    for module, (done, size, sources) in (filled or {}).items():
        run.filled[module] = [done, size]
        run.sources[module] = sources
    run.parameters, run.loaded = parameters or set(), loaded or set()
    return run


@pytest.mark.parametrize(("run", "partial", "expected"), [
    (dry_run(), False, []),
    (dry_run(error="'x': refused"), False, ["'x': refused"]),  # the loader's own refusal wins
    # a module vLLM stacks, filled in part: garbage in the rest once rebuilt
    (dry_run(filled={"l.qkv_proj": (4, 12, ["l.q_proj.weight"])}), True, ["'l.qkv_proj' would be filled only in part (4 of 12 elements, from 'l.q_proj.weight')"]),
    (dry_run(filled={"l.qkv_proj": (12, 12, ["q", "k", "v"]), "l.attn": (0, 4, [])}), True, []),
    # a full push must reach every parameter; a partial one need not
    (dry_run(parameters={"a", "lm_head.weight"}, loaded={"a"}), False, ["'lm_head.weight' gets nothing"]),
    (dry_run(parameters={"a", "lm_head.weight"}, loaded={"a"}), True, []),
])  # fmt: skip
def test_what_a_dry_run_refuses(run: DryRun, partial: bool, expected: list[str]) -> None:
    found = problems(run, partial)
    assert len(found) == len(expected)
    for problem, fragment in zip(found, expected, strict=True):
        assert fragment in problem
