"""A sender's share of a push from many senders, and the rules the senders settle it by.

A sharded trainer pushing from every rank (docs/many-senders.md) is K lanes at once, one per
sender (``send.senders`` and ``receive.inbound`` run them); this module decides, without moving a byte:

* what each sender sends: every trainer rank reads the same layout off its state dict's DTensors
  (their meshes and placements are the same on every rank, and ``blocks.assign`` is
  deterministic), then sends only the blocks the layout gives it, straight from its own shards
  (``share_of``): nothing is gathered, no rank holds more than its shards plus its lane's
  staging buckets;
* whether the push may go ahead, from every sender's row (``called_off``): the same answer on
  every rank, so all of them call it off together, before any byte moves;
* whether the ranks' ``SyncConfig``s agree where they must (``config_row``,
  ``config_disagreement``), checked once as the senders are made: every other field may differ
  rank by rank (docs/many-senders.md, "Each rank's SyncConfig").

The verdict after, from every sender's report, is ``wire.blame.judge``.
"""

from __future__ import annotations

import struct
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, get_args, runtime_checkable

import torch

from weight_sync.config import CastDtype, SyncConfig
from weight_sync.wire.blocks import (
    REPLICATE,
    BlockLayout,
    Placement,
    Shard,
    Spread,
    StridedShard,
    assign,
)
from weight_sync.wire.mapping import rename as renaming
from weight_sync.wire.metadata import TensorMeta
from weight_sync.wire.state_dict import (
    Entries as Checked,
)
from weight_sync.wire.state_dict import (
    StateDict,
    check_state_dict,
    is_dtensor,
    wire_dtype,
)
from weight_sync.wire.versions import agreed_version, check_version, proposed_version

Entries = Sequence[tuple[str, torch.Tensor]]


def layout_of(
    entries: Entries,
    sender_ranks: Sequence[int],
    cast_dtype: str | None = None,
    partial: bool = False,
) -> BlockLayout:
    """Who sends which block of each entry, the senders being the processes of global ranks
    ``sender_ranks`` (in order), each tensor described as it travels (``cast_dtype``: see
    ``SyncConfig``). A DTensor's mesh must lie within them; any other tensor is taken to be
    held whole by every sender (as replicated buffers are). ``ValueError`` for a placement this
    cannot send from the shards as they lie (``Partial``; a strided shard that is no block).
    ``partial``: the entries are some of the members' tensors only."""
    return Layouts().layout_of(entries, sender_ranks, cast_dtype, partial)


class Layouts:
    """``layout_of`` for one front's pushes, reusing the last layout while the entries are
    unchanged -- the usual case in a training loop, which pushes the same names, dtypes, shapes
    and placements every step -- so that neither the layout nor its digest is rebuilt, as
    ``PushPlanner`` reuses one sender's plan (rebuilding it was a sixth of a small push's time
    on rank 0)."""

    def __init__(self) -> None:
        self._last: tuple[Hashable, BlockLayout] | None = None

    def layout_of(
        self,
        entries: Entries,
        sender_ranks: Sequence[int],
        cast_dtype: str | None = None,
        partial: bool = False,
    ) -> BlockLayout:
        """See the module function ``layout_of``."""
        index = {rank: i for i, rank in enumerate(sender_ranks)}
        grids: dict[int, Grid] = {}  # a model's tensors share a few meshes
        described = []
        for name, tensor in entries:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name!r}: a push takes tensors, got {type(tensor).__name__}")
            spread = _spread(name, tensor, index, grids) if is_dtensor(tensor) else None
            wire = tensor.dtype if cast_dtype is None else wire_dtype(tensor.dtype, cast_dtype)
            described.append((name, tuple(tensor.shape), wire, spread))
        key = (tuple(described), len(sender_ranks), partial)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        whole = Spread.everywhere(len(sender_ranks))
        metas = [
            TensorMeta.of(name, tensor, wire)
            for (name, tensor), (_, _, wire, _) in zip(entries, described, strict=True)
        ]
        spreads = [spread or whole for *_, spread in described]
        layout = assign(metas, spreads, len(sender_ranks), partial)
        self._last = (key, layout)
        return layout


