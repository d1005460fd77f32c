"""A sharded trainer's rank, sending what it holds: its lane of a push from many senders.

Every trainer rank reads the same layout off its state dict's DTensors (their device meshes and
placements are the same on every rank, and ``blocks.assign`` is deterministic), then sends only
the blocks the layout gives it, straight from its own shards: nothing is gathered, no rank holds
more than its shards plus its sender's staging buckets. ``layout_of`` and ``lane_of`` are that
reading; the pushes themselves are ordinary ``Pusher`` pushes, one per lane (see
``weight_sync.torchrun``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weight_sync.blocks import REPLICATE, BlockLayout, Placement, Shard, Spread, assign
from weight_sync.metadata import TensorMeta
from weight_sync.send.checks import is_dtensor

Entries = Sequence[tuple[str, torch.Tensor]]


def layout_of(entries: Entries, sender_ranks: Sequence[int]) -> BlockLayout:
    """Who sends which block of each entry, the senders being the processes of global ranks
    ``sender_ranks`` (in order). A DTensor's mesh must lie within them; any other tensor is
    taken to be held whole by every sender (as replicated buffers are). ``ValueError`` for a
    placement this cannot send from the shards as they lie (``Partial``, strided shards)."""
    index = {rank: i for i, rank in enumerate(sender_ranks)}
    metas, spreads = [], []
    for name, tensor in entries:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r}: a sharded push takes tensors, got {type(tensor).__name__}")
        metas.append(TensorMeta.of(name, tensor))
        spreads.append(_spread(name, tensor, index) if is_dtensor(tensor) else None)
    whole = Spread.everywhere(len(sender_ranks))
    return assign(metas, [spread or whole for spread in spreads], len(sender_ranks))


def lane_of(entries: Entries, layout: BlockLayout, sender: int) -> dict[str, torch.Tensor]:
    """What ``sender`` sends: for each of its blocks, the tensor holding it here (a DTensor's
    local shard, or a whole tensor), by the entry's name."""
    tensors = dict(entries)
    lane = {}
    for block in layout.sent_by(sender):
        meta = layout.tensors[block.tensor]
        tensor = tensors[meta.name]
        local = tensor.to_local() if is_dtensor(tensor) else tensor
        assert tuple(local.shape) == block.size, (meta.name, tuple(local.shape), block.size)
        lane[meta.name] = local.detach()
    return lane


def _spread(name: str, tensor: torch.Tensor, index: dict[int, int]) -> Spread:
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    ranks = mesh.mesh.flatten().tolist()
    outside = [rank for rank in ranks if rank not in index]
    if outside:
        raise ValueError(
            f"{name!r} lies on ranks {outside}, which are not senders: every rank of a sharded "
            "tensor's mesh must send"
        )
    placements: list[Placement] = []
    for placement in tensor.placements:  # type: ignore[attr-defined]
        kind = type(placement).__name__
        if kind == "Replicate":
            placements.append(REPLICATE)
        elif kind == "Shard":  # not a subclass: _StridedShard splits in another order
            placements.append(Shard(placement.dim))
        else:
            raise ValueError(
                f"{name!r} is placed {placement}: only Shard(dim) and Replicate are sent from "
                "the shards as they lie; push it from one rank (ShardedSource) instead"
            )
    return Spread(tuple(mesh.mesh.shape), tuple(placements), tuple(index[r] for r in ranks))
