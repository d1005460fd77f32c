"""What a push from one Ray trainer would cost on the many-senders path: the same trainer and
workers, one sender's protocol (``WeightUpdater(workers)``) against the K = 1 case of the
many-senders front (``RayLanes`` -- what ``WeightUpdater(workers, senders=group)`` runs -- over
``OneRank``, a trainer of one process with no torch.distributed: the agreement, rank 0's store,
one lane of store commands).

Issue 63 asked that one sender's push become the K = 1 case of a push from many; this measured
what that would cost, before it was done. Since session 30 it is done: ``WeightUpdater(workers)``
is that front, so in this tree the first and last paths below are one protocol (the ring, and
Gloo lanes); run the script in a tree before the switch (``f4b3f64``) and in this one for the
before and after. Three paths, on one host (Ray, CPU):

* ``one sender`` -- the default: a worker on the trainer's host takes the shared-memory ring;
* ``one sender, group`` -- the same with ``SyncConfig(same_host="group")``: every worker a rank
  of the Gloo group, as every lane's members are;
* ``K=1 lanes`` -- the many-senders front for this one process (Gloo lanes).

Each round makes a new updater per path (alternating the order), pushes once to warm up (group
formed, layout sent) and times ``--pushes`` pushes; figures are medians over every timed push
of every round, with each path's ratio to ``one sender, group`` (the same data plane). W5 (64
tensors of 16 KB) is bound by the control plane, W1 (GPT-2 small, 498 MB) by the bytes.

    python benchmarks/k1_paths.py --workers 3 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import ray
import torch

from weight_sync import SyncConfig
from weight_sync.actors import WeightUpdater
from weight_sync.actors.lanes import RayLanes
from weight_sync.send.collectives import OneRank
from weight_sync.tools.bench.actors import BenchWorker
from weight_sync.tools.bench.workloads import WORKLOADS, Workload

PATHS = ("one sender", "one sender, group", "K=1 lanes")


@ray.remote(num_cpus=0)
class Trainer:
    """One trainer process: the workload's tensors, and an updater of the path asked for."""

    def __init__(self, workload: Workload) -> None:
        torch.set_num_threads(1)
        self.state = workload.build(fill=1.0)
        self.updater: WeightUpdater | RayLanes | None = None

    def open(self, workers: list[Any], path: str) -> None:
        if path == "K=1 lanes":
            self.updater = RayLanes(workers, group=OneRank())
        else:
            config = SyncConfig(same_host="group") if path.endswith("group") else SyncConfig()
            self.updater = WeightUpdater(workers, config)

    def push(self) -> tuple[float, list[str]]:
        assert self.updater is not None
        began = time.perf_counter()
        if isinstance(self.updater, RayLanes):
            self.updater.push(self.state, {})
        else:
            self.updater.push(self.state)
        return time.perf_counter() - began, [str(route) for route in self.updater.routes]

    def close(self) -> None:
        if self.updater is not None:
            self.updater.close()
            self.updater = None


def measure(name: str, workers_n: int, rounds: int, pushes: int) -> dict[str, Any]:
    workload = WORKLOADS[name]()
    workers = [BenchWorker.options(num_cpus=0).remote() for _ in range(workers_n)]  # type: ignore[attr-defined]
    ray.get([w.setup.remote(workload) for w in workers])
    trainer = Trainer.remote(workload)
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    routes: dict[str, list[str]] = {}
    try:
        for index in range(rounds):
            order = PATHS if index % 2 == 0 else PATHS[::-1]
            for path in order:
                ray.get(trainer.open.remote(workers, path))
                ray.get(trainer.push.remote())  # warm: the group formed, the layout sent
                for _ in range(pushes):
                    seconds, routes[path] = ray.get(trainer.push.remote())
                    times[path].append(seconds)
                ray.get(trainer.close.remote())
    finally:
        for actor in [trainer, *workers]:
            ray.kill(actor)
    base = statistics.median(times["one sender, group"])
    rows = {
        path: {
            "median_s": round(statistics.median(runs), 4),
            "vs_group": round(statistics.median(runs) / base, 2),
            "runs": len(runs),
            "routes": routes[path],
        }
        for path, runs in times.items()
    }
    return {"workload": name, "workers": workers_n, "paths": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--workloads", default="W5,W1")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pushes", default="W5=20,W1=2", help="timed pushes per round")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    pushes = dict(item.split("=") for item in args.pushes.split(","))
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        results = []
        for name in args.workloads.split(","):
            results.append(measure(name, args.workers, args.rounds, int(pushes.get(name, 3))))
            print(json.dumps(results[-1]), flush=True)
    finally:
        ray.shutdown()
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
