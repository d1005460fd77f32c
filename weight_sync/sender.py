"""Trainer side of the data plane: check the state dict, plan, pack, broadcast."""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeGuard, cast

import torch
from torch.distributed.tensor import DTensor

from weight_sync import mapping
from weight_sync.config import SyncConfig
from weight_sync.deadline import Deadline
from weight_sync.mapping import Transform
from weight_sync.metadata import DTYPES, MAX_NAME_CHARS, SyncPlan, TensorMeta, Tied, dtype_name
from weight_sync.packing import (
    Checksum,
    Packer,
    Staging,
    byte_view,
    checksum_of,
    read_checksums,
    read_values,
    staging_slots,
)
from weight_sync.planner import direct_threshold, make_plan
from weight_sync.transport import Transport, Work

logger = logging.getLogger(__name__)

StateDict = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
Rename = Callable[[str], str | None]
_CASTABLE = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
_FINITE_CHUNK = 1 << 22  # elements per chunk of the exact finiteness check
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_SENDABLE = frozenset(DTYPES.values())
# Read column by column: see _plain_entries.
_DTYPE, _SHAPE, _LAYOUT, _ITEMSIZE, _IS_CPU, _REQUIRES_GRAD = map(
    operator.attrgetter, ("dtype", "shape", "layout", "itemsize", "is_cpu", "requires_grad")
)
# isfinite has kernels for these; fp8/fp4 storage dtypes are skipped (too coarse to hold a NaN
# the trainer did not put there on purpose).
_FINITE_CHECKABLE = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128}
)


@dataclass(frozen=True)
class Entries:
    """A checked state dict in the workers' names: each distinct tensor once, in order, and the
    names that share one of those tensors' storage (tied weights), which travel as metadata."""

    names: list[str]
    tensors: list[torch.Tensor]
    tied: list[Tied] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.names) + len(self.tied)


def check_state_dict(
    state_dict: StateDict,
    config: SyncConfig,
    rename: Rename | None = None,
    transform: Transform | None = None,
    *,
    sharded: bool = False,
) -> Entries:
    """Check every entry; raises ``TypeError``/``ValueError`` naming the bad entry, before
    anything is sent anywhere.

    ``transform`` (see ``weight_sync.mapping``) and then ``rename`` (``None`` drops a tensor)
    map the trainer's names to the workers'; two tensors ending up under one name is refused,
    since one of them would silently be lost. Names whose tensor is a view of exactly the same
    bytes as an earlier one (tied weights) are sent once. ``sharded`` admits DTensors (see
    ``weight_sync.sharded``, which checks their values itself). A delta push
    (``config.delta``) of GPU tensors is refused (see the message).
    """
    names, tensors = _columns(state_dict, config.max_tensors, rename, transform)
    entries = None if sharded else _plain_entries(names, tensors)
    if entries is None:
        entries = _entries(
            names, tensors, sharded, renamed=rename is not None or transform is not None
        )
    if config.delta and not sharded and not all(map(_IS_CPU, entries.tensors)):
        raise ValueError(
            "delta=True needs the weights in host memory: its baseline lives there and each push "
            "compares on the host, which for GPU weights is a device-to-host copy of the whole "
            "model every push -- slower than sending it dense over NCCL. Set delta=False for GPU "
            "weights, or push host (CPU) tensors; nothing was sent"
        )
    if config.check_finite and not sharded:
        _check_finite(entries.names, entries.tensors, config.cast_dtype)
    return entries


def _columns(
    state_dict: StateDict, limit: int, rename: Rename | None, transform: Transform | None
) -> tuple[list, list]:
    """The names and the tensors, mapped, as two lists: no tuple per entry, which on thousands
    of tensors would wake the garbage collector every push (it cost more than the checks)."""
    if isinstance(state_dict, Mapping) and rename is None and transform is None:
        names, tensors = list(state_dict), list(state_dict.values())
    else:
        items: Iterable = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
        if transform is not None:
            items = transform(items)
        if rename is not None:
            items = mapping.rename(rename)(items)
        pairs = list(itertools.islice(items, limit + 1))
        for entry in pairs:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise TypeError(f"expected (name, tensor) pairs, got {type(entry).__name__}")
        names, tensors = [name for name, _ in pairs], [tensor for _, tensor in pairs]
    if len(names) > limit:
        raise ValueError(
            f"more than max_tensors={limit} tensors; raise the limit in SyncConfig or push in parts"
        )
    return names, tensors


