"""A launched job's push from one sender on one GPU (``JobSync``, K = 1: the agreement, the
lane, the verdict, ``Member`` on the receiving ranks), as a user's ``torchrun`` job meets it:

* every rank's model on the one GPU (the colocated deployment): the receiving ranks cannot
  join an NCCL group with rank 0 (one GPU, one rank) and must take the CUDA ring, bit-exact;
* rank 0 an FSDP2 trainer on the GPU (a mesh of one), the receiving ranks on the host: its
  DTensors pushed through the host, bit-exact (``tests/launch/sharded_job.py``'s steps).

No Ray.

    pytest -m gpu tests/gpu/test_job_on_gpu.py -v
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import forked
from tests.launch.test_launchers import LAUNCH_S, _join_all
from tests.launch.test_many_senders import _assert_steps, _reports, _spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

WIDE, LAYERS = 8192, 8  # bf16 Linear(8192, 8192) x 8: 1.07 GB, the size of the H100 run's job
PUSHES = 4


def _colocated_rank(index: int, world_size: int, store: str, out: str) -> None:
    from weight_sync import JobSync, SyncConfig
    from weight_sync.wire.checksums import state_dict_digests

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=index,
                            world_size=world_size)  # fmt: skip
    torch.cuda.set_device(0)
    torch.manual_seed(index)  # every rank starts with weights of its own: a push must replace them
    model = torch.nn.Sequential(
        *[torch.nn.Linear(WIDE, WIDE, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    )
    record: dict = {"rank": index, "versions": [], "digests": [], "took": []}
    with JobSync(SyncConfig(push_timeout_s=120)) as sync:
        for step in range(PUSHES):
            if sync.is_sender:  # a step of "training": every weight changes
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.add_(torch.randn_like(parameter), alpha=0.01 * (step + 1))
            torch.cuda.synchronize()
            started = time.perf_counter()
            record["versions"].append(sync.update(model))
            torch.cuda.synchronize()
            record["took"].append(time.perf_counter() - started)
            record["digests"].append(state_dict_digests(model.state_dict()))
        if sync.is_sender:
            assert sync._out is not None
            record["routes"] = list(sync._out.pusher.routes)
            record["nbytes"] = sync.last_result.nbytes if sync.last_result else 0
    (Path(out) / f"rank{index}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def test_every_rank_on_one_gpu_takes_the_cuda_ring_bit_exactly(tmp_path: Path) -> None:
    world = 3
    context = forked.start(_colocated_rank, (world, str(tmp_path / "store"), str(tmp_path)), world)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * world
    reports = _reports(tmp_path, range(world))
    sender = reports[0]
    assert sender["routes"] == ["cuda_ipc"] * (world - 1)  # never an NCCL group on one GPU
    assert len(set(map(json.dumps, sender["digests"]))) == PUSHES  # each push changed weights
    for report in reports:
        assert report["versions"] == list(range(1, PUSHES + 1)), report["rank"]
        assert report["digests"] == sender["digests"], report["rank"]
    steady = statistics.median(sender["took"][1:])  # the first push forms the group
    print(f"colocated JobSync push of {sender['nbytes'] / 1e9:.2f} GB to {world - 1} ranks: "
          f"first {sender['took'][0]:.3f} s, then median {steady:.3f} s")  # fmt: skip


def test_an_fsdp2_sender_on_the_gpu_to_host_ranks(tmp_path: Path) -> None:
    """One sender whose state dict is DTensors on the GPU (FSDP2 over NCCL, a mesh of one):
    three steps land bit-exact on two ranks on the host, one of them loading through
    ``load_weights``."""
    context = _spawn("steps", tmp_path, senders=1, world_size=3, device="cuda")
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * 3
    _assert_steps(_reports(tmp_path, range(3)))
