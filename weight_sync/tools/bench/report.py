"""The benchmark's report: results.json (raw numbers), results.md (tables, target checks) and
PNG plots (when matplotlib is installed: ``pip install 'weight_sync[bench]'``)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from weight_sync.tools.bench.measurement import Measurement

MB = 1e6


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(
                line.split(":", 1)[1].strip() for line in info if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {memory:.0f} GiB RAM; Python {platform.python_version()}, "
        f"torch {torch.__version__}, ray {ray.__version__}; {time.strftime('%Y-%m-%d')}"
    )


def _find(
    rows: Sequence[Measurement],
    workload: str,
    strategy: str,
    workers: int | None = None,
    suite: str = "workloads",
) -> Measurement | None:
    for row in rows:
        if (row.workload, row.strategy, row.suite) == (workload, strategy, suite) and (
            workers is None or row.workers == workers
        ):
            return row
    return None


def targets(rows: Sequence[Measurement]) -> list[tuple[str, str, bool]]:
    """The issue's targets, checked against this run: (target, measured, met)."""
    checks = []

    def ratio(workload: str, slow: str, fast: str) -> float | None:
        a, b = _find(rows, workload, slow), _find(rows, workload, fast)
        return a.median / b.median if a and b and a.seconds and b.seconds else None

    for workload, slow, fast, bound, text in [
        ("W1", "weight_sync", "raw", 1.15, "W1: weight_sync within 1.15x of raw"),
        ("W2", "weight_sync", "raw", 3.0, "W2: weight_sync within 3x of raw"),
        ("W1", "per_tensor", "weight_sync", 3.0, "W1: at least 3x faster than per_tensor"),
        ("W1", "object_store", "weight_sync", 5.0, "W1: at least 5x faster than object_store"),
        ("W2", "per_tensor", "weight_sync", 10.0, "W2: at least 10x faster than per_tensor"),
    ]:
        value = ratio(workload, slow, fast)
        if value is None:
            continue
        met = value <= bound if slow == "weight_sync" else value >= bound
        checks.append((text, f"{value:.2f}x", met))
    floor = _control_floor(rows, "W5")
    push = _find(rows, "W5", "weight_sync")
    if floor is not None and push is not None and push.seconds:
        value = push.median / floor
        checks.append(
            ("W5: median push at most 2x (ray_call + raw)", f"{value:.2f}x", value <= 2.0)
        )
    shm = _find(rows, "W1", "weight_sync (shared memory)", suite="same host")
    for baseline, bound in (("raw", 0.6), ("memcpy", 1.5)):
        base = _find(rows, "W1", baseline, suite="same host")
        if shm and base and shm.seconds and base.seconds:
            value = shm.median / base.median
            checks.append(
                (
                    f"W1, same host: shared memory at most {bound}x {baseline}",
                    f"{value:.2f}x",
                    value <= bound,
                )
            )
    for strategy, wire_bound, time_bound in (("after_step", 0.10, 1.0), ("all_changed", None, 1.1)):
        dense, delta = (
            _find(rows, "W1", strategy, suite="dense"),
            _find(rows, "W1", strategy, suite="delta"),
        )
        if not (dense and delta and dense.seconds and delta.seconds):
            continue
        if wire_bound is not None:
            share = statistics.median(delta.wire_bytes) / statistics.median(dense.wire_bytes)
            checks.append(
                (
                    f"W1 bf16, {strategy}: delta bytes on the wire at most {wire_bound:.0%} of dense",
                    f"{share:.1%}",
                    share <= wire_bound,
                )
            )
        value = delta.median / dense.median
        checks.append(
            (
                f"W1 bf16, {strategy}: delta push at most {time_bound}x the dense push",
                f"{value:.2f}x",
                value <= time_bound,
            )
        )
    for row in rows:
        if (
            row.strategy.startswith("weight_sync")
            and row.suite in ("workloads", "same host")
            and row.seconds
            and row.strategy != "weight_sync (all packed)"
        ):
            bound = 3 * row.bucket_bytes
            worst = max(max(row.trainer_extra), max(row.worker_extra))
            checks.append(
                (
                    (
                        f"{row.workload}, {row.strategy}: peak extra memory <= 3 x bucket "
                        f"({bound / MB:.0f} MB)"
                    ),
                    (
                        f"trainer {max(row.trainer_extra) / MB:.0f} MB, "
                        f"worker {max(row.worker_extra) / MB:.0f} MB"
                    ),
                    worst <= bound,
                )
            )
    return checks


