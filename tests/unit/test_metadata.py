import pydantic
import pytest
import torch

from weight_sync.wire.metadata import (
    MAX_DELTA_SECTIONS,
    BucketMeta,
    GroupSpec,
    PrepareRequest,
    Segment,
    SyncPlan,
    TensorMeta,
    dtype_name,
)
from weight_sync.wire.planner import make_plan


def t(name: str, n: int, dtype: str = "float32") -> dict:
    return {"name": name, "dtype": dtype, "shape": [n]}


def seg(tensor: int, tensor_offset: int, bucket_offset: int, nbytes: int) -> dict:
    return {
        "tensor": tensor,
        "tensor_offset": tensor_offset,
        "bucket_offset": bucket_offset,
        "nbytes": nbytes,
    }


GOOD = {
    "alignment": 16,
    "tensors": [t("a", 4), t("b", 8)],
    "buckets": [{"nbytes": 48, "segments": [seg(0, 0, 0, 16), seg(1, 0, 16, 32)]}],
}


def with_changes(**changes) -> dict:
    return {**GOOD, **changes}


def test_good_plan_parses() -> None:
    plan = SyncPlan.model_validate(GOOD)
    assert plan.nbytes == 48 and plan.max_packed_bytes == 48 and plan.packed_buckets == 1


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (with_changes(tensors=[t("a", 4), t("a", 8)]), "duplicate"),
        (
            with_changes(
                buckets=[{"nbytes": 48, "segments": [seg(0, 0, 0, 16), seg(2, 0, 16, 32)]}]
            ),
            "names tensor 2",
        ),
        (
            with_changes(
                buckets=[{"nbytes": 48, "segments": [seg(0, 0, 0, 16), seg(1, 0, 8, 32)]}]
            ),
            "overlaps",
        ),
        (
            with_changes(
                buckets=[{"nbytes": 48, "segments": [seg(0, 0, 0, 16), seg(1, 0, 24, 24)]}]
            ),
            "misaligned",
        ),
        (
            with_changes(
                buckets=[{"nbytes": 40, "segments": [seg(0, 0, 0, 16), seg(1, 0, 16, 32)]}]
            ),
            "past the bucket",
        ),
        (
            with_changes(
                buckets=[{"nbytes": 64, "segments": [seg(0, 0, 0, 16), seg(1, 0, 16, 32)]}]
            ),
            "declared",
        ),
        (with_changes(buckets=[{"nbytes": 16, "segments": [seg(0, 0, 0, 16)]}]), "0 of 32 bytes"),
        (
            with_changes(
                buckets=[{"nbytes": 48, "segments": [seg(0, 0, 0, 16), seg(1, 16, 16, 32)]}]
            ),
            "out of order",
        ),
        (
            with_changes(
                buckets=[
                    {"nbytes": 48, "segments": [seg(0, 0, 0, 16), seg(1, 0, 16, 30)]},
                    {"nbytes": 2, "segments": [seg(1, 30, 0, 2)]},
                ]
            ),
            "inside an element",
        ),
        (with_changes(tensors=[t("a", 4, "float128"), t("b", 8)]), "unknown dtype"),
        (
            with_changes(tensors=[{"name": "a", "dtype": "float32", "shape": [-4]}, t("b", 8)]),
            "negative",
        ),
        (with_changes(tensors=[t("", 4), t("b", 8)]), "at least 1 character"),
        (with_changes(tensors=[t("a" * 2000, 4), t("b", 8)]), "at most 1024"),
        ({**GOOD, "extra": 1}, "Extra inputs"),
        (
            with_changes(
                buckets=[
                    {
                        "nbytes": 48,
                        "direct": True,
                        "segments": [seg(0, 0, 0, 16), seg(1, 0, 16, 32)],
                    }
                ]
            ),
            "exactly one whole tensor",
        ),
        (
            with_changes(
                buckets=[
                    {"nbytes": 16, "segments": [seg(0, 0, 0, 16)]},
                    {"nbytes": 16, "direct": True, "segments": [seg(1, 0, 0, 16)]},
                    {"nbytes": 16, "segments": [seg(1, 16, 0, 16)]},
                ]
            ),
            "exactly one whole tensor",
        ),
        (
            with_changes(
                buckets=[{"nbytes": 48, "segments": [seg(0, -16, 0, 16), seg(1, 0, 16, 32)]}]
            ),
            "greater than or equal",
        ),
    ],
)
def test_corrupted_plans_are_refused(plan: dict, message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        SyncPlan.model_validate(plan)


def test_json_round_trip_and_digest() -> None:
    plan = make_plan(
        [TensorMeta(name=f"w{i}", dtype="bfloat16", shape=(i, 3)) for i in range(50)], 256, 64
    )
    again = SyncPlan.model_validate_json(plan.model_dump_json())
    assert again == plan and again.digest == plan.digest
    other = make_plan(list(plan.tensors), 512, 64)
    assert other.digest != plan.digest


def test_dtype_names_cover_the_zoo_and_refuse_the_rest() -> None:
    for dtype in (
        torch.float32,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.bool,
        torch.uint16,
    ):
        assert TensorMeta.of("x", torch.empty(1, dtype=dtype)).torch_dtype == dtype
    with pytest.raises(TypeError, match="cannot be sent"):
        dtype_name(torch.bits16)


def test_messages_are_bounded_and_strict() -> None:
    with pytest.raises(pydantic.ValidationError):
        PrepareRequest(version=0, plan_digest="0" * 64)
    with pytest.raises(pydantic.ValidationError):
        PrepareRequest(version=1, plan_digest="not-a-digest")
    delta = {"version": 1, "plan_digest": "0" * 64, "built_on": f"{'5e' * 8}:1",
             "new_base": f"{'5e' * 8}:2", "delta": True, "delta_bucket_bytes": 1 << 20}  # fmt: skip
    assert PrepareRequest(**delta, delta_sections=4).delta_sections == 4
    for wrong in ({"delta_sections": 0}, {"delta_sections": MAX_DELTA_SECTIONS + 1}):
        with pytest.raises(pydantic.ValidationError):
            PrepareRequest(**delta, **wrong)
    # Sections are for deltas only (streamed or staged: a staged one reserves its staging area
    # section by section).
    assert PrepareRequest(**delta, staging="atomic", delta_sections=2).delta_sections == 2
    with pytest.raises(pydantic.ValidationError, match="sections"):
        PrepareRequest(**{**delta, "delta": False}, delta_sections=2)
    with pytest.raises(pydantic.ValidationError, match="outside world"):
        GroupSpec(
            group_id="abcdef0123",
            address="127.0.0.1",
            port=1,
            world_size=2,
            rank=2,
            backend="gloo",
            mode="world",
            rendezvous_timeout_s=1,
            collective_timeout_s=1,
        )
    with pytest.raises(pydantic.ValidationError):
        BucketMeta(nbytes=4, segments=())
    with pytest.raises(pydantic.ValidationError):
        Segment(tensor=0, tensor_offset=0, bucket_offset=0, nbytes=0)
