"""Microbenchmark of the copy paths around the wire, in one process (no Ray, no group):

* pack: the trainer's tensors -> staging buffers (what packed buckets cost the sender);
* unpack: staging buffers -> the worker's tensors (what they cost the receiver);
* with --device cuda: the same on the GPU, plus the device -> host path that a CUDA state dict
  takes over Gloo (packing straight into CPU buffers, pageable and pinned).

    python benchmarks/pack_paths.py --workload W1 --device cpu
    python benchmarks/pack_paths.py --workload W4 --device cuda

Prints GB/s (payload of the packed buckets / median seconds over --repeats runs).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from weight_sync import SyncConfig
from weight_sync.tools.bench import timing as bench_timing
from weight_sync.tools.bench.workloads import WORKLOADS
from weight_sync.wire.packing import Packer, Unpacker, bucket_buffers, staging_slots
from weight_sync.wire.state_dict import Entries
from weight_sync.send.sender import PushPlanner


def timed(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    return statistics.median(bench_timing.timed(fn, repeats, device=device))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="W1", choices=sorted(WORKLOADS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    workload = WORKLOADS[args.workload]()
    state = {n: t.to(device) for n, t in workload.build(fill=1.0).items()}
    # Pack everything: this measures the copy paths, not which tensors skip them.
    config = SyncConfig(bucket_bytes=args.bucket_mb << 20, direct_min_bytes=None)
    plan = PushPlanner(config, device).plan(Entries(list(state), list(state.values())))
    packer = Packer(plan, list(state.values()))
    slots = staging_slots(plan)
    model = {n: torch.zeros_like(t) for n, t in state.items()}
    landing = {i: model[m.name] for i, m in enumerate(plan.tensors)}
    gb = plan.nbytes / 1e9
    print(
        f"{workload.title}: {plan.nbytes / 1e6:.0f} MB in {len(plan.buckets)} buckets on {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )

    buffers = bucket_buffers(plan, device)

    def pack() -> None:
        for index in range(len(plan.buckets)):
            packer.pack(index, buffers[slots[index] or 0])

    def unpack() -> None:
        unpacker = Unpacker(plan, landing, device)
        for index, bucket in enumerate(plan.buckets):
            unpacker.unpack(index, buffers[slots[index] or 0][: bucket.nbytes])

    print(f"  pack   {gb / timed(pack, args.repeats, device):8.2f} GB/s")
    print(f"  unpack {gb / timed(unpack, args.repeats, device):8.2f} GB/s")
    if device.type == "cuda":
        for pinned in (False, True):
            host = [
                torch.empty(plan.max_packed_bytes, dtype=torch.uint8, pin_memory=pinned)
                for _ in range(2)
            ]

            def to_host(host: list[torch.Tensor] = host) -> None:
                for index in range(len(plan.buckets)):
                    packer.pack(index, host[slots[index] or 0])

            label = "pinned" if pinned else "pageable"
            print(
                f"  pack device->host ({label}) {gb / timed(to_host, args.repeats, device):8.2f} GB/s"
            )


if __name__ == "__main__":
    main()
