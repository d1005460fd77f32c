"""A ``vllm serve`` of two tensor-parallel workers (vLLM's multiprocess executor) after pushes
that failed on both of its workers, from one trainer and from every rank of a sharded one.

The executor runs each weight-transfer call as a ``collective_rpc`` that reads the workers'
replies in order and raises at the first failed one, leaving the other's queued: had a worker
raised, the server's next calls would read the reply left behind as their own and fail
(``pause`` answering with ``finish_weight_update``'s error). Here each push after a failure
must land, bit for bit, and the server must keep serving. Last, the other server is killed
while two trainer ranks push into both: the tensor-parallel one serves on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.models import QWEN2
from tests.vllm_serve.helpers import (
    PROMPTS,
    TENSOR_PARALLEL,
    Servers,
    Trainer,
    all_resumed,
    assert_matches,
    complete,
    kill_trainer_mid_push,
    paused,
    served_versions,
    wait_released,
)
from tests.vllm_serve.lane_trainer import pushed_model, run_job
from weight_sync.adapters.vllm import ServerProcess, VLLMServers

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def server(servers: Servers) -> ServerProcess:
    """The folder's server of two tensor-parallel workers (as it is now: a test before may have
    restarted it)."""
    return servers.processes[TENSOR_PARALLEL]


@pytest.mark.parametrize("where", ["broadcast", "commit"])
def test_one_trainer_killed_mid_push_then_the_next_lands(
    server: ServerProcess, model_dir: str, where: str
) -> None:
    """The trainer dies mid-push: one worker's watchdog releases the server (each worker
    raising would end one session twice), which serves on, claiming no version; a new
    trainer's push then lands on both workers."""
    killed = kill_trainer_mid_push(server.url, where)
    with VLLMServers([server.url]) as pushing:
        wait_released(pushing, killed)
        ids, _ = complete(server.url, model_dir, PROMPTS[0])
        assert len(ids) == 8
        trainer = Trainer(QWEN2, seed=9)
        result = pushing.push(trainer.state())
        trainer.landed()
        assert pushing.versions() == [result.version] and not paused(server.url)
        assert_matches(server.url, model_dir, trainer)


def test_a_trainer_rank_killed_mid_push_then_the_sharded_trainer_lands(
    server: ServerProcess, model_dir: str, tmp_path: Path
) -> None:
    """Rank 1 of a sharded trainer dies once both workers are receiving its lane: both
    workers' lanes fail, which they answer in rank 0's store rather than raise; the server is
    released claiming no version, and a new sharded trainer's pushes land."""
    urls = [server.url]
    (report,) = run_job("kill", urls, tmp_path / "kill", ranks=1)
    (error,) = report["errors"]
    assert error.startswith("SenderFailedError: trainer rank 1 died or left mid-push"), error
    assert report["senders"] == [1], report
    assert served_versions(urls) == [None] and all_resumed(urls)
    reports = run_job("steps", urls, tmp_path / "after")
    assert not reports[0]["errors"] and reports[0]["versions"][0] > report["versions"][0] + 1
    assert served_versions(urls) == [reports[0]["versions"][-1]] and all_resumed(urls)
    assert_matches(server.url, model_dir, pushed_model(tmp_path / "after", 1))


def test_a_server_killed_mid_push_is_named_at_once_on_every_rank(
    servers: Servers, tmp_path: Path
) -> None:
    """The server of one worker is SIGKILLed while two trainer ranks push into both servers:
    rank 0 names it by URL (``ServerError``) from its update call on it, and rank 1, told by
    rank 0 (its own store cannot tell a dead worker from a slow one: its lane waited for that
    worker's answers until its bound, 60 s here), names it too -- both within seconds. The
    other server serves on, claiming no version, resumed. The victim is left dead: a test after
    that takes ``servers`` starts it again first."""
    dead = 1 - TENSOR_PARALLEL
    victim, survivor = servers.urls[dead], servers.urls[TENSOR_PARALLEL]
    out = tmp_path / "lose"
    out.mkdir()
    (out / "victim.pid").write_text(str(servers.processes[dead].pid))
    try:
        reports = run_job("lose", servers.urls, out)
    finally:
        servers.processes[dead].kill()  # (reaped: rank 0 killed it)
    print([(report["errors"], round(report["seconds"], 2)) for report in reports])
    (first,) = reports[0]["versions"]
    for report in reports:
        (error,) = report["errors"]
        assert victim in error, error
        assert report["seconds"] < 20, report  # the ranks' rpc bound is 60 s
    assert reports[0]["errors"][0].startswith("ServerError"), reports[0]
    assert reports[1]["errors"][0].startswith("WorkerFailedError"), reports[1]
    assert "stopped answering mid-push" in reports[1]["errors"][0], reports[1]
    assert served_versions([survivor]) == [None] and all_resumed([survivor])
    assert first > 0
