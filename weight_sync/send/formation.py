"""Forming the sync group: choosing each member's route, opening the rings and the broadcast
group, and bringing the members in.

The trainer (rank 0 of every part) probes its members first (``protocol.Pusher``); from their
answers this module decides how each one receives -- the broadcast group, the host's
shared-memory ring, or the CUDA ring on the trainer's GPU (see ``weight_sync.send.routes``) -- opens
the trainer's end of every part, asks the members to join, and waits for all of them. A group
that does not form is closed on both sides before the error is raised, naming the members it
blames.
"""

from __future__ import annotations

import logging
import secrets
import socket
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weight_sync.config import SyncConfig
from weight_sync.control.deadline import Deadline
from weight_sync.control.plane import collect
from weight_sync.errors import TransportError, WeightSyncError, WorkerFailedError, first_line
from weight_sync.send.roster import GRACE_S, Roster
from weight_sync.send.routes import Route, choose_routes
from weight_sync.transport import (
    Fanout,
    TorchGroup,
    Transport,
    bind_listener,
    cuda_ipc,
    listen_address,
    shm,
)
from weight_sync.transport.devices import CPU, gpu_uuid
from weight_sync.transport.ring import RingUnavailableError
from weight_sync.wire.blame import excuse_followers
from weight_sync.wire.metadata import (
    TRAINER_RANK,
    BackendName,
    GroupSpec,
    MemberInfo,
    ModeName,
    RelaySpec,
)

logger = logging.getLogger(__name__)

Ring = shm.ShmWriter | cuda_ipc.CudaIpcWriter  # the trainer's end of a ring


@dataclass(frozen=True)
class Formed:
    """A group every member joined: the transport (this process is rank 0), each member's
    route through it, and whether any of them receives across a network link (from another
    host, or one not known to be this one)."""

    group: Transport
    routes: list[Route]
    far: bool