def _plain_entries(names: list, tensors: list) -> Entries | None:
    """The usual state dict, checked column by column: distinct names, plain dense CPU or CUDA
    tensors of dtypes that travel, no two at one address (so none tied). A training loop pushes
    one every step, and on a model of thousands of tensors a Python loop over them costs more
    than the push's own work per tensor. None for anything else: ``_entries`` then goes entry
    by entry, naming what is wrong or finding the ties; where this returns entries, it returns
    the same ones."""
    if not names:
        return Entries([], [])
    if set(map(type, names)) != {str} or not set(map(type, tensors)) <= _PLAIN_TENSORS:
        return None
    lengths = list(map(len, names))
    if (
        min(lengths) < 1 or max(lengths) > MAX_NAME_CHARS or len(set(names)) < len(names)
        or set(map(_LAYOUT, tensors)) != {torch.strided}
        or not set(map(_DTYPE, tensors)) <= _SENDABLE
        or not (all(map(_IS_CPU, tensors)) or all(t.is_cpu or t.is_cuda for t in tensors))
    ):  # fmt: skip
        return None
    addresses = set(map(torch.Tensor.data_ptr, tensors))  # dense tensors on a real device only
    if len(addresses) < len(tensors):
        return None
    if any(map(_REQUIRES_GRAD, tensors)):
        tensors = list(map(_detached, tensors))
    return Entries(names, tensors)


def _entries(names: list, tensors: list, sharded: bool, renamed: bool) -> Entries:
    """Check each entry, raising for the first bad one; find tied weights (names sharing one
    tensor's exact bytes), which travel as metadata."""
    entries = Entries([], [], [])
    seen: set[str] = set()
    storages: dict[tuple, int] = {}
    for name, tensor in zip(names, tensors, strict=True):
        dtensor = _check_entry(name, tensor, sharded)
        if name in seen:
            raise ValueError(
                f"tensor name {name!r} appears twice{' (after renaming)' if renamed else ''}"
            )
        seen.add(name)
        key = _storage_key(tensor, dtensor)
        if key is not None and key in storages:
            entries.tied.append(Tied(name=name, tensor=storages[key]))
        else:
            if key is not None:
                storages[key] = len(entries.tensors)
            entries.names.append(name)
            # A DTensor stays the very object the sharded source knows, to gather it by.
            entries.tensors.append(tensor if dtensor else _detached(tensor))
    return entries


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    # Packing must not record autograd history; detaching only what has any costs nothing
    # for a state_dict(), whose tensors are detached already.
    return tensor.detach() if tensor.requires_grad else tensor


def _storage_key(tensor: torch.Tensor, dtensor: bool = False) -> tuple | None:
    """Identifies a tensor's exact bytes: equal keys mean one tensor under two names. Only
    exact aliases count (same storage, offset, shape, strides and dtype), not overlapping
    views; tensors with no bytes are never tied. (Run once per tensor per push: each part is
    the cheapest accessor there is.)"""
    local = cast(DTensor, tensor).to_local() if dtensor else tensor
    if not local.numel():
        return None
    # The address of the first element stands for storage and offset (storages never
    # overlap); the device's index (-1 on the CPU) for the device (only CPU and CUDA pass).
    return local.data_ptr(), local.stride(), tensor.shape, local.dtype, local.get_device()


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    return isinstance(tensor, DTensor)


