"""What gathering costs: the same model pushed from one plain trainer and from two FSDP2 ranks.

    python benchmarks/sharded.py [--layers 16] [--dim 1024] [--workers 2] [--repeats 5]

Both trainers push to the same workers over Gloo on CPU; the sharded one gathers every DTensor
with its peer rank (``full_tensor``) as it packs. Prints the median push time of each, their
ratio, and the most bytes of gathered full tensors the sending rank held at once (against the
model's size). Every push is verified against the trainer's weights.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics

import ray
import torch
import torch.distributed as dist

from weight_sync import SyncConfig, WeightSyncWorker, WeightUpdater
from weight_sync.wire.checksums import state_dict_digests
from weight_sync.send.sharded import ShardedSource
from weight_sync.transport.rendezvous import bind_listener, open_store


def build(layers: int, dim: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(dim, dim) for _ in range(layers)))


@ray.remote(num_cpus=0)
class Worker(WeightSyncWorker):
    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self.model = build(layers, dim)


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank: int, world: int, layers: int, dim: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.world, self.layers, self.dim = rank, world, layers, dim
        self.listener = bind_listener("127.0.0.1") if rank == 0 else None
        self.updater: WeightUpdater | None = None

    def port(self) -> int:
        assert self.listener is not None
        return self.listener.getsockname()[1]

    def setup(self, port: int, workers: list | None, sharded: bool) -> None:
        self.model = build(self.layers, self.dim)
        if sharded:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            store = open_store("127.0.0.1", port, self.world, 60, self.listener)
            dist.init_process_group(
                "gloo",
                store=store,
                rank=self.rank,
                world_size=self.world,
                timeout=datetime.timedelta(seconds=120),
            )
            fully_shard(self.model, mesh=init_device_mesh("cpu", (self.world,)))
        if workers:
            self.updater = WeightUpdater(workers, SyncConfig(bucket_bytes=16 << 20))

    def push_plain(self) -> float:
        assert self.updater is not None
        return self.updater.push(self.model.state_dict()).seconds

    def push_sharded(self) -> tuple[float, int]:
        source = ShardedSource(self.model.state_dict())
        if self.updater is None:
            source.serve()
            return 0.0, 0
        return self.updater.push(source).seconds, source.peak_gathered_bytes

    def digests(self) -> dict[str, str]:
        state = self.model.state_dict()
        full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in state.items()}
        return state_dict_digests(full)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(include_dashboard=False)
    model_bytes = sum(p.nbytes for p in build(args.layers, args.dim).parameters())
    times: dict[str, list[float]] = {"plain": [], "sharded": []}
    peak = 0
    for kind in ("plain", "sharded"):
        workers = [Worker.remote(args.layers, args.dim) for _ in range(args.workers)]
        world = 2 if kind == "sharded" else 1
        ranks = [Rank.remote(r, world, args.layers, args.dim) for r in range(world)]
        port = ray.get(ranks[0].port.remote())
        ray.get(
            [
                rank.setup.remote(port, workers if r == 0 else None, kind == "sharded")
                for r, rank in enumerate(ranks)
            ]
        )
        for repeat in range(args.repeats + 1):  # the first forms the group: not timed
            if kind == "plain":
                seconds = ray.get(ranks[0].push_plain.remote())
            else:
                (seconds, peak), _ = ray.get([rank.push_sharded.remote() for rank in ranks])
            if repeat:
                times[kind].append(seconds)
        want = ray.get([rank.digests.remote() for rank in ranks])[0]
        got = ray.get([w.weight_sync_digests.remote() for w in workers])
        assert all(g == want for g in got), f"{kind}: workers differ from the trainer"
        for actor in [*ranks, *workers]:
            ray.kill(actor)
    ray.shutdown()
    plain, sharded = (statistics.median(times[k]) for k in ("plain", "sharded"))
    print(f"model {model_bytes / 1e6:.1f} MB, {args.workers} workers, median of {args.repeats}:")
    print(f"  plain trainer      {plain:.3f} s")
    print(f"  2 FSDP2 ranks      {sharded:.3f} s   ({sharded / plain:.2f}x plain)")
    print(f"  peak gathered on the sending rank: {peak / 1e6:.1f} MB "
          f"({peak / model_bytes:.0%} of the model)")  # fmt: skip


if __name__ == "__main__":
    main()
