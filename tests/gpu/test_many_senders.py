"""A sharded trainer on two GPUs pushing from both: ``JobSync(senders=2)`` with FSDP2 over NCCL
on the senders (sender r on GPU r) and receiving ranks on the host, the lanes over Gloo carrying
the CUDA shards. Needs two GPUs (skipped on fewer); no Ray.

    pytest -m gpu tests/gpu/test_many_senders.py -v
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.launch.test_launchers import LAUNCH_S, _join_all
from tests.launch.test_many_senders import _assert_steps, _reports, _spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs, one per sender"),
]


def test_two_gpu_senders_to_host_receivers(tmp_path: Path) -> None:
    context = _spawn("steps", tmp_path, senders=2, world_size=4, device="cuda")
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * 4
    _assert_steps(_reports(tmp_path, range(4)))