def lane_of(entries: Entries, layout: BlockLayout, sender: int) -> dict[str, torch.Tensor]:
    """What ``sender`` sends: for each of its blocks, the tensor holding it here (a DTensor's
    local shard, or a whole tensor), by the entry's name."""
    tensors = dict(entries)
    lane = {}
    for block in layout.sent_by(sender):
        name = layout.tensors[block.tensor].name
        tensor = tensors[name]
        local = tensor.to_local() if is_dtensor(tensor) else tensor
        assert tuple(local.shape) == block.size, (name, tuple(local.shape), block.size)
        lane[name] = local.detach() if local.requires_grad else local  # (a state dict's are not)
    return lane


Grid = tuple[tuple[int, ...], list[int], list[int | None]]


def _spread(
    name: str, tensor: torch.Tensor, index: dict[int, int], grids: dict[int, Grid]
) -> Spread:
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    if id(mesh) not in grids:  # DeviceMesh.mesh is worked out anew on every read
        grids[id(mesh)] = _grid(mesh, index)
    shape, ranks, dims = grids[id(mesh)]
    outside = [rank for rank in ranks if rank not in index]
    if outside:
        raise ValueError(
            f"{name!r} lies on ranks {outside}, which are not senders: every rank of a sharded "
            "tensor's mesh must send"
        )
    placements: list[Placement] = []
    for dim in dims:
        placement = None if dim is None else tensor.placements[dim]  # type: ignore[attr-defined]
        kind = type(placement).__name__
        if placement is None or kind == "Replicate":
            placements.append(REPLICATE)
        elif kind == "Shard":
            placements.append(Shard(placement.dim))
        elif kind == "_StridedShard":  # FSDP2 over tensor parallelism
            placements.append(StridedShard(placement.dim, int(placement.split_factor)))
        else:
            raise ValueError(
                f"{name!r} is placed {placement}: only Shard, _StridedShard and Replicate are "
                "sent from the shards as they lie; push it from one rank (ShardedSource) instead"
            )
    return Spread(shape, tuple(placements), tuple(index[r] for r in ranks))


def _grid(mesh: Any, index: dict[int, int]) -> Grid:
    """The mesh a DTensor's placements are read against, as its shape, its ranks (row-major)
    and, per dimension, which of the tensor's placements applies (None: replicated along it).

    Its own mesh, unless that is a slice of a mesh of senders: FSDP2 over tensor parallelism
    shards a layer that tensor parallelism leaves alone over the ``"dp"`` slice only, so each
    sender sees the slice it is in (ranks 0 and 2 of a (2, 2) mesh, or 1 and 3) and knows
    nothing of the others. Read against the whole mesh, replicated along the dimensions the
    slice leaves out, the tensor is described alike on every sender."""
    own: Grid = (tuple(mesh.mesh.shape), mesh.mesh.flatten().tolist(), list(range(mesh.ndim)))
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names, whole = mesh.mesh_dim_names, root.mesh_dim_names
    if root is mesh or not names or not whole or not set(names) <= set(whole):
        return own
    ranks = root.mesh.flatten().tolist()
    if any(rank not in index for rank in ranks):
        return own
    dims = [names.index(name) if name in names else None for name in whole]
    return tuple(root.mesh.shape), ranks, dims


@runtime_checkable
class Gathered(Protocol):
    """A state dict one sender gathers as its lane sends it (``send.sharded.ShardedSource``:
    the other trainer ranks serve the gathers): a push from one sender only."""

    def stand_ins(self) -> list[tuple[str, torch.Tensor]]:
        """Each entry's name with a tensor of its full shape and dtype, no storage; raises
        ``ValueError`` on a rank that does not send."""
        ...


@dataclass(frozen=True)
class Share:
    """What one sender brings to a push from many senders: its lane's state dict, the layout
    (None with ``error``: this sender refused its share, which ``error`` says why), the version
    it names (0: none), and the lane as checked (``checked``: what its push sends, not checked
    again). ``source``: a ``Gathered`` state dict its lane pushes instead (with ``rename``),
    gathering as it sends."""

    lane: dict[str, torch.Tensor]
    layout: BlockLayout | None
    error: Exception | None
    named: int
    source: Gathered | None = None
    rename: Any = None
    checked: Checked | None = None

    @property
    def sends(self) -> bool:
        """Whether this sender has a lane in the push."""
        return bool(self.lane) or self.source is not None

    def row(self, next_version: int) -> tuple[list[int], bytes]:
        """This sender's row for ``called_off``, and its layout digest."""
        digest = bytes.fromhex(self.layout.digest) if self.layout is not None else bytes(32)
        proposal = proposed_version(self.named, next_version)
        return [int(self.error is not None), proposal, self.named], digest


