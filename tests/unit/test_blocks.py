"""The blocks of a push from many senders (pure): which block each mesh coordinate holds, who
sends each, and a layout that must tile every tensor; then a member's assembly of them."""

from __future__ import annotations

import itertools

import pytest
import torch
from pydantic import ValidationError
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from weight_sync.wire.blocks import (
    REPLICATE,
    Block,
    BlockLayout,
    Shard,
    Spread,
    StridedShard,
    assign,
    block_of,
    view_of,
)
from weight_sync.wire.metadata import TensorMeta
from weight_sync.receive.assembly import Assembly, layout_of_push
from weight_sync.receive.receiver import Receiver
from weight_sync.wire.metadata import SyncPlan, SyncStatus
from weight_sync.wire.lane_rules import layout_of


def meta(name: str, *shape: int, dtype: str = "float32") -> TensorMeta:
    return TensorMeta(name=name, dtype=dtype, shape=shape)


def _torch(placements: tuple) -> list:
    return [Replicate() if p is REPLICATE else TorchShard(p.dim) for p in placements]


@pytest.mark.parametrize(
    ("shape", "mesh", "placements"),
    [
        ((10, 7), (3,), (Shard(0),)),  # uneven: 4, 4, 2
        ((2, 5), (4,), (Shard(0),)),  # more ranks than rows: the last ones empty
        ((0, 5), (2,), (Shard(0),)),  # no rows at all
        ((10, 7), (3,), (Shard(1),)),
        ((10, 7), (2,), (REPLICATE,)),
        ((10, 7), (2, 2), (Shard(0), Shard(0))),  # one dim split twice, in mesh order
        ((9, 7), (2, 3), (Shard(0), Shard(1))),  # FSDP x TP
        ((9, 7), (2, 3), (REPLICATE, Shard(1))),  # HSDP-like: replicated across the first dim
        ((11,), (3, 2), (Shard(0), REPLICATE)),
        ((), (2,), (REPLICATE,)),  # a scalar
    ],
)
def test_block_of_agrees_with_dtensor(shape, mesh, placements) -> None:
    """Every coordinate's block is the one DTensor itself computes for it."""
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        size, offset = _compute_local_shape_and_global_offset(
            shape, mesh, list(coordinate), _torch(placements)
        )
        got_offset, got_size = block_of(shape, mesh, placements, coordinate)
        assert got_size == tuple(size)
        if all(size):  # torch's offset of an empty block is its own business
            assert got_offset == tuple(offset)


def _torch_strided(placement: object) -> object:
    if isinstance(placement, StridedShard):
        return _StridedShard(placement.dim, split_factor=placement.split_factor)
    return _torch((placement,))[0]


def _local(whole: torch.Tensor, mesh: tuple, placements: tuple, coordinate: tuple) -> torch.Tensor:
    """What DTensor itself gives ``coordinate`` of ``whole``: each mesh dimension's placement
    splits what the ones before it left, by torch's own ``_split_tensor``."""
    local = whole
    for ways, placement, index in zip(mesh, placements, coordinate, strict=True):
        if placement is not REPLICATE:
            pieces, _ = _torch_strided(placement)._split_tensor(local, ways, with_padding=False)
            local = pieces[index]
    return local


@pytest.mark.parametrize(
    ("shape", "mesh", "placements"),
    [
        # FSDP2 over tensor parallelism on one dimension (ColwiseParallel's weights): even,
        # uneven, more coordinates than rows, and a TP degree of 4
        ((8, 3), (2, 2), (StridedShard(0, 2), Shard(0))),
        ((50, 3), (2, 2), (StridedShard(0, 2), Shard(0))),
        ((9,), (4, 2), (StridedShard(0, 2), Shard(0))),
        ((5, 2), (3, 2), (StridedShard(0, 2), Shard(0))),
        ((10, 3), (2, 4), (StridedShard(0, 4), Shard(0))),
        ((7, 12), (3, 2), (StridedShard(1, 2), Shard(1))),
        # HSDP over tensor parallelism: replicated, then strided, then TP
        ((12, 2), (2, 2, 3), (REPLICATE, StridedShard(0, 3), Shard(0))),
        # FSDP over TP on another dimension (RowwiseParallel's weights) is plain Shard
        ((7, 48), (2, 2), (Shard(0), Shard(1))),
    ],
)
def test_block_of_holds_what_dtensor_splits_off(shape, mesh, placements) -> None:
    """Every coordinate's block holds exactly the elements DTensor's own split gives it, strided
    shards included: the block's view of the whole tensor equals the coordinate's shard."""
    whole = torch.arange(max(1, torch.Size(shape).numel())).reshape(shape).float()
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        expected = _local(whole, mesh, placements, coordinate)
        offset, size = block_of(shape, mesh, placements, coordinate)
        assert size == tuple(expected.shape), coordinate
        block = Block(tensor=0, sender=0, offset=offset, size=size)
        torch.testing.assert_close(view_of(whole, block), expected, rtol=0, atol=0)


