"""The Ray cluster job: place a trainer and N workers, push a model of a given size K times, verify.

    python -m weight_sync.tools.ray_job --workers 7 --size-mb 1024 --pushes 5      # or: weight-sync job ...
    ray job submit --address http://HEAD:8265 -- python -m weight_sync.tools.ray_job --workers 7 --spread

Placement comes from ``weight_sync.actors.placement`` (one bundle per actor: GPUs when the cluster has
them, CPU bundles otherwise). When any worker lands on another node than the trainer, the group
listens on the trainer node's own address (or ``--interface`` / ``--master-addr``), never on
loopback. Every push is timed per phase; at the end every worker's weights are compared with the
trainer's (SHA-256 per tensor) and the job exits 0 only if all match at the last version.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
from typing import Any

import ray
import torch

from weight_sync import PushResult, SyncConfig, WeightSyncWorker, WeightUpdater
from weight_sync.actors.fleet import count_verified, take_down
from weight_sync.actors.placement import reserve
from weight_sync.send.routes import describe_routes
from weight_sync.wire.checksums import state_dict_digests

MB = 1_000_000
TENSOR_BYTES = 16 * MB  # the synthetic model: fp32 tensors of at most this size


def model_shapes(size_mb: float) -> list[tuple[int, ...]]:
    """Shapes of a synthetic fp32 model of ``size_mb`` MB: whole 16 MB tensors and a remainder,
    plus a few small ones (biases, norms) so packed and direct buckets both occur."""
    elements = int(size_mb * MB) // 4
    rows = TENSOR_BYTES // 4 // 1024
    whole, rest = divmod(elements, rows * 1024)
    shapes: list[tuple[int, ...]] = [(rows, 1024)] * whole
    if rest:
        shapes.append((rest,))
    return shapes + [(1024,)] * 4


def _node() -> dict[str, str]:
    context = ray.get_runtime_context()
    return {
        "node_id": context.get_node_id(),
        "ip": ray.util.get_node_ip_address(),
        "pid": str(os.getpid()),
    }


class _Synthetic(torch.nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]], fill: float) -> None:
        super().__init__()
        for index, shape in enumerate(shapes):
            self.register_buffer(f"w{index}", torch.full(shape, fill))


class JobWorker(WeightSyncWorker):
    def __init__(self, shapes: list[tuple[int, ...]], device: str) -> None:
        super().__init__()
        self.model = _Synthetic(shapes, fill=-1.0).to(device)

    def node(self) -> dict[str, str]:
        return _node()


class JobTrainer:
    def __init__(self, shapes: list[tuple[int, ...]], device: str) -> None:
        self.model = _Synthetic(shapes, fill=0.0).to(device)
        self.updater: WeightUpdater | None = None

    def node(self) -> dict[str, str]:
        return _node()

    def connect(self, workers: list, config: dict[str, Any]) -> None:
        self.updater = WeightUpdater(workers, SyncConfig(**config))

    def push(self, step: int) -> PushResult:
        assert self.updater is not None
        generator = torch.Generator().manual_seed(step)
        with torch.no_grad():  # new values every step, as an optimizer step would give
            for tensor in self.model.buffers():
                tensor.copy_(torch.rand(tensor.shape, generator=generator))
        return self.updater.push(self.model.state_dict())

    def digests(self) -> dict[str, str]:
        return state_dict_digests(self.model.state_dict())

    def routes(self) -> list[str]:
        assert self.updater is not None
        return list(self.updater.routes)

    def close(self) -> None:
        if self.updater is not None:
            self.updater.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Place, push, verify; returns the report (also printed)."""
    placement = reserve(args.workers, gpus=args.gpus, spread=args.spread, timeout_s=args.timeout)
    device = "cuda" if placement.layout.gpus else "cpu"
    shapes = model_shapes(args.size_mb)
    worker_class: Any = ray.remote(JobWorker)  # Any: Ray's stubs do not type .options().remote()
    trainer_class: Any = ray.remote(JobTrainer)
    workers = [
        worker_class.options(**placement.worker_options(i)).remote(shapes, device)
        for i in range(args.workers)
    ]
    trainer = trainer_class.options(**placement.trainer_options()).remote(shapes, device)
    actors = [trainer, *workers]
    try:
        nodes = ray.get([actor.node.remote() for actor in actors], timeout=args.timeout)
        config = _sync_config(args, nodes)
        ray.get(trainer.connect.remote(workers, config), timeout=args.timeout)
        print(
            f"trainer on {_where(nodes[0])}; workers on {_count_by_node(nodes[1:])}; "
            f"{placement.layout.describe()}, {placement.layout.strategy}; "
            f"group listens on {config.get('interface') or config['master_addr']}",
            flush=True,
        )
        print(f"{'version':>7} {'MB':>9} {'buckets':>7} {'seconds':>8} {'GB/s':>6}  phases (s)")
        results: list[PushResult] = []
        for step in range(args.pushes):
            result = ray.get(trainer.push.remote(step), timeout=args.timeout)
            results.append(result)
            phases = " ".join(f"{k}={v:.3f}" for k, v in result.phases.items() if k != "total")
            print(f"{result.version:>7} {result.nbytes / MB:>9.1f} {result.buckets:>7} "
                  f"{result.seconds:>8.3f} {result.gbps:>6.2f}  {phases}", flush=True)  # fmt: skip
        last = results[-1].version if results else 0
        verified, tensors = count_verified(trainer, workers, last, args.timeout)
        routes = ray.get(trainer.routes.remote(), timeout=args.timeout)
        report = {
            "workers": args.workers,
            "pushes": args.pushes,
            "size_mb": args.size_mb,
            "verified": verified,
            "version": last,
            "trainer_node": nodes[0],
            "worker_nodes": nodes[1:],
            "gpus": placement.layout.gpus,
            "gpu_share": placement.layout.gpu_share,
            "strategy": placement.layout.strategy,
            "median_seconds": statistics.median(r.seconds for r in results) if results else None,
            "median_gbps": statistics.median(r.gbps for r in results) if results else None,
            "seconds": [r.seconds for r in results],
            # per worker, a weight_sync.send.routes.Route: "group", "shm" (on the trainer's host),
            # "cuda_ipc" (on the trainer's GPU), "relay" (from the member of its host in the group)
            "routes": routes,
        }
        print(f"routes (workers): {describe_routes(routes)}")
        verdict = "OK" if verified == args.workers else "FAILED"
        print(
            f"verified: {verified}/{args.workers} workers hold version {last}, {tensors} "
            f"tensors bit-exact (sha256); median {report['median_seconds'] or 0:.3f}s "
            f"({report['median_gbps'] or 0:.2f} GB/s) -- {verdict}"
        )
        print("REPORT " + json.dumps(report), flush=True)
        return report
    finally:
        take_down(trainer, workers)
        placement.remove()


