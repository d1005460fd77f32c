"""Which device a push runs on, and which physical GPU that is.

A push's device comes from the tensors pushed (or, on a worker, from where its weights live),
never from ``torch.cuda.current_device()``: that is per thread, so a push made from a background
thread or a Ray concurrency-group thread would see ``cuda:0`` whatever GPU the weights are on.
GPUs are told apart by UUID, not index: two processes may number one GPU differently
(``CUDA_VISIBLE_DEVICES``), and NCCL refuses two ranks on one physical device.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from weight_sync.config import SyncConfig

CPU = torch.device("cpu")


def push_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """The CUDA device of the tensors pushed, or the CPU when none is on a GPU.

    Raises ``ValueError`` for tensors on several GPUs: one process sends from one device (a
    model spread over GPUs is pushed by one rank per GPU, or moved first).
    """
    devices = {tensor.device for tensor in tensors if tensor.is_cuda}
    if len(devices) > 1:
        shown = ", ".join(sorted(str(device) for device in devices))
        raise ValueError(
            f"the state dict spans several GPUs ({shown}); push from one device: move the "
            "tensors to one GPU (or to the CPU) first"
        )
    if not devices:
        return CPU
    (device,) = devices
    return device  # a tensor's CUDA device always has its index


def module_device(module: torch.nn.Module) -> torch.device:
    """Where a model's weights live: the device of its first CUDA parameter or buffer, else
    the CPU (a model with no tensors, or a CPU model)."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_cuda:
            return tensor.device
    return CPU


def current_gpu() -> torch.device:
    """This thread's current GPU, with its index: where a rank of a group made over NCCL
    without a model to say where (the one group, a group of NCCL alone) has its tensors. The
    caller set it (``torch.cuda.set_device``); it is per thread (see the module doc)."""
    return torch.device("cuda", torch.cuda.current_device())


def gpu_uuid(device: torch.device) -> str | None:
    """The UUID of ``device``'s physical GPU, or None for the CPU."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def free_bytes(device: torch.device) -> int | None:
    """Memory free on ``device``'s GPU now (the whole device's, other processes included:
    ``cudaMemGetInfo``), or None for the CPU or where CUDA is not available."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def sized_for(config: SyncConfig, device: torch.device) -> SyncConfig:
    """``config`` with its "auto" sizes settled for a trainer whose tensors live on ``device``
    (see ``SyncConfig.sized_for``); the GPU's free memory is read only when one is auto."""
    if config.bucket_bytes != "auto":
        return config
    return config.sized_for(device.type, free_bytes(device))
