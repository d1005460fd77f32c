"""The RLHF example rolling out with a real vLLM engine (``--engine vllm``): a push after every
optimizer step, every rollout tagged by vLLM with the version that made it. One engine: a second
costs CI ~30 s to start and proves nothing the engine tests do not (two engines, TP=2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.rlhf_loop import main
from tests.rlhf_checks import STEPS, assert_learned

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("ray_cluster")]


def test_rlhf_loop_learns_on_vllm_engines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "loop.png"
    history = main(
        [
            "--engine",
            "vllm",
            "--workers",
            "1",
            "--steps",
            str(STEPS),
            "--plot",
            str(plot),
            "--window",
            "5",
        ]
    )
    # Every rollout came labelled by vLLM with the trainer's current version: none was stale.
    assert_learned(capsys.readouterr().out, history, STEPS, plot)
