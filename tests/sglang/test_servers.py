"""Real SGLang HTTP servers (``python -m sglang.launch_server``, CPU) taking pushes from this
process over ``SGLangServers``: no Ray, no SGLang import here.

Three servers start once for the module (about 30 s each on 2 cores, 2 GB each): two of a tied
Qwen2 in float32, one of an untied Llama in bfloat16. Every test begins with a push of its own
and never relies on what an earlier one left; a test that kills a server starts it again at the
same URL before it ends.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.sglang.helpers import (
    ENV,
    PROMPTS,
    READY_S,
    REPO,
    Trainer,
    assert_matches,
    generate,
    server_args,
)
from tests.vllm.models import LLAMA, QWEN2
from weight_sync import PlanMismatchError, SyncConfig
from weight_sync.adapters.sglang import (
    ServerError,
    SGLangPusher,
    SGLangServer,
    SGLangServers,
    release_servers,
)
from weight_sync.adapters.sglang.client import HTTPEngine
from weight_sync.control.http import call
from weight_sync.adapters.local_servers import start_together, stop_together
from weight_sync.wire.versions import label_past, label_version, unlabelled

pytestmark = pytest.mark.timeout(900)

SMALL = 2048  # bytes per bucket: far smaller than a layer (Qwen2's MLP weights are 32 KB each)
FLOAT32_TOLERANCE = 1e-4
BFLOAT16_TOLERANCE = 0.1  # SGLang's bf16 kernels and transformers' accumulate differently
SPECS = {  # name: (model, dtype)
    "qwen2_a": ("qwen2", "float32"), "qwen2_b": ("qwen2", "float32"),
    "llama_bf16": ("llama", "bfloat16"),
}  # fmt: skip


class Fleet:
    """The module's servers by name; ``restart`` starts one again at its URL."""

    def __init__(self, sglang: str, models: dict[str, str], logs: Path) -> None:
        self.sglang, self.models, self.logs = sglang, models, logs
        self.running: dict[str, SGLangServer] = {}

    def start(self, name: str, port: int = 0) -> SGLangServer:
        model, dtype = SPECS[name]
        server = SGLangServer(self.models[model], python=self.sglang, args=server_args(dtype),
                              env=ENV, port=port, log_path=str(self.logs / f"{name}.log"),
                              ready_timeout_s=READY_S)  # fmt: skip
        self.running[name] = server
        return server

    def url(self, name: str) -> str:
        return self.running[name].url

    def restart(self, name: str) -> None:
        old = self.running[name]
        old.stop(timeout_s=30)
        self.start(name, port=old.port)


@pytest.fixture(scope="module")
def fleet(sglang: str, models: dict[str, str], logs: Path) -> Iterator[Fleet]:
    held = Fleet(sglang, models, logs)
    with start_together(len(SPECS), lambda index: held.start(list(SPECS)[index])):
        try:
            yield held
        finally:  # a server a test restarted is not one start_together started
            stop_together(held.running.values(), timeout_s=30)


def push(servers: SGLangPusher, trainer: Trainer, **options: Any) -> int:
    result = servers.push(trainer.model.state_dict(), **options)
    trainer.landed()
    return result.version


def assert_serves(url: str, trainer: Trainer, version: int | str, tolerance: float) -> None:
    for prompt in PROMPTS:
        output = generate(url, prompt)
        assert output["version"] == str(version), output
        assert_matches(output, prompt, trainer, tolerance)


@pytest.mark.parametrize(
    ("name", "config", "cast", "tolerance"),
    [("qwen2_a", QWEN2, None, FLOAT32_TOLERANCE),
     ("llama_bf16", LLAMA, "bfloat16", BFLOAT16_TOLERANCE)],
    ids=["qwen2-tied-float32", "llama-untied-bfloat16"],
)  # fmt: skip
def test_every_push_after_an_optimizer_step_serves_the_trainers_weights(
    fleet: Fleet, name: str, config: dict[str, Any], cast: str | None, tolerance: float
) -> None:
    """Three rounds of an Adam step and a push in buckets far smaller than a layer: the server
    then generates what the trainer's model does (its own init differs: seed 0 against 1), and
    labels every output with the push's version."""
    trainer = Trainer(config, dtype=getattr(torch, cast) if cast else None)
    url = fleet.url(name)
    with SGLangServers([url], SyncConfig(bucket_bytes=SMALL, cast_dtype=cast)) as servers:
        for _ in range(3):
            trainer.step()
            version = push(servers, trainer)
            assert servers.versions() == [version]
            assert_serves(url, trainer, version, tolerance)