def share_of(
    state_dict: StateDict | object,
    options: Mapping[str, Any],
    senders: int,
    sender: int,
    config: SyncConfig,
    layouts: Layouts | None = None,
    gathered: bool = False,
) -> Share:
    """``sender``'s share of a push of ``state_dict`` by ``senders`` senders (the ranks
    ``0..senders-1`` of the trainers' group), checked as a push checks a state dict; a caller's
    mistake is kept in ``Share.error``, to raise once every sender agreed to call it off.
    ``options``: ``version``; ``transform`` (see ``wire.mapping``: whole tensors only, so no
    DTensor) and then ``rename`` (name -> the workers' name, None drops it), applied before the
    layout, so that every lane and every member speak the workers' names; and ``partial`` (some
    of the members' tensors only), which the layout carries to them. An option given as None
    is not given (a front passes each of its own). ``layouts``: the front's, which keeps the
    last layout (default: one made for this share). ``gathered``: the front takes a
    ``Gathered`` state dict from one sender (and ends its gathers, whatever happens): the
    layout is read off its stand-ins, and its lane pushes it (``Share.source``)."""
    options = {key: value for key, value in options.items() if value is not None}
    named = options.get("version")
    source: Gathered | None = None
    # A state dict is no ``Gathered`` (a runtime protocol's isinstance is slow).
    if not isinstance(state_dict, Mapping) and isinstance(state_dict, Gathered):
        source = state_dict
    try:
        if source is not None and not (gathered and senders == 1):
            raise TypeError(
                "a ShardedSource is gathered by one sender (WeightUpdater without senders, or "
                "with senders=OneRank()); with several, every sender pushes its own state dict "
                "(name -> tensor or DTensor): nothing is gathered"
            )
        if not isinstance(state_dict, Mapping | Iterable | Gathered):
            raise TypeError(
                "the senders each push their own state dict (name -> tensor or DTensor: every "
                f"sender sends its own shards, nothing is gathered), not a "
                f"{type(state_dict).__name__}"
            )
        unknown = set(options) - {"version", "rename", "transform", "partial"}
        if unknown:
            raise ValueError(
                f"unknown push option(s) {sorted(unknown)}: a push takes version, rename, "
                "transform and partial"
            )
        partial = options.get("partial", False)
        if not isinstance(partial, bool):
            raise TypeError(f"partial must be a bool, got {type(partial).__name__}")
        check_version(named)
        transform, rename = options.get("transform"), options.get("rename")
        items: Iterable[Any]
        if source is not None:
            if transform is not None:
                raise ValueError(
                    "transform needs whole tensors and cannot run on a sharded source; rename "
                    "(names only) can"
                )
            items = source.stand_ins()
        else:
            items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict  # type: ignore[assignment]
        if transform is not None:
            items = list(items)
            sharded = [name for name, tensor in items if is_dtensor(tensor)]
            if sharded:
                raise ValueError(
                    f"transform takes whole tensors, and {sharded[0]!r} is a DTensor: each "
                    "sender holds its shards only. rename (names alone) can map sharded tensors"
                )
            items = transform(items)
        entries = list(renaming(rename)(items) if rename is not None else items)
        if len({name for name, _ in entries}) != len(entries):
            raise ValueError(
                "two tensors of the state dict end up under one name (transform, rename)"
            )
        layouts = layouts if layouts is not None else Layouts()
        layout = layouts.layout_of(entries, range(senders), config.cast_dtype, partial)
        if len(layout.wire) > config.max_metadata_bytes:
            raise ValueError(
                f"the push's layout ({len(layout.blocks)} blocks) is over max_metadata_bytes="
                f"{config.max_metadata_bytes}; raise it in SyncConfig on every rank"
            )
        if source is not None:  # its lane checks the values as it gathers them
            return Share({}, layout, None, named or 0, source, rename)
        lane = lane_of(entries, layout, sender)
        checked = check_state_dict(lane, config)
    except Exception as exc:  # raised once the senders agreed: none may skip a collective
        return Share({}, None, exc, 0)
    return Share(lane, layout, None, named or 0, checked=checked)


