"""The RLHF example rolling out with a real vLLM engine (``--engine vllm``): a push after every
optimizer step, every rollout tagged by vLLM with the version that made it. One engine: a second
costs CI ~30 s to start and proves nothing the engine tests do not (two engines, TP=2)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from examples.rlhf_loop import main

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("ray_cluster")]


def test_rlhf_loop_learns_on_vllm_engines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "loop.png"
    history = main(["--engine", "vllm", "--workers", "1", "--steps", "40", "--plot", str(plot), "--window", "5"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(r"reward: first=(\d\.\d{3}) last=(\d\.\d{3})", line)
    assert match, line
    first, last = map(float, match.groups())
    assert last > first + 0.1, line  # a random policy scores ~0.1
    # Every rollout came labelled by vLLM with the trainer's current version: none was stale.
    assert history.stale == 0 and len(history.reward) == 40 and len(history.push_ms) == 41
    assert plot.stat().st_size > 10_000