def test_one_push_reaches_two_servers(fleet: Fleet) -> None:
    trainer = Trainer(QWEN2)
    urls = [fleet.url("qwen2_a"), fleet.url("qwen2_b")]
    with SGLangServers(urls, SyncConfig(bucket_bytes=64 << 10)) as servers:
        trainer.step()
        version = push(servers, trainer)
        assert servers.versions() == [version, version]
        for url in urls:
            assert_serves(url, trainer, version, FLOAT32_TOLERANCE)


@pytest.mark.parametrize(
    "spoil",
    [lambda s: s.update({"model.layers.0.mlp.up_proj.weight": s["model.layers.0.mlp.up_proj.weight"][:-1]}),
     lambda s: s.update({"model.layers.0.mlp.upproj.weight": s.pop("model.layers.0.mlp.up_proj.weight")})],
    ids=["a-shape-the-engine-does-not-hold", "a-name-the-engine-does-not-hold"],
)  # fmt: skip
def test_a_push_the_engine_cannot_load_is_refused_and_changes_nothing(
    fleet: Fleet, spoil: Any
) -> None:
    """Refused before anything is paused or sent: the server keeps its weights and version and
    generates on. (SGLang alone would drop an unknown name silently and claim the version.)"""
    trainer = Trainer(QWEN2)
    url = fleet.url("qwen2_a")
    with SGLangServers([url], SyncConfig(bucket_bytes=SMALL)) as servers:
        version = push(servers, trainer)
        trainer.step()
        state = dict(trainer.model.state_dict())
        spoil(state)
        with pytest.raises(PlanMismatchError, match="model.layers.0.mlp.up"):
            servers.push(state)
        assert servers.versions() == [version]
        assert call(url, "model_info", timeout_s=10)["weight_version"] == str(version)
        assert_serves(url, trainer, version, FLOAT32_TOLERANCE)  # the weights pushed before


