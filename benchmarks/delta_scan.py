"""Microbenchmark of a delta push's comparison on the trainer (``Baseline.scan``), in one process
(no Ray, no group, no workers):

* W1 (GPT-2 small) held in fp32, pushed as bf16 (``cast_dtype="bfloat16"``), weights drawn as a
  model's are (normal, std 0.02) -- or (``--as-is``) pushed in the dtype it is held in
  (``--dtype``: fp32 or bf16), compared word for word;
* the copy ``Baseline`` keeps is filled as a dense push fills it, then one Adam step at lr 1e-6
  changes some of the bf16 values (about 4-5%) -- or (``--every N``) every N-th element changes;
* each timed run puts the copy back as it was before the step (not timed) and times one
  ``Baseline.scan`` of the stepped weights against it;
* then the scan followed by the packing of every bucket of the delta's layout: the trainer's
  whole work for a delta push but the sending (blobs the scan did not keep are found again
  while packing, as in a push);
* a memory-speed reference in the same run: one pass that reads the weights and the copy
  (a sum of each, NumPy, on one thread and on as many as the scan) -- what the scan cannot beat.

    python benchmarks/delta_scan.py --repeats 7
    python benchmarks/delta_scan.py --threads 1
    python benchmarks/delta_scan.py --numpy      # without the fused kernels
    python benchmarks/delta_scan.py --as-is --dtype bfloat16   # a bf16 model pushed as bf16

Prints medians over --repeats runs (after one untimed warm-up) and the density found.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import torch

from weight_sync import SyncConfig
from weight_sync.tools.bench import timing as bench_timing
from weight_sync.tools.bench.workloads import WORKLOADS
from weight_sync.delta.baseline import Baseline
from weight_sync.delta.layout import delta_layout
from weight_sync.wire.metadata import SyncPlan
from weight_sync.wire.packing import Packer, bucket_buffers
from weight_sync.wire.state_dict import Entries
from weight_sync.send.sender import PushPlanner


def timed(
    fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None
) -> list[float]:
    """Seconds of ``fn`` over ``repeats`` runs after one warm-up (``before`` runs untimed first)."""
    return bench_timing.timed(fn, repeats, before=before)


def fill(baseline: Baseline, plan: SyncPlan, tensors: Sequence[torch.Tensor]) -> None:
    """Bring the copy up to ``tensors`` as a dense push does: pack every bucket, record it."""
    baseline.begin()
    packer = Packer(plan, tensors)
    buffer = bucket_buffers(plan, torch.device("cpu"))[0]
    record = baseline.recorder(plan, plan, {i: i for i in range(len(plan.tensors))})
    for index in range(len(plan.buckets)):
        record(index, packer.pack(index, buffer))
    baseline.finish(plan, 1, False)


def widest(data: np.ndarray) -> np.ndarray:
    """Bytes as the widest integers that divide them: summing int16 into NumPy's int64
    accumulator is compute-bound, summing int64 is not."""
    for dtype in (np.int64, np.int32, np.int16):
        if data.nbytes % np.dtype(dtype).itemsize == 0:
            return data.view(dtype)
    return data


def read_once(arrays: Sequence[np.ndarray], threads: int) -> None:
    """Read every byte of ``arrays`` once (a sum over pieces of 4 MiB), over ``threads``."""
    pieces = [a[i : i + (1 << 20)] for a in arrays for i in range(0, a.size, 1 << 20)]
    if threads == 1:
        for piece in pieces:
            piece.sum()
        return
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(np.sum, pieces, chunksize=8):
            pass


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="W1", choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--threads", type=int, default=None, help="the scan's threads (default: Baseline's)"
    )
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument(
        "--numpy", action="store_true", help="compare the NumPy way, without the fused kernels"
    )
    parser.add_argument("--as-is", action="store_true", help="push in the model's own dtype")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--every", type=int, default=0, help="change every N-th element instead of an Adam step"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the benchmark's trainer actor: the scan uses threads of its own

    workload = WORKLOADS[args.workload]()
    state = workload.build(fill=1.0)
    generator = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    for name, tensor in state.items():
        state[name] = tensor.normal_(0.0, 0.02, generator=generator).to(dtype)
    cast = None if args.as_is else "bfloat16"
    config = SyncConfig(cast_dtype=cast, direct_min_bytes=None).sized_for("cpu")
    plan = PushPlanner(config, torch.device("cpu")).plan(Entries(list(state), list(state.values())))
    tensors = list(state.values())

    baseline = Baseline(threads=args.threads, fused=not args.numpy)
    threads = baseline.threads
    fill(baseline, plan, tensors)  # the copy as the workers hold it before the step
    # The copy's bytes (private): put back before each timed scan, which brings them up to date.
    before_step = {name: held.clone() for name, held in baseline._bytes.items()}

    if args.every:  # as benchmarks/many_senders.py changes its model
        for tensor in tensors:
            tensor.view(-1)[:: args.every] += 0.25
    else:
        parameters = [torch.nn.Parameter(t) for t in tensors]
        optimizer = torch.optim.Adam(parameters, lr=args.lr)
        for parameter in parameters:
            parameter.grad = torch.randn_like(parameter)
        optimizer.step()
        del optimizer, parameters

    counts: list[int] = []

    def restore() -> None:
        baseline.begin()
        for name, held in before_step.items():
            baseline._bytes[name].copy_(held)

    def scan() -> None:
        counts[:] = baseline.scan(plan, tensors)

    scans = timed(scan, args.repeats, restore)

    def scan_and_pack() -> None:
        """What the trainer does for a delta push but send: scan, then pack every bucket of
        the layout (the blobs the scan did not keep are found again there, ahead of the packer
        on the scan's threads, as in a push)."""
        scan()
        layout = delta_layout(plan, counts, config.sized_bucket_bytes)
        sources = baseline.sources(layout, plan, tensors, None)
        try:
            packer = Packer(layout.plan, sources)
            for index in range(len(layout.plan.buckets)):
                packer.pack(index, buffers[0])
        finally:
            sources.close()

    buffers = bucket_buffers(plan, torch.device("cpu"))
    packs = timed(scan_and_pack, args.repeats, restore)
    elements = sum(math.prod(meta.shape) for meta in plan.tensors)
    arrays = [widest(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors] + [
        widest(b.numpy()) for b in baseline._bytes.values()
    ]
    read_bytes = sum(a.nbytes for a in arrays)
    reads = {n: timed(partial(read_once, arrays, n), args.repeats) for n in sorted({1, threads})}

    scan_s = statistics.median(scans)
    pushed = f"{args.dtype} as is" if args.as_is else f"{args.dtype} -> bf16"
    print(
        f"{workload.title}: {elements / 1e6:.1f}M elements, {pushed}, lr {args.lr:g}, "
        f"{os.cpu_count()} CPUs, scan on {threads} thread(s), "
        f"{'NumPy' if args.numpy else 'fused kernels'}"
    )
    print(f"  density: {sum(counts) / elements:.2%} of the values pushed changed")
    print(f"  scan:               median {scan_s * 1e3:7.1f} ms  (runs: {runs(scans)})")
    print(f"  scan, then pack:    median {statistics.median(packs) * 1e3:7.1f} ms  "
          f"(runs: {runs(packs)})")  # fmt: skip
    for n, times in reads.items():
        read_s = statistics.median(times)
        print(f"  read, {n} thread(s):  median {read_s * 1e3:7.1f} ms  ({read_bytes / 1e6:.0f} MB, "
              f"{read_bytes / read_s / 1e9:.1f} GB/s; runs: {runs(times)}); scan / read: "
              f"{scan_s / read_s:.2f}x")  # fmt: skip


def runs(times: list[float]) -> str:
    return ", ".join(f"{t * 1e3:.0f}" for t in times)


if __name__ == "__main__":
    main()