@pytest.mark.parametrize(("ways", "split_factor"), list(itertools.product((2, 3, 4), repeat=2)))
def test_strided_shards_are_blocks_or_refused(ways, split_factor) -> None:
    """Over uneven sizes (13 rows over 3 x 2 holds rows 6 and 11 at (2, 0)): where DTensor's
    strided split gives a coordinate one run of rows, ``block_of`` finds that run; where it
    does not, ``block_of`` refuses it, never a wrong block."""
    mesh, placements = (ways, split_factor), (StridedShard(0, split_factor), Shard(0))
    for length, coordinate in itertools.product(
        range(1, 40), itertools.product(range(ways), range(split_factor))
    ):
        rows = _local(torch.arange(length), mesh, placements, coordinate).tolist()
        if rows and rows != list(range(rows[0], rows[0] + len(rows))):
            with pytest.raises(ValueError, match="not one run"):
                block_of((length,), mesh, placements, coordinate)
            continue
        offset, size = block_of((length,), mesh, placements, coordinate)
        assert size == (len(rows),) and (not rows or offset == (rows[0],))


@pytest.mark.parametrize(
    ("tensors", "spreads", "senders", "expected"),
    [
        # FSDP over 2: each sender its own rows; no block twice
        ([meta("w", 10, 4)], [Spread((2,), (Shard(0),), (0, 1))], 2,
         [(0, 0, (0, 0), (5, 4)), (0, 1, (5, 0), (5, 4))]),
        # whole tensors go to the least-loaded sender, in turn
        ([meta("a", 8), meta("b", 8), meta("c", 4)], [Spread.everywhere(2)] * 3, 2,
         [(0, 0, (0,), (8,)), (1, 1, (0,), (8,)), (2, 0, (0,), (4,))]),
        # replicated across the first mesh dim: one copy of each column block is sent
        ([meta("w", 4, 6)], [Spread((2, 3), (REPLICATE, Shard(1)), (0, 1, 2, 3, 4, 5))], 6,
         [(0, 0, (0, 0), (4, 2)), (0, 1, (0, 2), (4, 2)), (0, 2, (0, 4), (4, 2))]),
        # a mesh of other senders than 0..n-1, in its own order
        ([meta("w", 4)], [Spread((2,), (Shard(0),), (3, 1))], 4,
         [(0, 3, (0,), (2,)), (0, 1, (2,), (2,))]),
        # the empty shard of an uneven split is no block; a tensor with no elements has none
        ([meta("w", 1, 3), meta("e", 0)], [Spread((2,), (Shard(0),), (0, 1)), Spread.everywhere(2)],
         2, [(0, 0, (0, 0), (1, 3))]),
    ],
)  # fmt: skip
def test_assign_table(tensors, spreads, senders, expected) -> None:
    layout = assign(tensors, spreads, senders)
    assert [(b.tensor, b.sender, b.offset, b.size) for b in layout.blocks] == expected


def bytes_per_sender(layout: BlockLayout) -> list[int]:
    sizes = [0] * layout.senders
    for block in layout.blocks:
        sizes[block.sender] += block.numel * layout.tensors[block.tensor].itemsize
    return sizes


def test_assign_balances_the_lanes() -> None:
    """Many replicated tensors of varied sizes: no lane carries much more than another."""
    sizes = [1 << (i % 7) for i in range(200)]
    layout = assign(
        [meta(f"t{i}", n) for i, n in enumerate(sizes)], [Spread.everywhere(4)] * 200, 4
    )
    loads = bytes_per_sender(layout)
    assert max(loads) - min(loads) <= 4 * max(sizes)


