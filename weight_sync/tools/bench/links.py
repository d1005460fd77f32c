"""The multi-node bench: pushes across shaped links between network namespaces.

For every link rate a fresh cluster is built (``weight_sync.tools.bench.netns``): the trainer on node
0, ``workers_per_node`` workers on each other node (and on node 0 too with ``local_workers``).
Each mode is measured after one verified warm-up push (``BenchTrainer.setup``) and one untimed
push (three for ``delta``), then ``repeats`` timed pushes (medians), and verified bit-exact again
at the end:

* ``dense`` -- a push after an Adam step, cast to bf16, relayed once per far host
  (``SyncConfig.relay``, the default);
* ``dense (tree)`` -- the same with ``relay=False``: every far worker is a rank of Gloo's
  binomial tree, which sends the payload across the trainer's link ~log2(members + 1) times;
* ``delta`` -- the push after an Adam step with ``delta=True``: a delta where that was faster
  when timed (``weight_sync.delta.choice``; three untimed pushes first let it time both ways);
* ``delta (always)`` -- with ``delta="always"``: the delta push itself, faster or not;
* ``delta (atomic)`` -- the same with ``staging="atomic"``: staged, applied at commit;
* ``raw`` -- one flat Gloo broadcast of the dense payload's bytes over a group that holds every
  worker (``relay=False, same_host="group"``): what a hand-written broadcast costs.

Besides seconds, each push reports how many times its bytes crossed the trainer's link: the
bytes node 0 sent out of its ``eth0`` during the push (read from ``/proc/net/dev`` inside the
trainer actor, which lives in node 0's namespace) over the bytes the push put on the wire. The
one-crossing bound is wire bytes x 8 / rate: no push to another host can beat it.

All the Ray glue is here, in :func:`drive`, which runs *inside* node 0's namespace (so that
``ray.init`` reaches the head at its namespace address): :func:`run_links` builds each cluster
from the root namespace and re-runs this module there (``python -m weight_sync.tools.bench.links``),
passing what to measure and getting the rows back as JSON files.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from weight_sync.tools.bench.netns import NODE_LINK, ShapedCluster, check_usable, node_resource
from weight_sync.tools.bench.report import LinkRow, write_links_report
from weight_sync.tools.bench.workloads import WORKLOADS, MiB, Workload, synthetic

logger = logging.getLogger(__name__)

TIMEOUT_S = 1800
CAST = "bfloat16"
# mode -> (SyncConfig fields, the BenchTrainer strategy that pushes)
MODES: dict[str, tuple[dict[str, Any], str]] = {
    "dense": ({"cast_dtype": CAST, "delta": False, "relay": True}, "after_step"),
    "dense (tree)": ({"cast_dtype": CAST, "delta": False, "relay": False}, "after_step"),
    "delta": ({"cast_dtype": CAST, "delta": True, "relay": True}, "after_step"),
    "delta (always)": ({"cast_dtype": CAST, "delta": "always", "relay": True}, "after_step"),
    "delta (atomic)": (
        {"cast_dtype": CAST, "delta": "always", "relay": True, "staging": "atomic"},
        "after_step",
    ),
    "raw": ({"cast_dtype": CAST, "delta": False, "relay": False, "same_host": "group"}, "raw"),
}
SCALING_MODES = ("dense", "delta")
SCALING_NODES = (1, 2, 3, 4)
SCALING_WORKERS = (1, 2, 3)


def workload_named(name: str) -> Workload:
    """A workload of the single-host bench (W1..W5), or ``S<MB>M``: that many MiB of synthetic
    fp32 in 4 MiB tensors (small cases, the CI test)."""
    if name in WORKLOADS:
        return WORKLOADS[name]()
    match = re.fullmatch(r"S(\d+)M", name)
    if match is None or int(match.group(1)) < 1:
        raise ValueError(
            f"unknown workload {name!r}: choose from {list(WORKLOADS)} or S<MB>M (e.g. S16M)"
        )
    return synthetic(int(match.group(1)) * MiB, tensor_bytes=4 * MiB)


@dataclass(frozen=True)
class Layout:
    """Where the workers go: ``workers_per_node`` on each of nodes 1..nodes-1, and on node 0
    (beside the trainer) too with ``local_workers``. One node means workers on node 0."""

    nodes: int
    workers_per_node: int
    local_workers: bool = False

    def __post_init__(self) -> None:
        if self.workers_per_node < 1:
            raise ValueError(f"workers_per_node must be >= 1 (got {self.workers_per_node})")
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1 (got {self.nodes})")

    def per_node(self) -> list[int]:
        """Workers on each node, node 0 first."""
        near = self.workers_per_node if self.local_workers or self.nodes == 1 else 0
        return [near] + [self.workers_per_node] * (self.nodes - 1)

    @property
    def workers(self) -> int:
        return sum(self.per_node())


@dataclass(frozen=True)
class DriveSpec:
    """What one driver run measures on one cluster (crosses the namespace boundary as JSON)."""

    workload: str
    rate_bits: int
    delay_ms: float
    repeats: int
    layouts: tuple[tuple[Layout, tuple[str, ...], str], ...]  # (layout, modes, suite)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DriveSpec:
        data = json.loads(text)
        layouts = tuple(
            (Layout(**layout), tuple(modes), suite) for layout, modes, suite in data.pop("layouts")
        )
        return cls(layouts=layouts, **data)


@dataclass(frozen=True)
class Pool:
    """How many workers each node needs across ``layouts`` (the most any layout puts there):
    the actors are made once per cluster, pinned to their nodes, and each layout takes the
    first of them on every node."""

    sizes: tuple[int, ...]

    @classmethod
    def of(cls, layouts: Sequence[Layout]) -> Pool:
        nodes = max(layout.nodes for layout in layouts)
        counts = [layout.per_node() + [0] * (nodes - layout.nodes) for layout in layouts]
        return cls(tuple(max(column) for column in zip(*counts, strict=True)))

    def members(self, layout: Layout) -> list[int]:
        """Indices into the pool's flat worker list (node 0's first) of ``layout``'s workers."""
        starts = [sum(self.sizes[:node]) for node in range(len(self.sizes))]
        return [
            starts[node] + slot
            for node, count in enumerate(layout.per_node())
            for slot in range(count)
        ]


