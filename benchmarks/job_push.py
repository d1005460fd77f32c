"""A launched job's push from one sender, per push, in two checkouts of weight_sync side by side.

What a change to the push protocol costs a loop that pushes after every step, where the fixed
costs (the agreement, the lane's control steps, the verdict) are most of the push: each tree in
``--trees`` runs, in turn, a job of ``--ranks`` ranks (``mp.spawn``, Gloo, rank 0 sending) that
pushes a 33 KB model and then a 25 MB one ``--pushes`` times each; rank 0 times every
``update``. The trees alternate ``--runs`` times (this machine is noisy), and the medians of the
runs' medians are printed per tree, with the ratio of each to the first::

    git worktree add /tmp/before <rev>
    python benchmarks/job_push.py --trees /tmp/before .
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = {"33 KB": (64, 2), "25 MB": (1024, 6)}  # Linear(wide, wide) x layers


def _rank(index: int, ranks: int, store: str, out: str, pushes: int) -> None:
    import time

    import torch
    import torch.distributed as dist

    from weight_sync import SyncConfig
    from weight_sync.launch.job_sync import JobSync

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=index, world_size=ranks)
    sync = JobSync(SyncConfig(bucket_bytes=8 << 20))
    medians = {}
    for name, (wide, layers) in MODELS.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(wide, wide) for _ in range(layers)])
        took = []
        for _ in range(pushes):
            started = time.perf_counter()
            sync.update(model)
            took.append(time.perf_counter() - started)
        medians[name] = statistics.median(took[3:]) * 1e3  # the first pushes form and warm up
    if index == 0:
        Path(out).write_text(json.dumps(medians))
    sync.close()


def _job(ranks: int, pushes: int) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as scratch:
        out = f"{scratch}/out.json"
        args = (ranks, f"{scratch}/store", out, pushes)
        mp.start_processes(_rank, args=args, nprocs=ranks, start_method="spawn")
        print(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs="+", required=True, help="checkouts to compare")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--pushes", type=int, default=30)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:  # one run, in the tree PYTHONPATH names
        _job(args.ranks, args.pushes)
        return
    runs: dict[str, list[dict[str, float]]] = {tree: [] for tree in args.trees}
    for _ in range(args.runs):
        for tree in args.trees:
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve()), "OMP_NUM_THREADS": "1"}
            command = [sys.executable, __file__, "--job", "--ranks", str(args.ranks),
                       "--pushes", str(args.pushes), "--trees", tree]  # fmt: skip
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            runs[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
    first = args.trees[0]
    for name in MODELS:
        base = statistics.median(run[name] for run in runs[first])
        for tree in args.trees:
            median = statistics.median(run[name] for run in runs[tree])
            print(f"{name:>6}  {tree:<30} {median:7.1f} ms per push  ({median / base:.2f}x)")


if __name__ == "__main__":
    main()
