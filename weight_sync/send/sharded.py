"""Sharded trainers: push a state dict of DTensors (FSDP2, tensor parallel) held by many ranks.

Every trainer rank wraps its own shards in a ``ShardedSource`` (a collective: it checks that all
ranks hold the same tensors in the same order). The rank that owns the ``WeightUpdater`` passes
its source to ``updater.push``; every other rank calls ``source.serve()``. ``push_sharded`` does
both in one call.

The sending rank drives: as the sender packs each bucket, it names the next tensor to gather
over the trainers' own group, and every rank gathers it (``full_tensor``) together; the other
ranks drop their copy at once. So:

* no rank holds more than about a bucket of full tensors (plus one tensor split across buckets),
  never the whole model;
* only the sending rank talks to the workers;
* the trainers' collectives run in one order decided by one rank, between ranks that are all
  inside this call, so none of the training step's collectives can interleave with them.

A failed push tells the serving ranks to stop (they raise ``WeightSyncError``) instead of leaving
them waiting for a gather that will never come. If the sending *process* dies, they wait for the
trainers' group timeout, like any other collective of the training job.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from weight_sync.errors import WeightSyncError
from weight_sync.result import PushResult
from weight_sync.transport.devices import current_gpu
from weight_sync.wire.metadata import DTYPES, dtype_name
from weight_sync.wire.state_dict import is_dtensor, is_finite

logger = logging.getLogger(__name__)

# Commands from the sending rank, as (op, argument): one small broadcast each.
_GATHER, _CHECK_FINITE, _DONE, _ABORT = range(4)
_NO_CAST = -1
_CASTS = list(DTYPES)  # a cast dtype travels as its index here


class SourcePusher(Protocol):
    """What ``push_sharded`` needs of an updater (``protocol.Pusher`` and its subclasses): declared
    here so that this module, which the protocol imports, does not import the protocol back."""

    def push(self, state_dict: ShardedSource, *, partial: bool = False) -> PushResult: ...


class ShardedSource:
    """One trainer rank's view of a sharded state dict, for one push.

    ``group`` is the trainers' process group (default: the default group); it must contain
    every rank of the DTensors' device meshes. ``src`` is the rank, in ``group``, that owns
    the ``WeightUpdater``. Entries that are not DTensors (replicated buffers) are sent from
    ``src``'s copy with no gather.
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        src: int = 0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"a ShardedSource needs a state dict (Mapping), got {type(state_dict).__name__}"
            )
        if not dist.is_initialized():
            raise ValueError(
                "a ShardedSource needs the trainers' torch.distributed group; "
                "call init_process_group first"
            )
        self._group = group
        self._src = src
        self._rank = dist.get_rank(group)
        self._entries = list(state_dict.items())
        self._device = control_device(group)
        self._finished = False
        self._positions: dict[int, int] | None = None  # id(DTensor) -> entry index, on src
        self._alive: list[weakref.ref[torch.Tensor]] = []  # gathered tensors, while referenced
        self.peak_gathered_bytes = 0
        self._check_same_layout()

    @property
    def is_sender(self) -> bool:
        """Whether this rank sends (passes the source to ``WeightUpdater.push``)."""
        return self._rank == self._src

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The entries, with DTensors as they are (the updater gathers them as it sends)."""
        return iter(self._entries)

    def stand_ins(self) -> list[tuple[str, torch.Tensor]]:
        """Each entry's name with a tensor of its full shape and dtype and no storage: what the
        many-senders front lays a push of this source out from (``lane_rules.Gathered``)."""
        if not self.is_sender:
            raise ValueError("this rank does not send: call serve() on its ShardedSource")
        return [
            (name, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
            for name, tensor in self._entries
        ]

    def serve(self) -> int:
        """On a rank that does not send: take part in every gather the sending rank asks for,
        until its push ends. Returns the version pushed; raises ``WeightSyncError`` if the push
        failed (the sending rank has the details)."""
        if self.is_sender:
            raise ValueError("serve() is for the ranks that do not send; push this source instead")
        while True:
            op, argument = self._receive_command()
            if op == _GATHER:
                _gather(self._entries[argument][1])
            elif op == _CHECK_FINITE:
                self._agree_finite(_CASTS[argument] if argument != _NO_CAST else None)
            elif op == _DONE:
                return argument
            elif op == _ABORT:
                raise WeightSyncError(
                    f"the push from trainer rank {self._src} failed; see the error on that rank"
                )
            else:
                raise WeightSyncError(f"unknown command {op} from trainer rank {self._src}")

    # -- used by WeightUpdater.push on the sending rank ----------------------------------------

    def gathering(self, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """``tensors`` (from ``items``, possibly renamed) as a sequence that gathers each DTensor,
        with every rank, when the sender first reads it."""
        assert self.is_sender
        return _Gathered(self, tensors)

    def all_finite(self, cast_dtype: str | None) -> bool:
        """Whether every rank's shards are free of NaN and Inf (and, with ``cast_dtype``, of
        values beyond its range). Asks every rank; no full tensor is gathered."""
        code = _NO_CAST if cast_dtype is None else _CASTS.index(cast_dtype)
        self._send_command(_CHECK_FINITE, code)
        return self._agree_finite(cast_dtype)

    def finish(self, version: int | None) -> None:
        """End the push on every rank: ``version`` when it was committed, ``None`` if it failed."""
        assert self.is_sender
        if not self._finished:
            self._finished = True
            self._send_command(_DONE if version is not None else _ABORT, version or 0)
            logger.debug(
                "sharded push %s; at most %d bytes of full tensors held at once",
                "failed" if version is None else f"of version {version} done",
                self.peak_gathered_bytes,
            )

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The full tensor of one of this source's entries, gathered with every rank if it is a
        DTensor. ``peak_gathered_bytes`` records the most bytes of gathered tensors still
        referenced (by the sender, the wire) at once: the memory the gathering cost."""
        if not is_dtensor(tensor):
            return tensor
        if self._positions is None:
            self._positions = {id(t): index for index, (_, t) in enumerate(self._entries)}
        index = self._positions.get(id(tensor))
        assert index is not None, "gather() takes the DTensors of this source's own entries"
        self._send_command(_GATHER, index)
        full = _gather(tensor)
        self._alive = [ref for ref in self._alive if ref() is not None] + [weakref.ref(full)]
        held = sum(t.nbytes for ref in self._alive if (t := ref()) is not None)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, held)
        return full

    # -- internals ---------------------------------------------------------------------------

    def _check_same_layout(self) -> None:
        """All ranks must list the same names, dtypes and global shapes in the same order: a
        gather named by index on one rank must be the same tensor on every other."""
        layout = hashlib.sha256()
        for name, tensor in self._entries:
            layout.update(f"{name}\0{dtype_name(tensor.dtype)}\0{tuple(tensor.shape)}\n".encode())
        mine = torch.frombuffer(bytearray(layout.digest()), dtype=torch.uint8).to(self._device)
        theirs = mine.clone()
        dist.broadcast(theirs, src=self._global_src(), group=self._group)
        differs = torch.tensor([int(not torch.equal(mine, theirs))], device=self._device)
        dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=self._group)
        if differs.item():
            raise ValueError(
                "trainer ranks hold different state dicts (names, dtypes or shapes differ, or "
                "come in another order); every rank must wrap the same model's state_dict()"
            )

    def _agree_finite(self, cast_dtype: str | None) -> bool:
        ok = all(
            is_finite(tensor.to_local() if is_dtensor(tensor) else tensor, cast_dtype)
            for _, tensor in self._entries
        )
        flag = torch.tensor([int(ok)], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _send_command(self, op: int, argument: int) -> None:
        command = torch.tensor([op, argument], dtype=torch.int64, device=self._device)
        dist.broadcast(command, src=self._global_src(), group=self._group)

    def _receive_command(self) -> tuple[int, int]:
        command = torch.empty(2, dtype=torch.int64, device=self._device)
        dist.broadcast(command, src=self._global_src(), group=self._group)
        op, argument = command.tolist()
        return op, argument

    def _global_src(self) -> int:
        return self._src if self._group is None else dist.get_global_rank(self._group, self._src)


def push_sharded(
    state_dict: Mapping[str, torch.Tensor],
    updater: SourcePusher | None,
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    **push_options: Any,
) -> PushResult | int:
    """Call on every trainer rank: the one holding ``updater`` (rank ``src`` of ``group``)
    pushes, the others serve its gathers. Returns the ``PushResult`` on the sending rank and
    the version pushed on the others. ``push_options`` go to ``WeightUpdater.push``."""
    source = ShardedSource(state_dict, src=src, group=group)
    if source.is_sender:
        if updater is None:
            raise ValueError(f"rank {src} sends and needs the WeightUpdater")
        return updater.push(source, **push_options)
    if updater is not None:
        raise ValueError(f"only rank {src} holds the WeightUpdater; pass None on the others")
    return source.serve()


class _Gathered(Sequence[torch.Tensor]):
    """Gathers a DTensor when the sender reads it and keeps only the last one gathered: the
    sender reads tensors in plan order and a split tensor's pieces one after the other."""

    def __init__(self, source: ShardedSource, tensors: Sequence[torch.Tensor]) -> None:
        self._source = source
        self._tensors = tensors
        self._last: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self._tensors)

    def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        if self._last is None or self._last[0] != index:
            self._last = (index, self._source.gather(self._tensors[index]))
        return self._last[1]


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tensor.full_tensor() if is_dtensor(tensor) else tensor


def control_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the small tensors of ``group``'s control collectives live: the host wherever the
    group has a backend for it (Gloo; ``cpu:gloo,cuda:nccl`` included), else this thread's
    GPU (a group of NCCL alone, under whatever name: ``nccl``, ``cuda:nccl``)."""
    if takes_host_tensors(dist.get_backend_config(group)):
        return torch.device("cpu")
    return current_gpu()


def takes_host_tensors(backend_config: str) -> bool:
    """Whether a group of this backend config (``dist.get_backend_config``: ``device:backend``
    pairs, e.g. ``cpu:gloo,cuda:nccl``, or one backend's name) has a backend for host tensors."""
    pairs = [part.split(":", 1) for part in backend_config.split(",") if part]
    if all(len(pair) == 1 for pair in pairs):  # a bare name: NCCL takes GPU tensors only
        return "nccl" not in backend_config
    return any(len(pair) == 2 and pair[0] == "cpu" for pair in pairs)