@pytest.mark.parametrize(
    ("blocks", "problem"),
    [
        ([((0, 0), (2, 3)), ((2, 0), (2, 3))], None),  # two halves: tiles it
        ([((0, 0), (2, 3))], "do not tile"),  # half missing
        ([((0, 0), (3, 3)), ((2, 0), (2, 3))], "out"),  # past the end
        ([((0, 0), (3, 3)), ((2, 0), (1, 3))], "do not tile"),  # overlapping, right count
        ([((0, 0), (2, 3)), ((2, 0), (0, 3)), ((2, 0), (2, 3))], "empty"),
        ([((0,), (4,))], "other rank"),
    ],
)
def test_a_layout_must_tile_every_tensor(blocks, problem) -> None:
    def build() -> BlockLayout:
        return BlockLayout(
            senders=2,
            tensors=(meta("w", 4, 3),),
            blocks=tuple(
                Block(tensor=0, sender=i % 2, offset=o, size=s) for i, (o, s) in enumerate(blocks)
            ),
        )

    if problem is None:
        assert build().digest
    else:
        with pytest.raises(ValidationError, match=problem):
            build()


def test_view_of_is_the_block_in_place() -> None:
    full = torch.arange(24.0).reshape(4, 6)
    view = view_of(full, Block(tensor=0, sender=0, offset=(2, 0), size=(2, 6)))
    assert view.is_contiguous() and view.data_ptr() == full[2:].data_ptr()
    column = view_of(full, Block(tensor=0, sender=0, offset=(0, 3), size=(4, 3)))
    column.fill_(-1)
    assert not column.is_contiguous() and (full[:, 3:] == -1).all() and (full[:, :3] >= 0).all()


def holding(version: int | None) -> Receiver:
    """A member's record (a real ``Receiver``) that holds ``version``."""
    record = Receiver(torch.device("cpu"))
    if version is not None:
        record.adopt(SyncStatus(version=version, full_version=version, dirty=False, phase="idle"))
    return record


def _layout() -> BlockLayout:
    spreads = [Spread((2,), (Shard(1),), (0, 1)), Spread((2,), (Shard(0),), (0, 1))]
    return assign([meta("cols", 3, 4), meta("rows", 4)], spreads, 2)


def test_assembly_into_a_model_lands_each_lane_in_place_or_copies() -> None:
    model = {"cols": torch.zeros(3, 4), "rows": torch.zeros(4)}
    assembly = Assembly(_layout(), model)
    assert assembly.problems(holding(None)) == []
    for sender in (0, 1):
        views = assembly.destinations(sender)
        assert views is not None and views["rows"].is_contiguous()
        assert not views["cols"].is_contiguous()  # a column block: copied into, by the loader
        assembly.loader(sender)([("cols", torch.full((3, 2), sender + 1.0))])
        views["rows"].copy_(torch.full((2,), sender + 1.0))
    assert model["cols"].tolist() == [[1, 1, 2, 2]] * 3 and model["rows"].tolist() == [1, 1, 2, 2]
    plan_check = assembly.check(1)
    assert plan_check  # the lane's plan is checked against its blocks' shapes, not the model's


def test_a_lane_plan_accepted_is_not_checked_again_and_any_other_is() -> None:
    """A lane's plan is checked against its blocks until one is accepted; the same plan (and
    partial flag) is then taken unchecked on the pushes the assembly serves after, while another
    plan, another flag or another lane is still checked -- and a refused one never
    remembered."""
    assembly = Assembly(_layout(), {"cols": torch.zeros(3, 4), "rows": torch.zeros(4)})
    blocks = _layout().lane_tensors(0)
    good = SyncPlan.model_construct(alignment=1, tensors=tuple(blocks.values()), buckets=())
    wrong = SyncPlan.model_construct(
        alignment=1, tensors=(TensorMeta(name="cols", dtype="float32", shape=(3, 3)),), buckets=()
    )
    check = assembly.check(0)
    assert check(wrong, False) and check(wrong, False)  # refused, every time
    assert check(good, False) == [] and check(good, False) == []
    assert check(wrong, False)  # another plan: checked, not taken for the one accepted
    assert check(good, True) == []  # another flag: checked (a partial one fits too)
    assert assembly.check(1)(wrong, False)  # lane 1 remembers nothing of lane 0's


