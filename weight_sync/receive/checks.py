"""What a worker can load of a plan: checked before any collective runs, since Gloo aborts a
process whose receive buffer is smaller than what is sent and silently garbles one that differs.

Pure: knows the wire types and torch tensors, nothing of transports or of a push's state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from weight_sync.wire.blocks import BlockLayout
from weight_sync.wire.metadata import SyncPlan, TensorMeta, dtype_name

# What a worker cannot load of a plan, given whether the push is partial; empty: all of it.
Check = Callable[[SyncPlan, bool], Sequence[str]]


def accept_all(plan: SyncPlan, partial: bool) -> list[str]:
    """A ``Check`` for workers whose ``load_weights`` decides for itself."""
    return []


def expecting(expected: Callable[[], Mapping[str, TensorMeta | torch.Tensor] | None]) -> Check:
    """A ``Check`` against the target ``expected()`` names (see ``check_plan``)."""
    return lambda plan, partial: check_plan(plan, expected(), partial)


def partial_problems(partial: bool, held: int | None) -> list[str]:
    """A partial push (some of the tensors only) completes the weights a member holds: one
    that holds no version (``held`` None) cannot take it."""
    if not partial or held is not None:
        return []
    why = "a partial push needs weights to complete, and this member holds no committed version"
    return [f"{why}: push the full state dict first"]


def check_layout(layout: BlockLayout, check: Check, held: int | None) -> list[str]:
    """What of a push from many senders a member holding version ``held`` cannot take, before
    any lane's bytes move: ``partial_problems``, then ``check`` against the layout's whole
    tensors (as a plan's: no buckets, only their names, dtypes and shapes are compared)."""
    if problems := partial_problems(layout.partial, held):
        return problems
    plan = SyncPlan.model_construct(alignment=1, tensors=layout.tensors, buckets=())
    return list(check(plan, layout.partial))


def check_plan(
    plan: SyncPlan, expected: Mapping[str, TensorMeta | torch.Tensor] | None, partial: bool = False
) -> list[str]:
    """What in ``plan`` this worker cannot load; empty when it can load all of it.

    ``expected`` is the worker's target (name -> meta, or the tensor itself); ``None`` accepts
    any plan (a custom ``load_weights`` decides for itself). With a target, every name sent must be in it, and a
    full push must cover all of it: one that covered only part of the model would leave it
    mixing two versions unannounced (a ``partial`` push announces it).
    """
    if expected is None:
        return []
    problems = []
    sent = plan.metas()
    for name, meta in sent.items():
        want = expected.get(name)
        if want is None:
            problems.append(f"unknown tensor {name!r}")
            continue
        dtype, shape = _described(want)
        if (dtype, shape) != (meta.dtype, meta.shape):
            problems.append(
                f"{name!r}: sent {meta.dtype}{list(meta.shape)}, model has {dtype}{list(shape)}"
            )
    if not partial:
        problems.extend(f"missing tensor {name!r}" for name in expected if name not in sent)
    return problems


def _described(target: TensorMeta | torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """The dtype name and shape of a worker's target: a tensor is described on the spot (a
    TensorMeta per tensor per push costs more than the check on models of thousands)."""
    if not isinstance(target, torch.Tensor):
        return target.dtype, target.shape
    try:
        return dtype_name(target.dtype), tuple(target.shape)
    except TypeError:  # a dtype that cannot travel: no push can match it
        return str(target.dtype), tuple(target.shape)
