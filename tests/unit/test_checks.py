"""The checks that run before any collective: the sender's on the state dict, the receiver's on
the plan, a member's on the layout of a push from many senders."""

import pytest
import torch

from weight_sync import SyncConfig
from weight_sync.receive.checks import check_layout, expecting
from weight_sync.wire.blocks import Block, BlockLayout
from weight_sync.wire.mapping import fuse
from weight_sync.wire.metadata import WIRE_VERSION, PrepareRequest, TensorMeta
from weight_sync.wire.packing import read_values
from weight_sync.wire.planner import make_plan
from weight_sync.receive.buckets import Targets
from weight_sync.receive.receiver import Receiver, accept_all, check_plan
from weight_sync.wire.state_dict import (
    _entries,
    _plain_entries,
    check_state_dict,
    device_finite_flags,
    finite_flags,
    is_finite,
)
from weight_sync.send.sender import PushPlanner


def expected_of(**tensors: torch.Tensor) -> dict[str, TensorMeta]:
    return {name: TensorMeta.of(name, tensor) for name, tensor in tensors.items()}


def plan_of(**tensors: torch.Tensor):
    return make_plan(list(expected_of(**tensors).values()), 1024, 64)


MODEL = expected_of(w=torch.zeros(4, 4), b=torch.zeros(4))


@pytest.mark.parametrize(
    ("plan", "problems"),
    [
        (plan_of(w=torch.zeros(4, 4), b=torch.zeros(4)), []),
        (plan_of(b=torch.zeros(4), w=torch.zeros(4, 4)), []),  # order does not matter
        (plan_of(w=torch.zeros(4, 4), b=torch.zeros(4), x=torch.zeros(1)), ["unknown tensor 'x'"]),
        (plan_of(w=torch.zeros(4, 4)), ["missing tensor 'b'"]),
        (
            plan_of(w=torch.zeros(4, 5), b=torch.zeros(4)),
            ["'w': sent float32[4, 5], model has float32[4, 4]"],
        ),
        (
            plan_of(w=torch.zeros(4, 4), b=torch.zeros(4, dtype=torch.float16)),
            ["'b': sent float16[4], model has float32[4]"],
        ),
    ],
)
def test_check_plan_table(plan, problems: list[str]) -> None:
    assert check_plan(plan, MODEL) == problems


@pytest.mark.parametrize(
    ("plan", "problems"),
    [
        (plan_of(w=torch.zeros(4, 4)), []),  # a subset: fine when announced
        (plan_of(w=torch.zeros(4, 4), b=torch.zeros(4)), []),
        (plan_of(w=torch.zeros(4, 4), x=torch.zeros(1)), ["unknown tensor 'x'"]),
        (plan_of(b=torch.zeros(5)), ["'b': sent float32[5], model has float32[4]"]),
    ],
)
def test_check_plan_table_for_partial_pushes(plan, problems: list[str]) -> None:
    assert check_plan(plan, MODEL, partial=True) == problems


def test_check_plan_counts_tied_names_as_sent() -> None:
    entries = check_state_dict(
        {"w": (w := torch.zeros(4, 4)), "head": w, "b": torch.zeros(4)}, SyncConfig()
    )
    plan = PushPlanner(SyncConfig(), torch.device("cpu")).plan(entries)
    model = {**MODEL, "head": MODEL["w"].model_copy(update={"name": "head"})}
    assert [t.name for t in plan.tensors] == ["w", "b"] and check_plan(plan, model) == []
    assert check_plan(plan, MODEL) == ["unknown tensor 'head'"]


@pytest.mark.parametrize(
    ("make", "tied"),
    [
        (lambda w: {"a": w, "b": w}, [("b", 0)]),  # the same tensor twice
        (lambda w: {"a": w, "b": w.detach()}, [("b", 0)]),  # state_dict()'s detached aliases
        (lambda w: {"a": w, "b": w.view(4, 4)}, []),  # same bytes, another shape: sent twice
        (lambda w: {"a": w, "b": w[:1]}, []),  # an overlapping view is not a tie
        (lambda w: {"a": w, "b": w.clone()}, []),  # equal values, own storage
        (lambda w: {"e": torch.zeros(0), "f": torch.zeros(0)}, []),  # nothing to share
        (lambda w: {"x": torch.ones(2), "a": w, "c": w, "b": w}, [("c", 1), ("b", 1)]),
    ],
)
def test_tied_weights_are_found_by_exact_storage(make, tied: list[tuple[str, int]]) -> None:
    entries = check_state_dict(make(torch.zeros(2, 8)), SyncConfig())
    assert [(t.name, t.tensor) for t in entries.tied] == tied
    assert len(entries.names) + len(entries.tied) == entries.count