def form_group(
    roster: Roster,
    config: SyncConfig,
    infos: list[MemberInfo],
    device: torch.device,
    deadline: Deadline,
    *,
    ipc_refused: bool = False,
) -> Formed:
    """Form a group over the members of ``roster`` (``infos``: their answers to the probe), for
    weights on ``device``; every wait draws on ``deadline``.

    On failure both ends are closed (the members asked to leave) and members that died or froze
    are dropped from ``roster``. Raises ``cuda_ipc.IpcUnavailableError`` where the CUDA ring
    could not be had (the caller may form again with ``ipc_refused``), a ``WeightSyncError``
    naming the members to blame, where the group can tell, otherwise.
    """
    # A group over a job's world is made by every rank of it (new_group is collective): no
    # member of such a group can leave it to a relay.
    relay = config.relay and config.group_mode != "job"
    here = shm.host_key()
    writers: dict[Route, Ring] = {}
    try:
        routes = choose_routes(
            backend=config.backend,
            same_host=config.same_host,
            trainer_gpu=gpu_uuid(device),
            trainer_host=here,
            infos=infos,
            ipc_refused=ipc_refused,
            relay=relay,
        )
        backend = routes.backend
        # NCCL sends from the weights' GPU; Gloo (and the rings beside it) from host buffers.
        send_device = device if backend == "nccl" else CPU
        mode = _choose_mode(config, infos, backend)
        group_id = secrets.token_hex(8)
        kinds, writers = _open_rings(config, group_id, list(routes.routes), infos, send_device)
        remote = sum(i.ranks for i, kind in zip(infos, kinds, strict=True) if kind == "group")
        address = listen_address(config.master_addr, config.interface)
        listener = bind_listener(address) if remote else None
    except BaseException as exc:  # before any member was told its place
        _close_all(list(writers.values()), None)
        roster.plane.unformed(first_line(exc))
        raise
    rendezvous_s = deadline.left(config.rendezvous_timeout_s)
    common = {
        "group_id": group_id,
        "backend": backend,
        "mode": mode,
        "rendezvous_timeout_s": rendezvous_s,
        "collective_timeout_s": config.collective_timeout_s,
    }

    # The members that relay the push on their host (see transport.relay): their followers, and
    # the id of the ring each opens.
    followers = {
        leader: [i for i, of in routes.leaders.items() if of == leader]
        for leader in set(routes.leaders.values())
    }
    relays = {leader: secrets.token_hex(8) for leader in followers}

    def group_spec(rank: int, relay: RelaySpec | None = None) -> GroupSpec:
        assert listener is not None
        return GroupSpec(
            address=address,
            port=listener.getsockname()[1],
            world_size=remote + 1,
            rank=rank,
            relay=relay,
            **common,
        )

    def spec(member: int, rank: int, kind: Route) -> GroupSpec:
        """Member ``member``'s spec: rank ``rank`` of the group, of the ring ``kind``, or of
        the ring of the member it takes the push from."""
        if kind == "relay":
            leader = routes.leaders[member]
            ring_id = relays[leader]
            return GroupSpec(
                **{**common, "group_id": ring_id},
                address=shm.socket_name(ring_id),
                port=0,
                transport=kind,
                rank=rank,
                world_size=len(followers[leader]) + 1,
            )
        if kind != "group":
            ring = writers[kind]
            return GroupSpec(
                address=ring.name,
                port=0,
                transport=kind,
                world_size=ring.world_size,
                rank=rank,
                **common,
            )
        if member not in relays:
            return group_spec(rank)
        return group_spec(
            rank,
            RelaySpec(
                group_id=relays[member],
                readers=len(followers[member]),
                slot_bytes=shm.slot_bytes_for(config.sized_bucket_bytes, config.alignment),
            ),
        )

    # A relay's followers count their ranks in its ring: their part is that leader's.
    part_of = [
        ("relay", routes.leaders[i]) if kind == "relay" else kind for i, kind in enumerate(kinds)
    ]
    firsts = first_ranks([info.ranks for info in infos], part_of)
    specs = [
        spec(member, rank, kind)
        for member, (rank, kind) in enumerate(zip(firsts, kinds, strict=True))
    ]
    join_s = deadline.left(config.rpc_timeout_s)
    joining = roster.plane.join(specs, config.max_metadata_bytes, join_s)
    parts: list[Transport] = []
    try:
        # The rings first: taking their readers in is quick and local, while an NCCL group's
        # formation (check-in, communicator, warm-up) may take seconds of the readers' budget.
        for ring in writers.values():
            ring.accept(deadline.left(rendezvous_s))
        if listener is not None:
            on = send_device if backend == "nccl" else None
            parts.append(TorchGroup.join(group_spec(TRAINER_RANK), listener, device=on))
    except BaseException as exc:
        _close_all([*parts, *writers.values()], listener)
        failure = None
        if isinstance(exc, WeightSyncError):  # the members that joined fail about now
            outcomes = collect(roster.plane, joining, min(GRACE_S, deadline.remaining()))
            excuse_followers(outcomes, routes.leaders)
            failure = None if outcomes.ok else roster.blame(outcomes, "join", rendezvous_s)
        roster.leave(deadline)
        if isinstance(exc, WeightSyncError) and not isinstance(exc, cuda_ipc.IpcUnavailableError):
            raise _formation_error(exc, failure, firsts, kinds, infos) from exc
        raise
    parts.extend(writers.values())  # the group first: Fanout starts its broadcast first
    group = parts[0] if len(parts) == 1 else Fanout(parts, send_device)
    try:
        roster.replies(joining, "join", join_s)
    except BaseException:
        group.close()
        roster.leave(deadline)
        raise
    if writers or relays:
        counts = {kind: kinds.count(kind) for kind in ("group", "shm", "cuda_ipc", "relay")}
        logger.info(
            "routes of the %d members: %s",
            len(kinds),
            ", ".join(f"{kind} {n}" for kind, n in counts.items() if n),
        )
    far = any(info.host is None or info.host != here for info in infos)
    return Formed(group, list(kinds), far)


def _choose_mode(config: SyncConfig, infos: list[MemberInfo], backend: BackendName) -> ModeName:
    here = dist.is_available() and dist.is_initialized()
    # 'world' makes each member's process group the default one: that needs one rank per
    # process, which a member bringing several ranks (an engine's workers) cannot promise.
    anyone = here or any(info.has_default_group or info.ranks > 1 for info in infos)
    if config.group_mode == "auto":
        # NCCL always stands alone: a standalone group is aborted in the background, while
        # tearing down a world runs torch's global cleanup on the calling thread (see
        # transport.torch_group), which a leaving member must not sit through.
        return "standalone" if anyone or backend == "nccl" else "world"
    if config.group_mode == "job":
        # new_group over the job's world: Gloo only (an NCCL group stands alone, as above).
        return "standalone" if backend == "nccl" else "job"
    if config.group_mode == "world" and anyone:
        raise TransportError(
            "group_mode='world' but a member already has a torch.distributed default group (or "
            "brings several ranks, as a tensor-parallel engine does); use group_mode="
            "'standalone' or 'auto'"
        )
    return config.group_mode


