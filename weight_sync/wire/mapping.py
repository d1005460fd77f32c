"""Name mapping on the sender: rename, drop and fuse tensors into the layout the workers load.

A trainer's model and an inference engine's rarely agree on names: the engine may prefix them
differently, skip buffers it recomputes, or keep q/k/v (or gate/up) projections stacked in one
tensor. A ``Transform`` turns the trainer's ``(name, tensor)`` stream into the workers' one
before anything is planned, so the plan -- and the worker's check of it -- is in the workers'
names. Transforms are plain functions of that stream: they compose with ``chain`` and are
tested as tables, with no group or actor involved.

Renaming and dropping touch no bytes. Fusing concatenates, so a fused tensor is a new
allocation on the sender (one group at a time; the parts are released once fused).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

NamedStream = Iterable[tuple[str, torch.Tensor]]
Transform = Callable[[NamedStream], Iterator[tuple[str, torch.Tensor]]]


def rename(fn: Callable[[str], str | None]) -> Transform:
    """Rename every tensor with ``fn``; a tensor ``fn`` maps to ``None`` is dropped."""
    if not callable(fn):
        raise TypeError(f"rename needs a function of the name, got {type(fn).__name__}")

    def transform(items: NamedStream) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in items:
            new = fn(name)
            if new is None:
                continue
            if not isinstance(new, str):
                raise TypeError(f"rename({name!r}) returned {type(new).__name__}, not str or None")
            yield new, tensor

    return transform


def fuse(parts: Sequence[str], into: str, dim: int = 0) -> Transform:
    """Concatenate sibling tensors along ``dim`` into one, as engines that stack projections
    expect: ``fuse(["q_proj", "k_proj", "v_proj"], into="qkv_proj")`` turns
    ``layers.0.attn.q_proj.weight``, ``...k_proj.weight`` and ``...v_proj.weight`` into
    ``layers.0.attn.qkv_proj.weight`` (concatenated in the order of ``parts``).

    ``parts`` and ``into`` are whole dot-separated components of a name. Each group is emitted
    as soon as its last part is seen; a group still missing parts at the end of the stream is a
    ``ValueError`` (sending only some of the parts would leave the worker mixing versions).
    """
    parts = tuple(parts)
    if len(parts) < 2 or len(set(parts)) != len(parts):
        raise ValueError(f"fuse needs at least two distinct parts, got {parts!r}")
    for component in (*parts, into):
        if not component or "." in component:
            raise ValueError(f"fuse parts and target are single name components: {component!r}")

    def transform(items: NamedStream) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in items:
            match = _match_part(name, parts, into)
            if match is None:
                yield name, tensor
                continue
            fused_name, part = match
            group = pending.setdefault(fused_name, {})
            if part in group:
                raise ValueError(f"{name!r} appears twice while fusing into {fused_name!r}")
            group[part] = tensor
            if len(group) == len(parts):
                del pending[fused_name]
                yield fused_name, _concatenate(fused_name, [group[p] for p in parts], dim)
        if pending:
            fused_name, group = next(iter(pending.items()))
            missing = [p for p in parts if p not in group]
            raise ValueError(
                f"cannot fuse {fused_name!r}: parts {missing} are missing from the state dict"
            )

    return transform


def chain(*transforms: Transform) -> Transform:
    """Apply ``transforms`` left to right."""

    def transform(items: NamedStream) -> Iterator[tuple[str, torch.Tensor]]:
        stream: Iterable[tuple[str, torch.Tensor]] = items
        for step in transforms:
            stream = step(stream)
        yield from stream

    return transform


def _match_part(name: str, parts: tuple[str, ...], into: str) -> tuple[str, str] | None:
    """(fused name, part) if one component of ``name`` is one of ``parts``; the last such
    component counts, so a part name that also appears in a module path higher up is safe."""
    components = name.split(".")
    for position in range(len(components) - 1, -1, -1):
        if components[position] in parts:
            part = components[position]
            components[position] = into
            return ".".join(components), part
    return None


def _concatenate(name: str, tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    first = tensors[0]
    for tensor in tensors[1:]:
        if tensor.dtype != first.dtype or tensor.device != first.device:
            raise ValueError(
                f"cannot fuse {name!r}: parts differ in dtype or device "
                f"({first.dtype}/{first.device} vs {tensor.dtype}/{tensor.device})"
            )
    try:
        return torch.cat([t.detach() for t in tensors], dim=dim)
    except (RuntimeError, IndexError) as exc:
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(f"cannot fuse {name!r} along dim {dim}: shapes {shapes}") from exc
