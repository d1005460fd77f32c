"""The trainer of these tests (in the test process) and the check that a server generates what
its ``transformers`` model, with the weights it pushed, would -- over HTTP.

The tolerance and the comparison are tests/vllm/test_engine.py's: float32 log-probabilities
within 1e-4, greedy tokens equal except at ties within the tolerance.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.reference import Trainer
from tests.vllm.models import MAX_MODEL_LEN
from tests.vllm.test_engine import PROMPTS, TOLERANCE
from weight_sync.adapters.vllm import ServerProcess, VLLMServers
from weight_sync.wire.versions import label_version

TIMEOUT = 120
REPO = str(Path(__file__).resolve().parents[2])
# Longer than a KV block (128 tokens on CPU): their first block is cached by prefix, and a push
# that did not reset the cache would have them answered partly by the old weights.
LONG_PROMPTS = [[(7 * i + 3) % 500 for i in range(200)], [(11 * i) % 500 for i in range(180)]]
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

READY_S = 600  # servers start together on 2 cores, beside other work
# Mirrors tests/vllm/models.engine_options as flags. Scale-out mounts vLLM's token-in-token-out
# endpoint (/inference/v1/generate), whose outputs carry the weight versions that made them.
ARGS = [
    "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
    "--max-model-len", str(MAX_MODEL_LEN), "--generation-config", "vllm", "--seed", "0",
    "--skip-tokenizer-init", "--enable-scale-out",
]  # fmt: skip
# Several servers on one node: vLLM's automatic binding would pin all to one core.
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
TENSOR_PARALLEL = 1  # the index of the session's server of two tensor-parallel workers


def server_args(index: int) -> list[str]:
    """The flags of the session's server ``index``: server 1 runs two tensor-parallel workers
    (vLLM's multiprocess executor), so a push to both servers meets one worker and two, and the
    tensor-parallel tests need no server of their own (a start is ~25 CPU-seconds)."""
    return [*ARGS, "--tensor-parallel-size", "2"] if index == TENSOR_PARALLEL else ARGS


class Servers:
    """The session's servers, by index; ``restart`` starts one again at its port."""

    def __init__(self, model: str, logs: Path) -> None:
        self.model, self.logs = model, logs
        self.processes: list[ServerProcess] = []
        self._starts = 0

    def start(self, index: int, port: int = 0) -> ServerProcess:
        self._starts += 1
        return ServerProcess(self.model, args=server_args(index), env=ENV, port=port,
                             ready_timeout_s=READY_S,
                             log_path=str(self.logs / f"server-{self._starts}.log"))  # fmt: skip

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.processes]

    def restart(self, index: int) -> ServerProcess:
        """Start server ``index`` again at the same URL (it was killed or stopped)."""
        old = self.processes[index]
        old.stop(timeout_s=30)
        self.processes[index] = self.start(index, port=old.port)
        assert self.processes[index].url == old.url
        return self.processes[index]


def metrics(url: str) -> str:
    with _OPENER.open(f"{url}/metrics", timeout=TIMEOUT) as response:
        return str(response.read().decode())


def post(url: str, path: str, body: dict[str, Any] | None = None, timeout: float = TIMEOUT) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/{path}", data=data, method="POST" if body is not None
                                     or path.split("?")[0] not in ("is_paused", "weight_info")
                                     else "GET", headers={"Content-Type": "application/json"})  # fmt: skip
    with _OPENER.open(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def get(url: str, path: str, timeout: float = TIMEOUT) -> Any:
    with _OPENER.open(f"{url}/{path}", timeout=timeout) as response:
        return json.loads(response.read())


def complete(
    url: str, model: str, prompt: list[int], tokens: int = 8
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from ``/v1/completions`` (token ids in and out:
    the servers have no tokenizer)."""
    answer = post(url, "v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
        "logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True,
        "ignore_eos": True,
    })  # fmt: skip
    choice = answer["choices"][0]
    return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])


def assert_matches(url: str, model: str, trainer: Trainer,
                   prompts: list[list[int]] = PROMPTS) -> None:  # fmt: skip
    """The server at ``url`` generates what the trainer's model, with the weights it pushed,
    would (as tests/vllm/test_engine.assert_matches)."""
    for prompt in prompts:
        ids, logprobs = complete(url, model, prompt)
        want = trainer.reference(prompt, ids)
        for step, (token, logprob) in enumerate(zip(ids, logprobs, strict=True)):
            assert abs(logprob - want["logprobs"][step]) <= TOLERANCE, (url, step, logprob, want)
            assert token == want["greedy"][step] or want["gap"][step] <= TOLERANCE, (url, step)


def largest_difference(url: str, model: str, trainer: Trainer) -> float:
    """How far the server's log-probabilities are from the trainer's weights now (a push of
    those must show)."""
    current = Trainer.__new__(Trainer)
    current.model, current.pushed = trainer.model, trainer.model.state_dict()
    worst = 0.0
    for prompt in PROMPTS:
        ids, logprobs = complete(url, model, prompt)
        want = current.reference(prompt, ids)["logprobs"]
        worst = max(worst, *(abs(a - b) for a, b in zip(logprobs, want, strict=True)))
    return worst


def paused(url: str) -> bool:
    return bool(get(url, "is_paused")["is_paused"])


def kill_trainer_mid_push(url: str, where: str) -> float:
    """Run ``dying_trainer.py`` against ``url`` and kill it (SIGKILL) ``where`` it says: during
    the broadcast, or once every byte arrived, before the commit. Returns when it was killed
    (``time.monotonic``)."""
    command = [sys.executable, "-m", "tests.vllm_serve.dying_trainer", url, where]
    trainer_process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True,
                                       env={**os.environ, "PYTHONPATH": REPO})  # fmt: skip
    try:
        assert trainer_process.stdout is not None
        lines = []
        for line in trainer_process.stdout:  # bounded by the script's own alarm
            lines.append(line.strip())
            if line.startswith("striking"):
                break
        assert lines and lines[-1] == "striking", lines
        # Well inside the broadcast (~5 s) or the held commit (30 s). Nothing asks the server
        # meanwhile: even GET /is_paused waits for the engine while a worker call runs.
        time.sleep(0.5)
        os.kill(trainer_process.pid, signal.SIGKILL)
        return time.monotonic()
    finally:
        trainer_process.kill()
        trainer_process.wait(30)


def wait_released(watching: VLLMServers, killed: float, limit_s: float = 60) -> float:
    """Wait until a worker's watchdog released the servers ``watching`` watches (resumed, no
    version claimed) after their trainer was killed at ``killed``; returns how long it took."""
    while any(map(paused, watching.urls)) or set(watching.versions()) != {None}:
        assert time.monotonic() - killed < limit_s, "the server was not released"
        time.sleep(0.2)
    return time.monotonic() - killed


def served_versions(urls: list[str]) -> list[int | None]:
    """The version each server's outputs are labelled with (None: none claimed)."""
    return [label_version(str(get(url, "weight_info")["weight_version"])) for url in urls]


def all_resumed(urls: list[str]) -> bool:
    return not any(map(paused, urls))
