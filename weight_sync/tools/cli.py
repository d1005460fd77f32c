"""``weight-sync``: the command line."""

from __future__ import annotations

import argparse
import logging
import sys

from weight_sync import __version__
from weight_sync.tools.ray_job import add_arguments as add_job_arguments
from weight_sync.tools.ray_job import positive_int


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weight-sync",
        description="Push a trainer's weights to inference workers over a dedicated process group.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run a trainer actor and N worker actors, push after each step, verify",
        description="Start (or join) a Ray cluster, create a trainer actor and N inference-worker "
        "actors (on the cluster's GPUs if it has any, else on CPU), take optimizer steps with a push after each, print a table per push and "
        "verify that every worker holds the trainer's weights bit for bit.",
    )
    demo.add_argument("--workers", type=positive_int, default=7, help="worker actors (default 7)")
    demo.add_argument("--steps", type=positive_int, default=5, help="optimizer steps (default 5)")
    demo.add_argument(
        "--bucket-mb",
        type=positive_int,
        default=None,
        help="bucket size in MiB (default: SyncConfig's)",
    )
    demo.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (e.g. 'auto'); default: start a local one",
    )
    demo.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the weights live: auto (the cluster's GPUs if it has any), cpu, cuda; with "
        "fewer GPUs than actors, the actors share them (default auto)",
    )
    bench = commands.add_parser(
        "bench",
        help="measure weight_sync against raw / ray_call / per_tensor / fanout / object_store",
        description="On one local (or joined) Ray cluster, push the workloads with every strategy "
        "on the same trainer and worker actors; writes results.md, results.json and plots.",
    )
    bench.add_argument(
        "--workloads",
        default=None,
        help="comma-separated, from W1 (GPT-2 small), W2 (4,000 x 4 KB), W3 (1 GiB "
        "tensor), W4 (mixed dtypes), W5 (64 x 16 KB, 100 pushes: latency); "
        "default all (with --nodes: W1; S<MB>M there is that much synthetic fp32)",
    )
    bench.add_argument(
        "--strategies",
        default="weight_sync,raw,ray_call,per_tensor,fanout,object_store",
        help="comma-separated; default all but memcpy",
    )
    bench.add_argument("--workers", type=positive_int, default=7, help="worker actors (default 7)")
    bench.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="timed transfers per strategy after one warm-up (default 5)",
    )
    bench.add_argument("--sweep", action="store_true", help="also sweep the bucket size on W1")
    bench.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the weights live; cuda gives every actor a GPU (default cpu)",
    )
    bench.add_argument(
        "--options",
        action="store_true",
        help="also measure what checksum / atomic staging / check_finite cost on W1",
    )
    bench.add_argument(
        "--scaling", action="store_true", help="also measure 1 / 3 / 7 workers at 16 MB .. 2 GB"
    )
    bench.add_argument(
        "--same-host",
        default="",
        metavar="WORKLOADS",
        help="also measure these workloads (e.g. W1,W3,W4) through the shared-memory "
        "ring against the group, raw and the memory-bandwidth limit",
    )
    bench.add_argument(
        "--delta",
        action="store_true",
        help="also measure delta pushes (SyncConfig.delta) against dense ones on W1 "
        "cast to bf16: after an Adam step at lr 1e-6, and after every value changed",
    )
    bench.add_argument("--out", default="benchmarks/results", help="report folder")
    bench.add_argument("--address", default=None, help="Ray cluster to join; default: start one")
    links = bench.add_argument_group(
        "multi-node (needs root, iproute2 and tc)",
        "Build a Ray cluster of N nodes on this machine, each in its own network namespace, "
        "links shaped to each rate; the trainer on node 0. Measures dense, delta and raw pushes "
        "and how many times each crossed the trainer's link; writes links.md, links.json and "
        "plots. --address, --strategies and the single-host suites do not apply.",
    )
    links.add_argument(
        "--nodes",
        type=int,
        choices=range(1, 5),
        default=None,
        metavar="N",
        help="nodes, 1..4 (default: the single-host bench)",
    )
    links.add_argument(
        "--rates",
        default="1gbit,10gbit",
        help="comma-separated link rates in tc syntax (default 1gbit,10gbit)",
    )
    links.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="one-way delay added on every node's egress, in ms (default 0)",
    )
    links.add_argument(
        "--workers-per-node",
        type=positive_int,
        default=3,
        help="workers on each node but the trainer's (default 3)",
    )
    links.add_argument(
        "--local-workers",
        action="store_true",
        help="also put --workers-per-node workers on the trainer's node",
    )
    links.add_argument(
        "--node-scaling",
        action="store_true",
        help="also sweep 1..4 nodes x 1..3 workers per node (workers on every node), dense "
        "and delta, at the first rate; plots node_scaling.png",
    )
    job = commands.add_parser(
        "job",
        help="the cluster job: place a trainer and N workers, push K times, verify",
        description="Reserve a placement group (GPUs if the cluster has them), push a synthetic "
        "model of --size-mb MB --pushes times, verify every worker, report timings. The same as "
        "`python -m weight_sync.tools.ray_job`; submit it with `ray job submit`.",
    )
    add_job_arguments(job)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.command == "demo":
        from weight_sync.tools.demo import run_demo

        return run_demo(
            args.workers,
            args.steps,
            args.address,
            args.bucket_mb,
            device=args.device,
            verbose=args.verbose,
        )
    if args.command == "bench" and (args.nodes is not None or args.node_scaling):
        return _bench_links(args)
    if args.command == "bench":
        from pathlib import Path

        from weight_sync.tools.bench.harness import run_bench

        workloads = args.workloads or "W1,W2,W3,W4,W5"
        run_bench(
            workloads=[w for w in workloads.split(",") if w],
            workers=args.workers,
            repeats=args.repeats,
            strategies=args.strategies.split(","),
            scaling=args.scaling,
            sweep=args.sweep,
            options=args.options,
            out=Path(args.out),
            address=args.address,
            device=args.device,
            same_host=[w for w in args.same_host.split(",") if w],
            delta=args.delta,
        )
        print(f"report: {Path(args.out) / 'results.md'}")
        return 0
    if args.command == "job":
        from weight_sync.tools.ray_job import run_job

        return run_job(args)
    raise AssertionError(f"unhandled command {args.command}")


def _bench_links(args: argparse.Namespace) -> int:
    """``bench --nodes N`` / ``--node-scaling``: the multi-node bench (weight_sync.tools.bench.links)."""
    from pathlib import Path

    from weight_sync.tools.bench.links import run_links
    from weight_sync.tools.bench.netns import NetnsUnavailable, parse_rate

    try:
        rates = [parse_rate(rate) for rate in args.rates.split(",") if rate.strip()]
        run_links(
            nodes=args.nodes,
            rates=rates,
            workloads=(args.workloads or "W1").split(","),
            workers_per_node=args.workers_per_node,
            local_workers=args.local_workers,
            repeats=args.repeats,
            delay_ms=args.delay_ms,
            node_scaling=args.node_scaling,
            out=Path(args.out),
        )
    except (NetnsUnavailable, ValueError) as exc:
        print(f"weight-sync bench: {exc}", file=sys.stderr)
        return 2
    print(f"report: {Path(args.out) / 'links.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