class Striking(HTTPEngine):
    """A server whose ``strike`` runs as the trainer asks it to receive bucket ``at``."""

    def __init__(self, url: str, at: int, strike: Any) -> None:
        super().__init__(url)
        self.at, self.strike, self.buckets = at, strike, 0

    def call(self, route: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        if route == "update_weights_from_distributed":
            self.buckets += 1
            if self.buckets == self.at:
                self.strike()
        return super().call(route, body, timeout_s)


def label(url: str) -> str:
    return str(call(url, "model_info", timeout_s=30)["weight_version"])


def test_a_server_killed_mid_push_is_named_in_bound_and_the_other_serves_again(
    fleet: Fleet,
) -> None:
    """A server dies on the third bucket of a push to two: the push raises ``ServerError``
    naming it within its bound; the survivor, which may hold half-new weights, says so
    (``"none (past N)"``, N the failed push's version) and generates again. Started again at its
    URL (its label gone with it), the next push repairs both -- with a version past N, never one
    the survivor served."""
    trainer = Trainer(QWEN2)
    names = ["qwen2_a", "qwen2_b"]
    urls = [fleet.url(name) for name in names]
    victim = fleet.running["qwen2_b"]
    config = SyncConfig(bucket_bytes=SMALL, push_timeout_s=60)
    with SGLangServers(urls, config) as servers:
        served = push(servers, trainer)
    trainer.step()
    engines = [HTTPEngine(urls[0]), Striking(urls[1], 3, lambda: victim.kill())]
    with SGLangPusher(engines, config) as pusher:
        started = time.monotonic()
        with pytest.raises(ServerError) as caught:
            pusher.push(trainer.model.state_dict())
        assert time.monotonic() - started < config.push_timeout_s
    assert urls[1] in caught.value.servers, caught.value
    assert urls[0] not in caught.value.servers, caught.value
    output = generate(urls[0], PROMPTS[0])
    assert output["version"] == unlabelled(served + 1)  # resumed, and honest about its weights
    fleet.restart("qwen2_b")
    assert label_version(label(urls[1])) is None  # restarted: it remembers nothing
    with SGLangServers(urls, config) as servers:
        trainer.step()
        version = push(servers, trainer)
        assert version == served + 2  # past the failed push's, which the survivor may hold
        for url in urls:
            assert_serves(url, trainer, version, FLOAT32_TOLERANCE)


DYING_TRAINER = """
import os, signal, sys
import torch
sys.path.insert(0, {repo!r})
from tests.sglang.helpers import Trainer
from tests.sglang.test_servers import Striking
from tests.vllm.models import QWEN2
from weight_sync import SyncConfig
from weight_sync.adapters.sglang import SGLangPusher
trainer = Trainer(QWEN2, seed=3)
engine = Striking({url!r}, 3, lambda: os.kill(os.getpid(), signal.SIGKILL))
SGLangPusher([engine], SyncConfig(bucket_bytes={small})).push(trainer.model.state_dict())
"""


def test_the_trainer_killed_mid_push_leaves_the_server_to_the_next_one(fleet: Fleet) -> None:
    """A trainer process is killed on the third bucket of its push. The server lives on, paused
    and labelled ``"none (past N)"`` (SGLang cannot notice a trainer gone: the limit of HTTP
    servers); ``release_servers`` frees it, and a new trainer's push lands, with a version past
    N."""
    url = fleet.url("qwen2_a")
    before = label_past(label(url))
    script = DYING_TRAINER.format(repo=str(REPO), url=url, small=SMALL)
    dying = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert dying.returncode == -signal.SIGKILL, dying.stderr.decode()[-3000:]
    assert label(url) == unlabelled(before + 1)
    release_servers([url])
    assert generate(url, PROMPTS[0])["version"] == unlabelled(before + 1)  # serves, says so
    trainer = Trainer(QWEN2)
    with SGLangServers([url], SyncConfig(bucket_bytes=SMALL)) as servers:
        trainer.step()
        version = push(servers, trainer)
        assert version == before + 2
        assert_serves(url, trainer, version, FLOAT32_TOLERANCE)


def test_the_next_trainer_alone_repairs_a_server_a_dead_one_left(fleet: Fleet) -> None:
    """Without ``release_servers``: the next trainer's push ends the dead one's update session
    and resumes the server itself."""
    url = fleet.url("qwen2_a")
    script = DYING_TRAINER.format(repo=str(REPO), url=url, small=SMALL)
    dying = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert dying.returncode == -signal.SIGKILL, dying.stderr.decode()[-3000:]
    trainer = Trainer(QWEN2)
    with SGLangServers([url], SyncConfig(bucket_bytes=SMALL)) as servers:
        version = push(servers, trainer)
        assert_serves(url, trainer, version, FLOAT32_TOLERANCE)


def test_a_new_trainer_continues_past_what_the_servers_served_and_a_named_version_too(
    fleet: Fleet,
) -> None:
    """Two pushes from one trainer, then a new one on the same servers: it takes the next
    version, not 1 (its labels are read from /model_info); a named version the servers already
    served is refused before anything is paused or sent, and one past them labels the push (a
    trainer restarted from a checkpoint at that step)."""
    trainer = Trainer(QWEN2)
    url = fleet.url("qwen2_a")
    config = SyncConfig(bucket_bytes=64 << 10)
    with SGLangServers([url], config) as servers:
        first = push(servers, trainer)
        trainer.step()
        second = push(servers, trainer)
    assert second == first + 1
    with SGLangServers([url], config) as servers:
        trainer.step()
        third = push(servers, trainer)
        assert third == second + 1
        trainer.step()
        with pytest.raises(ValueError, match=f"version {second} is not past"):
            servers.push(trainer.model.state_dict(), version=second)
        assert label(url) == str(third)  # unchanged, and serving
        step = third + 100
        assert push(servers, trainer, version=step) == step
        assert_serves(url, trainer, step, FLOAT32_TOLERANCE)
    with SGLangServers([url], config) as servers:  # and after it, the count goes on past it
        trainer.step()
        assert push(servers, trainer) == step + 1