def _sync_config(args: argparse.Namespace, nodes: list[dict[str, str]]) -> dict[str, Any]:
    """Loopback when everyone shares the trainer's node; else the trainer node's address (or
    what the user named): workers elsewhere must be able to dial it."""
    config: dict[str, Any] = {}
    if args.bucket_mb:
        config["bucket_bytes"] = args.bucket_mb << 20
    if args.interface:
        config["interface"] = args.interface
    elif args.master_addr:
        config["master_addr"] = args.master_addr
    elif any(node["node_id"] != nodes[0]["node_id"] for node in nodes[1:]):
        config["master_addr"] = nodes[0]["ip"]
    else:
        config["master_addr"] = "127.0.0.1"
    return config


def _where(node: dict[str, str]) -> str:
    """``ip/node``: several nodes may share an address (one machine)."""
    return f"{node['ip']}/{node['node_id'][:6]}"


def _count_by_node(nodes: list[dict[str, str]]) -> str:
    counts: dict[str, int] = {}
    for node in nodes:
        counts[_where(node)] = counts.get(_where(node), 0) + 1
    return ", ".join(f"{where} x{count}" for where, count in counts.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=positive_int, default=7, help="worker actors (default 7)")
    parser.add_argument(
        "--size-mb",
        type=_positive_float,
        default=256.0,
        help="model size in MB, fp32 (default 256)",
    )
    parser.add_argument("--pushes", type=positive_int, default=5, help="pushes (default 5)")
    parser.add_argument(
        "--spread",
        action="store_true",
        help="spread actors across nodes (default: pack them on one node)",
    )
    parser.add_argument(
        "--gpus",
        choices=("auto", "yes", "no"),
        default="auto",
        help="put the actors on GPUs: auto (if the cluster has any), yes, no; one GPU per actor "
        "where there are enough, else they share GPUs (Ray's fractional GPUs)",
    )
    parser.add_argument(
        "--interface", default=None, help="NIC whose address the group listens on (e.g. eth1)"
    )
    parser.add_argument(
        "--master-addr",
        default=None,
        help="address the group listens on (default: loopback when on one node, "
        "else the trainer node's address)",
    )
    parser.add_argument(
        "--bucket-mb",
        type=positive_int,
        default=None,
        help="bucket size in MiB (default: SyncConfig's)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (default: RAY_ADDRESS, the job's cluster, or a new local one)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        help="bound on placement and on each push, seconds (default 600)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m weight_sync.tools.ray_job", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    return run_job(args)


def run_job(args: argparse.Namespace) -> int:
    started = not ray.is_initialized()
    if started and (args.address or os.environ.get("RAY_ADDRESS")):
        ray.init(address=args.address)  # a cluster (under `ray job submit`, RAY_ADDRESS is set)
    elif started:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(include_dashboard=False)
    try:
        report = run(args)
    finally:
        if started:
            ray.shutdown()
    return 0 if report["verified"] == args.workers else 1


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (the command line's counts and sizes)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


if __name__ == "__main__":
    sys.exit(main())
