"""The RLHF loop rolling out from a real SGLang server over HTTP (``examples/rlhf_loop.py
--engine sglang``): no Ray, no SGLang import here; the server runs with SGLang's interpreter.
One server (a second costs a minute of 2 cores and proves nothing one does not), stopped by
the loop on the way out, on failure too."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.rlhf_loop import main as rlhf_main
from tests.rlhf_checks import STEPS, assert_learned


@pytest.mark.timeout(600)
def test_rlhf_loop_learns_from_sglang_servers_without_ray(
    sglang: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """25 GRPO steps, a push through ``SGLangServers`` after each; every rollout labelled by
    SGLang (``meta_info["weight_versions"]``) with the trainer's current version."""
    import ray

    ray_before = ray.is_initialized()  # another test module may have started one in-process
    plot = tmp_path / "loop.png"
    history = rlhf_main(["--engine", "sglang", "--workers", "1", "--steps", str(STEPS),
                         "--plot", str(plot), "--window", "5",
                         "--server-logs", str(tmp_path), "--sglang-python", sglang])  # fmt: skip
    assert ray.is_initialized() == ray_before  # this mode never calls ray.init
    assert_learned(capsys.readouterr().out, history, STEPS, plot)