def test_assembly_refuses_a_model_the_layout_does_not_fit() -> None:
    model = {"cols": torch.zeros(3, 5), "extra": torch.zeros(1)}
    problems = Assembly(_layout(), model).problems(holding(None))
    assert any("'cols': sent float32[3, 4], model has float32[3, 5]" in p for p in problems)
    assert "unknown tensor 'rows'" in problems and "missing tensor 'extra'" in problems


def test_a_layout_taken_into_the_same_tensors_is_not_checked_again_and_others_are() -> None:
    """The record remembers the layout it last accepted into the very same tensors: a check
    asked again for it is skipped, and asked for another layout
    (which, refused, leaves nothing remembered), another partial flag or other tensors; a tensor
    replaced by one of another shape is found."""
    model = {"cols": torch.zeros(3, 4), "rows": torch.zeros(4)}
    record, layout = holding(1), _layout()
    assert Assembly(layout, model).problems(record) == []
    plan = SyncPlan.model_construct(alignment=1, tensors=layout.tensors, buckets=())
    always = lambda plan, partial: ["checked"]  # noqa: E731

    def asked(tensors: dict, digest: str, partial: bool = False) -> list[str]:
        return list(record.remembered(always, record.targets(tensors), digest)(plan, partial))

    assert asked(model, layout.digest) == []
    assert asked(dict(model), layout.digest) == []  # the same ones
    assert asked(model, "0" * 64) == ["checked"]
    assert asked(model, layout.digest) == ["checked"]  # forgot
    for partial, tensors in [(True, model), (False, {**model, "cols": torch.zeros(3, 4)})]:
        assert Assembly(layout, model).problems(record) == []  # accepted again
        assert asked(tensors, layout.digest, partial) == ["checked"]
    model["cols"] = torch.zeros(3, 5)
    assert any("model has float32[3, 5]" in p for p in Assembly(layout, model).problems(record))


def test_an_assembly_serves_again_only_the_same_layout_into_the_very_same_tensors() -> None:
    """Its views of the model hold while the layout and the tensors (objects and storage) are
    the ones it was made for; a member then reuses it rather than make them every push."""
    model = {"cols": torch.zeros(3, 4), "rows": torch.zeros(4)}
    layout = _layout()
    assembly = Assembly(layout, model)
    views = assembly.destinations(0)
    assert assembly.serves(layout, model) and assembly.serves(_layout(), dict(model))
    assert assembly.destinations(0) is views
    other = assign([meta("cols", 3, 4), meta("rows", 4)], [Spread.everywhere(2)] * 2, 2)
    assert not assembly.serves(other, model)
    assert not assembly.serves(layout, {**model, "rows": torch.zeros(4)})  # another tensor
    moved = dict(model)
    moved["cols"].data = torch.zeros(3, 4)  # the same object, its bytes elsewhere
    assert not assembly.serves(layout, moved)
    assert not Assembly(layout, None, lambda weights: None).serves(layout, model)  # a loader


@pytest.mark.parametrize(
    ("partial", "held", "found"),
    [
        (False, 3, "missing tensor 'extra'"),  # a subset, not announced: refused
        (True, 3, None),  # announced, on top of a version held: taken
        (True, None, "push the full state dict first"),  # nothing held to complete
    ],
)
def test_a_partial_layout_completes_a_version_held(partial, held, found) -> None:
    """A layout of some of the model's tensors: refused unless it says it is partial, and then
    only by a member that holds a version for it to complete. The flag is part of the digest,
    so the senders agree on it as on the rest."""
    spreads = [Spread((2,), (Shard(0),), (0, 1))]
    layout = assign([meta("rows", 4)], spreads, 2, partial)
    model = {"rows": torch.zeros(4), "extra": torch.zeros(1)}
    problems = Assembly(layout, model).problems(holding(held))
    assert problems == [] if found is None else any(found in p for p in problems), problems
    assert layout.digest != assign([meta("rows", 4)], spreads, 2, not partial).digest