def drive(spec: DriveSpec, address: str) -> list[LinkRow]:
    """Measure ``spec`` on the cluster at ``address``; run inside node 0's namespace."""
    import ray

    from weight_sync import SyncConfig
    from weight_sync.tools.bench.actors import BenchTrainer, BenchWorker

    workload = workload_named(spec.workload)
    payload = workload.nbytes_as(getattr(torch, CAST))
    ray.init(address=address, logging_level=logging.WARNING)
    try:
        pool = Pool.of([layout for layout, _, _ in spec.layouts])
        flat = [
            BenchWorker.options(resources={node_resource(node): 1}).remote()  # type: ignore[attr-defined]
            for node, size in enumerate(pool.sizes)
            for _ in range(size)
        ]
        trainer = BenchTrainer.options(resources={node_resource(0): 1}).remote(flat)  # type: ignore[attr-defined]
        _log("building %s on %d workers", workload.name, len(flat))
        ray.get([w.setup.remote(workload, CAST) for w in flat], timeout=TIMEOUT_S)
        ray.get(trainer.set_raw_bytes.remote(payload), timeout=TIMEOUT_S)
        rows = []
        for layout, modes, suite in spec.layouts:
            members = pool.members(layout)
            for mode in modes:
                fields, strategy = MODES[mode]
                config = SyncConfig(interface=NODE_LINK, **fields)
                row = LinkRow(
                    suite=suite,
                    workload=workload.name,
                    title=workload.title,
                    rate_bits=spec.rate_bits,
                    delay_ms=spec.delay_ms,
                    nodes=layout.nodes,
                    workers_per_node=layout.workers_per_node,
                    local_workers=layout.local_workers,
                    workers=layout.workers,
                    mode=mode,
                    payload_bytes=payload,
                )
                label = f"{workload.name} {mode}, {layout.nodes} nodes x {layout.workers_per_node}"
                _log("%s: setting up (verified warm-up push)", label)
                ray.get(
                    trainer.setup.remote(workload, len(members), config, True, members),
                    timeout=TIMEOUT_S,
                )
                # Untimed first: one push, or three where delta=True times both ways first (a
                # dense push, then a delta: the push into the new group only allocates the copy).
                untimed = 3 if fields["delta"] is True else 1
                for attempt in range(spec.repeats + untimed):
                    seconds, wire, sent, as_delta, phases = ray.get(
                        trainer.link_run.remote(strategy, NODE_LINK), timeout=TIMEOUT_S
                    )
                    wire = payload if wire is None else wire  # raw moves the payload
                    if attempt >= untimed:
                        row.seconds.append(seconds)
                        row.wire_bytes.append(wire)
                        row.sent_bytes.append(sent)
                        row.deltas += as_delta
                        row.phases.append(phases)
                    _log(
                        "%s: push %d/%d %.3f s (%s), wire %.1f MB, sent %.1f MB",
                        label,
                        attempt + 1 - untimed,
                        spec.repeats,
                        seconds,
                        ", ".join(f"{name} {s:.3f}" for name, s in phases.items()),
                        wire / 1e6,
                        sent / 1e6,
                    )
                if strategy != "raw":
                    row.verified = ray.get(trainer.verify.remote(), timeout=TIMEOUT_S)
                    if not row.verified:
                        raise AssertionError(f"{label}: the workers do not hold the weights")
                rows.append(row)
        ray.get(trainer.close.remote(), timeout=TIMEOUT_S)
        return rows
    finally:
        ray.shutdown()


