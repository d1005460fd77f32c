"""Who sends which block of which tensor, when every rank of a sharded trainer sends what it holds.

A sharded trainer (FSDP2, tensor parallel: DTensors) holds each parameter as blocks spread over
its ranks. Rather than gather each parameter onto one rank, every trainer rank sends its own
blocks, at once, over its own link (a *lane*: see ``weight_sync.launch.job_sync``), and each member
writes every block where it belongs in its full tensor. This module is the pure half of that:

* ``block_of`` -- the block a mesh coordinate holds, from the tensor's global shape and its
  placements, by the rule DTensor splits by (``torch.chunk``: pieces of ``ceil(n / k)``, the
  last ones shorter or empty; mesh dimensions sharding one tensor dimension split in turn, a
  strided shard -- FSDP2 over tensor parallelism -- as DTensor's ``_StridedShard`` does);
* ``assign`` -- one sender for each distinct block: a block held by several ranks (a replicated
  dimension, a tensor that is no DTensor) goes to the holder with the fewest bytes so far, so
  the lanes carry about the same;
* ``BlockLayout`` -- the result as it travels to the members: typed, bounded, and checked on
  construction to tile every tensor exactly (every element in one block, none outside), so a
  member that accepts a layout cannot commit a version with a hole in it.

Every trainer rank computes the same layout from the same metadata, with no message between
them; the members receive it from rank 0 and check it against their own model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import product

import torch
from pydantic import Field, model_validator

from weight_sync.wire.metadata import MAX_DIMS, MAX_SENDERS, Hashed, TensorMeta, _Wire


@dataclass(frozen=True)
class Shard:
    """The tensor dimension one mesh dimension splits (DTensor's ``Shard(dim)``)."""

    dim: int


@dataclass(frozen=True)
class StridedShard:
    """DTensor's ``_StridedShard(dim, split_factor)``: what FSDP2 puts on its mesh dimension
    when tensor parallelism, on a later one, shards the same tensor dimension. It splits as if
    the later split came first: the dimension into ``split_factor`` pieces, each of those into
    as many chunks as this mesh dimension has coordinates, a coordinate holding its chunk of
    every piece, one after the other. The later split then cuts that along the seams, so each
    coordinate of the whole mesh holds one run of the dimension (``block_of`` checks it)."""

    dim: int
    split_factor: int


REPLICATE = None  # a mesh dimension every coordinate of which holds the same block
Placement = Shard | StridedShard | None


@dataclass(frozen=True)
class Spread:
    """How one tensor lies over the senders: the mesh's shape, each mesh dimension's placement,
    and the sender (its index among the trainer ranks) at each coordinate, row-major. A tensor
    that is no DTensor is a mesh of every sender, replicated."""

    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    senders: tuple[int, ...]

    @classmethod
    def everywhere(cls, senders: int) -> Spread:
        return cls((senders,), (REPLICATE,), tuple(range(senders)))


def block_of(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``(offset, size)`` of the block held at ``coordinate`` of the mesh: per tensor
    dimension, where it starts and how long it is (0 for the empty block of a rank past the
    end of an uneven split). ``ValueError`` where a coordinate holds rows of a dimension that
    are not one run (strided shards of sizes that do not split along the pieces' seams): such
    a shard is no block."""
    if not len(mesh_shape) == len(placements) == len(coordinate):
        raise ValueError("a mesh shape, its placements and a coordinate name as many dimensions")
    # Per tensor dimension, the global positions this coordinate holds, in its local order, as
    # runs (start, length): each split takes some of the positions held so far.
    held = [[(0, n)] for n in shape]
    for ways, placement, index in zip(mesh_shape, placements, coordinate, strict=True):
        if placement is REPLICATE:
            continue
        if not 0 <= placement.dim < len(shape):
            raise ValueError(f"{placement} of a tensor of {len(shape)} dimensions")
        runs = held[placement.dim]
        length = sum(n for _, n in runs)
        if isinstance(placement, Shard):
            held[placement.dim] = _take(runs, *_chunk(length, ways, index))
            continue
        if placement.split_factor < 1:
            raise ValueError(f"{placement}: the split factor must be at least 1")
        taken: list[tuple[int, int]] = []
        for piece in range(placement.split_factor):
            start, count = _chunk(length, placement.split_factor, piece)
            within, part = _chunk(count, ways, index)
            taken += _take(runs, start + within, part)
        held[placement.dim] = taken
    block = []
    for dim, runs in enumerate(held):
        merged = _merged(runs)
        if len(merged) > 1:
            raise ValueError(
                f"mesh coordinate {tuple(coordinate)} holds rows {merged} of dimension {dim}, "
                "not one run: its shard is no block"
            )
        block.append(merged[0] if merged else (0, 0))
    return tuple(start for start, _ in block), tuple(count for _, count in block)


def _chunk(length: int, ways: int, index: int) -> tuple[int, int]:
    """Where chunk ``index`` of ``length`` split ``ways`` ways by ``torch.chunk`` starts, and
    its length (0 past the end)."""
    piece = -(-length // ways)
    start = min(index * piece, length)
    return start, min(piece, length - start)


def _take(runs: Sequence[tuple[int, int]], start: int, length: int) -> list[tuple[int, int]]:
    """Positions ``start .. start + length`` (local order) of those ``runs`` hold, as runs."""
    taken = []
    for first, count in runs:
        if length <= 0:
            break
        if start >= count:
            start -= count
            continue
        part = min(count - start, length)
        taken.append((first + start, part))
        start, length = 0, length - part
    return taken


def _merged(runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for first, count in runs:
        if merged and merged[-1][0] + merged[-1][1] == first:
            merged[-1] = (merged[-1][0], merged[-1][1] + count)
        elif count:
            merged.append((first, count))
    return merged


class Block(_Wire):
    """One block of one tensor, and the sender (index among the trainer ranks) that sends it."""

    tensor: int = Field(ge=0, description="index into BlockLayout.tensors")
    sender: int = Field(ge=0, lt=MAX_SENDERS)
    offset: tuple[int, ...] = Field(max_length=MAX_DIMS)
    size: tuple[int, ...] = Field(max_length=MAX_DIMS)

    @property
    def numel(self) -> int:
        return math.prod(self.size)


class BlockLayout(Hashed):
    """Every tensor of a sharded push (global names, dtypes and shapes) and who sends each of its
    blocks. Tiles every tensor exactly; blocks with no elements are left out."""

    senders: int = Field(ge=1, le=MAX_SENDERS)
    tensors: tuple[TensorMeta, ...]
    blocks: tuple[Block, ...]
    partial: bool = Field(
        False, description="some of the members' tensors only (push(..., partial=True))"
    )

    @model_validator(mode="after")
    def _tiles_every_tensor(self) -> BlockLayout:
        seen: list[list[Block]] = [[] for _ in self.tensors]
        for block in self.blocks:
            if block.tensor >= len(self.tensors) or block.sender >= self.senders:
                raise ValueError("a block names a tensor or a sender outside the layout")
            shape = self.tensors[block.tensor].shape
            if len(block.offset) != len(shape) or len(block.size) != len(shape):
                raise ValueError(f"a block of {self.tensors[block.tensor].name!r} has other rank")
            if not block.numel or any(
                o < 0 or o + s > n for o, s, n in zip(block.offset, block.size, shape, strict=True)
            ):
                raise ValueError(f"a block of {self.tensors[block.tensor].name!r} is empty or out")
            seen[block.tensor].append(block)
        for meta, blocks in zip(self.tensors, seen, strict=True):
            if sum(b.numel for b in blocks) != math.prod(meta.shape) or _overlap(blocks):
                raise ValueError(f"the blocks of {meta.name!r} do not tile it exactly")
        return self

    def sent_by(self, sender: int) -> tuple[Block, ...]:
        """The blocks ``sender`` sends, in the tensors' order (found once per sender: a front
        reuses a layout push after push)."""
        if sender not in self._sent:
            self._sent[sender] = tuple(block for block in self.blocks if block.sender == sender)
        return self._sent[sender]

    def lane_tensors(self, sender: int) -> dict[str, TensorMeta]:
        """What the plan of ``sender``'s lane must carry: each of its blocks as a tensor of its
        own (the tensor's name and dtype, the block's shape). Worked out once per sender: a
        member checks every push of a layout it holds against it."""
        if sender not in self._lanes:
            self._lanes[sender] = {
                meta.name: TensorMeta.model_construct(
                    name=meta.name, dtype=meta.dtype, shape=block.size
                )
                for block in self.sent_by(sender)
                for meta in (self.tensors[block.tensor],)
            }
        return self._lanes[sender]

    @cached_property
    def _lanes(self) -> dict[int, dict[str, TensorMeta]]:
        return {}

    @cached_property
    def _sent(self) -> dict[int, tuple[Block, ...]]:
        return {}


def assign(
    tensors: Sequence[TensorMeta], spreads: Sequence[Spread], senders: int, partial: bool = False
) -> BlockLayout:
    """The layout of ``tensors``, each spread as ``spreads`` says over ``senders`` senders: each
    distinct non-empty block to one of its holders, the one with the fewest bytes assigned so
    far (the lowest of those tied). Deterministic: every trainer rank gets the same answer.
    ``partial``: the tensors are some of the members' only."""
    if len(tensors) != len(spreads):
        raise ValueError(f"{len(spreads)} spreads for {len(tensors)} tensors")
    load = [0] * senders
    blocks: list[Block] = []
    for index, (meta, spread) in enumerate(zip(tensors, spreads, strict=True)):
        if math.prod(spread.mesh_shape) != len(spread.senders):
            raise ValueError(f"{meta.name!r}: a mesh of {spread.mesh_shape} lists other senders")
        holders: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
        coordinates = product(*(range(n) for n in spread.mesh_shape))
        for coordinate, sender in zip(coordinates, spread.senders, strict=True):
            if not 0 <= sender < senders:
                raise ValueError(f"{meta.name!r}: sender {sender} outside 0..{senders - 1}")
            try:
                where = block_of(meta.shape, spread.mesh_shape, spread.placements, coordinate)
            except ValueError as exc:
                raise ValueError(f"{meta.name!r}: {exc}") from None
            if math.prod(where[1]):
                holders.setdefault(where, []).append(sender)
        for (offset, size), who in holders.items():
            sender = min(who, key=lambda s: (load[s], s))
            load[sender] += math.prod(size) * meta.itemsize
            blocks.append(
                Block.model_construct(tensor=index, sender=sender, offset=offset, size=size)
            )
    return BlockLayout(
        senders=senders, tensors=tuple(tensors), blocks=tuple(blocks), partial=partial
    )


def view_of(tensor: torch.Tensor, block: Block) -> torch.Tensor:
    """The block of ``tensor`` (a full tensor of the layout's shape), as a view."""
    for dim, (start, length) in enumerate(zip(block.offset, block.size, strict=True)):
        if length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, start, length)
    return tensor


def _overlap(blocks: Sequence[Block]) -> bool:
    return any(
        all(
            a_o < b_o + b_s and b_o < a_o + a_s
            for a_o, a_s, b_o, b_s in zip(a.offset, a.size, b.offset, b.size, strict=True)
        )
        for i, a in enumerate(blocks)
        for b in blocks[i + 1 :]
    )