_CASTS: tuple[str | None, ...] = (None, *get_args(CastDtype))
NOT_MINE = -1  # a rank's word on a field it does not use


def config_row(config: SyncConfig, sender: bool, one_group: bool) -> list[int]:
    """This rank's word on the ``SyncConfig`` fields every rank of a push from several senders
    must give alike: a sender's ``cast_dtype`` (the wire dtypes are part of the layout the
    senders agree on: a difference would call every push off as state dicts that differ), and
    over one group the backend it forms on (every rank joins it on its own config's: NCCL and
    Gloo ranks would never meet). ``NOT_MINE`` where this rank does not use the field."""
    cast = _CASTS.index(config.cast_dtype) if sender else NOT_MINE
    backend = int(config.backend == "nccl") if one_group else NOT_MINE
    return [cast, backend]


def config_disagreement(rows: Sequence[Sequence[int]]) -> str | None:
    """What every rank is told to change where their ``config_row``s (rank r's at ``rows[r]``)
    differ, naming each rank's value; None where they agree."""
    fields = (
        ("cast_dtype", lambda word: repr(_CASTS[word]), "the wire dtypes are part of the layout"),
        ("backend", lambda word: "'nccl'" if word else "'gloo'", "the one group forms on it"),
    )
    problems = []
    for column, (name, shown, why) in enumerate(fields):
        said = {rank: row[column] for rank, row in enumerate(rows) if row[column] != NOT_MINE}
        if len(set(said.values())) > 1:
            values = ", ".join(f"rank {rank}: {shown(word)}" for rank, word in said.items())
            problems.append(f"{name} ({values}; {why})")
    if not problems:
        return None
    return (
        "the ranks of a push from several senders must give the same SyncConfig "
        + "; ".join(problems)
        + " -- pass one value on every rank (the other fields may differ: docs/many-senders.md)"
    )


def called_off(senders: list[tuple[int, ...]]) -> str | None:
    """Why a push from many senders is called off before any byte moves, from every sender's
    row (``Share.row``: refused, proposed version, named version, then the layout digest's
    words): the same answer on every rank, which gathered the same rows. None: it goes ahead."""
    return proposal(senders, len(senders))[0]


def proposal(rows: Sequence[tuple[int, ...]], senders: int) -> tuple[str | None, int]:
    """Why a push is called off (``called_off``: None, it goes ahead), and its version
    (``versions.agreed_version``), from every rank's row of its agreement (the ``senders``
    senders' first): what senders and receiving ranks alike decide from the same rows."""
    rows = list(rows[:senders])
    version, named_apart = agreed_version([row[1] for row in rows], [row[2] for row in rows])
    refused = [rank for rank, row in enumerate(rows) if row[0]]
    if refused:
        return f"trainer rank(s) {refused} refused their shards (see their errors)", version
    if len({row[3:] for row in rows}) > 1:
        return (
            "the trainer ranks' state dicts differ (names, dtypes, shapes or placements): every "
            "sender must push the same model's state_dict()"
        ), version
    return named_apart, version


def row_bytes(values: list[int], digest: bytes) -> bytes:
    """A rank's row of an agreement, ``values`` then its layout digest (32 bytes), as int64
    words (little-endian): of one size on every rank, to all-gather."""
    assert len(digest) == 32, "a layout digest is 32 bytes"
    return struct.pack(f"<{len(values)}q", *values) + digest


def row_words(raw: bytes) -> tuple[int, ...]:
    """A gathered row (``row_bytes``) as its words, the digest the last four (``row_digest``)."""
    return struct.unpack(f"<{len(raw) // 8}q", raw)


def row_digest(row: Sequence[int], values: int = 3) -> str:
    """The layout digest (hex) a gathered row carries after its ``values`` (``row_bytes``)."""
    return b"".join(int(w).to_bytes(8, "little", signed=True) for w in row[values:]).hex()
