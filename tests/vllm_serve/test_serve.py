"""Pushes into real ``vllm serve`` processes over HTTP from a plain Python trainer (this test
process; no Ray), checked against the trainer's own ``transformers`` model as in tests/vllm.

The tests run in file order: the last one kills a server and starts it again at its URL.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
import torch

from tests.vllm.models import MAX_MODEL_LEN, QWEN2
from tests.vllm_serve.helpers import (
    LONG_PROMPTS,
    PROMPTS,
    TENSOR_PARALLEL,
    TOLERANCE,
    Servers,
    Trainer,
    assert_matches,
    complete,
    get,
    kill_trainer_mid_push,
    largest_difference,
    metrics,
    paused,
    post,
    wait_released,
)
from weight_sync import PlanMismatchError, SyncConfig
from weight_sync.adapters.vllm import VLLMServers
from weight_sync.adapters.vllm.servers import ServerError

pytestmark = pytest.mark.timeout(900)
FAILING = SyncConfig(push_timeout_s=60)  # a failure must be reported within this


# Every version each server (by URL, across restarts) was seen serving in this module: a version
# must never name two sets of weights, whichever trainer pushed it and whatever happened between.
SERVED: dict[str, set[int]] = {}


def served(url: str, version: int) -> None:
    """Record that ``url`` serves ``version``, which must be past every version it served."""
    before = SERVED.setdefault(url, set())
    assert version > max(before, default=0), (url, version, sorted(before))
    before.add(version)


def push(servers: VLLMServers, trainer: Trainer, version: int | None = None) -> int:
    result = servers.push(trainer.state(), version=version)
    trainer.landed()
    assert servers.version == result.version
    assert servers.versions() == [result.version] * len(servers.urls)
    for url in servers.urls:
        served(url, result.version)
    return result.version


def test_every_push_lands_after_an_optimizer_step(servers: Servers, model_dir: str) -> None:
    """Three pushes with Adam steps between; prompts longer than a KV block see the new weights
    (the prefix cache is reset after each push: without it they fail from the second push)."""
    url = servers.urls[0]
    trainer = Trainer(QWEN2)
    with VLLMServers([url]) as pushing:
        push(pushing, trainer)
        assert_matches(url, model_dir, trainer, LONG_PROMPTS)  # their prefixes are cached now
        versions = []
        for _ in range(3):
            trainer.step()
            assert largest_difference(url, model_dir, trainer) > 100 * TOLERANCE  # must show
            versions.append(push(pushing, trainer))
            assert_matches(url, model_dir, trainer, PROMPTS + LONG_PROMPTS)
        assert versions == sorted(set(versions))
        assert not paused(url)


def test_two_servers_in_one_push(servers: Servers, model_dir: str) -> None:
    trainer = Trainer(QWEN2, seed=2)
    with VLLMServers(servers.urls) as pushing:
        for _ in range(2):
            trainer.step()
            push(pushing, trainer)
            for url in servers.urls:
                assert_matches(url, model_dir, trainer)
                assert not paused(url)


def test_a_request_in_flight_is_paused_and_finishes_with_the_new_weights(
    servers: Servers, model_dir: str
) -> None:
    """pause_mode='keep': a request generating while a push lands is frozen, recomputed with the
    new weights on resume, and finishes; vLLM's token-in-token-out endpoint says which tokens
    came from which version."""
    url = servers.urls[0]
    trainer = Trainer(QWEN2, seed=3)
    tokens = MAX_MODEL_LEN - len(PROMPTS[0])
    with VLLMServers([url], pause_mode="keep") as pushing:
        first = push(pushing, trainer)
        trainer.step()
        answer: dict[str, Any] = {}

        def generate() -> None:
            answer.update(post(url, "inference/v1/generate", {
                "model": model_dir, "token_ids": PROMPTS[0],
                "sampling_params": {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True},
            }))  # fmt: skip

        request = threading.Thread(target=generate)
        request.start()
        deadline = time.monotonic() + 60
        # Until the gauge shows it running -- or it is over: a request that ran between two
        # readings of the gauge (each an HTTP call to a busy server) is never seen running.
        while request.is_alive() and not _running(url):
            assert time.monotonic() < deadline, f"the request never started (paused: {paused(url)})"
            time.sleep(0.02)
        second = push(pushing, trainer)
        request.join(120)
        assert not paused(url)
        choice = answer["choices"][0]
        assert len(choice["token_ids"]) == tokens
        spans = [span["version"] for span in choice["weight_versions"]]
        print(f"weight_versions of the request in flight: {choice['weight_versions']}")
        # Two spans when the push landed mid-request (the usual case here); one if it finished
        # first on a fast machine.
        assert spans in ([str(first), str(second)], [str(first)]), choice["weight_versions"]
        assert_matches(url, model_dir, trainer)


def _running(url: str) -> bool:
    """Whether the server is generating a request now (its Prometheus gauge)."""
    text = metrics(url)
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)", text, re.MULTILINE)
    return bool(found and float(found.group(1)) >= 1)


def test_a_push_the_server_cannot_load_is_refused_and_changes_nothing(
    servers: Servers, model_dir: str
) -> None:
    url = servers.urls[0]
    trainer = Trainer(QWEN2, seed=4)
    with VLLMServers([url]) as pushing:
        first = push(pushing, trainer)
        trainer.step()
        name = "model.layers.1.mlp.down_proj.weight"
        state = dict(trainer.state())
        state[name] = state[name][:-1]
        with pytest.raises(PlanMismatchError, match=re.escape(name)):
            pushing.push(state)
        assert pushing.versions() == [first] and pushing.version == first
        assert not paused(url)
        with pytest.raises(TypeError):  # the caller's mistake: nothing sent, nothing changed
            pushing.push({name: "not a tensor"})  # type: ignore[dict-item]
        assert pushing.versions() == [first] and not paused(url)
        assert_matches(url, model_dir, trainer)  # still the weights of the first push
        push(pushing, trainer)  # the group survived the refusal
        assert_matches(url, model_dir, trainer)


def test_vllms_own_http_client_through_the_factory(servers: Servers, model_dir: str) -> None:
    """vLLM's API with its own HTTP client: the caller resets the prefix cache itself."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weight_sync.adapters.vllm.backend import StateDictSource, WeightSyncTrainerInitInfo

    url = servers.urls[0]
    trainer = Trainer(QWEN2, seed=5)
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(rank=0, world_size=1 + 1, config=SyncConfig(push_timeout_s=120)),
        client=HTTPVLLMWeightSyncClient(url, timeout=120), source=StateDictSource(trainer.model),
    )  # fmt: skip
    try:
        for _ in range(2):
            trainer.step()
            post(url, "pause?mode=keep", {})
            result = engine.send_weights()
            assert post(url, "reset_prefix_cache?reset_running_requests=true", {})["success"]
            post(url, "resume", {})
            trainer.landed()
            assert get(url, "weight_info")["weight_version"] == str(result.version)
            served(url, result.version)
            assert_matches(url, model_dir, trainer, PROMPTS + LONG_PROMPTS)
    finally:
        engine.shutdown()


