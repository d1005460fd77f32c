"""``Baseline.scan`` on several threads against a plain one-thread reference written here with
torch alone: the same counts, the same blobs kept while scanning (the budget spent in the same
order), the same copy afterwards -- over dtypes (1 to 16 bytes, a cast), densities (none, sparse,
dense, spans of each in one tensor, enough to cross the budget), sizes that are not multiples of
a span, tied names and partial pushes; with the fused kernels (fp32 -> bf16, and 2- and 4-byte
dtypes as they are) and without; and a
push scanned section after section (``layout.sections``), as a sectioned delta's send scans it."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from weight_sync import SyncConfig
from weight_sync.delta import scan as scan_module
from weight_sync.delta import kernels
from weight_sync.delta.baseline import Baseline
from weight_sync.delta.scan import ENCODED_BUDGET, PIECE, kept_bytes
from weight_sync.delta.codec import encode_sparse, words
from weight_sync.delta.kernel_loader import FusedKernels
from weight_sync.delta.layout import (
    DENSE,
    RUN_SPANS,
    SPAN,
    SPARSE,
    encoding,
    sections,
    span_elements,
    span_runs,
    spans_of,
)
from weight_sync.delta.layout import sparse_bytes as blob_bytes
from weight_sync.wire.metadata import SyncPlan
from weight_sync.wire.packing import Packer, bucket_buffers
from weight_sync.wire.state_dict import Entries, check_state_dict
from weight_sync.send.sender import PushPlanner

CPU = torch.device("cpu")
Encoded = dict[tuple[str, int], torch.Tensor]

# Per span densities, cycled over a tensor's spans.
PATTERNS = {
    "none": [0.0],
    "sparse": [0.01],
    "dense": [1.0],
    "mixed": [0.01, 0.0, 0.9, 0.003, 0.6, 0.0, 0.2],  # its first span sparse: compared whole
    "heavy": [0.3],  # sparse in every dtype, and enough of it to spend the budget
}


def reference(plan: SyncPlan, tensors: list[torch.Tensor], held: dict[str, torch.Tensor]) -> tuple[list[int], Encoded, dict[str, torch.Tensor]]:  # fmt: skip
    """What a scan must return, keep and leave in the copy, one tensor and piece after another."""
    counts: list[int] = []
    encoded: Encoded = {}
    after = {name: data.clone() for name, data in held.items()}
    budget = plan.payload_bytes // ENCODED_BUDGET
    for meta, tensor in zip(plan.tensors, tensors, strict=True):
        numel, size = math.prod(meta.shape), meta.itemsize
        every = [span_elements(numel, s) for s in range(spans_of(numel))]
        if meta.name not in held or held[meta.name].numel() != meta.nbytes or not numel:
            counts += every
            continue
        new = words(tensor.reshape(-1).to(meta.torch_dtype).contiguous().view(torch.uint8), size)
        old = words(held[meta.name], size)
        diff = new != old
        if diff.dim() == 2:
            diff = diff.any(dim=1)
        spans = [int(diff[s * SPAN : (s + 1) * SPAN].sum()) for s in range(len(every))]
        if encoding(spans[0], every[0], size) == DENSE:
            counts += every
            continue
        counts += spans
        for first in range(0, len(spans), RUN_SPANS):  # a piece
            piece = spans[first : first + RUN_SPANS]
            ways = [encoding(c, every[first + s], size) for s, c in enumerate(piece)]
            runs = [(a, b) for a, b, way in span_runs(ways) if way == SPARSE]
            kept = sum(kept_bytes(blob_bytes(sum(piece[a:b]), size)) for a, b in runs)
            if not runs or kept > budget:
                continue
            budget -= kept
            for a, b in runs:
                lo, hi = (first + a) * SPAN, min((first + b) * SPAN, numel)
                rows = diff[lo:hi].nonzero().view(-1)
                encoded[(meta.name, first + a)] = encode_sparse(rows, new[lo:hi][rows], size)
                words(after[meta.name], size)[lo:hi][rows] = new[lo:hi][rows]
    return counts, encoded, after


def fill(baseline: Baseline, plan: SyncPlan, tensors: list[torch.Tensor]) -> None:
    """The copy as a dense push leaves it."""
    baseline.begin()
    packer, buffer = Packer(plan, tensors), bucket_buffers(plan, CPU)[0]
    record = baseline.recorder(plan, plan, {i: i for i in range(len(plan.tensors))})
    for index in range(len(plan.buckets)):
        record(index, packer.pack(index, buffer))
    baseline.finish(plan, 1, False)


def change(
    tensor: torch.Tensor, pattern: list[float], gen: torch.Generator, finite: bool = False
) -> None:
    """Give each span of ``tensor`` (in place) its density of random bytes (``finite``: of
    random normal values, which the fused kernels compare; random fp32 bytes hold NaNs)."""
    rows = tensor.view(-1).view(torch.uint8).view(tensor.numel(), tensor.element_size())
    for span in range(spans_of(tensor.numel())):
        elements = span_elements(tensor.numel(), span)
        picked = torch.randperm(elements, generator=gen)[
            : round(elements * pattern[span % len(pattern)])
        ]
        picked += span * SPAN
        if finite:
            tensor.view(-1)[picked] = torch.randn(picked.numel(), generator=gen, dtype=tensor.dtype)
        else:
            rows[picked] = torch.randint(
                0, 256, (picked.numel(), rows.shape[1]), dtype=torch.uint8, generator=gen
            )


def model(dtype: torch.dtype, gen: torch.Generator, finite: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:  # fmt: skip
    """Tensors of every shape of trouble, and the pattern each will change by (``finite``:
    normal values, not random bytes)."""
    sizes = {  # the heavy ones come before small sparse ones: those still fit once they spent the budget
        "none_big": (3 * SPAN + 7, "none"), "sparse_big": (PIECE + SPAN + 7, "sparse"),
        "dense_big": (2 * SPAN + 5, "dense"), "mixed_big": (PIECE + 5 * SPAN + 3, "mixed"),
        "heavy_big": (2 * PIECE + 11, "heavy"), "dense_one": (1, "dense"), "sparse_five": (5, "sparse"),
        "sparse_short": (SPAN - 1, "sparse"), "mixed_short": (SPAN + 3, "mixed"), "heavy_short": (4 * SPAN, "heavy"),
        "empty": (0, "sparse"), "sparse_tail": (3 * SPAN + 1, "sparse"),
    }  # fmt: skip
    tensors = {
        name: torch.randn(numel, generator=gen, dtype=dtype) if finite else
        torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen).view(dtype)
        for name, (numel, _) in sizes.items()
    }  # fmt: skip
    return tensors, {name: pattern for name, (_, pattern) in sizes.items()}


def scan_both(baseline: Baseline, plan: SyncPlan, tensors: list[torch.Tensor], threads: int) -> tuple[list[int], Encoded]:  # fmt: skip
    """Scan on ``threads`` threads and check it against the reference (from the same copy)."""
    held = {name: data.clone() for name, data in baseline._bytes.items()}
    want_counts, want_encoded, want_after = reference(plan, tensors, held)
    baseline.begin()
    baseline.threads = threads
    counts = baseline.scan(plan, tensors)
    assert counts == want_counts
    assert list(baseline._encoded) == list(want_encoded)  # the same blobs, kept in the same order
    for key, blob in want_encoded.items():
        assert torch.equal(baseline._encoded[key], blob), key
    assert baseline._bytes.keys() == want_after.keys()
    for name, data in want_after.items():
        assert torch.equal(baseline._bytes[name], data), name
    return counts, want_encoded


def stepped(baseline: Baseline, tensors: dict[str, torch.Tensor], patterns: dict[str, str], config: SyncConfig,
            gen: torch.Generator, finite: bool = False) -> tuple[Entries, SyncPlan]:  # fmt: skip
    """Plan ``tensors``, fill the copy as a dense push leaves it, then change each tensor by its
    pattern (a tied name is changed through the tensor it names)."""
    entries = check_state_dict(tensors, config)
    plan = PushPlanner(config, CPU).plan(entries)
    fill(baseline, plan, entries.tensors)
    for name in entries.names:
        change(tensors[name], PATTERNS[patterns[name]], gen, finite)
    return entries, plan


@pytest.fixture(autouse=True)
def always_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads even for these small scans (left alone, they would stay on one)."""
    monkeypatch.setattr(scan_module, "PARALLEL_MIN", 0)


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize(
    ("dtype", "cast", "fused"),
    [(torch.float32, None, True), (torch.float32, "bfloat16", False), (torch.float32, "bfloat16", True),
     (torch.float16, None, False), (torch.float16, None, True), (torch.uint8, None, False),
     (torch.float64, None, False), (torch.complex128, None, True)],
)  # fmt: skip
def test_a_scan_on_threads_is_the_one_thread_scan(dtype: torch.dtype, cast: str | None, fused: bool, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(threads)
    tensors, patterns = model(dtype, gen)
    tensors["alias"] = tensors["mixed_big"]  # tied: one copy
    config = SyncConfig(cast_dtype=cast, direct_min_bytes=None)
    baseline = Baseline(fused=fused)
    entries, plan = stepped(baseline, tensors, patterns, config, gen)
    assert [tie.name for tie in plan.tied] == ["alias"]
    scans = spy(monkeypatch, "scan")
    counts, encoded = scan_both(baseline, plan, entries.tensors, threads)
    # The kernels compare 2- and 4-byte words as they are, NaN payloads included, and fp32
    # pushed as bf16 (random fp32 bytes hold NaNs in nearly every piece: they leave those to
    # NumPy); nothing else.
    assert bool(scans) is (fused and (cast is not None or dtype.itemsize in (2, 4)))
    # What this model is for: spans of every way, and the budget crossed in the middle.
    assert any(c == 0 for c in counts) and any(c == SPAN for c in counts) and encoded
    assert ("sparse_big", 0) in encoded and ("heavy_big", RUN_SPANS) not in encoded
    assert ("sparse_tail", 0) in encoded  # after the budget ran short, a small blob still fits


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("fused", [False, True])
def test_finite_fp32_pushed_as_bf16_is_scanned_fused_as_numpy_scans_it(fused: bool, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Without NaNs the fused kernel finds the changes of every fp32 -> bf16 piece: the same
    counts, blobs kept and copy as NumPy's (and as the reference's); a NaN sends its piece the
    NumPy way."""
    gen = torch.Generator().manual_seed(threads)
    tensors, patterns = model(torch.float32, gen, finite=True)
    config = SyncConfig(cast_dtype="bfloat16", direct_min_bytes=None)
    baseline = Baseline(fused=fused)
    entries, plan = stepped(baseline, tensors, patterns, config, gen, finite=True)
    tensors["mixed_short"][SPAN + 1] = float("nan")  # its one piece: compared in NumPy, kept
    scans = spy(monkeypatch, "scan")
    counts, encoded = scan_both(baseline, plan, entries.tensors, threads)
    assert bool(scans) is fused  # the kernel ran, or never
    assert any(c == 0 for c in counts) and any(c == SPAN for c in counts)
    assert ("sparse_big", 0) in encoded and ("heavy_big", RUN_SPANS) not in encoded
    assert ("mixed_short", 0) in encoded and ("sparse_tail", 0) in encoded


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_partial_pushes_new_and_reshaped_tensors(threads: int) -> None:
    """A partial plan, a tensor the copy lacks and one it holds in another shape: those count
    as all changed; the rest as ever. The copy keeps what the partial plan leaves out."""
    gen = torch.Generator().manual_seed(7)
    tensors, patterns = model(torch.float32, gen)
    config = SyncConfig(cast_dtype="bfloat16", direct_min_bytes=None)
    baseline = Baseline(fused=False)
    stepped(baseline, tensors, patterns, config, gen)
    part = {name: tensors[name] for name in ["mixed_big", "sparse_tail", "heavy_short"]}
    part["new"] = torch.randn(SPAN + 9, generator=gen)
    part["sparse_short"] = tensors["sparse_short"][
        : SPAN - 3
    ].clone()  # held with SPAN - 1 elements
    entries = check_state_dict(part, config)
    partial = PushPlanner(config, CPU).plan(entries)
    counts, _ = scan_both(baseline, partial, entries.tensors, threads)
    assert counts[-1:] == [SPAN - 3] and counts[-3:-1] == [
        SPAN,
        9,
    ]  # sparse_short, new: all changed
    assert "sparse_big" in baseline._bytes


@pytest.mark.parametrize("threads", [1, 3])
def test_bits_not_numbers(threads: int) -> None:
    """-0.0 against 0.0 and NaNs of other payloads are changes; the same NaN is not."""
    tensor = torch.zeros(PIECE + SPAN + 1)
    nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    tensor[SPAN * 3 :: 977] = nan
    tensors = {"w": tensor}
    config = SyncConfig(direct_min_bytes=None)
    entries = check_state_dict(tensors, config)
    plan = PushPlanner(config, CPU).plan(entries)
    baseline = Baseline(fused=False)
    fill(baseline, plan, entries.tensors)
    tensor[5] = -0.0
    tensor[SPAN * 3 + 977].view(torch.int32).fill_(0x7FC00002)
    tensor[SPAN * 3 + 2 * 977] = nan  # the same bits
    tensor[PIECE + 17] = float("nan")
    counts, _ = scan_both(baseline, plan, entries.tensors, threads)
    assert counts == [1, 0, 0, 1] + [0] * (RUN_SPANS - 4) + [1, 0]


@pytest.mark.timeout(60)
def test_a_failing_thread_fails_the_scan_and_every_thread_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(1)
    tensors, patterns = model(torch.float32, gen)
    config = SyncConfig(direct_min_bytes=None)
    baseline = Baseline(threads=3, fused=False)
    entries, plan = stepped(baseline, tensors, patterns, config, gen)
    real = scan_module.encode_sparse_rows
    calls = iter(range(1000))

    def failing(*args: object, **kwargs: object) -> object:
        if next(calls) == 3:
            raise RuntimeError("no memory left")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(scan_module, "encode_sparse_rows", failing)
    with pytest.raises(RuntimeError, match="no memory left"):
        baseline.scan(plan, entries.tensors)
    assert not [
        thread for thread in threading.enumerate() if thread.name.startswith("weight-sync-scan")
    ]


def spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of kernel ``name`` (what each returned)."""
    real, calls = getattr(kernels, name), []

    def counted(*args: object) -> object:
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(kernels, name, counted)
    return calls


def test_a_plan_that_grows_gets_room_for_its_kept_blobs() -> None:
    """Kept blobs are written into room kept from scan to scan; a bigger push gets more."""
    gen = torch.Generator().manual_seed(11)
    tensors, patterns = model(torch.float32, gen, finite=True)
    config = SyncConfig(cast_dtype="bfloat16", direct_min_bytes=None)
    baseline = Baseline(fused=True)
    for names in (["sparse_short", "mixed_short"], list(tensors)):
        part = {name: tensors[name] for name in names}
        entries, plan = stepped(baseline, part, patterns, config, gen, finite=True)
        room = baseline._room
        _, encoded = scan_both(baseline, plan, entries.tensors, 2)
        assert encoded and baseline._room.numel() >= plan.payload_bytes // ENCODED_BUDGET
    assert baseline._room is not room  # grown for the whole model
    baseline.forget()
    assert baseline._room.numel() == 0


def test_kernels_load_on_their_own_thread() -> None:
    loading = FusedKernels()
    deadline = time.monotonic() + 60
    while loading.get() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loading.get() is kernels and FusedKernels(True).get() is kernels
    assert FusedKernels(False).get() is None


def test_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Baseline(threads=0)
    assert Baseline().threads >= 1


@pytest.mark.parametrize("count", [2, 5])
def test_a_push_scanned_by_sections_keeps_each_sections_blobs_in_room_of_its_own(count: int) -> None:  # fmt: skip
    """Each section is scanned as a push of its own (its own share of the budget), all of them
    before any blob is sent -- as when the scan runs ahead of the wire -- and no section's kept
    blobs are written over by a later one's: they share the push's room."""
    gen = torch.Generator().manual_seed(count)
    tensors, patterns = model(torch.float32, gen, finite=True)
    config = SyncConfig(cast_dtype="bfloat16", direct_min_bytes=None)
    baseline = Baseline(fused=True)
    entries, plan = stepped(baseline, tensors, patterns, config, gen, finite=True)
    held = {name: data.clone() for name, data in baseline._bytes.items()}
    parts = sections(plan, count)
    assert len(parts) > 1 and parts[-1].stop == len(plan.tensors)
    baseline.begin()
    counts: list[int] = []
    want_encoded: Encoded = {}
    for part in parts:
        own = entries.tensors[part.first : part.stop]
        want_counts, encoded, _ = reference(part.plan, own, held)
        assert baseline.scan(part.plan, own, plan) == want_counts
        counts += want_counts
        want_encoded.update(encoded)
    assert counts == reference(plan, entries.tensors, held)[0]  # the header a whole scan makes
    assert want_encoded and list(baseline._encoded) == list(want_encoded)
    for key, blob in want_encoded.items():
        assert torch.equal(baseline._encoded[key], blob), key
