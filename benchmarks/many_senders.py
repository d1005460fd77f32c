"""Pushes from every rank of a sharded trainer against pushes from one, over shaped links.

For each K (``--senders 1,2,4``) a network of network namespaces is built
(``weight_sync.tools.bench.netns``, no Ray): K trainer nodes, each behind its own link of ``--rate``
(one GPU with its own NIC), and one node of ``--receivers`` workers. The workers' node takes
either K such links (``rails``: one NIC per GPU, as rail-optimised clusters are wired; shaped
here as one link of K x rate) or a single one (``single``: every design is then bound by that
node's ingress). In each network two jobs run, one after the other, each a launched job of
``JobSync`` ranks (``--rank-job``, started inside the nodes' namespaces):

* ``one sender`` -- rank 0 on trainer node 0 holds the whole model and pushes it alone
  (``JobSync()``): the best one sender can do, with no gather before it;
* ``K senders`` -- K ranks, one per trainer node, hold the model as DTensors sharded on their
  first dimension over a mesh of them (as FSDP2 does) and each pushes its own shards
  (``JobSync(senders=K)``), all of them at once: they meet at a barrier after building their
  state, as a sharded trainer's ranks leave an optimizer step together (each builds the whole
  model to take its shard, which takes them unequal times on 2 cores);
* with ``--one-group``, also ``K senders, one group`` -- the same, every lane's buckets over one
  group of every rank, in rounds (``JobSync(senders=K, one_group=True)``: the NCCL design, run
  here over Gloo).

Every rank is set up as a warmed-up trainer or engine is before anything is timed: the fused
delta kernels loaded, its heap frozen (``gc.freeze()``).

Each job times ``--repeats`` pushes after a verified warm-up, dense and then as deltas
(``delta="always"``, a tenth of the elements changed before each push), and every worker checks
its weights bit for bit against the model it computes itself after every mode. Rows go to
``--out`` (JSON) and a plot to ``--plot``; the figures are medians, with the CPU seconds every
rank spent on a push together (``cpu_s``), each rank's (``cpu_ranks_s``, senders first) and
the sum over the machine's cores (``cpu_floor_s``: how fast the push could be here with links of
no cost). Needs root, ``ip`` and
``tc``. A run at W1 and 1 Gbit/s takes about 10 minutes on 2 cores.

    sudo -E python benchmarks/many_senders.py --senders 1,2,4 --rate 1gbit
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
MODES = ("dense", "delta")
CHANGED = 10  # a delta push follows a change to every CHANGED-th element
DELTA_FROM = 4  # steps before it change every element (the dense pushes' steps)


def values(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    """The model's tensor ``name`` after ``step`` changes, computed alike on every rank (so the
    workers check what they hold without the trainers' help): the steps before ``DELTA_FROM``
    change every element, the later ones one in ``CHANGED``."""
    seed = sum(map(ord, name)) % 97
    flat = torch.arange(int(torch.Size(shape).numel()), dtype=torch.float32).remainder_(1021)
    flat.mul_(1e-3).add_(seed + min(step, DELTA_FROM))
    flat[::CHANGED].add_(max(0, step - DELTA_FROM))
    return flat.view(shape)


# -- one rank of a job, inside a node's namespace ----------------------------------------------


def rank_job(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from weight_sync import SyncConfig
    from weight_sync.wire.blocks import Shard, block_of
    from weight_sync.wire.checksums import state_dict_digests
    from weight_sync.launch.job_sync import JobSync

    # The fused delta kernels, loaded now and untimed, as a trainer past its first pushes has
    # them: a delta's copy loads them on a thread of its own (numba's import, 2-3 s of a core)
    # and compares the NumPy way meanwhile -- which here overlapped the first timed deltas.
    importlib.import_module("weight_sync.delta.kernels")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
    # Set up, the process freezes its heap, as vLLM's engine core and its sharded weight-transfer
    # trainer do: otherwise a full collection (0.13-0.35 s here, over torch's objects) stops
    # one of the K + 2 processes in about one delta push in three, and the push with it.
    gc.collect()
    gc.freeze()
    workload = _workload(args.workload)
    specs = [(name, tuple(shape)) for name, _, shape in workload.specs]
    senders = args.job_senders
    rows: list[dict[str, Any]] = []
    cpu: list[dict[str, Any]] = []  # this process's CPU seconds (all its threads) per push
    mesh = None
    if senders > 1:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh("cpu", list(range(senders)))  # every rank: new_group is collective
    for mode in MODES:
        config = SyncConfig(
            interface="eth0",
            push_timeout_s=900,
            delta="always" if mode == "delta" else False,
            group_mode="standalone",  # one sender too: relayed on the workers' node, as lanes are
        )
        sync = JobSync(config, senders=senders, one_group=args.job_one_group)
        # steps 0..4 are dense changes, 5.. delta changes (see values)
        first = 0 if mode == "dense" else DELTA_FROM
        model = None if sync.is_sender else _module(specs)
        for step in range(first, first + 1 + args.repeats):
            if sync.is_sender:
                state = {}
                for name, shape in specs:
                    full = values(name, shape, step)
                    if mesh is None:
                        state[name] = full
                    else:
                        from torch.distributed.tensor import DTensor
                        from torch.distributed.tensor import Shard as TorchShard

                        offset, size = block_of(shape, (senders,), (Shard(0),), (rank,))
                        local = full.narrow(0, offset[0], size[0]).clone() if shape else full
                        state[name] = DTensor.from_local(
                            local, mesh, [TorchShard(0)], run_check=False, shape=torch.Size(shape),
                            stride=full.stride(),
                        )  # fmt: skip
                    del full
                if mesh is not None:  # every sender at the push together, as after a step
                    dist.barrier(group=mesh.get_group())
                started = time.process_time()
                result = sync.push(state)
                spent = time.process_time() - started
                if rank == 0:
                    rows.append({"step": step, "mode": mode, "seconds": result.seconds,
                                 "nbytes": result.nbytes, "wire": result.wire_bytes,
                                 "delta": result.delta})  # fmt: skip
            else:
                assert model is not None
                started = time.process_time()
                sync.receive(model)  # in place, in the model's own tensors
                spent = time.process_time() - started
            cpu.append({"mode": mode, "step": step, "cpu": spent})
        if not sync.is_sender:
            assert model is not None
            expected = {name: values(name, shape, first + args.repeats) for name, shape in specs}
            exact = state_dict_digests(model.state_dict()) == state_dict_digests(expected)
            Path(f"{args.job_out}.rank{rank}.{mode}").write_text(json.dumps({"exact": exact}))
        sync.close()
    Path(f"{args.job_out}.cpu{rank}").write_text(json.dumps(cpu))
    if rank == 0:
        Path(args.job_out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _workload(name: str) -> Any:
    """W1..W5, or ``S<MB>M``: that many MB of fp32 in 8 MB tensors."""
    from weight_sync.tools.bench.workloads import WORKLOADS, MiB, synthetic

    if name.startswith("S") and name.endswith("M"):
        return synthetic(int(name[1:-1]) * MiB)
    return WORKLOADS[name]()


def _module(specs: list[tuple[str, tuple[int, ...]]]) -> torch.nn.Module:
    """A worker's model: the workload's tensors as buffers of one module (names have no dots)."""
    module = torch.nn.Module()
    for name, shape in specs:
        module.register_buffer(name, torch.zeros(shape))
    return module


# -- the orchestrator, in the root namespace --------------------------------------------------


def run_job(
    cluster: Any,
    senders: int,
    receivers: int,
    args: argparse.Namespace,
    tmp: str,
    one_group: bool = False,
) -> dict:
    """One launched job: ranks 0..senders-1 on trainer nodes 0..senders-1, the rest on the
    workers' node (the last). Returns its rows and every worker's verdicts."""
    world = senders + receivers
    name = f"{senders}{'g' if one_group else ''}"
    store, out = f"{tmp}/store{name}", f"{tmp}/job{name}.json"
    workers_node = len(cluster.plan.nodes) - 1
    processes = []
    for rank in range(world):
        node = rank if rank < senders else workers_node
        env = {**cluster.env(), "RANK": str(rank), "WORLD_SIZE": str(world),
               "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
        command = cluster.command(node, [sys.executable, __file__, "--rank-job", "--store", store,
                                         "--job-out", out, "--job-senders", str(senders),
                                         "--workload", args.workload,
                                         "--repeats", str(args.repeats)]
                                + (["--job-one-group"] if one_group else []))  # fmt: skip
        processes.append(subprocess.Popen(command, env=env))
    deadline = time.monotonic() + 1800
    try:
        for process in processes:
            process.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    codes = [process.returncode for process in processes]
    if any(codes):
        raise RuntimeError(f"a rank of the {senders}-sender job failed: exit codes {codes}")
    exact = {
        mode: all(
            json.loads(Path(f"{out}.rank{rank}.{mode}").read_text())["exact"]
            for rank in range(senders, world)
        )
        for mode in MODES
    }
    rows = json.loads(Path(out).read_text())
    spent = [json.loads(Path(f"{out}.cpu{rank}").read_text()) for rank in range(world)]
    for row in rows:  # the CPU seconds each rank spent on that push (senders first)
        row["cpu_ranks"] = [
            sum(e["cpu"] for e in entries if (e["mode"], e["step"]) == (row["mode"], row["step"]))
            for entries in spent
        ]
        row["cpu"] = sum(row["cpu_ranks"])
    return {"rows": rows, "exact": exact}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from weight_sync.tools.bench.netns import ShapedCluster, parse_rate

    rate = parse_rate(args.rate)
    results = []
    for k in args.senders:
        for ingress in ("rails", "single") if k > 1 else ("rails",):
            widest = rate * (k if ingress == "rails" else 1)
            with (
                tempfile.TemporaryDirectory(prefix="ws_senders_") as tmp,
                ShapedCluster(
                    k + 1, None, node_rates=(rate,) * k + (widest,), ray=False
                ) as cluster,
            ):
                jobs = [(1, False)] + ([(k, False)] if k > 1 else [])
                jobs += [(k, True)] if k > 1 and args.one_group else []
                for senders, one_group in jobs:
                    job = run_job(cluster, senders, args.receivers, args, tmp, one_group)
                    for mode in MODES:
                        timed = [r for r in job["rows"] if r["mode"] == mode][1:]
                        results.append({
                            "K": k, "ingress": ingress, "senders": senders, "mode": mode,
                            "one_group": one_group,
                            "median_s": statistics.median(r["seconds"] for r in timed),
                            "runs_s": [round(r["seconds"], 3) for r in timed],
                            "nbytes": timed[0]["nbytes"], "wire": timed[0]["wire"],
                            # every rank's CPU seconds per push, and the push's floor on this
                            # machine's cores had it no link at all
                            "cpu_s": round(statistics.median(r["cpu"] for r in timed), 3),
                            "cpu_floor_s": round(
                                statistics.median(r["cpu"] for r in timed) / os.cpu_count(), 3
                            ),
                            # each rank's, senders first then workers
                            "cpu_ranks_s": [
                                round(statistics.median(r["cpu_ranks"][i] for r in timed), 3)
                                for i in range(senders + args.receivers)
                            ],
                            "exact": job["exact"][mode],
                        })  # fmt: skip
                        print(json.dumps(results[-1]), flush=True)
    return results


def plot(results: list[dict[str, Any]], path: Path, rate: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(MODES), figsize=(10, 4))
    for axis, mode in zip(axes, MODES, strict=True):
        rows = [r for r in results if r["mode"] == mode and not r.get("one_group")]
        ks = sorted({r["K"] for r in rows})
        one = {r["K"]: r["median_s"] for r in rows if r["senders"] == 1 and r["ingress"] == "rails"}
        axis.plot(ks, [one[k] for k in ks], "x-", color="black", label="one sender")
        axis.plot(ks, [one[k] / k for k in ks], ":", color="gray", label="one sender / K")
        axis.plot(ks, [1.3 * one[k] / k for k in ks], "--", color="gray", lw=0.8,
                  label="target: 1.3 x one sender / K")  # fmt: skip
        for ingress, style, where in (("rails", "o-", "K links"), ("single", "s-", "one link")):
            many = {r["K"]: r["median_s"] for r in rows
                    if r["ingress"] == ingress and r["senders"] == r["K"] > 1}  # fmt: skip
            if 1 in one and many:  # K=1 is the one sender itself
                many[1] = one[1]
            label = f"K senders, the workers' node on {where}"
            axis.plot(sorted(many), [many[k] for k in sorted(many)], style, label=label)
        axis.set_xlabel("trainer nodes K, one link each")
        axis.set_ylabel("seconds per push (median)")
        axis.set_xticks(ks)
        axis.set_ylim(bottom=0)
        axis.set_title(f"{mode}: W1 over links of {rate}")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--senders", type=lambda s: [int(k) for k in s.split(",")], default=[1, 2, 4]
    )
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--workload", default="W1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/many_senders.json")
    parser.add_argument("--plot", type=Path, default=REPO / "benchmarks/results/many_senders.png")
    parser.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--job-out", help=argparse.SUPPRESS)
    parser.add_argument("--job-senders", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--job-one-group", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--one-group", action="store_true", help="also K senders over one group (rounds)"
    )
    args = parser.parse_args()
    if args.rank_job:
        rank_job(args)
        return
    results = measure(args)
    args.out.write_text(json.dumps({"rate": args.rate, "workload": args.workload,
                                    "receivers": args.receivers, "rows": results}, indent=1))  # fmt: skip
    plot(results, args.plot, args.rate)


if __name__ == "__main__":
    main()
