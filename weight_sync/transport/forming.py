"""Forming the sync group's process group, three ways (``world``, ``job``, ``standalone``: see
``transport.torch_group``), and the errors a formation that failed raises.
"""

from __future__ import annotations

import datetime
import fcntl
import logging
import os
import socket
import struct
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from weight_sync.errors import (
    SyncTimeoutError,
    TransportError,
)
from weight_sync.transport import nccl
from weight_sync.transport.rendezvous import local_address_towards
from weight_sync.wire.metadata import GroupSpec

logger = logging.getLogger(__name__)


class GroupHandle(Protocol):
    """What we use of a ProcessGroup, ProcessGroupGloo or ProcessGroupNCCL object."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work: ...

    def shutdown(self) -> None: ...

    def abort(self) -> None: ...


def join_world(
    spec: GroupSpec,
    store: dist.Store,
    rendezvous: datetime.timedelta,
    collective: datetime.timedelta,
) -> dist.ProcessGroup:
    env: dict[str, str | None] = {}
    backend: str = spec.backend
    if spec.backend == "nccl":
        env["TORCH_NCCL_BLOCKING_WAIT"] = "1"  # see weight_sync.transport.nccl
        backend = nccl.world_backend()  # ProcessGroupNCCL, not torch 2.15's default nccl2
    elif "GLOO_SOCKET_IFNAME" not in os.environ:
        # init_process_group gives Gloo no device option: the environment is the only way to
        # keep its sockets on the interface that reaches the master (loopback by default).
        # Gloo reads it while the groups form, so it is set for exactly that long.
        interface = interface_of(local_address_towards(spec.address))
        if interface is not None:
            env["GLOO_SOCKET_IFNAME"] = interface
    with nccl.env_window(env):  # the lock also keeps an abort's world cleanup away
        if dist.is_initialized():
            raise TransportError(
                "group_mode='world' needs a process without a torch.distributed default group, "
                "but this one has one; use group_mode='standalone' (or 'auto')"
            )
        dist.init_process_group(
            backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=rendezvous
        )
        group = dist.new_group(list(range(spec.world_size)), timeout=collective, backend=backend)
    assert isinstance(group, dist.ProcessGroup)
    return group


def job_group(
    spec: GroupSpec, ours: dist.Store, rendezvous: datetime.timedelta
) -> dist.ProcessGroup:
    """``new_group`` over the job's default group, whose ranks are the sync group's: every rank of
    the job calls this at once (``new_group`` is collective over the default group).

    ``new_group`` names a group by a per-process count of the groups made so far, and meets its
    peers in the default store under that name. A formation that failed on some ranks before
    they reached ``new_group`` would leave the counts apart for good, every later group waiting
    for peers under another name; so the ranks first agree on the count, through this group's
    own store (fresh per formation), and take the highest."""
    if not dist.is_initialized() or dist.get_world_size() != spec.world_size:
        found = dist.get_world_size() if dist.is_initialized() else "no default group"
        raise TransportError(
            f"group_mode='job' needs every member in one torch.distributed world of "
            f"{spec.world_size} ranks (rank 0 the trainer), found {found}; use weight_sync.launch.job_sync"
        )
    if dist.get_rank() != spec.rank:
        raise TransportError(
            f"group_mode='job': this process is rank {dist.get_rank()} of the job but was given "
            f"rank {spec.rank} of the sync group; the ranks must be the job's"
        )
    world = dist.distributed_c10d._world
    ours.set(f"count/{spec.rank}", str(world.group_count))
    counts = [int(ours.get(f"count/{rank}")) for rank in range(spec.world_size)]
    with nccl.env_window({}):  # the lock: no abort's world cleanup meanwhile
        if world.group_count != max(counts):
            logger.warning(
                "group_mode='job': new_group counts differ across ranks %s (an earlier "
                "formation failed part-way); taking %d",
                counts,
                max(counts),
            )
            world.group_count = max(counts)
        group = dist.new_group(list(range(spec.world_size)), timeout=rendezvous, backend="gloo")
    assert isinstance(group, dist.ProcessGroup)
    return group


def gloo_group(
    spec: GroupSpec,
    store: dist.Store,
    rendezvous: datetime.timedelta,
    collective: datetime.timedelta,
) -> GroupHandle:
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = rendezvous  # bounds the full-mesh connect
    # Bind the data sockets to the interface that reaches the master (loopback by default).
    options._devices = [
        ProcessGroupGloo.create_device(hostname=local_address_towards(spec.address))
    ]
    group = ProcessGroupGloo(store, spec.rank, spec.world_size, options)
    group.set_timeout(collective)
    return cast(GroupHandle, group)


def device_for(backend: str, device: torch.device | None) -> torch.device:
    """The member's device: the CPU for Gloo; for NCCL the CUDA device the caller names."""
    if backend == "gloo":
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"a Gloo sync group keeps its buffers on the CPU, not {device}")
        return torch.device("cpu")
    if device is None:
        raise ValueError(
            "backend 'nccl' needs the CUDA device this member sends or receives on "
            "(TorchGroup.join(..., device=torch.device('cuda', index)))"
        )
    device = torch.device(device)
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"backend 'nccl' needs a CUDA device with an index, not {device}")
    if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
        raise TransportError(
            f"backend 'nccl' needs {device}, but this process sees "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA devices"
        )
    return device


def interface_of(ip: str) -> str | None:
    """The name of the IPv4 interface holding ``ip`` (Linux), or None if unknown."""
    siocgifaddr = 0x8915
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(
                    probe.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode())
                )
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


def rendezvous_error(exc: Exception, spec: GroupSpec) -> Exception:
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return SyncTimeoutError(
            f"the sync group did not form within {spec.rendezvous_timeout_s}s ({text}); a "
            f"worker may not have joined or cannot reach {spec.address}:{spec.port}"
        )
    return TransportError(f"could not form the sync group: {text}")