def wire_dtype(dtype: torch.dtype, cast_dtype: str | None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels in: ``cast_dtype`` for the standard floats."""
    if cast_dtype is None or dtype not in _CASTABLE:
        return dtype
    return DTYPES[cast_dtype]


def _check_finite(
    names: Sequence[str], tensors: Sequence[torch.Tensor], cast_dtype: str | None
) -> None:
    bad = [
        name for name, ok in zip(names, finite_flags(tensors, cast_dtype), strict=True) if not ok
    ]
    if bad:
        shown = ", ".join(repr(name) for name in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(f"NaN or Inf{_beyond(cast_dtype)} in {shown}{more}; nothing was sent "
                         "(check_finite=True in SyncConfig)")  # fmt: skip


def finite_flags(tensors: Sequence[torch.Tensor], cast_dtype: str | None) -> list[bool]:
    """``is_finite`` of every tensor. Host tensors are checked one by one (``_all_finite``,
    tuned for the CPU); GPU tensors together on their devices (``device_finite_flags``), read
    back with one host synchronisation per device for the whole push instead of one to three
    per tensor."""
    flags = [True] * len(tensors)
    on_gpu: list[int] = []
    for index, tensor in enumerate(tensors):
        if tensor.is_cuda:
            on_gpu.append(index)
        else:
            flags[index] = is_finite(tensor, cast_dtype)
    if on_gpu:
        found = device_finite_flags([tensors[index] for index in on_gpu], cast_dtype)
        for index, ok in zip(on_gpu, read_values(found), strict=True):
            flags[index] = ok
    return flags


def device_finite_flags(
    tensors: Sequence[torch.Tensor], cast_dtype: str | None
) -> list[torch.Tensor | bool]:
    """Per tensor, whether it arrives free of NaN and Inf (as ``is_finite``), computed on the
    tensors' own devices without a host synchronisation: a bool where the answer needs no
    reduction, else a one-element bool tensor on the tensor's device (read with
    ``packing.read_values``).

    The largest magnitude of each tensor comes from ``torch._foreach_norm(..., inf)``, one
    fused launch per dtype and device on CUDA, whose maximum propagates NaN
    (aten/src/ATen/native/cuda/ForeachReduceOp.cu, ``LpNormFunctor``: ``max_propagate_nan``);
    a tensor is finite exactly when that is at most its dtype's largest value -- or the wire
    dtype's, when a cast narrows the range (a value beyond it would arrive as Inf). Exact: no
    sum that could overflow from finite values. Complex tensors are checked as their real and
    imaginary parts.
    """
    flags: list[torch.Tensor | bool] = [True] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.dtype in _FINITE_CHECKABLE and tensor.numel():
            groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    for (_, dtype), indices in groups.items():
        parts = [tensors[index] for index in indices]
        if dtype.is_complex:
            parts = [torch.view_as_real(part) for part in parts]
        wire = wire_dtype(dtype, cast_dtype)
        limit = min(torch.finfo(wire).max, torch.finfo(parts[0].dtype).max)
        largest = torch.stack(torch._foreach_norm(parts, float("inf")))
        within = (largest <= limit).split(1)
        for index, ok in zip(indices, within, strict=True):
            flags[index] = ok
    return flags


def nonfinite_error(cast_dtype: str | None) -> ValueError:
    """The error for non-finite values found on other ranks of a sharded trainer."""
    return ValueError(f"NaN or Inf{_beyond(cast_dtype)} in the trainer's shards; nothing was "
                      "sent (check_finite=True in SyncConfig)")  # fmt: skip


def _beyond(cast_dtype: str | None) -> str:
    return f" (or values beyond torch.{cast_dtype}'s range)" if cast_dtype else ""


def is_finite(tensor: torch.Tensor, cast_dtype: str | None) -> bool:
    """Whether ``tensor``, sent with ``cast_dtype``, arrives free of NaN and Inf (dtypes with no
    such values, and fp8/fp4 storage dtypes, pass)."""
    if tensor.dtype not in _FINITE_CHECKABLE:
        return True
    return _all_finite(tensor, wire_dtype(tensor.dtype, cast_dtype))


def _all_finite(tensor: torch.Tensor, wire: torch.dtype | None = None) -> bool:
    """Whether ``tensor`` (sent as ``wire``, if given) holds only finite values, in one
    reduction instead of ``isfinite(t).all()``, which would allocate a bool per element (and is
    30x slower on CPU).

    A NaN or Inf anywhere makes the sum non-finite, so a finite sum proves the tensor finite.
    A sum can also overflow from finite values (half precision is summed in float32 to make that
    rare): only then is the exact check run, in bounded chunks. A cast to a narrower range also
    checks the extremes: a value beyond it would arrive as Inf.
    """
    if not tensor.numel():
        return True
    if wire is not None and torch.finfo(wire).max < torch.finfo(tensor.dtype).max:
        low, high = torch.aminmax(tensor)  # NaN propagates: the comparisons fail
        limit = torch.finfo(wire).max
        return bool(low >= -limit) and bool(high <= limit)
    wide = torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype
    if bool(torch.isfinite(tensor.sum(dtype=wide))):
        return True
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(chunk).all()) for chunk in torch.split(flat, _FINITE_CHUNK))


class PushPlanner:
    """Plans pushes for a transport whose buffers live on ``device``, reusing the last plan
    while the layout is unchanged -- the usual case in a training loop, which pushes the same
    names, dtypes and shapes every step -- so neither the plan nor its digest is rebuilt.

    Tensors of at least ``direct_min_bytes`` (resolved for ``device``: ``direct_threshold``)
    that are contiguous, already on ``device`` and not cast are sent from their own storage;
    the rest are packed (and cast while packing).
    """

    def __init__(self, config: SyncConfig, device: torch.device) -> None:
        self._config = config
        self._device = device
        self._last: _Planned | None = None

    def plan(self, entries: Entries) -> SyncPlan:
        # Column by column, as in _plain_entries: this runs on every push. The shapes are
        # compared one by one as they are read, not kept: thousands of torch.Size objects alive
        # at once would wake the garbage collector.
        names, tensors, tied = entries.names, entries.tensors, entries.tied
        dtypes = list(map(_DTYPE, tensors))
        casts = {dtype: wire_dtype(dtype, self._config.cast_dtype) for dtype in set(dtypes)}
        wire = list(map(casts.__getitem__, dtypes))
        direct = self._direct(tensors, dtypes, wire)
        last = self._last
        if (
            last is not None and last.names == names and last.dtypes == dtypes
            and last.direct == direct and last.tied == tied
            and all(map(operator.eq, map(_SHAPE, tensors), last.shapes))
        ):  # fmt: skip
            return last.plan
        metas = [
            TensorMeta.of(name, tensor, dtype)
            for name, tensor, dtype in zip(names, tensors, wire, strict=True)
        ]
        config = self._config
        plan = make_plan(metas, config.bucket_bytes, config.alignment, direct, tied)
        shapes = [meta.shape for meta in metas]
        self._last = _Planned(list(names), dtypes, shapes, direct, list(tied), plan)
        return plan

    def _direct(
        self, tensors: list[torch.Tensor], dtypes: list[torch.dtype], wire: list[torch.dtype]
    ) -> list[bool]:
        """Which tensors are sent from their own storage: large enough (the full tensor's
        size, for a DTensor too), contiguous, on the transport's device and not cast."""
        config = self._config
        threshold = direct_threshold(
            config.direct_min_bytes, self._device.type, config.bucket_bytes
        )
        direct = [False] * len(tensors)
        if threshold is None:
            return direct
        sizes = map(operator.mul, map(torch.Tensor.numel, tensors), map(_ITEMSIZE, dtypes))
        large = itertools.compress(
            range(len(tensors)), map(operator.ge, sizes, itertools.repeat(threshold))
        )
        for index in large:
            tensor = tensors[index]
            direct[index] = (
                _is_contiguous(tensor)
                and tensor.device == self._device
                and dtypes[index] == wire[index]
            )
        return direct