def _log(message: str, *args: object) -> None:
    """Progress on stderr (the driver's stdout is not the report)."""
    print(time.strftime("%H:%M:%S ") + message % args, file=sys.stderr, flush=True)


def run_on_cluster(cluster: ShapedCluster, spec: DriveSpec) -> list[LinkRow]:
    """Run :func:`drive` for ``spec`` inside node 0 of ``cluster``; its rows."""
    with tempfile.TemporaryDirectory(prefix="ws_links_") as temp:
        spec_path, out_path = Path(temp) / "spec.json", Path(temp) / "rows.json"
        spec_path.write_text(spec.to_json())
        args = [
            sys.executable,
            "-m",
            "weight_sync.tools.bench.links",
            "--address",
            cluster.plan.address,
            "--spec",
            str(spec_path),
            "--out",
            str(out_path),
        ]
        done = subprocess.run(
            cluster.command(0, args), env=cluster.env(), timeout=TIMEOUT_S, check=False
        )
        if done.returncode:
            raise RuntimeError(
                f"the multi-node driver failed on {spec.workload} at "
                f"{spec.rate_bits / 1e9:g} Gbit/s (exit {done.returncode}); its log is above"
            )
        return [LinkRow(**row) for row in json.loads(out_path.read_text())]


def run_links(
    nodes: int | None,
    rates: Sequence[int],
    workloads: Sequence[str] = ("W1",),
    workers_per_node: int = 3,
    local_workers: bool = False,
    repeats: int = 3,
    delay_ms: float = 0.0,
    node_scaling: bool = False,
    out: Path | None = None,
) -> list[LinkRow]:
    """The multi-node bench: every workload at every rate on ``nodes`` nodes, then (with
    ``node_scaling``) the node x workers-per-node sweep at the first rate. Writes links.md,
    links.json and plots under ``out`` after every cluster, so a failure keeps what was done."""
    if not rates:
        raise ValueError("rates is empty: pass --rates 1gbit,10gbit (tc syntax)")
    if nodes is None and not node_scaling:
        raise ValueError("pass --nodes N (1..4) or --node-scaling")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1 (got {repeats})")
    for name in workloads:
        workload_named(name)  # a bad name fails before any cluster is built
    check_usable()
    rows: list[LinkRow] = []
    if nodes is not None:
        layout = Layout(nodes, workers_per_node, local_workers)
        if layout.workers == 0:
            raise ValueError("no workers: with --nodes 1 every worker is local")
        modes = tuple(MODES)
        for rate in rates:
            with ShapedCluster(nodes, rate, delay_ms) as cluster:
                for name in workloads:
                    spec = DriveSpec(name, rate, delay_ms, repeats, ((layout, modes, "links"),))
                    rows += run_on_cluster(cluster, spec)
                    if out is not None:
                        write_links_report(rows, out)
    if node_scaling:
        layouts = tuple(
            (Layout(n, k, local_workers=True), SCALING_MODES, "node scaling")
            for k in SCALING_WORKERS
            for n in SCALING_NODES
        )
        with ShapedCluster(max(SCALING_NODES), rates[0], delay_ms) as cluster:
            spec = DriveSpec(workloads[0], rates[0], delay_ms, repeats, layouts)
            rows += run_on_cluster(cluster, spec)
        if out is not None:
            write_links_report(rows, out)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """The driver's entry point inside node 0: ``--spec`` in, ``--out`` rows as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the head's GCS address")
    parser.add_argument("--spec", required=True, type=Path, help="a DriveSpec as JSON")
    parser.add_argument("--out", required=True, type=Path, help="where the rows go (JSON)")
    args = parser.parse_args(argv)
    rows = drive(DriveSpec.from_json(args.spec.read_text()), args.address)
    args.out.write_text(json.dumps([asdict(row) for row in rows]))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
