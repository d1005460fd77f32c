"""The Hugging Face adapter and the RLHF loop example, with real Ray actors."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from examples.rlhf_loop import POLICY, PolicyTrainer, main
from tests.rlhf_checks import assert_learned
from weight_sync.adapters.hf import RemoteHFWorker

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_cluster")]
TIMEOUT = 120


def test_hf_worker_needs_only_the_model_named(tmp_path: Path) -> None:
    workers = [RemoteHFWorker.remote(POLICY) for _ in range(2)]
    trainer = PolicyTrainer.remote(workers, 1e-3, 0)
    try:
        prompt = torch.tensor([[3, 8, 10]])
        before = ray.get(workers[0].generate.remote(prompt, max_new_tokens=1), timeout=TIMEOUT)
        assert before.version is None
        version = ray.get(trainer.push.remote(), timeout=TIMEOUT).version
        after = ray.get([w.generate.remote(prompt, max_new_tokens=2, do_sample=False, pad_token_id=11)
                         for w in workers], timeout=TIMEOUT)  # fmt: skip
        assert [g.version for g in after] == [version, version]
        assert torch.equal(after[0].sequences, after[1].sequences)  # the same weights everywhere
        statuses = ray.get([w.sync_status.remote() for w in workers], timeout=TIMEOUT)
        assert all(s.last is not None and s.last.nbytes < 75328 * 4 for s in statuses)  # tied: once
    finally:
        ray.get(trainer.close.remote(), timeout=TIMEOUT)
        for actor in [trainer, *workers]:
            ray.kill(actor)


def test_rlhf_loop_learns_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "loop.png"
    history = main(["--steps", "40", "--plot", str(plot), "--window", "5"])
    assert_learned(capsys.readouterr().out, history, 40, plot)  # 40 steps reach ~0.5