def test_a_new_trainer_continues_past_what_the_server_served_and_a_named_version_too(
    servers: Servers, model_dir: str
) -> None:
    """A new trainer on a server that earlier trainers pushed to takes a version past theirs
    (checked by ``served``); a named version the server already served is refused before
    anything moves (the server keeps its weights and version, resumed); one past them labels
    the push -- a trainer restarted from a checkpoint at that step."""
    url = servers.urls[0]
    trainer = Trainer(QWEN2, seed=7)
    with VLLMServers([url]) as pushing:
        current = push(pushing, trainer)
        trainer.step()
        with pytest.raises(ValueError, match=f"version {current} is not past .* at least"):
            pushing.push(trainer.state(), version=current)
        assert pushing.versions() == [current] and not paused(url)
        step = current + 100
        assert push(pushing, trainer, version=step) == step
        assert_matches(url, model_dir, trainer)
    with VLLMServers([url]) as pushing:  # and the next trainer goes on past it
        trainer.step()
        assert push(pushing, trainer) == step + 1


def test_a_server_another_trainer_pushed_to_meanwhile_is_joined_again(
    servers: Servers, model_dir: str
) -> None:
    """Two trainers' ``VLLMServers`` on one server, taking turns: each push of the other
    trainer has the server's workers follow that trainer's lane. The first trainer's next push
    finds the server reporting another version than its last one and has its workers join its
    lane again before anything moves, then lands past both (as after a restart at the URL)."""
    url = servers.urls[0]
    first, second = Trainer(QWEN2, seed=12), Trainer(QWEN2, seed=13)
    with VLLMServers([url]) as mine, VLLMServers([url]) as theirs:
        push(mine, first)
        pushed = push(theirs, second)
        first.step()
        assert push(mine, first) > pushed
        assert_matches(url, model_dir, first)


