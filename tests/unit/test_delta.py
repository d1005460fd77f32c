"""Delta pushes without a network: the layout as tables, the lineage rule, and the trainer's
encoding against a worker's patching, bit for bit, over every dtype (the buckets are handed
from the one to the other in memory; the real transports are in tests/distributed)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from tests.zoo import zoo
from weight_sync import SyncConfig
from weight_sync.delta import baseline as baseline_module
from weight_sync.delta.baseline import Baseline
from weight_sync.delta.layout import (
    DELTA_BUCKETS,
    DENSE,
    MIN_DELTA_BUCKET,
    NONE,
    RUN_SPANS,
    SPAN,
    SPARSE,
    check_counts,
    delta_bucket_bytes,
    delta_layout,
    encoding,
    header_counts,
    sections,
    span_elements,
    span_runs,
    span_ways,
    spans_of,
)
from weight_sync.delta.lineage import next_base
from weight_sync.delta.transfer import Patcher
from weight_sync.errors import WeightSyncError
from weight_sync.wire.metadata import SyncPlan, TensorMeta, Tied
from weight_sync.wire.packing import Packer, Unpacker, bucket_buffers, byte_view
from weight_sync.wire.planner import align_up, make_plan
from weight_sync.wire.state_dict import check_state_dict
from weight_sync.send.sender import PushPlanner

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("count", "elements", "itemsize", "way"),
    [
        (0, SPAN, 2, NONE),
        (1, SPAN, 2, SPARSE),
        (SPAN // 2 - 1, SPAN, 2, SPARSE),  # 4 bytes per change against 2 per element
        (SPAN // 2, SPAN, 2, DENSE),  # equal: dense (the delta must be smaller)
        (SPAN * 2 // 3 - 1, SPAN, 4, SPARSE),
        (SPAN * 2 // 3 + 1, SPAN, 4, DENSE),
        (SPAN // 3 + 1, SPAN, 1, DENSE),  # fp8: 3 bytes per change against 1 per element
        (SPAN // 3, SPAN, 1, SPARSE),
        (1, 1, 4, DENSE),  # a one-element span is never worth indexing
        (3, 10, 16, SPARSE),
    ],
)
def test_each_span_travels_the_smaller_way(
    count: int, elements: int, itemsize: int, way: int
) -> None:
    assert encoding(count, elements, itemsize) == way


@pytest.mark.parametrize("itemsize", [1, 2, 4, 16])
@pytest.mark.parametrize("numel", [0, 1, 10, SPAN, SPAN + 1, 3 * SPAN - 5])
def test_a_tensor_s_spans_travel_as_each_would_alone(itemsize: int, numel: int) -> None:
    # Boundary counts of every way, cycled over the spans (capped at a span's elements).
    edges = [0, 1, SPAN // 3, SPAN // 3 + 1, SPAN // 2 - 1, SPAN // 2, SPAN * 2 // 3, SPAN]
    for shift in range(len(edges)):
        counts = [min(edges[(span + shift) % len(edges)], span_elements(numel, span))
                  for span in range(spans_of(numel))]  # fmt: skip
        alone = [encoding(c, span_elements(numel, span), itemsize) for span, c in enumerate(counts)]
        assert span_ways(counts, numel, itemsize) == alone


@pytest.mark.parametrize(
    ("ways", "runs"),
    [
        ([SPARSE], [(0, 1, SPARSE)]),
        ([SPARSE, SPARSE, DENSE, NONE, NONE], [(0, 2, SPARSE), (2, 3, DENSE), (3, 5, NONE)]),
        ([DENSE] * (RUN_SPANS + 2), [(0, RUN_SPANS, DENSE), (RUN_SPANS, RUN_SPANS + 2, DENSE)]),
        ([NONE] * (RUN_SPANS - 1) + [SPARSE] * 2,
         [(0, RUN_SPANS - 1, NONE), (RUN_SPANS - 1, RUN_SPANS, SPARSE), (RUN_SPANS, RUN_SPANS + 1, SPARSE)]),
    ],
)  # fmt: skip
def test_runs_are_maximal_and_never_cross_a_piece(
    ways: list[int], runs: list[tuple[int, int, int]]
) -> None:
    assert span_runs(ways) == runs


def plan_of(
    *shapes: tuple[int, ...], direct: tuple[bool, ...] = (), tied: tuple[Tied, ...] = ()
) -> SyncPlan:
    metas = [
        TensorMeta(name=f"t{i}", dtype="float32", shape=shape) for i, shape in enumerate(shapes)
    ]
    return make_plan(metas, 1 << 20, 64, direct, tied)


@pytest.mark.parametrize(
    ("sizes", "count", "cuts"),
    [
        ([100, 5, 5, 5, 300, 1, 1, 1, 1, 50], 1, [(0, 10)]),  # one: the plan itself
        ([100, 5, 5, 5, 300, 1, 1, 1, 1, 50], 2, [(0, 5), (5, 10)]),
        ([100, 5, 5, 5, 300, 1, 1, 1, 1, 50], 8, [(0, 1), (1, 5), (5, 10)]),  # at tensors only
        ([10] * 8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        ([10] * 3, 8, [(0, 1), (1, 2), (2, 3)]),  # never more than one tensor each
        ([1000, 1, 1], 4, [(0, 1), (1, 3)]),  # a tensor goes where its first byte falls
        ([0, 0, 10, 0], 2, [(0, 3), (3, 4)]),
        ([], 4, [(0, 0)]),
    ],
)  # fmt: skip
def test_a_delta_is_cut_into_sections_at_tensors(sizes: list[int], count: int, cuts: list[tuple[int, int]]) -> None:  # fmt: skip
    plan = plan_of(*[(size,) for size in sizes], direct=tuple(size >= 300 for size in sizes),
                   tied=(Tied(name="alias", tensor=len(sizes) - 1),) if sizes else ())  # fmt: skip
    parts = sections(plan, count)
    assert [(part.first, part.stop) for part in parts] == cuts
    assert sum((part.plan.tensors for part in parts), ()) == plan.tensors
    for part in parts:  # direct tensors and tied names go with their section, renumbered
        direct = {b.segments[0].tensor + part.first for b in part.plan.buckets if b.direct}
        assert direct == {part.first + i for i, meta in enumerate(part.plan.tensors)
                          if meta.nbytes >= 4 * 300}  # fmt: skip
        assert [(tie.name, tie.tensor + part.first) for tie in part.plan.tied] == [
            (tie.name, tie.tensor) for tie in plan.tied if part.first <= tie.tensor < part.stop
        ]
    with pytest.raises(ValueError, match="count"):
        sections(plan, 0)


def test_layout_keeps_dense_tensors_whole_skips_unchanged_ones_and_cuts_blobs() -> None:
    numel = (RUN_SPANS + 3) * SPAN
    plan = plan_of((numel,), (SPAN,), (2 * SPAN,), (0, 4), direct=(True, False, False, False),
                   tied=(Tied(name="alias", tensor=0), Tied(name="alias2", tensor=2)))  # fmt: skip
    spans = [math.ceil(numel / SPAN), 1, 2]
    assert header_counts(plan) == sum(spans)
    counts = [SPAN] * spans[0] + [0] + [5, SPAN]
    layout = delta_layout(plan, counts, 1 << 20)
    whole = {plan.tensors[i].name for i in layout.whole.values()}
    assert whole == {"t0", "t3"}  # every span dense (t0 keeps its direct bucket), and the empty one
    assert layout.plan.buckets[0].direct and layout.plan.tensors[0].name == "t0"
    blobs = sorted((b.tensor, b.first_span, b.dense, b.counts) for b in layout.blobs.values())
    assert blobs == [(2, 0, False, (5,)), (2, 1, True, (SPAN,))]
    assert [t.name for t in layout.plan.tied] == ["alias"]  # t2's alias is refreshed by the worker
    assert layout.changed_tensors == {2}


MiB = 1 << 20


@pytest.mark.parametrize(
    ("payload", "bucket_bytes", "alignment", "size"),
    [
        (80 * MiB, 32 * MiB, 64, 10 * MiB),  # an eighth
        (10 * MiB + 1, 32 * MiB, 64, align_up(-(-(10 * MiB + 1) // DELTA_BUCKETS), 64)),
        (1000 * MiB, 32 * MiB, 64, 32 * MiB),  # never above the configured size
        (3 * MiB, 32 * MiB, 64, MIN_DELTA_BUCKET),  # never below a MiB...
        (3 * MiB, 4096, 64, 4096),  # ...unless the configured size is smaller
        (0, 32 * MiB, 64, MIN_DELTA_BUCKET),
        (0, 64, 4096, 4096),  # at least the alignment (make_plan needs it)
    ],
)  # fmt: skip
def test_a_delta_travels_in_about_eight_buckets(payload: int, bucket_bytes: int, alignment: int, size: int) -> None:  # fmt: skip
    assert delta_bucket_bytes(payload, bucket_bytes, alignment) == size


def test_a_layout_cuts_a_delta_into_eighths_or_more() -> None:
    """At the configured 32 MiB this delta would be one bucket: nothing is forwarded or patched
    before all of it arrived."""
    plan = plan_of(*[(8 * RUN_SPANS * SPAN,)] * 4)  # 32M float32: 128 MiB
    counts = [SPAN // 8] * header_counts(plan)  # an eighth changed: sparse everywhere
    layout = delta_layout(plan, counts, 32 * MiB)
    payload = sum(meta.nbytes for meta in layout.plan.tensors)
    assert 8 * MIN_DELTA_BUCKET < payload < 32 * MiB and not layout.whole
    assert len(layout.plan.buckets) >= DELTA_BUCKETS
    assert max(b.nbytes for b in layout.plan.buckets) <= delta_bucket_bytes(payload, 32 * MiB, 64)


@pytest.mark.parametrize(
    ("counts", "problem"),
    [([0, 0], "has 2 counts"), ([0, 0, -1], "-1 changes"), ([SPAN + 1, 0, 0], "changes in span 0"),
     ([0, 0, 11], "11 changes in span 1")],
)  # fmt: skip
def test_a_header_that_cannot_belong_to_the_plan_is_refused(
    counts: list[int], problem: str
) -> None:
    plan = plan_of((SPAN,), (SPAN + 10,))
    with pytest.raises(ValueError, match=problem):
        check_counts(plan, counts)


A, B, C = "0" * 16 + ":1", "0" * 16 + ":2", "0" * 16 + ":3"


@pytest.mark.parametrize(
    ("held", "built_on", "new", "full", "after"),
    [
        (None, None, A, True, A),  # a full push defines everything
        (B, A, C, True, C),
        (A, A, B, False, B),  # a partial push (or a delta) on the base it was built on
        (None, A, B, False, None),  # ... on anything else describes nothing
        (C, A, B, False, None),
        (None, None, B, False, None),  # the trainer had no base: a partial push cannot make one
        (A, A, None, True, None),  # the trainer keeps no copy
    ],
)
def test_lineage(
    held: str | None, built_on: str | None, new: str | None, full: bool, after: str | None
) -> None:
    assert next_base(held, built_on, new, full) == after


def transfer(baseline: Baseline, plan: SyncPlan, tensors: list[torch.Tensor],
             destinations: dict[str, torch.Tensor], bucket_bytes: int, delta: bool = True) -> int:  # fmt: skip
    """One push from ``baseline`` into ``destinations``, the buckets handed over in memory, as
    ``delta.transfer`` and ``Receiver`` drive them; returns the bytes that travelled."""
    baseline.begin()
    counts = baseline.scan(plan, tensors) if delta else [math.prod(m.shape) for m in plan.tensors]
    if not delta:  # every element counted as changed: the dense layout
        counts = [min(SPAN, n - s * SPAN) for n in counts for s in range(math.ceil(n / SPAN))]
    layout = delta_layout(plan, counts, bucket_bytes)
    sent_sums: list[int] = []
    sources = baseline.sources(layout, plan, tensors, sent_sums)
    record = baseline.recorder(plan, layout.plan, layout.whole)
    got_sums: list[int] = []
    patcher = Patcher(plan, layout, destinations, got_sums)
    unpacker = Unpacker(layout.plan, patcher.landing(), CPU)
    packer = Packer(layout.plan, sources)
    buffer = bucket_buffers(layout.plan, CPU)
    for index, bucket in enumerate(layout.plan.buckets):
        if bucket.direct:
            data = byte_view(sources[bucket.segments[0].tensor])
            received = unpacker.direct_target(index, CPU)
            received.copy_(data)
        else:
            data = packer.pack(index, buffer[0])
            received = data.clone()
        record(index, data)
        assert patcher.apply(unpacker.unpack(index, received)) == []  # everything lands in place
    sources.close()
    patcher.finish()
    assert got_sums == sent_sums
    baseline.finish(plan, 1, False)
    return layout.plan.nbytes


def change(
    tensors: dict[str, torch.Tensor], fraction: float, seed: int, finite: bool = False
) -> None:
    """Overwrite ``fraction`` of the elements of every contiguous tensor with random bits
    (``finite``: fp32 ones with random normal values, which hold no NaN for the fused kernels
    to leave to NumPy)."""
    gen = torch.Generator().manual_seed(seed)
    for tensor in tensors.values():
        if tensor.is_contiguous() and tensor.numel() > 4:
            rows = tensor.view(-1).view(torch.uint8).view(tensor.numel(), tensor.element_size())
            picked = torch.randint(
                0, tensor.numel(), (max(1, int(tensor.numel() * fraction)),), generator=gen
            )
            if finite and tensor.dtype == torch.float32:
                tensor.view(-1)[picked] = torch.randn(picked.numel(), generator=gen)
                continue
            rows[picked] = torch.randint(0, 256, (picked.numel(), tensor.element_size()), dtype=torch.uint8,
                                         generator=gen)  # fmt: skip


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(
    ("cast", "fused"), [(None, False), (None, True), ("bfloat16", False), ("bfloat16", True)]
)
@pytest.mark.parametrize(
    ("bucket_bytes", "fraction"), [(4096, 0.01), (1 << 20, 0.01), (1 << 20, 0.2)]
)
def test_deltas_rebuild_every_dtype_bit_for_bit(cast: str | None, fused: bool, bucket_bytes: int, fraction: float, threads: int) -> None:  # fmt: skip
    """The zoo (every dtype, views, split tensors), changed at random again and again: after each
    delta the worker's tensors equal the trainer's copy byte for byte, and far fewer bytes
    travelled than a dense push sends. At a fifth changed, the blobs outgrow what a scan keeps
    encoded, and the rest are found again while packing (on ``threads``, ahead of the packer,
    checksums still in the packer's order). ``fused``: found by the fused kernels, while scanning
    and again while packing -- every 2- and 4-byte dtype compared as it is, NaN payloads
    included; with the cast, fp32 changed to finite values rounded to bf16."""
    tensors = zoo(seed=3, big=200_000)
    tensors["alias"] = tensors["float32_big"]  # tied: travels once, refreshed on the worker
    config = SyncConfig(bucket_bytes=bucket_bytes, direct_min_bytes=100_000, cast_dtype=cast)
    entries = check_state_dict(tensors, config)
    plan = PushPlanner(config, CPU).plan(entries)
    destinations = {
        name: torch.zeros(meta.shape, dtype=meta.torch_dtype) for name, meta in plan.metas().items()
    }
    baseline = Baseline(threads=threads, fused=fused)
    assert (
        transfer(baseline, plan, entries.tensors, destinations, bucket_bytes, delta=False)
        >= plan.payload_bytes
    )
    for step in range(3):
        change(tensors, fraction, seed=step, finite=fused and cast is not None)
        sent = transfer(baseline, plan, entries.tensors, destinations, bucket_bytes)
        assert sent < plan.nbytes * (0.1 if fraction < 0.05 else 0.8)
        for name in plan.metas():
            held = baseline._bytes.get(
                plan.tensors[_index(plan, name)].name, torch.empty(0, dtype=torch.uint8)
            )
            assert torch.equal(byte_view(destinations[name].contiguous()), held), name
        if cast is None:  # without a cast, the copy is the trainer's tensors themselves
            for name, tensor in tensors.items():
                assert torch.equal(
                    byte_view(destinations[name].contiguous()), byte_view(tensor.contiguous())
                ), name


@pytest.mark.parametrize("threads", [1, 2])
def test_a_blob_split_over_buckets_is_encoded_once(threads: int) -> None:
    """A sparse blob bigger than a delta bucket ends in the next bucket, after a small blob the
    packer copies first there: the split blob is read again after another, and must not be
    compared again (its changes are already in the copy: nothing would be found)."""
    gen = torch.Generator().manual_seed(5)
    tensors = {
        "a": torch.randn(RUN_SPANS * SPAN, generator=gen),
        "b": torch.randn(1000, generator=gen),
    }
    config = SyncConfig(direct_min_bytes=None).sized_for("cpu")
    entries = check_state_dict(tensors, config)
    plan = PushPlanner(config, CPU).plan(entries)
    destinations = {name: torch.zeros_like(tensor) for name, tensor in tensors.items()}
    baseline = Baseline(threads=threads, fused=False)  # it keeps the first blob while scanning
    transfer(baseline, plan, entries.tensors, destinations, config.sized_bucket_bytes, delta=False)
    before = {name: tensor.clone() for name, tensor in tensors.items()}
    tensors["a"].view(-1)[torch.randperm(RUN_SPANS * SPAN, generator=gen)[:300_000]] += 1
    tensors["b"][3] += 1
    counts = [int((before[meta.name] != tensors[meta.name]).view(-1)[at : at + SPAN].sum())
              for meta in plan.tensors for at in range(0, math.prod(meta.shape), SPAN)]  # fmt: skip
    layout = delta_layout(plan, counts, config.sized_bucket_bytes)
    buckets = [
        [layout.plan.tensors[seg.tensor].name for seg in b.segments] for b in layout.plan.buckets
    ]
    assert len(buckets) == 2 and buckets[0] == buckets[1][:1] and len(buckets[1]) == 2, buckets
    transfer(baseline, plan, entries.tensors, destinations, config.sized_bucket_bytes)
    for name, tensor in tensors.items():
        assert torch.equal(destinations[name], tensor), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fused", [False, True])
def test_a_step_during_a_push_fails_it_and_no_encoding_thread_outlives_it(fused: bool) -> None:
    """Blobs not encoded by the scan are compared again while packing, on threads ahead of the
    packer (fp32 pushed as bf16, ``fused``: by the fused kernel): one that finds other changes
    than were counted fails the push (there, in the packer's thread), and closing the sources
    ends every thread."""
    tensors = {f"w{i}": torch.randn(4 * SPAN) for i in range(6)}
    config = SyncConfig(direct_min_bytes=None, cast_dtype="bfloat16" if fused else None)
    entries = check_state_dict(tensors, config)
    plan = PushPlanner(config, CPU).plan(entries)
    baseline = Baseline(threads=3, fused=fused)
    destinations = {
        name: torch.zeros(4 * SPAN, dtype=plan.tensors[0].torch_dtype) for name in tensors
    }
    transfer(baseline, plan, entries.tensors, destinations, 1 << 20, delta=False)
    change(tensors, 0.3, seed=1, finite=fused)  # past what a scan keeps encoded
    assert encoding_threads() == 0
    baseline.begin()
    counts = baseline.scan(plan, entries.tensors)
    layout = delta_layout(plan, counts, 1 << 20)
    assert len(layout.blobs) > 3 and ("w5", 0) not in baseline._encoded
    tensors["w5"].view(torch.int32)[7] ^= 1 << 20  # an optimizer step, mid-push (seen in bf16)
    sources = baseline.sources(layout, plan, entries.tensors, None)
    packer, buffer = Packer(layout.plan, sources), bucket_buffers(layout.plan, CPU)[0]
    with pytest.raises(WeightSyncError, match="'w5' changed while it was being pushed"):
        for index in range(len(layout.plan.buckets)):
            packer.pack(index, buffer)
    assert encoding_threads() > 0  # encoding ahead
    sources.close()
    assert encoding_threads() == 0


@pytest.mark.parametrize("fused", [False, True])
def test_a_change_moved_to_another_span_mid_push_fails_it(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Workers place a sparse blob's changes by each span's count: a step that moves a change to
    another span of the same blob keeps the blob's total, and still fails the push."""
    monkeypatch.setattr(baseline_module, "ENCODED_BUDGET", 1 << 40)  # nothing kept: compared again
    w = torch.randn(2 * SPAN)
    config = SyncConfig(direct_min_bytes=None, cast_dtype="bfloat16")
    entries = check_state_dict({"w": w}, config)
    plan = PushPlanner(config, CPU).plan(entries)
    baseline = Baseline(threads=1, fused=fused)
    transfer(
        baseline,
        plan,
        entries.tensors,
        {"w": torch.zeros(2 * SPAN, dtype=torch.bfloat16)},
        1 << 20,
        delta=False,
    )
    old = w[9].clone()
    w[[5, 9, SPAN + 3]] += 1.0
    baseline.begin()
    counts = baseline.scan(plan, entries.tensors)
    assert counts == [2, 1]
    layout = delta_layout(plan, counts, 1 << 20)
    assert [blob.counts for blob in layout.blobs.values()] == [(2, 1)]  # one blob over both spans
    w[9], w[SPAN + 4] = old, w[SPAN + 4] + 1.0  # still 3 changes: 1 and 2
    sources = baseline.sources(layout, plan, entries.tensors, None)
    with pytest.raises(WeightSyncError, match="'w' changed while it was being pushed"):
        Packer(layout.plan, sources).pack(0, bucket_buffers(layout.plan, CPU)[0])
    sources.close()


def encoding_threads() -> int:
    """Threads encoding ahead of a packer (not, say, one loading the fused kernels)."""
    return sum(thread.name.startswith("weight-sync-encode") for thread in threading.enumerate())


def _index(plan: SyncPlan, name: str) -> int:
    for index, meta in enumerate(plan.tensors):
        if meta.name == name:
            return index
    return next(tie.tensor for tie in plan.tied if tie.name == name)


def test_a_tensor_whose_first_span_is_dense_is_sent_whole_without_comparing_the_rest() -> None:
    tensor = torch.zeros(3 * SPAN)
    plan = plan_of((3 * SPAN,))
    baseline = Baseline()
    destinations = {"t0": torch.zeros(3 * SPAN)}
    transfer(baseline, plan, [tensor], destinations, 1 << 20, delta=False)
    tensor[:SPAN] += 1  # every element of the first span
    assert baseline.scan(plan, [tensor]) == [SPAN, SPAN, SPAN]
    tensor[:SPAN] -= 1
    tensor[SPAN : SPAN + 3] += 1
    assert baseline.scan(plan, [tensor]) == [0, 3, 0]