def test_transform_runs_before_rename_and_tie_detection() -> None:
    q, k = torch.ones(2, 3), torch.zeros(2, 3)
    entries = check_state_dict(
        {"m.q_proj.w": q, "m.k_proj.w": k, "m.out.w": q}, SyncConfig(),
        rename=lambda n: n.removeprefix("m."), transform=fuse(["q_proj", "k_proj"], into="qk"),
    )  # fmt: skip
    assert entries.names == ["qk.w", "out.w"] and not entries.tied  # the fused copy is new
    assert torch.equal(entries.tensors[0], torch.cat([q, k]))


def test_check_plan_accepts_anything_without_a_target() -> None:
    assert check_plan(plan_of(anything=torch.zeros(3)), None) == []


W, B, C = torch.zeros(4, 3), torch.zeros(4), torch.zeros(2)
PARTIAL = "a partial push needs weights to complete, and this member holds no committed version"


@pytest.mark.parametrize(
    ("partial", "held", "target", "problems"),
    [
        (False, None, {"w": W, "b": B}, []),  # a first push, whole: taken
        (True, 3, {"w": W, "b": B, "c": C}, []),  # part of the weights held: completed
        (True, None, {"w": W, "b": B, "c": C}, [f"{PARTIAL}: push the full state dict first"]),
        (False, 3, {"w": W, "b": B, "c": C}, ["missing tensor 'c'"]),  # whole, but not all
        (False, 3, {"w": W.T, "b": B}, ["'w': sent float32[4, 3], model has float32[3, 4]"]),
        (False, 3, None, []),  # a loader takes any names
    ],
)
def test_a_members_check_of_a_layout(
    partial: bool, held: int | None, target: dict | None, problems: list[str]
) -> None:
    layout = BlockLayout(
        senders=2,
        tensors=(TensorMeta.of("w", W), TensorMeta.of("b", B)),
        blocks=(
            Block(tensor=0, sender=0, offset=(0, 0), size=(2, 3)),
            Block(tensor=0, sender=1, offset=(2, 0), size=(2, 3)),
            Block(tensor=1, sender=1, offset=(0,), size=(4,)),
        ),
        partial=partial,
    )
    assert check_layout(layout, expecting(lambda: target), held) == problems


def request(plan, version: int = 1, with_plan: bool = True) -> str:
    return PrepareRequest(
        version=version, plan_digest=plan.digest, plan=plan if with_plan else None
    ).model_dump_json()


def test_receiver_refuses_oversized_and_malformed_metadata() -> None:
    receiver = Receiver()
    receiver._max_metadata_bytes = 100
    reply = receiver.prepare(request(plan_of(w=torch.zeros(1))), accept_all)
    assert not reply.accepted and "exceeds max_metadata_bytes" in reply.problems[0]
    receiver._max_metadata_bytes = 1 << 20
    reply = receiver.prepare('{"version": 1, "plan_digest": "x"}', accept_all)
    assert not reply.accepted and "malformed metadata" in reply.problems[0]
    plan = plan_of(w=torch.zeros(1))
    tampered = request(plan).replace(plan.digest, "0" * 64)
    assert receiver.prepare(tampered, accept_all).problems == ("plan does not match its digest",)
    assert receiver.prepare(request(plan, with_plan=False), accept_all).need_plan
    other = PrepareRequest(version=1, wire=WIRE_VERSION + 1, plan_digest=plan.digest, plan=plan)
    reply = receiver.prepare(other.model_dump_json(), accept_all)
    assert not reply.accepted and "wire version" in reply.problems[0]  # another release
    # A release from before wire versions sends no "wire" at all: refused too, not defaulted.
    older = request(plan).replace(f'"wire":{WIRE_VERSION},', "")
    assert '"wire"' not in older
    reply = receiver.prepare(older, accept_all)
    assert not reply.accepted and "wire version none" in reply.problems[0], reply
    assert "wire" not in receiver.prepare(request(plan), accept_all).problems[0]  # past it
    # Another release whose fields this one cannot read is named as such, not as malformed.
    newer = request(plan).replace(f'"wire":{WIRE_VERSION}', f'"wire":{WIRE_VERSION + 1}')
    newer = newer.replace('"staging":"stream"', '"staging":"a-staging-of-tomorrow"')
    reply = receiver.prepare(newer, accept_all)
    assert not reply.accepted and f"wire version {WIRE_VERSION + 1}" in reply.problems[0], reply
    assert receiver.version is None and not receiver.dirty