@pytest.mark.parametrize("where", ["broadcast", "commit"])
def test_the_trainer_killed_mid_push_leaves_the_server_serving(
    where: str, servers: Servers, model_dir: str
) -> None:
    """The trainer dies while the server is paused for its push -- during the broadcast, or after
    every byte arrived but before the commit (vLLM's update session still open): the worker's
    watchdog sees the trainer's store go, labels the outputs "none", ends the session and
    resumes the server, which keeps serving and reports no version until a push repairs it."""
    url = servers.urls[0]
    killed = kill_trainer_mid_push(url, where)
    with VLLMServers([url]) as watching:
        released_s = wait_released(watching, killed)
        ids, _ = complete(url, model_dir, PROMPTS[0])  # still serving
        assert len(ids) == 8
        trainer = Trainer(QWEN2, seed=6)
        push(watching, trainer)  # the repair: past what the dead trainer sent (``served``)
        assert_matches(url, model_dir, trainer)
    print(f"killed at {where}: released {released_s:.1f}s after the trainer was killed")


def test_a_server_killed_mid_push_or_between_pushes_fails_fast_and_rejoins_when_restarted(
    servers: Servers, model_dir: str
) -> None:
    """The server of one worker is killed during a push, then pushed to while dead: each push
    raises a ServerError naming it within push_timeout_s, and the tensor-parallel one serves on
    (resumed, no version). Restarted at the same URL, it rejoins with full weights at the next
    push. (The one restarted is the server of one worker: three processes to start, not four.)"""
    dead = 1 - TENSOR_PARALLEL
    victim, survivor = servers.urls[dead], servers.urls[TENSOR_PARALLEL]
    trainer = Trainer(QWEN2, seed=8)
    # Tiny buckets over the group (the host ring would batch them): ~100 broadcasts, slowed.
    config = SyncConfig(
        push_timeout_s=60, bucket_bytes=4096, direct_min_bytes=None, same_host="group"
    )
    with VLLMServers(servers.urls, config) as pushing:
        push(pushing, trainer)
        group = pushing._lanes._lanes.out.pusher.group  # a test hook: slow the link mid-push
        broadcast, started = group.broadcast, threading.Event()

        def slow(tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> Any:
            started.set()
            time.sleep(0.05)
            return broadcast(tensor, src, timeout_s)

        group.broadcast = slow
        trainer.step()
        outcome: dict[str, Any] = {}

        def run() -> None:
            began = time.monotonic()
            try:
                pushing.push(trainer.state())
            except BaseException as exc:
                outcome["error"] = exc
            outcome["seconds"] = time.monotonic() - began

        pushing_thread = threading.Thread(target=run)
        pushing_thread.start()
        assert started.wait(60)
        time.sleep(0.5)
        servers.processes[dead].kill()
        pushing_thread.join(90)
        assert isinstance(outcome.get("error"), ServerError), outcome
        assert list(outcome["error"].servers) == [victim], outcome  # the dead one, not the other
        assert outcome["seconds"] < config.push_timeout_s, outcome
        print(f"killed mid-push: {type(outcome['error']).__name__} after "
              f"{outcome['seconds']:.1f}s: {outcome['error']}")  # fmt: skip
        assert not paused(survivor)
        assert get(survivor, "weight_info")["weight_version"] == "none"

        began = time.monotonic()  # the victim is still dead
        with pytest.raises(ServerError) as caught:
            pushing.push(trainer.state())
        seconds = time.monotonic() - began
        assert list(caught.value.servers) == [victim] and seconds < config.push_timeout_s
        print(f"pushed to a dead server: ServerError after {seconds:.1f}s: {caught.value}")
        assert not paused(survivor)
        ids, _ = complete(survivor, model_dir, PROMPTS[0])
        assert len(ids) == 8

        servers.restart(dead)
        push(pushing, trainer)
        for url in servers.urls:
            assert_matches(url, model_dir, trainer)
