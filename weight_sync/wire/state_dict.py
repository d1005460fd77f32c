"""The state dict a push is given, checked before anything is sent anywhere: names, tensors,
dtypes, devices, ties, and (with ``check_finite``) NaN and Inf.

A bad entry raises ``TypeError``/``ValueError`` naming it here, in the caller's thread, rather
than surfacing later as a refusal on the workers or as a collective that never completes.
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeGuard, cast

import torch

if TYPE_CHECKING:  # importing it costs ~0.4 s of CPU in every process that imports weight_sync
    from torch.distributed.tensor import DTensor

from weight_sync.config import SyncConfig
from weight_sync.wire.mapping import Transform
from weight_sync.wire.mapping import rename as renaming
from weight_sync.wire.metadata import DTYPES, MAX_NAME_CHARS, Tied, dtype_name
from weight_sync.wire.packing import read_values

StateDict = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
Rename = Callable[[str], str | None]
_CASTABLE = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
_FINITE_CHUNK = 1 << 22  # elements per chunk of the exact finiteness check
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_SENDABLE = frozenset(DTYPES.values())
# Read column by column: see _plain_entries.
_DTYPE, _LAYOUT, _IS_CPU, _REQUIRES_GRAD = map(
    operator.attrgetter, ("dtype", "layout", "is_cpu", "requires_grad")
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

    ``transform`` (see ``weight_sync.wire.mapping``) and then ``rename`` (``None`` drops a tensor)
    map the trainer's names to the workers'; two tensors ending up under one name is refused,
    since one of them would silently be lost. Names whose tensor is a view of exactly the same
    bytes as an earlier one (tied weights) are sent once. ``sharded`` admits DTensors (see
    ``weight_sync.send.sharded``, which checks their values itself). A delta push
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
    if isinstance(state_dict, torch.nn.Module | torch.Tensor):
        raise TypeError(
            f"push a state dict (name -> tensor), not a {type(state_dict).__name__}: "
            "model.state_dict()"
        )
    if isinstance(state_dict, Mapping) and rename is None and transform is None:
        names, tensors = list(state_dict), list(state_dict.values())
    else:
        items: Iterable = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
        if transform is not None:
            items = transform(items)
        if rename is not None:
            items = renaming(rename)(items)
        pairs = list(itertools.islice(items, limit + 1))
        for entry in pairs:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise TypeError(
                    f"expected (name, tensor) pairs, got {type(entry).__name__}; "
                    "push a state dict, e.g. model.state_dict()"
                )
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
        min(lengths) < 1
        or max(lengths) > MAX_NAME_CHARS
        or len(set(names)) < len(names)
        or set(map(_LAYOUT, tensors)) != {torch.strided}
        or not set(map(_DTYPE, tensors)) <= _SENDABLE
        or not (all(map(_IS_CPU, tensors)) or all(t.is_cpu or t.is_cuda for t in tensors))
    ):
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
    local = cast("DTensor", tensor).to_local() if dtensor else tensor
    if not local.numel():
        return None
    # The address of the first element stands for storage and offset (storages never
    # overlap); the device's index (-1 on the CPU) for the device (only CPU and CUDA pass).
    return local.data_ptr(), local.stride(), tensor.shape, local.dtype, local.get_device()


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    # Nothing can be a DTensor before torch.distributed.tensor was imported, so a trainer that
    # never imported it never pays for importing it here.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


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
        raise ValueError(
            f"NaN or Inf{_beyond(cast_dtype)} in {shown}{more}; nothing was sent "
            "(check_finite=True in SyncConfig)"
        )


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
    return ValueError(
        f"NaN or Inf{_beyond(cast_dtype)} in the trainer's shards; nothing was "
        "sent (check_finite=True in SyncConfig)"
    )


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


def _what_to_pass(value: object) -> str:
    """What to push instead of a state dict holding ``value`` where a tensor belongs."""
    if isinstance(value, Mapping):  # a whole checkpoint: {"model": ..., "optimizer": ...}
        return (
            "a whole checkpoint or a nested dict? push the model's own state dict "
            "(model.state_dict(), or checkpoint['model']): name -> tensor, flat"
        )
    if isinstance(value, torch.nn.Module):
        return "push model.state_dict(), not the module"
    return "push name -> tensor pairs, e.g. model.state_dict() (other values: torch.as_tensor)"


def _check_entry(name: object, tensor: object, sharded: bool = False) -> bool:
    """Raises for an entry that cannot be sent; returns whether the tensor is a DTensor."""
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be str, got {type(name).__name__} ({name!r})")
    if not name or len(name) > MAX_NAME_CHARS:
        raise ValueError(f"tensor name must have 1..{MAX_NAME_CHARS} characters: {name[:80]!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}; "
            + _what_to_pass(tensor)
        )
    dtensor = is_dtensor(tensor)
    if dtensor and not sharded:
        raise TypeError(
            f"{name!r} is a DTensor; push a weight_sync.send.sharded.ShardedSource of the state "
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
