"""A sharded trainer on two GPUs pushing from both: ``JobSync(senders=2)`` with FSDP2 over NCCL
on the senders (sender r on GPU r) and receiving ranks on the host, the lanes over Gloo carrying
the CUDA shards. Needs two GPUs (skipped on fewer); no Ray. Over one NCCL group
(``one_group=True``) every rank needs a GPU of its own: three.

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


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs three GPUs, one per rank")
def test_two_gpu_senders_over_one_nccl_group(tmp_path: Path) -> None:
    """``JobSync(one_group=True)`` over NCCL: two senders and a receiving rank, each on a GPU
    of its own (NCCL puts no two ranks of one communicator on one GPU), the lanes' buckets in
    coalesced rounds (``transport.rounds``), three steps bit-exact."""
    context = _spawn("steps+one_group", tmp_path, senders=2, world_size=3, device="cuda")
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * 3
    _assert_steps(_reports(tmp_path, range(3)))
