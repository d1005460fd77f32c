"""The dedicated sync group, built from torch.distributed parts.

Two ways to build it, one way to use it:

* ``world`` -- the textbook path for processes with no torch.distributed world of their own:
  ``init_process_group`` makes the sync world and ``new_group`` the broadcast group. The library
  then owns the process's default group and destroys it on close.
* ``standalone`` -- for processes that already live in a world (an FSDP trainer, a
  tensor-parallel engine): a ``ProcessGroupGloo``/``ProcessGroupNCCL`` over a ``PrefixStore`` on
  our own ``TCPStore``. It never reads or touches the default group, and is driven through the
  group object's own methods (``dist.broadcast(group=...)`` refuses unregistered groups).

Either way the result is a ``ProcessGroup`` whose ``broadcast`` we call directly.
"""

from __future__ import annotations

import datetime
import fcntl
import logging
import os
import socket
import struct
import weakref
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo

from weight_sync.errors import SyncTimeoutError, TransportError
from weight_sync.metadata import GroupSpec
from weight_sync.transport.rendezvous import local_address_towards, open_store

logger = logging.getLogger(__name__)


class _GroupHandle(Protocol):
    """What we use of a ProcessGroup, ProcessGroupGloo or ProcessGroupNCCL object."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work: ...

    def shutdown(self) -> None: ...


class TorchWork:
    """A broadcast in flight.

    A Gloo work handle keeps the group's connections alive, so a handle lingering in an
    exception's traceback would keep peers blocked on us until their timeout instead of failing
    at once. The handle is therefore dropped as soon as it has been waited on, and by
    ``TorchGroup.close`` for handles nobody waited on.
    """

    def __init__(self, work: dist.Work, timeout: datetime.timedelta) -> None:
        self._work: dist.Work | None = work
        self._timeout = timeout

    def wait(self) -> None:
        work, self._work = self._work, None
        if work is None:
            raise TransportError("this broadcast was abandoned: the sync group was closed")
        try:
            work.wait(self._timeout)
            return
        except RuntimeError as exc:
            failure = exc
        finally:
            del work  # not even this frame may keep it alive in the traceback
        raise _collective_error(failure, self._timeout) from failure

    def release(self) -> None:
        self._work = None


class TorchGroup:
    """A member of the dedicated sync group (implements ``Transport``)."""

    def __init__(
        self, spec: GroupSpec, pg: _GroupHandle, store: dist.Store, device: torch.device
    ) -> None:
        self._spec = spec
        self._pg: _GroupHandle | None = pg
        self._store: dist.Store | None = store
        self._device = device
        self._timeout = datetime.timedelta(seconds=spec.collective_timeout_s)
        self._works: weakref.WeakSet[TorchWork] = weakref.WeakSet()

    @classmethod
    def join(cls, spec: GroupSpec, listener: socket.socket | None = None) -> TorchGroup:
        """Join (rank 0: create, taking over ``listener``) the group that ``spec`` describes.

        Blocks until every member has joined or ``spec.rendezvous_timeout_s`` passes.
        """
        assert (listener is not None) == (spec.rank == 0), "rank 0 and only rank 0 listens"
        store = open_store(
            spec.address, spec.port, spec.world_size, spec.rendezvous_timeout_s, listener
        )
        device = _device_for(spec.backend)
        rendezvous = datetime.timedelta(seconds=spec.rendezvous_timeout_s)
        collective = datetime.timedelta(seconds=spec.collective_timeout_s)
        ours = PrefixStore(f"weight_sync/{spec.group_id}/", store)  # random per group
        pg: _GroupHandle
        try:
            if spec.mode == "world":
                pg = _join_world(spec, ours, rendezvous, collective)
            elif spec.backend == "gloo":
                pg = _gloo_group(spec, ours, rendezvous, collective)
            else:
                pg = _nccl_group(spec, ours, collective)
        except RuntimeError as exc:
            raise _rendezvous_error(exc, spec) from exc
        logger.info(
            "joined sync group %s as rank %d/%d (%s, %s) via %s:%d",
            spec.group_id, spec.rank, spec.world_size, spec.backend, spec.mode,
            spec.address, spec.port,
        )  # fmt: skip
        return cls(spec, pg, store, device)

    @property
    def rank(self) -> int:
        return self._spec.rank

    @property
    def world_size(self) -> int:
        return self._spec.world_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def process_group(self) -> _GroupHandle:
        """The underlying group object, for tools that need other collectives on the same
        group (the benchmark's baselines). weight_sync itself only broadcasts."""
        if self._pg is None:
            raise TransportError("the sync group is closed")
        return self._pg

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> TorchWork:
        pg, timeout = self._open(), self._bound(timeout_s)
        assert tensor.dtype == torch.uint8 and tensor.is_contiguous()
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        options.timeout = timeout
        try:
            work = pg.broadcast([tensor], options)
        except RuntimeError as exc:
            raise _collective_error(exc, timeout) from exc
        handle = TorchWork(work, timeout)
        self._works.add(handle)
        return handle

    # One all-reduce tells every rank the outcome at once: nothing is left to announce.
    tally_is_final = True

    def vote(self, code: int, timeout_s: float | None = None) -> int:
        return self.tally(code, timeout_s)

    def tally(self, code: int, timeout_s: float | None = None) -> int:
        """The largest code of the group, on every rank (one all-reduce)."""
        pg, timeout = self._open(), self._bound(timeout_s)
        codes = torch.tensor([code], dtype=torch.int32, device=self._device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        options.timeout = timeout
        try:
            work = pg.allreduce([codes], options)
        except RuntimeError as exc:
            raise _collective_error(exc, timeout) from exc
        TorchWork(work, timeout).wait()
        return int(codes.item())

    def announce(self, code: int, timeout_s: float | None = None) -> int:
        return code

    def _open(self) -> _GroupHandle:
        if self._pg is None:
            raise TransportError("the sync group is closed; the next push rebuilds it")
        return self._pg

    def _bound(self, timeout_s: float | None) -> datetime.timedelta:
        """One collective's timeout: the group's, or less where the push has less left."""
        if timeout_s is None:
            return self._timeout
        return min(self._timeout, datetime.timedelta(seconds=max(timeout_s, 1e-3)))

    def close(self) -> None:
        """Leave the group so that peers notice at once: every handle to it is released, since
        Gloo keeps its connections open while any work handle lives."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        for handle in list(self._works):
            handle.release()
        try:
            if self._spec.mode == "world":
                dist.destroy_process_group()  # the sync world and every group in it
            else:
                pg.shutdown()
        except RuntimeError as exc:  # a dead peer must not stop us from leaving
            logger.warning("closing sync group %s: %s", self._spec.group_id, exc)
        self._store = None  # drops the rank-0 listening socket
        logger.info("left sync group %s (rank %d)", self._spec.group_id, self._spec.rank)


def _join_world(
    spec: GroupSpec,
    store: dist.Store,
    rendezvous: datetime.timedelta,
    collective: datetime.timedelta,
) -> dist.ProcessGroup:
    if dist.is_initialized():
        raise TransportError(
            "group_mode='world' needs a process without a torch.distributed default group, "
            "but this one has one; use group_mode='standalone' (or 'auto')"
        )
    interface = None
    if spec.backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        # init_process_group gives Gloo no device option: the environment is the only way to
        # keep its sockets on the interface that reaches the master (loopback by default).
        # Gloo reads it while the groups form, so it is set for exactly that long.
        interface = _interface_of(local_address_towards(spec.address))
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        dist.init_process_group(
            spec.backend, store=store, rank=spec.rank, world_size=spec.world_size,
            timeout=rendezvous,
        )  # fmt: skip
        group = dist.new_group(
            list(range(spec.world_size)), timeout=collective, backend=spec.backend
        )
    finally:
        if interface is not None:
            del os.environ["GLOO_SOCKET_IFNAME"]
    assert isinstance(group, dist.ProcessGroup)
    return group


def _gloo_group(
    spec: GroupSpec,
    store: dist.Store,
    rendezvous: datetime.timedelta,
    collective: datetime.timedelta,
) -> _GroupHandle:
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = rendezvous  # bounds the full-mesh connect
    # Bind the data sockets to the interface that reaches the master (loopback by default).
    options._devices = [ProcessGroupGloo.create_device(hostname=local_address_towards(spec.address))]
    group = ProcessGroupGloo(store, spec.rank, spec.world_size, options)
    group.set_timeout(collective)
    return cast(_GroupHandle, group)


def _nccl_group(spec: GroupSpec, store: dist.Store, collective: datetime.timedelta) -> _GroupHandle:
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = collective
    return cast(_GroupHandle, ProcessGroupNCCL(store, spec.rank, spec.world_size, options))


def _device_for(backend: str) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TransportError("backend 'nccl' needs a CUDA device in every member process")
    return torch.device("cuda", torch.cuda.current_device())


def _interface_of(ip: str) -> str | None:
    """The name of the IPv4 interface holding ``ip`` (Linux), or None if unknown."""
    siocgifaddr = 0x8915
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


def _collective_error(exc: Exception, timeout: datetime.timedelta) -> Exception:
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return SyncTimeoutError(
            f"a broadcast did not finish within {timeout.total_seconds()}s ({text}); a worker "
            "may be frozen or overloaded -- raise collective_timeout_s or check the workers"
        )
    return TransportError(
        f"a broadcast failed ({text}); a member of the sync group probably died -- check the "
        "workers' logs. The next push rebuilds the group."
    )


def _rendezvous_error(exc: Exception, spec: GroupSpec) -> Exception:
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return SyncTimeoutError(
            f"the sync group did not form within {spec.rendezvous_timeout_s}s ({text}); a "
            f"worker may not have joined or cannot reach {spec.address}:{spec.port}"
        )
    return TransportError(f"could not form the sync group: {text}")
