"""Which way each member receives a push: one pure decision, made before a group forms.

Three routes, mixed freely in one push (the trainer is rank 0 of each):

* ``"group"`` -- the torch.distributed broadcast group (NCCL between GPUs, else Gloo);
* ``"shm"`` -- the host ring: shared-memory slots on the trainer's host (one write, one read per
  member; device-to-host-to-device when the weights are on GPUs);
* ``"cuda_ipc"`` -- the CUDA ring: slots in the trainer's GPU memory, shared by IPC handle, for
  members on the trainer's own GPU (the colocated deployment OpenRLHF, verl and slime default to).

The rules, in order:

1. NCCL needs one rank per physical GPU: two ranks on one device fail at the first collective
   ("Duplicate GPU detected"). So a member on the trainer's GPU never joins an NCCL group: it takes
   the CUDA ring (or the host ring where IPC was refused); and if members share a GPU with each
   other, the push cannot use NCCL at all.
2. ``backend="auto"`` picks NCCL only for CUDA weights when every member that would be in the
   group receives on GPUs, all distinct from each other and from the trainer's; else Gloo. An
   explicit ``backend="nccl"`` that rule 1 forbids is refused, saying which members collide.
3. Under Gloo, members on the trainer's host take the host ring when ``same_host="shm"``.

Members are told apart by GPU UUID (``MemberInfo.gpus``) and host key (``MemberInfo.host``:
one kernel, one network namespace -- the rings' Unix sockets are per namespace).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from weight_sync.errors import TransportError
from weight_sync.metadata import BackendName, MemberInfo

Route = Literal["group", "shm", "cuda_ipc"]


@dataclass(frozen=True)
class Routes:
    """The push's backend, and each member's route (in the members' order)."""

    backend: BackendName
    routes: tuple[Route, ...]


def choose_routes(
    *,
    backend: Literal["auto", "gloo", "nccl"],
    same_host: Literal["shm", "group"],
    trainer_gpu: str | None,
    trainer_host: str | None,
    infos: Sequence[MemberInfo],
    ipc_refused: bool = False,
) -> Routes:
    """Decide the backend and every member's route.

    ``trainer_gpu`` is the UUID of the GPU the pushed tensors are on (None: CPU weights);
    ``trainer_host`` the trainer's host key (None where this platform has no ring);
    ``ipc_refused``: a CUDA ring failed to open on this deployment before, so colocated members
    take the host ring.
    """
    local = [trainer_host is not None and info.host == trainer_host for info in infos]
    colocated = [trainer_gpu is not None and trainer_gpu in info.gpus for info in infos]
    nccl_problem = _nccl_problem(trainer_gpu, infos, local, colocated)
    if backend == "nccl" and nccl_problem is not None:
        raise TransportError(f"backend='nccl' cannot be used: {nccl_problem}; use backend='auto'")
    chosen: BackendName = backend if backend != "auto" else ("gloo" if nccl_problem else "nccl")
    routes: list[Route] = []
    for near, shares_gpu in zip(local, colocated, strict=True):
        if chosen == "nccl" and shares_gpu:
            routes.append("shm" if ipc_refused else "cuda_ipc")
        elif chosen == "gloo" and near and same_host == "shm":
            routes.append("shm")
        else:
            routes.append("group")
    return Routes(chosen, tuple(routes))


def _nccl_problem(
    trainer_gpu: str | None,
    infos: Sequence[MemberInfo],
    local: Sequence[bool],
    colocated: Sequence[bool],
) -> str | None:
    """Why this push cannot go over NCCL, or None if it can."""
    if trainer_gpu is None:
        return "the weights pushed are not on a GPU"
    owners: dict[str, int | None] = {trainer_gpu: None}  # GPU -> the member on it (None: trainer)
    for index, info in enumerate(infos):
        if colocated[index]:
            if not local[index]:
                return (f"worker {index} shares the trainer's GPU but not its host namespace, so "
                        "neither an NCCL group nor a ring can reach it")  # fmt: skip
            continue  # it takes a ring, not the group
        if len(info.gpus) != info.ranks:
            return f"worker {index} does not receive on a GPU"
        for gpu in info.gpus:
            if gpu in owners:
                other = owners[gpu]
                who = (f"worker {index} has two ranks on GPU {gpu}" if other == index
                       else f"workers {other} and {index} share GPU {gpu}")  # fmt: skip
                return f"{who}, and NCCL refuses two ranks on one device"
            owners[gpu] = index
    return None