def _control_floor(rows: Sequence[Measurement], workload: str) -> float | None:
    """What a push of ``workload`` cannot beat: one bare Ray call to every worker (the control
    plane's floor) plus one flat broadcast of its bytes (the data plane's), medians."""
    call, raw = _find(rows, workload, "ray_call"), _find(rows, workload, "raw")
    if call is None or raw is None or not call.seconds or not raw.seconds:
        return None
    return call.median + raw.median


def markdown(rows: Sequence[Measurement]) -> str:
    devices = sorted({r.device for r in rows}) or ["cpu"]
    on_gpu = any(d.startswith("cuda") for d in devices)
    where = (
        f"CUDA tensors on {', '.join(devices)}, one GPU per actor"
        if on_gpu
        else "Gloo over loopback, CPU tensors"
    )
    memory = (
        "peak CUDA memory allocated above the baseline"
        if on_gpu
        else "peak resident memory above the baseline"
    )
    lines = [
        "# weight_sync benchmark results",
        "",
        f"Machine: {machine_line()}.",
        "",
        (
            f"{where}; one trainer actor and N worker actors in one Ray cluster; every strategy "
            "on the same processes and group. Seconds: median / min / max over the timed "
            "transfers after one warm-up, measured in the trainer around the whole transfer "
            "(Ray calls included). GB/s = payload bytes / median. x raw = median / raw's "
            f"median. Memory: {memory} during a transfer (max over runs; for workers, the "
            "largest worker)."
        ),
        "",
    ]
    header = (
        "| strategy | median s | min s | max s | GB/s | x raw | trainer extra MB | "
        "worker extra MB |\n|---|---|---|---|---|---|---|---|"
    )
    for name in dict.fromkeys(r.workload for r in rows if r.suite == "workloads"):
        group = [r for r in rows if r.workload == name and r.suite == "workloads"]
        first = group[0]
        raw = _find(rows, name, "raw", first.workers)
        lines += [
            f"## {name}: {first.title}",
            "",
            (
                f"{first.nbytes / MB:.0f} MB to {first.workers} workers, "
                f"{first.bucket_bytes >> 20} MiB buckets, {len(first.seconds)} timed runs."
            ),
            "",
            header,
        ]
        for r in group:
            if r.error:
                lines.append(f"| {r.strategy} | failed: {r.error} | | | | | | |")
                continue
            times = r.median / raw.median if raw else float("nan")
            lines.append(
                f"| {r.strategy} | {r.median:.3f} | {min(r.seconds):.3f} | "
                f"{max(r.seconds):.3f} | {r.gbps:.3f} | {times:.2f} | "
                f"{max(r.trainer_extra) / MB:.0f} | {max(r.worker_extra) / MB:.0f} |"
            )
        lines.append("")
    latency = [r for r in rows if r.suite == "workloads" and len(r.seconds) >= 20]
    if latency:
        lines += [
            "## Per-push latency",
            "",
            (
                "Workloads pushed many times: the distribution of one push, in milliseconds. "
                "ray_call is one Ray call per worker carrying nothing (the control plane's "
                "floor); floor = ray_call + raw (medians)."
            ),
            "",
            "| workload | strategy | runs | median ms | p90 ms | p99 ms | x floor |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in latency:
            floor = _control_floor(rows, r.workload)
            times = r.median / floor if floor else float("nan")
            lines.append(
                f"| {r.workload} | {r.strategy} | {len(r.seconds)} | {r.median * 1e3:.2f} | "
                f"{r.percentile(90) * 1e3:.2f} | {r.percentile(99) * 1e3:.2f} | {times:.2f} |"
            )
        lines.append("")
    checks = targets(rows)
    if checks:
        lines += ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
        lines += [
            f"| {text} | {value} | {'yes' if met else '**no**'} |" for text, value, met in checks
        ]
        lines.append("")
    local = [r for r in rows if r.suite == "same host"]
    if local:
        lines += [
            "## Workers on the trainer's host",
            "",
            (
                "The push through the shared-memory ring against the same push over the Gloo "
                "group, the flat Gloo broadcast (raw) and the memory-bandwidth limit (memcpy: "
                "the trainer writes the bytes once into memory every worker maps, and every "
                "worker reads them once, all at the same time)."
            ),
            "",
            (
                "| workload | strategy | median s | min s | max s | GB/s | x raw | x memcpy | "
                "trainer extra MB | worker extra MB |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in local:
            if r.error:
                lines.append(f"| {r.workload} | {r.strategy} | failed: {r.error} | | | | | | | |")
                continue
            ratios = []
            for baseline in ("raw", "memcpy"):
                base = _find(rows, r.workload, baseline, r.workers, suite="same host")
                ratios.append(r.median / base.median if base and base.seconds else float("nan"))
            lines.append(
                f"| {r.workload} | {r.strategy} | {r.median:.3f} | {min(r.seconds):.3f} | "
                f"{max(r.seconds):.3f} | {r.gbps:.3f} | {ratios[0]:.2f} | {ratios[1]:.2f} | "
                f"{max(r.trainer_extra) / MB:.0f} | {max(r.worker_extra) / MB:.0f} |"
            )
        lines.append("")
    deltas = [r for r in rows if r.suite in ("dense", "delta")]
    if deltas:
        lines += [
            "## Delta pushes",
            "",
            (
                "W1 held in fp32 by the trainer, cast to bf16 on the way (the workers hold bf16), "
                "over the default transports. after_step: the push after one Adam step at lr "
                "1e-6 (weights drawn normal, std 0.02); all_changed: after every value changed. "
                "Dense: SyncConfig(delta=False); delta: SyncConfig(delta=True)."
            ),
            "",
            (
                "| strategy | push | median s | min s | max s | MB on the wire | x dense time | "
                "trainer extra MB | worker extra MB |"
            ),
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in deltas:
            if r.error:
                lines.append(f"| {r.strategy} | {r.suite} | failed: {r.error} | | | | | | |")
                continue
            dense = _find(rows, r.workload, r.strategy, r.workers, suite="dense")
            ratio = r.median / dense.median if dense and dense.seconds else float("nan")
            wire = statistics.median(r.wire_bytes) / MB if r.wire_bytes else float("nan")
            lines.append(
                f"| {r.strategy} | {r.suite} | {r.median:.3f} | {min(r.seconds):.3f} | "
                f"{max(r.seconds):.3f} | {wire:.1f} | {ratio:.2f} | "
                f"{max(r.trainer_extra) / MB:.0f} | {max(r.worker_extra) / MB:.0f} |"
            )
        lines.append("")
    sweep = [r for r in rows if r.suite == "bucket sweep" and r.strategy != "raw"]
    if sweep:
        raw = _find(rows, sweep[0].workload, "raw", sweep[0].workers, suite="bucket sweep")
        lines += [
            "## Bucket-size sweep (W1, every tensor packed)",
            "",
            "| bucket MiB | median s | GB/s | x raw | trainer extra MB | worker extra MB |",
            "|---|---|---|---|---|---|",
        ]
        for r in sorted(sweep, key=lambda r: r.bucket_bytes):
            times = r.median / raw.median if raw else float("nan")
            lines.append(
                f"| {r.bucket_bytes >> 20} | {r.median:.3f} | {r.gbps:.3f} | {times:.2f} | "
                f"{max(r.trainer_extra) / MB:.0f} | {max(r.worker_extra) / MB:.0f} |"
            )
        lines.append("")
    costs = [r for r in rows if r.suite == "options" and r.strategy != "raw"]
    if costs:
        raw = _find(rows, costs[0].workload, "raw", costs[0].workers, suite="options")
        base = _find(rows, costs[0].workload, "weight_sync", costs[0].workers, suite="options")
        lines += [
            f"## What the safety options cost ({costs[0].workload}, {costs[0].workers} workers)",
            "",
            (
                "| variant | median s | min s | max s | x raw | x defaults | trainer extra MB | "
                "worker extra MB |"
            ),
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in costs:
            if r.error:
                lines.append(f"| {r.strategy} | failed: {r.error.split(':')[0]} | | | | | | |")
                continue
            x_raw = r.median / raw.median if raw and raw.seconds else float("nan")
            x_base = r.median / base.median if base and base.seconds else float("nan")
            lines.append(
                f"| {r.strategy} | {r.median:.3f} | {min(r.seconds):.3f} | "
                f"{max(r.seconds):.3f} | {x_raw:.2f} | {x_base:.2f} | "
                f"{max(r.trainer_extra) / MB:.0f} | {max(r.worker_extra) / MB:.0f} |"
            )
        lines.append("")
    scaling = [r for r in rows if r.suite == "scaling"]
    if scaling:
        lines += [
            "## Scaling (synthetic fp32, 8 MB tensors)",
            "",
            "| workers | MB | weight_sync s | raw s | x raw | weight_sync GB/s |",
            "|---|---|---|---|---|---|",
        ]
        for r in scaling:
            if r.strategy != "weight_sync":
                continue
            raw = _find(rows, r.workload, "raw", r.workers, suite="scaling")
            if raw is None or raw.error:
                raw_text = f"failed ({raw.error.split(':')[0]})" if raw and raw.error else "not run"
                ratio_text = "-"
            else:
                raw_text, ratio_text = f"{raw.median:.3f}", f"{r.median / raw.median:.2f}"
            lines.append(
                f"| {r.workers} | {r.nbytes / MB:.0f} | {r.median:.3f} | {raw_text} | "
                f"{ratio_text} | {r.gbps:.3f} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(rows: Sequence[Measurement], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    names = list(dict.fromkeys(r.workload for r in rows if r.suite == "workloads"))
    # One figure per workload: side by side they were too wide to read in a page's column.
    for name in names:
        group = [r for r in rows if r.workload == name and r.suite == "workloads" and r.seconds]
        if not group:
            continue
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.bar(
            range(len(group)),
            [r.median for r in group],
            yerr=[
                [r.median - min(r.seconds) for r in group],
                [max(r.seconds) - r.median for r in group],
            ],
            color=[
                "tab:green" if r.strategy.startswith("weight_sync") else "tab:gray" for r in group
            ],
        )
        ax.set_xticks(range(len(group)), [r.strategy for r in group], rotation=35, ha="right")
        ax.set_yscale("log")
        ax.set_title(
            f"{name}: {group[0].nbytes / MB:.0f} MB to {group[0].workers} workers", fontsize=9
        )
        ax.set_ylabel("seconds per push (median, min-max)")
        fig.tight_layout()
        written.append(_save(fig, out / f"workload_{name}.png"))
    scaling = [r for r in rows if r.suite == "scaling"]
    if scaling:
        fig, ax = plt.subplots(figsize=(6, 4))
        for count in sorted({r.workers for r in scaling}):
            for strategy, style in (("weight_sync", "-o"), ("raw", "--x")):
                points = sorted(
                    (r.nbytes, r.gbps)
                    for r in scaling
                    if r.workers == count and r.strategy == strategy
                )
                ax.plot(
                    [p[0] / MB for p in points],
                    [p[1] for p in points],
                    style,
                    label=f"{strategy}, {count} worker{'s' if count > 1 else ''}",
                )
        ax.set_xscale("log")
        ax.set_xlabel("state dict MB")
        ax.set_ylabel("GB/s (payload / median)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out / "scaling.png"))
    sweep = sorted(
        (r for r in rows if r.suite == "bucket sweep" and r.strategy != "raw"),
        key=lambda r: r.bucket_bytes,
    )
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(
            [r.bucket_bytes >> 20 for r in sweep],
            [r.median for r in sweep],
            "-o",
            label="weight_sync, every tensor packed",
        )
        raw = _find(rows, sweep[0].workload, "raw", sweep[0].workers, suite="bucket sweep")
        if raw:
            ax.axhline(raw.median, linestyle="--", color="gray", label="raw (floor)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bucket MiB")
        ax.set_ylabel("seconds per push (median)")
        ax.set_title("W1: GPT-2 small to workers, by bucket size", fontsize=9)
        ax.legend()
        fig.tight_layout()
        written.append(_save(fig, out / "buckets.png"))
    return written


def _save(fig: object, path: Path) -> Path:
    fig.savefig(path, dpi=110)  # type: ignore[attr-defined]
    import matplotlib.pyplot as plt

    plt.close(fig)  # type: ignore[arg-type]
    return path


def write_report(rows: Sequence[Measurement], out: Path) -> Path:
    """results.json, results.md and the plots under ``out``."""
    return _write(
        out, "results", [r.as_dict() for r in rows], markdown(rows), lambda: plot(rows, out)
    )


def _write(
    out: Path, stem: str, data: list[dict[str, Any]], text: str, plots: Callable[[], object]
) -> Path:
    """``stem``.json, ``stem``.md and the plots under ``out``; the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    report = out / f"{stem}.md"
    report.write_text(text)
    plots()
    return report


# -- the multi-node bench (weight_sync.tools.bench.links) ---------------------------------------------


@dataclass
class LinkRow:
    """One mode on one layout at one link rate: what the multi-node bench records. Lives here,
    below the driver, so that the report reads links.json back without importing Ray glue."""

    suite: str  # "links" (the rates) or "node scaling"
    workload: str
    title: str
    rate_bits: int
    delay_ms: float
    nodes: int
    workers_per_node: int
    local_workers: bool
    workers: int
    mode: str  # dense, dense (tree), delta, raw
    payload_bytes: int  # the state dict as pushed (cast), whatever went on the wire
    seconds: list[float] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)  # the push's own count, per push
    sent_bytes: list[int] = field(default_factory=list)  # out of the trainer node's link
    verified: bool | None = None  # bit-exact on every worker after the last push (not raw)
    deltas: int = 0  # timed pushes that went as deltas (delta=True picks per push)
    phases: list[dict[str, float]] = field(default_factory=list)  # PushResult.phases, per push

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")

    @property
    def wire(self) -> float:
        return statistics.median(self.wire_bytes) if self.wire_bytes else float("nan")

    @property
    def crossings(self) -> float:
        """How many times the push's bytes left the trainer's node: bytes sent out of its link
        (TCP/IP headers and the control plane's few KB included) over the wire bytes."""
        ratios = [s / w for s, w in zip(self.sent_bytes, self.wire_bytes, strict=True) if w]
        return statistics.median(ratios) if ratios else float("nan")

    @property
    def bound(self) -> float:
        """The one-crossing bound: the wire bytes once through the trainer's link, in seconds."""
        return self.wire * 8 / self.rate_bits

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "median": self.median,
            "crossings": self.crossings,
            "bound": self.bound,
        }


def _rate(bits: int) -> str:
    from weight_sync.tools.bench.netns import format_rate

    return format_rate(bits)


def links_markdown(rows: Sequence[LinkRow]) -> str:
    lines = [
        "# weight_sync across shaped links (multi-node bench)",
        "",
        f"Machine: {machine_line()}.",
        "",
        (
            "Nodes are network namespaces on this machine, joined by a bridge; each node's link "
            "is shaped to the rate with tc tbf at both ends (`weight_sync.tools.bench.netns`). The "
            "trainer is on node 0; pushes after an Adam step (lr 1e-6), cast to bf16. "
            "`crossings`: bytes the trainer's node sent out of its link during the push / the "
            "push's wire bytes (headers and the control plane add under 1%). `bound`: wire "
            "bytes x 8 / rate, one "
            "crossing of the link. `raw`: one flat Gloo broadcast of the payload to a group "
            "holding every worker."
        ),
        "",
    ]
    links = [r for r in rows if r.suite == "links"]
    for workload in dict.fromkeys(r.workload for r in links):
        group = [r for r in links if r.workload == workload]
        first = group[0]
        near = f", {first.workers_per_node} on node 0" if first.local_workers else ""
        lines += [
            (
                f"## {workload}: {first.title}, {first.nodes} nodes, "
                f"{first.workers_per_node} workers per far node{near}"
            ),
            "",
            f"Payload {first.payload_bytes / MB:.1f} MB (bf16); delay {first.delay_ms:g} ms.",
            "",
            (
                "| rate | mode | median s | min s | max s | wire MB | crossings | bound s | "
                "x bound | x raw | as delta | verified |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in group:
            verified = {True: "yes", False: "NO", None: "-"}[r.verified]
            raw = next((o for o in group if o.mode == "raw" and o.rate_bits == r.rate_bits), None)
            x_raw = r.median / raw.median if raw is not None else float("nan")
            lines.append(
                f"| {_rate(r.rate_bits)} | {r.mode} | {r.median:.3f} | {min(r.seconds):.3f} | "
                f"{max(r.seconds):.3f} | {r.wire / MB:.2f} | {r.crossings:.2f} | "
                f"{r.bound:.3f} | {r.median / r.bound:.2f} | {x_raw:.2f} | "
                f"{r.deltas}/{len(r.seconds)} | {verified} |"
            )
        lines.append("")
    scaling = [r for r in rows if r.suite == "node scaling"]
    if scaling:
        first = scaling[0]
        lines += [
            f"## Node scaling: {first.workload} at {_rate(first.rate_bits)}",
            "",
            (
                "Workers on every node, the trainer's included (through its shared-memory "
                "ring); the others relayed once per node."
            ),
            "",
            (
                "| nodes | workers per node | workers | mode | median s | wire MB | crossings | "
                "x bound | as delta |"
            ),
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(scaling, key=lambda r: (r.mode, r.workers_per_node, r.nodes)):
            lines.append(
                f"| {r.nodes} | {r.workers_per_node} | {r.workers} | {r.mode} | "
                f"{r.median:.3f} | {r.wire / MB:.2f} | {r.crossings:.2f} | "
                f"{r.median / r.bound:.2f} | {r.deltas}/{len(r.seconds)} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot_links(rows: Sequence[LinkRow], out: Path) -> list[Path]:
    """links.png: push seconds by rate, one line per mode (and the one-crossing bound);
    node_scaling.png: push seconds by nodes, one line per workers per node and mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    links = [r for r in rows if r.suite == "links" and r.seconds]
    workloads = list(dict.fromkeys(r.workload for r in links))
    if workloads:
        fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
        for ax, workload in zip(axes[0], workloads, strict=True):
            group = [r for r in links if r.workload == workload]
            for mode in dict.fromkeys(r.mode for r in group):
                points = sorted((r.rate_bits, r.median) for r in group if r.mode == mode)
                ax.plot([p[0] / 1e9 for p in points], [p[1] for p in points], "-o", label=mode)
            dense = sorted((r.rate_bits, r.bound) for r in group if r.mode == "dense")
            if dense:
                ax.plot(
                    [p[0] / 1e9 for p in dense],
                    [p[1] for p in dense],
                    ":",
                    color="gray",
                    label="one crossing (dense)",
                )
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("link rate, Gbit/s")
            ax.set_ylabel("seconds per push (median)")
            ax.set_title(
                f"{workload}: {group[0].nodes} nodes, {group[0].workers} workers", fontsize=9
            )
            ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out / "links.png"))
    scaling = [r for r in rows if r.suite == "node scaling" and r.seconds]
    if scaling:
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, style in (("dense", "-o"), ("delta", "--x")):
            for count in sorted({r.workers_per_node for r in scaling}):
                points = sorted(
                    (r.nodes, r.median)
                    for r in scaling
                    if r.mode == mode and r.workers_per_node == count
                )
                if points:
                    ax.plot(
                        [p[0] for p in points],
                        [p[1] for p in points],
                        style,
                        label=f"{mode}, {count} per node",
                    )
        ax.set_xticks(sorted({r.nodes for r in scaling}))
        ax.set_xlabel("nodes (trainer's included)")
        ax.set_ylabel("seconds per push (median)")
        ax.set_title(f"{scaling[0].workload} at {_rate(scaling[0].rate_bits)}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out / "node_scaling.png"))
    return written


def write_links_report(rows: Sequence[LinkRow], out: Path) -> Path:
    """links.json (every push's figures), links.md (tables) and the plots under ``out``."""
    return _write(
        out,
        "links",
        [r.as_dict() for r in rows],
        links_markdown(rows),
        lambda: plot_links(rows, out),
    )
