"""The SGLang adapter's pure parts: buckets laid out as SGLang cuts them, and the check of a
push against the engine's checkpoint (read from real safetensors files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weight_sync.adapters.sglang.buckets import pack, plan_buckets
from weight_sync.adapters.sglang.checkpoint import Checkpoint, check_push, read_checkpoint

F32, BF16, I64, U8 = torch.float32, torch.bfloat16, torch.int64, torch.uint8


def sglang_cut(data: torch.Tensor, request: dict[str, list]) -> list[tuple[str, torch.Tensor]]:
    """What SGLang's ``FlattenedTensorBucket.empty`` + ``reconstruct_tensors`` do with a bucket
    (sglang/srt/weight_sync/tensor_bucket.py), written out: each tensor right after the one
    before, its offset a multiple of its element size."""
    out, offset = [], 0
    for name, dtype_name, shape in zip(request["names"], request["dtypes"], request["shapes"],
                                       strict=True):  # fmt: skip
        dtype = getattr(torch, dtype_name)
        assert offset % dtype.itemsize == 0, f"unaligned {name} at {offset}"
        size = torch.Size(shape).numel() * dtype.itemsize
        out.append((name, data[offset : offset + size].view(dtype).reshape(shape)))
        offset += size
    assert offset == data.numel(), "the bucket holds exactly what SGLang allocates"
    return out


@pytest.mark.parametrize(
    ("tensors", "bucket_bytes", "expected"),
    [
        # name, dtype, shape -> the names of each bucket
        ([("a", F32, (4,)), ("b", F32, (4,))], 32, [["a", "b"]]),
        ([("a", F32, (4,)), ("b", F32, (4,))], 16, [["a"], ["b"]]),
        ([("a", F32, (4,)), ("b", F32, (4,))], 31, [["a"], ["b"]]),
        # a tensor larger than a bucket travels alone, never split
        ([("small", F32, (2,)), ("big", F32, (100,)), ("tail", F32, (2,))], 16,
         [["small"], ["big"], ["tail"]]),
        # falling element size inside a bucket keeps every offset aligned
        ([("h", BF16, (3,)), ("f", F32, (1,)), ("i", I64, (1,)), ("u", U8, (5,))], 1 << 10,
         [["i", "f", "h", "u"]]),
        ([], 64, []),
        ([("empty", F32, (0,)), ("a", F32, (2,))], 64, [["empty", "a"]]),
        ([("scalar", F32, ()), ("a", BF16, (1,))], 64, [["scalar", "a"]]),
    ],
)  # fmt: skip
def test_plan(tensors: list, bucket_bytes: int, expected: list[list[str]]) -> None:
    buckets = plan_buckets(tensors, bucket_bytes)
    assert [[slot.name for slot in bucket.slots] for bucket in buckets] == expected
    for bucket in buckets:
        assert bucket.nbytes <= bucket_bytes or len(bucket.slots) == 1


def test_a_bucket_packed_is_cut_back_by_sglangs_rule_into_the_same_tensors() -> None:
    gen = torch.Generator().manual_seed(0)
    named = {
        "w": torch.randn(7, 5, generator=gen),
        "h": torch.randn(3, generator=gen).to(BF16),
        "ids": torch.randint(0, 100, (3,), generator=gen),
        "t": torch.randn(5, 7, generator=gen).t(),  # not contiguous
        "m": torch.tensor([1, 0, 1], dtype=U8),
    }
    tensors = list(named.values())
    buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in named.items()], 100)
    assert len(buckets) > 1
    out = torch.empty(max(b.nbytes for b in buckets), dtype=U8)
    seen = {}
    for bucket in buckets:
        seen.update(sglang_cut(pack(bucket, tensors, out).clone(), bucket.request()))
    assert seen.keys() == named.keys()
    for name, tensor in named.items():
        assert torch.equal(seen[name], tensor), name


def test_pack_casts_to_the_wire_dtype() -> None:
    weight = torch.randn(4, 4)
    (bucket,) = plan_buckets([("w", BF16, (4, 4))], 1 << 10)
    out = torch.empty(bucket.nbytes, dtype=U8)
    ((_, got),) = sglang_cut(pack(bucket, [weight], out), bucket.request())
    assert got.dtype == BF16 and torch.equal(got, weight.to(BF16))


def test_bucket_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([("a", F32, (1,))], 0)


CHECKPOINT = Checkpoint({"emb": ("float32", (10, 4)), "norm": ("float32", (4,)),
                         "q": ("float8_e4m3fn", (2,)), "ids": ("int64", (3,))}, tied=True)  # fmt: skip


@pytest.mark.parametrize(
    ("pushed", "keep", "problems"),
    [
        ([("emb", (10, 4), "float32"), ("norm", (4,), "float32")], [0, 1], []),
        ([("norm", (4,), "bfloat16")], [0], []),  # a subset, cast: fine
        ([("emb", (10, 4), "float32"), ("lm_head.weight", (10, 4), "float32")], [0], []),
        ([("emb", (10, 5), "float32")], [], ["emb: pushed [10, 5], the engine holds [10, 4]"]),
        ([("model.emb", (10, 4), "float32"), ("norm", (4,), "float32")], [1],
         ["model.emb: no such tensor in the engine's checkpoint (map the trainer's names with "
          "rename= or transform=)"]),
        ([("q", (2,), "bfloat16"), ("ids", (3,), "int64")], [1],
         ["q: pushed bfloat16, the engine holds float8_e4m3fn (quantized or integer): push it "
          "in the engine's own dtype"]),
    ],
)  # fmt: skip
def test_check_push(pushed: list, keep: list[int], problems: list[str]) -> None:
    assert check_push(CHECKPOINT, pushed) == (keep, problems)


def test_an_untied_head_is_checked_like_any_tensor() -> None:
    untied = Checkpoint(CHECKPOINT.tensors, tied=False)
    assert check_push(untied, [("lm_head.weight", (10, 4), "float32")])[1][0].startswith(
        "lm_head.weight: no such tensor"
    )


def test_read_checkpoint_from_safetensors_headers(tmp_path: Path) -> None:
    save_file(
        {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=BF16)}, tmp_path / "one.safetensors"
    )
    save_file({"c": torch.zeros(1, dtype=I64)}, tmp_path / "two.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    checkpoint = read_checkpoint(tmp_path)
    assert checkpoint.tensors == {
        "a": ("float32", (2, 3)), "b": ("bfloat16", (4,)), "c": ("int64", (1,)),
    }  # fmt: skip
    assert checkpoint.tied
    assert Checkpoint.from_json(checkpoint.to_json()) == checkpoint


def test_a_folder_without_a_checkpoint_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="checkpoint="):
        read_checkpoint(tmp_path)