def first_ranks(ranks: Sequence[int], parts: Sequence[Hashable]) -> list[int]:
    """Each member's first rank in its part of the push (``parts``: its route -- the group or
    a ring), counting from 1 in each (the trainer is rank 0 of every part). A member bringing
    several ranks (an engine with tensor parallelism: each of its workers receives every byte)
    numbers the rest on from its first."""
    following: dict[Hashable, int] = {}
    firsts = []
    for count, part in zip(ranks, parts, strict=True):
        firsts.append(following.get(part, 1))
        following[part] = firsts[-1] + count
    return firsts


def _open_rings(
    config: SyncConfig,
    group_id: str,
    kinds: list[Route],
    infos: Sequence[MemberInfo],
    device: torch.device,
) -> tuple[list[Route], dict[Route, Ring]]:
    """Open the rings the routes call for; members whose ring cannot be had fall back -- from
    the CUDA ring to the host ring, from the host ring to the group. Returns every member's
    route as it now stands, and the rings by route."""
    writers: dict[Route, Ring] = {}
    wanted = list(kinds)
    fallbacks: tuple[tuple[Route, Route], ...] = (("cuda_ipc", "shm"), ("shm", "group"))
    for kind, fallback in fallbacks:
        members = [index for index, taken in enumerate(kinds) if taken == kind]
        if not members:
            continue
        readers = sum(infos[index].ranks for index in members)
        ring = _open_ring(config, group_id, readers, kind, device)
        if ring is not None:
            writers[kind] = ring
            continue
        for index in members:
            kinds[index] = fallback
    stranded = [
        i
        for i, (want, got) in enumerate(zip(wanted, kinds, strict=True))
        if want != "group" and got == "group"
    ]
    if device.type == "cuda" and stranded:
        _close_all(list(writers.values()), None)
        raise TransportError(
            f"worker(s) {stranded} share the trainer's GPU, which an NCCL group cannot hold, and "
            "no ring could be opened for them (see the warnings above); free memory or use "
            "backend='gloo'"
        )
    return kinds, writers


def _open_ring(
    config: SyncConfig,
    group_id: str,
    readers: int,
    kind: Route = "shm",
    device: torch.device = CPU,
) -> Ring | None:
    """The ring ``kind`` for ``readers`` ranks, sending from ``device``; None where it cannot
    be had (no room, no IPC: those members fall back, see ``_open_rings``)."""
    slot_bytes = shm.slot_bytes_for(config.sized_bucket_bytes, config.alignment)
    timeout_s = config.collective_timeout_s
    try:
        if kind == "cuda_ipc":
            writer: Ring = cuda_ipc.CudaIpcWriter(group_id, readers, slot_bytes, timeout_s, device)
        else:
            writer = shm.ShmWriter(group_id, readers, slot_bytes, timeout_s, device)
        return writer
    except RingUnavailableError as exc:
        instead = (
            ("the host ring", "CUDA IPC") if kind == "cuda_ipc" else ("the group", "shared memory")
        )
        logger.warning("workers on this host take %s instead of %s: %s", *instead, exc)
        return None


def _close_all(parts: Sequence[Transport], listener: socket.socket | None) -> None:
    for part in parts:
        part.close()
    if listener is not None:
        listener.close()


def _formation_error(
    exc: WeightSyncError,
    failure: WeightSyncError | None,
    firsts: Sequence[int],
    kinds: Sequence[Route],
    infos: Sequence[MemberInfo],
) -> WeightSyncError:
    """The error of a group that did not form: the group's own verdict, naming the members
    whose ranks it blames (a duplicate GPU, a failed NCCL init, mismatched NCCL settings), or
    else what the members' join calls reported."""
    ranks = set(getattr(exc, "ranks", ()))
    blamed = [
        index
        for index, (first, kind, info) in enumerate(zip(firsts, kinds, infos, strict=True))
        if kind == "group" and ranks & set(range(first, first + info.ranks))
    ]
    if not blamed:
        return failure or exc
    dropped = failure.dropped if isinstance(failure, WorkerFailedError) else []
    return WorkerFailedError(
        f"the sync group could not form, because of worker(s) {blamed}: {exc}", blamed, dropped
    )
