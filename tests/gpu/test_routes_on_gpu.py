"""Routing with real GPUs: members report their GPU by UUID, and a second process on the
trainer's GPU is never put in an NCCL group with it (NCCL refuses two ranks on one device). The
rules themselves are tested without GPUs in tests/unit/test_routes.py."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from weight_sync.transport.devices import gpu_uuid, module_device, push_device
from weight_sync.wire.metadata import MemberInfo
from weight_sync.receive.receiver import Receiver
from weight_sync.send.routes import choose_routes
from weight_sync.transport import shm

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def _member_info(results: mp.Queue) -> None:
    results.put(Receiver(torch.device("cuda", 0)).info().model_dump_json())


def test_a_second_process_on_the_trainers_gpu_takes_the_cuda_ring_not_nccl() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_member_info, args=(results,), daemon=True)
    child.start()
    try:
        info = MemberInfo.model_validate_json(results.get(timeout=90))
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    trainer_gpu = gpu_uuid(push_device([torch.zeros(1, device="cuda")]))
    assert info.cuda and info.gpus == (trainer_gpu,)  # one UUID, seen alike from two processes
    for backend in ("auto", "nccl"):
        routes = choose_routes(backend=backend, same_host="shm", trainer_gpu=trainer_gpu,  # type: ignore[arg-type]
                               trainer_host=shm.host_key(), infos=[info, info])  # fmt: skip
        assert routes.routes == ("cuda_ipc", "cuda_ipc")  # never "group" on a shared GPU
    refused = choose_routes(backend="auto", same_host="shm", trainer_gpu=trainer_gpu,
                            trainer_host=shm.host_key(), infos=[info], ipc_refused=True)  # fmt: skip
    assert refused.routes == ("shm",)


def test_the_device_comes_from_the_weights_on_any_thread() -> None:
    model = torch.nn.Linear(4, 4).to("cuda")
    seen: list[torch.device] = []
    thread = threading.Thread(target=lambda: seen.extend(
        [module_device(model), push_device(model.state_dict().values())]
    ))  # fmt: skip
    thread.start()
    thread.join(timeout=30)
    assert seen == [torch.device("cuda", 0)] * 2
    assert Receiver(lambda: module_device(model)).device == torch.device("cuda", 0)