@pytest.mark.parametrize(
    ("state_dict", "error", "message"),
    [
        ({"w": [1.0, 2.0]}, TypeError, "expected a torch.Tensor, got list; push name -> tensor"),
        # the common mistakes, each told what to pass instead
        (
            {"model": {"w": torch.zeros(1)}, "step": 3},
            TypeError,
            r"'model': expected a torch.Tensor, got dict; a whole checkpoint .*checkpoint\['model'\]",
        ),
        (
            {"encoder": torch.nn.Linear(2, 2)},
            TypeError,
            r"push model.state_dict\(\), not the module",
        ),
        (torch.nn.Linear(2, 2), TypeError, r"not a Linear: model.state_dict\(\)"),
        (torch.zeros(3), TypeError, r"not a Tensor: model.state_dict\(\)"),
        (["w"], TypeError, "pairs, got str; push a state dict"),
        ({3: torch.zeros(1)}, TypeError, "names must be str"),
        ({"": torch.zeros(1)}, ValueError, "1..1024 characters"),
        ([("w", torch.zeros(1)), ("w", torch.ones(1))], ValueError, "appears twice"),
        ([("w", torch.zeros(1), 3)], TypeError, "pairs"),
        ({"w": torch.zeros(2, device="meta")}, ValueError, "only CPU and CUDA"),
        ({"w": torch.zeros(2, 2).to_sparse()}, ValueError, "dense"),
        ({"w": torch.empty(2, dtype=torch.bits16)}, TypeError, "cannot be sent"),
    ],
)
def test_bad_state_dicts_are_refused(state_dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        check_state_dict(state_dict, SyncConfig())


_W = torch.zeros(2, 8)


@pytest.mark.parametrize(
    ("pairs", "plain"),
    [
        ([], True),
        ([("a", torch.zeros(3)), ("b", torch.ones(2, 2, dtype=torch.bfloat16))], True),
        ([("a", torch.nn.Parameter(torch.ones(3)))], True),  # detached on the way
        ([("a", torch.nn.Parameter(torch.ones(3), requires_grad=False))], True),
        ([("a", torch.zeros(8, 8).t())], True),  # strided: packing gathers it
        ([("a", _W), ("b", _W)], False),  # tied: found entry by entry
        ([("a", _W), ("b", _W.view(16))], False),  # one address, not tied: settled there too
        ([("a", torch.zeros(0)), ("b", torch.zeros(0))], False),
        ([("a", torch.zeros(1)), ("a", torch.zeros(1))], False),  # the errors are named there
        ([("", torch.zeros(1))], False),
        ([("a", torch.zeros(2, device="meta"))], False),
        ([("a", torch.zeros(2, 2).to_sparse())], False),
        ([("a", torch.empty(2, dtype=torch.bits16))], False),
        ([("a", [1.0])], False),
    ],
)
def test_the_column_check_agrees_with_the_entry_by_entry_one(pairs: list, plain: bool) -> None:
    """``_plain_entries`` is a fast path: where it answers, the loop would answer the same."""
    names, tensors = [name for name, _ in pairs], [tensor for _, tensor in pairs]
    fast = _plain_entries(names, tensors)
    assert (fast is not None) is plain
    if fast is not None:
        slow = _entries(names, tensors, sharded=False, renamed=False)
        assert fast.names == slow.names and fast.tied == slow.tied == []
        assert [(t.data_ptr(), t.shape, t.stride()) for t in fast.tensors] == [
            (t.data_ptr(), t.shape, t.stride()) for t in slow.tensors
        ]
        assert not any(t.requires_grad for t in fast.tensors)


def test_too_many_tensors() -> None:
    with pytest.raises(ValueError, match="max_tensors=3"):
        check_state_dict({f"w{i}": torch.zeros(1) for i in range(4)}, SyncConfig(max_tensors=3))


def test_parameters_are_detached() -> None:
    entries = check_state_dict({"w": torch.nn.Parameter(torch.ones(3))}, SyncConfig())
    assert entries.names == ["w"] and not entries.tensors[0].requires_grad


@pytest.mark.parametrize(
    ("tensor", "min_bytes", "direct"),
    [
        (torch.zeros(1024), 4096, True),  # exactly at the threshold
        (torch.zeros(1023), 4096, False),  # below it: packed
        (torch.zeros(64, 64).t(), 4096, False),  # not contiguous: packed
        (torch.zeros(1024), None, False),  # direct transfers switched off
    ],
)
def test_which_tensors_go_direct(tensor: torch.Tensor, min_bytes: int | None, direct: bool) -> None:
    config = SyncConfig(direct_min_bytes=min_bytes, bucket_bytes=1 << 20)
    plan = PushPlanner(config, torch.device("cpu")).plan(check_state_dict({"w": tensor}, config))
    assert plan.buckets[0].direct is direct


def test_tensors_on_another_device_are_never_direct() -> None:
    config = SyncConfig(direct_min_bytes=1)
    planner = PushPlanner(config, torch.device("cuda", 0))
    assert not planner.plan(check_state_dict({"w": torch.zeros(4)}, config)).buckets[0].direct


def test_the_plan_is_reused_while_the_layout_is_unchanged() -> None:
    planner = PushPlanner(SyncConfig(bucket_bytes=1024), torch.device("cpu"))
    first = planner.plan(check_state_dict({"a": torch.zeros(10), "b": torch.ones(3)}, SyncConfig()))
    same = planner.plan(check_state_dict({"a": torch.ones(10), "b": torch.zeros(3)}, SyncConfig()))
    reshaped = planner.plan(
        check_state_dict({"a": torch.zeros(2, 5), "b": torch.ones(3)}, SyncConfig())
    )
    assert same is first  # new values, same layout: no re-planning, no new digest
    assert reshaped is not first and reshaped.digest != first.digest


def test_rename_maps_drops_and_refuses_collisions() -> None:
    entries = check_state_dict(
        {"model.w": torch.zeros(1), "model.rope": torch.zeros(2)},
        SyncConfig(),
        rename=lambda n: None if n.endswith("rope") else n.removeprefix("model."),
    )
    assert entries.names == ["w"]
    with pytest.raises(ValueError, match=r"'w' appears twice \(after renaming\)"):
        check_state_dict(
            {"a.w": torch.zeros(1), "b.w": torch.zeros(1)},
            SyncConfig(),
            rename=lambda n: n.split(".")[-1],
        )
    with pytest.raises(TypeError, match="returned int"):
        check_state_dict({"w": torch.zeros(1)}, SyncConfig(), rename=lambda n: 3)  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize(
    ("tensor", "refused"),
    [
        (torch.tensor([1.0, float("nan")]), True),
        (torch.tensor([float("-inf")], dtype=torch.bfloat16), True),
        (torch.tensor([1 + 1j, complex(float("inf"), 0)]), True),
        (torch.tensor([1.0, 2.0], dtype=torch.float16), False),
        (torch.zeros(0), False),
        (
            torch.full((10,), 1e308, dtype=torch.float64),
            False,
        ),  # the sum overflows; values are finite
        (
            torch.full((100_000,), 60_000.0, dtype=torch.float16),
            False,
        ),  # likewise in half precision
        (
            torch.cat(
                [
                    torch.full((10,), 1e308, dtype=torch.float64),
                    torch.tensor([float("nan")], dtype=torch.float64),
                ]
            ),
            True,
        ),
        (torch.tensor([1, 2]), False),  # integers are always finite
        (torch.zeros(4).to(torch.float8_e4m3fn), False),  # no isfinite kernel: not checked
    ],
)
def test_finiteness_check_table(tensor: torch.Tensor, refused: bool) -> None:
    state_dict = {"ok": torch.ones(3), "w": tensor}
    check_state_dict(state_dict, SyncConfig())  # off by default
    if refused:
        with pytest.raises(ValueError, match="NaN or Inf in 'w'; nothing was sent"):
            check_state_dict(state_dict, SyncConfig(check_finite=True))
    else:
        check_state_dict(state_dict, SyncConfig(check_finite=True))


@pytest.mark.parametrize(
    ("tensor", "cast", "refused"),
    [
        (torch.tensor([1.0, 70_000.0]), "float16", True),  # would arrive as Inf
        (torch.tensor([1.0, -70_000.0]), "float16", True),
        (torch.tensor([1.0, 60_000.0]), "float16", False),
        (torch.tensor([1.0, 70_000.0]), "bfloat16", False),  # bf16 has fp32's range
        (torch.tensor([1e300], dtype=torch.float64), "float32", True),
        (torch.tensor([1.0, float("nan")]), "float16", True),
        (torch.tensor([70_000], dtype=torch.int64), "float16", False),  # integers are not cast
    ],
)
def test_finiteness_check_looks_through_the_cast(
    tensor: torch.Tensor, cast: str, refused: bool
) -> None:
    config = SyncConfig(check_finite=True, cast_dtype=cast)
    if refused:
        with pytest.raises(ValueError, match=f"beyond torch.{cast}'s range"):
            check_state_dict({"w": tensor}, config)
    else:
        check_state_dict({"w": tensor}, config)


def test_a_workers_tensors_are_recognised_across_pushes() -> None:
    """What the receiver's reuse (of its plan check and unpacker) is keyed by: the same tensors
    at the same addresses match; a swapped storage, a new name or a new shape do not."""
    model = torch.nn.Linear(4, 4)
    first = Targets.of(model.state_dict(keep_vars=True))
    assert Targets.of(model.state_dict(keep_vars=True), first) is first  # the very objects
    detached = Targets.of(model.state_dict(), first)  # new objects, same tensors: equal
    assert detached is not first and detached == first
    model.bias.data = torch.zeros(4)  # a new storage under the same Parameter
    assert Targets.of(model.state_dict(keep_vars=True), first) != first
    model.register_buffer("scale", torch.ones(1))
    assert Targets.of(model.state_dict(keep_vars=True), first) != first
    reshaped = {"w": torch.zeros(16)}
    assert Targets.of({"w": reshaped["w"].view(4, 4)}, Targets.of(reshaped)) != Targets.of(reshaped)


def _finite_table() -> list[torch.Tensor]:
    big = torch.finfo(torch.float32).max
    return [
        torch.randn(1000),
        torch.tensor([1.0, float("nan")]),
        torch.tensor([float("inf"), 1.0]),
        torch.tensor([-float("inf")], dtype=torch.float64),
        torch.tensor([big, big]),  # the sum overflows, yet every value is finite
        torch.tensor([1e5, -2.0]),  # beyond float16's range: Inf when cast to it
        torch.tensor([65504.0, -65504.0]),  # float16's largest: still finite when cast
        torch.randn(64, 64).t(),  # strided
        torch.randn(100).to(torch.bfloat16),
        torch.tensor([float("nan")], dtype=torch.float16),
        torch.tensor([1 + 1j, complex(float("nan"), 0)], dtype=torch.complex64),
        torch.tensor([1 + 1j, 2 - 3j], dtype=torch.complex128),
        torch.tensor([], dtype=torch.float32),
        torch.arange(10),  # no NaN to have
        torch.zeros(3, dtype=torch.float8_e4m3fn),  # storage dtypes pass
    ]


@pytest.mark.parametrize("cast", [None, "float16", "bfloat16", "float32"])
def test_batched_finiteness_equals_the_per_tensor_answer(cast: str | None) -> None:
    tensors = _finite_table()
    expected = [is_finite(tensor, cast) for tensor in tensors]
    assert read_values(device_finite_flags(tensors, cast)) == expected
    assert finite_flags(tensors, cast) == expected
    assert not all(expected)


def test_check_finite_names_the_bad_tensors() -> None:
    config = SyncConfig(check_finite=True, cast_dtype="float16")
    state = {"ok": torch.ones(3), "nan": torch.tensor([float("nan")]), "big": torch.tensor([1e6])}
    with pytest.raises(ValueError, match="'nan', 'big'; nothing was sent"):
        check_state_dict(state, config)
