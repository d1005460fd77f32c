"""The trainer's end of the group SGLang engines join for a weight update.

An engine joins with ``init_weights_update_group``, which builds its group with SGLang's own
``init_custom_process_group`` (``sglang/srt/utils/common.py``): it dials the ``TCPStore`` at
``tcp://master_address:master_port`` (rank 0, the trainer, serves it), wraps it in
``PrefixStore(group_name)``, and hands that to torch's ``_new_process_group_helper``, which
wraps it twice more -- ``PrefixStore(f"{group_name}/")``, then ``PrefixStore(f"{device}/")``
per device backend (``"cpu/"`` for Gloo, ``"cuda/"`` for NCCL; ``distributed_c10d.py`` in torch
2.13) -- before building the backend on it. A trainer that called plain ``init_process_group``
would wait under other keys and never meet the engines: the trainer builds its backend over the
same three prefixes instead, as a standalone group (``TorchGroup``, so that every broadcast is
bounded and an abort ends it at once on our side). SGLang's side of it has no bound of ours:
its group carries torch's default timeout (30 minutes), which no SGLang call lets us change.

NCCL: the engines' communicator forms lazily in their first broadcast; ours is built the same
way (no eager connect, no warm-up collective the engines would never post), in blocking-wait
mode (``transport.nccl.construct``). Written from torch's and SGLang's source; no machine with
two GPUs has run it here.
"""

from __future__ import annotations

import datetime
import secrets
import socket
from typing import Any, cast

import torch
from torch.distributed import PrefixStore

from weight_sync.transport import nccl
from weight_sync.transport.forming import gloo_group
from weight_sync.transport.rendezvous import open_store
from weight_sync.transport.torch_group import TorchGroup
from weight_sync.wire.metadata import BackendName, GroupSpec


def sglang_store(store: object, group_name: str, backend: BackendName) -> PrefixStore:
    """``store`` as SGLang's engines see it for ``group_name`` (see the module doc)."""
    device = "cpu" if backend == "gloo" else "cuda"
    named = PrefixStore(group_name, cast(PrefixStore, store))
    return PrefixStore(f"{device}/", PrefixStore(f"{group_name}/", named))


def open_trainer_group(
    listener: socket.socket,
    address: str,
    world_size: int,
    group_name: str,
    backend: BackendName,
    device: torch.device | None,
    rendezvous_timeout_s: float,
    collective_timeout_s: float,
) -> TorchGroup:
    """Serve the store on ``listener`` and join the group as rank 0; returns once every engine
    rank has joined too (Gloo: the full mesh connects in the constructor; NCCL: at the first
    broadcast), or raises within ``rendezvous_timeout_s``."""
    port = listener.getsockname()[1]
    spec = GroupSpec(
        group_id=secrets.token_hex(8),
        address=address,
        port=port,
        world_size=world_size,
        rank=0,
        backend=backend,
        mode="standalone",
        rendezvous_timeout_s=rendezvous_timeout_s,
        collective_timeout_s=collective_timeout_s,
    )
    store = open_store(address, port, world_size, rendezvous_timeout_s, listener)
    theirs = sglang_store(store, group_name, backend)
    ours = PrefixStore(f"weight_sync/{spec.group_id}/", store)  # our abort key, read by no one
    rendezvous = datetime.timedelta(seconds=rendezvous_timeout_s)
    collective = datetime.timedelta(seconds=collective_timeout_s)
    if backend == "gloo":
        pg = gloo_group(spec, theirs, rendezvous, collective)
        return TorchGroup(spec, pg, store, ours, torch.device("cpu"))
    assert device is not None and device.type == "cuda", "NCCL sends from a CUDA device"
    pg = cast(Any, nccl.nccl_group(spec, theirs, collective))
    return TorchGroup(spec, pg, store, ours, device)


def connect_nccl(group: TorchGroup) -> None:
    """Create the trainer's NCCL communicator now (``ncclCommInitRank``, unbounded: run it on a
    thread and bound the wait). The engines create theirs lazily in their first receive, under
    the same store key (each ``ProcessGroupNCCL``'s first communicator: ``"0"``)."""
    device = group.device
    with torch.cuda.device(device):
        group.process_group.eager_connect_single_device(device)  # type: ignore[attr-defined]
