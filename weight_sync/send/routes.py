"""Which way each member receives a push: one pure decision, made before a group forms.

Four routes, mixed freely in one push (the trainer is rank 0 of the first three):

* ``"group"`` -- the torch.distributed broadcast group (NCCL between GPUs, else Gloo);
* ``"shm"`` -- the host ring: shared-memory slots on the trainer's host (one write, one read per
  member; device-to-host-to-device when the weights are on GPUs);
* ``"cuda_ipc"`` -- the CUDA ring: slots in the trainer's GPU memory, shared by IPC handle, for
  members on the trainer's own GPU (the colocated deployment OpenRLHF, verl and slime default to);
* ``"relay"`` -- a ring on another host, written by the member of that host that is in the group
  (its *leader*, see ``transport.relay``): the payload crosses the link to that host once.

The rules, in order:

1. NCCL needs one rank per physical GPU: two ranks on one device fail at the first collective
   ("Duplicate GPU detected"). So a member on the trainer's GPU never joins an NCCL group: it takes
   the CUDA ring (or the host ring where IPC was refused); and if members share a GPU with each
   other, the push cannot use NCCL at all.
2. ``backend="auto"`` picks NCCL only for CUDA weights when every member that would be in the
   group receives on GPUs, all distinct from each other and from the trainer's; else Gloo. An
   explicit ``backend="nccl"`` that rule 1 forbids is refused, saying which members collide.
3. Under Gloo, members on the trainer's host take the host ring when ``same_host="shm"``.
4. Under Gloo with ``relay``, the members of any other host (known by its key, each bringing one
   rank) beyond the first take ``"relay"`` from that first one, which stays in the group.

Members are told apart by GPU UUID (``MemberInfo.gpus``) and host key (``MemberInfo.host``:
one kernel, one network namespace -- the rings' Unix sockets are per namespace).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from weight_sync.errors import TransportError
from weight_sync.wire.metadata import BackendName, MemberInfo

Route = Literal["group", "shm", "cuda_ipc", "relay"]


@dataclass(frozen=True)
class Routes:
    """The push's backend, each member's route (in the members' order), and for each member on
    ``"relay"`` the member it takes the push from."""

    backend: BackendName
    routes: tuple[Route, ...]
    leaders: Mapping[int, int] = field(default_factory=dict)


def choose_routes(
    *,
    backend: Literal["auto", "gloo", "nccl"],
    same_host: Literal["shm", "group"],
    trainer_gpu: str | None,
    trainer_host: str | None,
    infos: Sequence[MemberInfo],
    ipc_refused: bool = False,
    relay: bool = False,
) -> Routes:
    """Decide the backend and every member's route.

    ``trainer_gpu`` is the UUID of the GPU the pushed tensors are on (None: CPU weights);
    ``trainer_host`` the trainer's host key (None where this platform has no ring);
    ``ipc_refused``: a CUDA ring failed to open on this deployment before, so colocated members
    take the host ring; ``relay``: rule 4.
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
    leaders = relay_leaders(routes, infos, trainer_host) if relay and chosen == "gloo" else {}
    for follower in leaders:
        routes[follower] = "relay"
    return Routes(chosen, tuple(routes), leaders)


# Each route in a user's words, in the order a summary lists them.
ROUTE_WORDS: Mapping[Route, str] = {
    "group": "through the group",
    "shm": "through shared memory",
    "cuda_ipc": "through the trainer's GPU (CUDA IPC)",
    "relay": "relayed on their host",
}


def describe_routes(routes: Sequence[str]) -> str:
    """How many members took each route, every route named, none left out (pure): "0 through
    the group, 0 through shared memory, 7 through the trainer's GPU (CUDA IPC), 0 relayed on
    their host"."""
    unknown = sorted(set(routes) - set(ROUTE_WORDS))
    parts = [f"{routes.count(route)} {words}" for route, words in ROUTE_WORDS.items()]
    return ", ".join(parts + [f"{routes.count(route)} {route}" for route in unknown])


def relay_leaders(
    routes: Sequence[Route], infos: Sequence[MemberInfo], trainer_host: str | None
) -> dict[int, int]:
    """Rule 4: each member of the group that can take the push from another member of its host
    (the first of that host), and that member. Hosts without a key cannot share a ring; a member
    bringing several ranks (an engine's workers) stays in the group, and so do the members of
    the trainer's own host (in the group there only when ``same_host="group"`` asked for it)."""
    first: dict[str, int] = {}
    leaders: dict[int, int] = {}
    for index, (route, info) in enumerate(zip(routes, infos, strict=True)):
        if route != "group" or info.host in (None, trainer_host) or info.ranks != 1:
            continue
        leader = first.setdefault(info.host, index)
        if leader != index:
            leaders[index] = leader
    return leaders


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
                return (
                    f"worker {index} shares the trainer's GPU but not its host namespace, so "
                    "neither an NCCL group nor a ring can reach it"
                )
            continue  # it takes a ring, not the group
        problem = _claim_gpus(owners, index, info)
        if problem is not None:
            return problem
    return None


def members_nccl_problem(infos: Sequence[MemberInfo], trainer_gpu: str | None = None) -> str | None:
    """Why these members cannot all be ranks of one NCCL group beside a trainer rank on
    ``trainer_gpu`` -- one of them does not receive on a GPU, or two ranks would share one --
    or None if they can. For a group they join as ranks of their own
    (``WeightUpdater(one_group=True)``), where no ring stands in for a member on a GPU taken."""
    owners: dict[str, int | None] = {trainer_gpu: None} if trainer_gpu is not None else {}
    for index, info in enumerate(infos):
        problem = _claim_gpus(owners, index, info)
        if problem is not None:
            return problem
    return None


def _claim_gpus(owners: dict[str, int | None], index: int, info: MemberInfo) -> str | None:
    """Add member ``index``'s GPUs to ``owners`` (GPU -> the member on it; None: the trainer);
    why it cannot, if it cannot."""
    if len(info.gpus) != info.ranks:
        return f"worker {index} does not receive on a GPU"
    for gpu in info.gpus:
        if gpu in owners:
            other = owners[gpu]
            if other is None:
                who = f"worker {index} is on the trainer's GPU {gpu}"
            elif other == index:
                who = f"worker {index} has two ranks on GPU {gpu}"
            else:
                who = f"workers {other} and {index} share GPU {gpu}"
            return f"{who}, and NCCL refuses two ranks on one device"
        owners[gpu] = index
    return None
