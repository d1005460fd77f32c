"""The examples that need no Ray: an FSDP2 torchrun job pushing to a vLLM server, and the RLHF
loop rolling out from vLLM servers over HTTP (``--engine vllm-serve``). Both start real
``vllm serve`` processes (one each: a second costs CI a minute of its 2 cores and proves
nothing a push to one does not), so each test is bounded well above what it takes there
(about 2-3 minutes) and stops everything it started, on failure too."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the no-Ray examples start real vLLM servers (vllm extra)")

from examples.rlhf_loop import main as rlhf_main
from tests.rlhf_checks import STEPS, assert_learned

REPO = Path(__file__).resolve().parents[2]
TORCHRUN_S = 420  # the whole torchrun job: two ranks, one server started, three pushes


def _run_bounded(command: list[str], timeout_s: float, log: Path) -> tuple[int, str]:
    """Run ``command`` in a session of its own with its output in ``log``; past ``timeout_s``,
    SIGTERM the whole session (torchrun passes it to its ranks, whose ``finally`` blocks stop
    the servers they started), then SIGKILL what is left. Returns (exit code, output)."""
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
            pytest.fail(f"{command} ran past {timeout_s}s; output:\n{log.read_text()[-4000:]}")
    return code, log.read_text(errors="replace")


@pytest.mark.timeout(TORCHRUN_S + 180)
def test_fsdp_torchrun_pushes_every_step_and_servers_complete_as_the_trainer(
    tmp_path: Path,
) -> None:
    """Two FSDP2 ranks (Gloo) push after every Adam step; rank 0 starts the server, checks its
    greedy completions and log-probabilities against the gathered model, and stops it."""
    logs = tmp_path / "servers"
    logs.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", "examples/fsdp_torchrun.py", "--serve", "1", "--steps", "3",
               "--server-logs", str(logs), "--timeout-s", "300"]  # fmt: skip
    code, output = _run_bounded(command, TORCHRUN_S, tmp_path / "torchrun.log")
    assert code == 0, output[-4000:]
    assert "pushed 3 versions to 1 servers; completions match the trainer: True" in output, output[
        -4000:
    ]
    assert "servers at versions [3]" in output, output[-4000:]
    assert re.search(r"step 2 .* pushed v3 in \d+ ms", output), output[-4000:]


@pytest.mark.timeout(600)
def test_rlhf_loop_learns_from_vllm_servers_without_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The RLHF loop with ``--engine vllm-serve``: no Ray cluster (this process trains), one
    ``vllm serve`` rolls out over HTTP, every rollout labelled by vLLM with its weight version."""
    import ray

    ray_before = ray.is_initialized()  # another test module may have started one in-process
    plot = tmp_path / "loop.png"
    history = rlhf_main(["--engine", "vllm-serve", "--workers", "1", "--steps", str(STEPS),
                         "--plot", str(plot), "--window", "5",
                         "--server-logs", str(tmp_path)])  # fmt: skip
    assert ray.is_initialized() == ray_before  # this mode never calls ray.init
    # Every rollout came labelled by vLLM with the trainer's current version: none was stale.
    assert_learned(capsys.readouterr().out, history, STEPS, plot)
