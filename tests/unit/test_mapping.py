"""Name mapping on the sender, as tables: rename, drop, fuse, chain."""

import pytest
import torch

from weight_sync.wire.mapping import chain, fuse, rename


def stream(*names: str) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.full((2, 3), float(i))) for i, name in enumerate(names)]


def names_of(transform, *names: str) -> list[str]:
    return [name for name, _ in transform(stream(*names))]


QKV = fuse(["q_proj", "k_proj", "v_proj"], into="qkv_proj")


@pytest.mark.parametrize(
    ("transform", "names", "out"),
    [
        (rename(lambda n: "model." + n), ["a", "b"], ["model.a", "model.b"]),
        (rename(lambda n: None if "rotary" in n else n), ["a", "rotary.inv", "b"], ["a", "b"]),
        (QKV, ["l0.q_proj.w", "l0.k_proj.w", "l0.v_proj.w", "l0.o.w"], ["l0.qkv_proj.w", "l0.o.w"]),
        # parts in any order, interleaved across layers: each group is emitted when complete
        (
            QKV,
            [
                "l0.v_proj.w",
                "l1.q_proj.w",
                "l0.q_proj.w",
                "l1.k_proj.w",
                "l0.k_proj.w",
                "l1.v_proj.w",
            ],
            ["l0.qkv_proj.w", "l1.qkv_proj.w"],
        ),
        (
            QKV,
            [
                "l0.q_proj.w",
                "l0.k_proj.w",
                "l0.v_proj.w",
                "l0.q_proj.b",
                "l0.k_proj.b",
                "l0.v_proj.b",
            ],
            ["l0.qkv_proj.w", "l0.qkv_proj.b"],
        ),
        (QKV, ["q_proj_extra.w", "x.q_proj2"], ["q_proj_extra.w", "x.q_proj2"]),  # whole parts only
        (
            chain(QKV, rename(lambda n: n.replace("l0.", "layers.0."))),
            ["l0.q_proj.w", "l0.k_proj.w", "l0.v_proj.w"],
            ["layers.0.qkv_proj.w"],
        ),
        (chain(), ["a"], ["a"]),
    ],
)
def test_transform_table(transform, names: list[str], out: list[str]) -> None:
    assert names_of(transform, *names) == out


@pytest.mark.parametrize(("dim", "shape"), [(0, (6, 3)), (1, (2, 9)), (-1, (2, 9))])
def test_fuse_concatenates_in_the_order_of_parts(dim: int, shape: tuple[int, ...]) -> None:
    items = stream("a.v_proj.w", "a.k_proj.w", "a.q_proj.w")  # filled with 0, 1, 2
    [(name, fused)] = fuse(["q_proj", "k_proj", "v_proj"], into="qkv_proj", dim=dim)(items)
    assert name == "a.qkv_proj.w" and fused.shape == shape
    firsts = [chunk.flatten()[0].item() for chunk in fused.chunk(3, dim=dim)]
    assert firsts == [2.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("items", "error", "message"),
    [
        (stream("a.q_proj.w", "a.k_proj.w"), ValueError, r"parts \['v_proj'\] are missing"),
        (stream("a.q_proj.w", "a.q_proj.w"), ValueError, "appears twice"),
        (
            [
                ("a.q_proj.w", torch.zeros(2, 3)),
                ("a.k_proj.w", torch.zeros(2, 3, dtype=torch.float16)),
                ("a.v_proj.w", torch.zeros(2, 3)),
            ],
            ValueError,
            "differ in dtype",
        ),
        (
            [
                ("a.q_proj.w", torch.zeros(2, 3)),
                ("a.k_proj.w", torch.zeros(2, 4)),
                ("a.v_proj.w", torch.zeros(2, 3)),
            ],
            ValueError,
            r"shapes \[\(2, 3\), \(2, 4\), \(2, 3\)\]",
        ),
    ],
)
def test_fuse_refuses(items, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        list(QKV(items))


@pytest.mark.parametrize(
    ("parts", "into", "message"),
    [
        (["q"], "qk", "at least two"),
        (["q", "q"], "qq", "at least two"),
        (["q", "k"], "a.b", "single name"),
    ],
)
def test_fuse_arguments_are_checked_up_front(parts, into: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fuse(parts, into=into)


def test_rename_must_return_str_or_none() -> None:
    with pytest.raises(TypeError, match="returned int"):
        list(rename(lambda n: 1)(stream("a")))  # type: ignore[arg-type,return-value]