@dataclass(frozen=True)
class _Planned:
    """A plan and the layout it was made for (a tensor's shape as its plan has it: a tuple)."""

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    direct: list[bool]
    tied: list[Tied]
    plan: SyncPlan


def _is_contiguous(tensor: torch.Tensor) -> bool:
    # A DTensor is gathered into a fresh, contiguous tensor just before it is sent.
    return is_dtensor(tensor) or tensor.is_contiguous()


def _check_entry(name: object, tensor: object, sharded: bool = False) -> bool:
    """Raises for an entry that cannot be sent; returns whether the tensor is a DTensor."""
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be str, got {type(name).__name__} ({name!r})")
    if not name or len(name) > MAX_NAME_CHARS:
        raise ValueError(f"tensor name must have 1..{MAX_NAME_CHARS} characters: {name[:80]!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    dtensor = is_dtensor(tensor)
    if dtensor and not sharded:
        raise TypeError(
            f"{name!r} is a DTensor; push a weight_sync.sharded.ShardedSource of the state "
            "dict (from every trainer rank), or pass tensor.full_tensor()"
        )
    if tensor.layout != torch.strided:
        raise ValueError(f"{name!r}: only dense tensors can be sent, not {tensor.layout}")
    dtype_name(tensor.dtype)  # TypeError for dtypes that cannot travel as bytes
    if not (tensor.is_cpu or tensor.is_cuda):
        raise ValueError(
            f"{name!r} lives on {tensor.device}; only CPU and CUDA tensors can be sent"
        )
    return dtensor


class Sender:
    """Broadcasts a plan's buckets from this rank: packing bucket k+1 while bucket k is on the wire.

    On a GPU (NCCL) a steady-state push synchronises with the host once, at its end: packing
    runs on the current stream, each broadcast is ordered after it by the process group (its
    NCCL stream waits on the current one: ProcessGroupNCCL.cpp, ``collective`` ->
    ``syncStream``), and before a staging buffer is packed again the current stream waits for
    the broadcast still reading it (``Work.after``: ``WorkNCCL::synchronizeStream``, an event
    wait on the device) -- the host never polls in between. On the host (Gloo, the ring)
    ``after`` is ``wait``, and the loop is what it always was there.
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        # The last plan's staging buffers and packing, kept: a training loop pushes one plan
        # over and over, and packs it then with no work per tensor (see packing.Staging).
        self._staging: Staging | None = None

    def send(
        self,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        deadline: Deadline | None = None,
        with_checksums: bool = False,
        on_packed: Callable[[int, torch.Tensor], None] | None = None,
    ) -> list[int] | None:
        """Broadcast every bucket; returns each bucket's checksum (``packing.checksum``) if
        ``with_checksums``.

        Each collective is bounded by the group's timeout and by what is left of ``deadline``.
        ``on_packed(index, data)`` sees each bucket's bytes as it goes out, while the bucket
        before it is still on the wire (a delta baseline copies them).
        """
        return self.start(plan, tensors, deadline, with_checksums, on_packed).finish()

    def start(
        self,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        deadline: Deadline | None = None,
        with_checksums: bool = False,
        on_packed: Callable[[int, torch.Tensor], None] | None = None,
    ) -> InFlight:
        """``send`` up to its one host synchronisation: every bucket packed and its broadcast
        posted; ``finish`` on what this returns waits for them. Split so that the GPU suite can
        check that nothing before ``finish`` synchronises with the host."""
        transport = self._transport
        sums: list[Checksum] | None = [] if with_checksums else None
        works: list[Work] = []
        if not plan.buckets:
            return InFlight(works, sums)
        # GPU tensors over a host transport: their bytes cross in pinned buffers.
        crossing = _cuda_devices(tensors) if transport.device.type == "cpu" else []
        if (
            self._staging is None
            or self._staging.plan is not plan
            or (crossing and not self._staging.pinned)
        ):
            self._staging = Staging(plan, transport.device, pinned=bool(crossing))
        packer = Packer(plan, tensors, self._staging)
        buffers = self._staging.buffers
        slots = staging_slots(plan)
        # On a GPU two broadcasts stay in flight, so the NCCL stream never idles between
        # buckets. On the host (where ``after`` is ``wait``) one, as before: a second one in
        # flight measured no faster on Gloo over 2 cores (it competes with packing for them).
        in_flight = 2 if transport.device.type == "cuda" else 1
        for index, bucket in enumerate(plan.buckets):
            if index >= 2:
                # The broadcast two buckets back read the staging buffer this bucket may be
                # packed into: stream order, not a host wait (on the host, long done already).
                works[index - 2].after()
            slot = slots[index]
            if slot is None:  # direct: the tensor's own bytes go on the wire
                data = byte_view(tensors[bucket.segments[0].tensor])
                assert data.device == transport.device
            else:
                data = packer.pack(index, buffers[slot])
                for device in crossing:  # Gloo reads the bytes from its own threads
                    torch.cuda.current_stream(device).synchronize()
            if sums is not None:
                sums.append(checksum_of(data))
            if on_packed is not None:
                on_packed(index, data)
            if in_flight == 1 and index >= 1:
                works[index - 1].after()
            timeout = None if deadline is None else deadline.left(float("inf"))
            works.append(transport.broadcast(data, src=transport.rank, timeout_s=timeout))
        logger.debug("posted %d buckets, %d bytes", len(plan.buckets), plan.nbytes)
        return InFlight(works, sums)


@dataclass
class InFlight:
    """A push's broadcasts, posted, and its checksums, queued (see ``Sender.start``)."""

    works: list[Work]
    sums: list[Checksum] | None

    def finish(self) -> list[int] | None:
        """The push's one host synchronisation: a bounded wait on every broadcast, in order (one
        already complete returns at once), then every checksum read in one copy."""
        works, self.works = self.works, []
        for work in works:
            work.wait()
        return None if self.sums is None else read_checksums(self.sums)


def _cuda_devices(tensors: Sequence[torch.Tensor]) -> list[torch.device]:
    """The GPUs among ``tensors`` (copies from each run on that device's current stream). None
    where CUDA was never initialised in this process, and none for a sequence that makes its
    tensors on demand (a delta's blobs, always on the host): reading it would make them."""
    if not torch.cuda.is_initialized() or not isinstance(tensors, list | tuple):
        return []
    return list({tensor.device for tensor in tensors if tensor.is_cuda})