def test_assembly_hands_a_loader_whole_tensors_once_every_lane_gave_its_block() -> None:
    loaded: list[tuple[str, torch.Tensor]] = []
    assembly = Assembly(_layout(), None, lambda weights: loaded.extend(weights))
    assert assembly.destinations(0) is None
    assembly.loader(0)([("cols", torch.ones(3, 2)), ("rows", torch.ones(2))])
    assert loaded == []  # half of each: nothing whole yet
    assembly.loader(1)([("rows", torch.full((2,), 2.0))])
    assert [name for name, _ in loaded] == ["rows"] and loaded[0][1].tolist() == [1, 1, 2, 2]
    assembly.forget()  # a failed push: the half-made "cols" is dropped
    assembly.loader(1)([("cols", torch.full((3, 2), 2.0))])
    assert [name for name, _ in loaded] == ["rows"]


def test_a_loader_is_handed_the_tensors_of_no_element_once_with_the_first_it_is_handed() -> None:
    """A tensor with no element has no block (no lane carries it), yet a loader is handed it,
    empty, as one sender's pushes hand every tensor: once, beside the first tensors completed."""
    spreads = [Spread((2,), (Shard(0),), (0, 1)), Spread.everywhere(2)]
    layout = assign([meta("rows", 4), meta("none", 0, 3)], spreads, 2)
    assert all(layout.tensors[block.tensor].name == "rows" for block in layout.blocks)
    loaded: list[tuple[str, torch.Tensor]] = []
    assembly = Assembly(layout, None, lambda weights: loaded.extend(weights))
    assembly.loader(0)([("rows", torch.ones(2))])
    assert loaded == []
    assembly.loader(1)([("rows", torch.ones(2))])
    assert [(name, tuple(tensor.shape)) for name, tensor in loaded] == [
        ("rows", (4,)),
        ("none", (0, 3)),
    ]
    assembly.loader(1)([("rows", torch.ones(2))])  # (a second push's blocks: not again)
    assert [name for name, _ in loaded].count("none") == 1


def _rows(rows: int) -> BlockLayout:
    return layout_of([("w", torch.zeros(rows, 2))], range(1))


@pytest.mark.parametrize(
    ("sent", "held", "named", "limit", "expected"),
    [
        (4, None, 4, 10_000, "layout"),  # sent, and the one named
        (None, 4, 4, 10_000, "layout"),  # held from an earlier push
        (None, None, 4, 10_000, "does not hold the push's layout"),
        (None, 3, 4, 10_000, "does not hold the push's layout"),  # holds another one
        (3, 4, 4, 10_000, "does not hold the push's layout"),  # sent another than named
        (4, None, 4, 10, "exceeds max_metadata_bytes"),
        ("{", None, 4, 10_000, "malformed layout"),
    ],
)
def test_the_layout_a_member_takes_a_push_by(
    sent: int | str | None, held: int | None, named: int, limit: int, expected: str
) -> None:
    wire = sent if isinstance(sent, str) else None if sent is None else _rows(sent).wire
    found = layout_of_push(wire, _rows(named).digest, None if held is None else _rows(held), limit)
    if expected == "layout":
        assert isinstance(found, BlockLayout) and found.digest == _rows(named).digest
    else:
        assert isinstance(found, str) and expected in found


@pytest.mark.parametrize(
    ("dtype", "cast", "travels"),
    [
        (torch.float32, None, "float32"),
        (torch.float32, "bfloat16", "bfloat16"),
        (torch.bfloat16, "float16", "float16"),
        (torch.int64, "bfloat16", "int64"),  # only the standard floats are cast
    ],
)
def test_the_layout_describes_each_tensor_as_it_travels(
    dtype: torch.dtype, cast: str | None, travels: str
) -> None:
    layout = layout_of([("w", torch.zeros(4, 2, dtype=dtype))], range(2), cast)
    assert [meta.dtype for meta in layout.tensors] == [travels]
    assert sum(bytes_per_sender(layout)) == 8 * layout.tensors[0].itemsize


def test_a_strided_shard_that_is_no_block_is_refused_by_name() -> None:
    """13 rows over a (3, 2) mesh, strided: coordinate (2, 0) would hold rows 6 and 11; the
    layout refuses the tensor by name (the senders then push it from one rank)."""
    spread = Spread((3, 2), (StridedShard(0, 2), Shard(0)), tuple(range(6)))
    with pytest.raises(ValueError, match=r"'w': mesh coordinate \(2, 0\) holds rows"):
        assign([meta("w", 13, 4)], [spread], 6)
