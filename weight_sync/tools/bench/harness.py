"""Orchestration: one Ray cluster, one trainer and N workers, every strategy on every workload.

Each strategy gets one warm-up transfer, then ``repeats`` timed ones. Seconds are measured in
the trainer around the whole transfer (Ray calls included, as users would pay them); memory is
the peak resident memory above the baseline during each transfer, on the trainer and on every
worker (the largest worker is reported).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

try:
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm
except ImportError as exc:  # an extra, like matplotlib for the plots
    raise ImportError("the benchmark needs tqdm: pip install 'weight_sync[bench]'") from exc

from weight_sync import SyncConfig, WeightSyncError
from weight_sync.tools.bench.actors import STRATEGIES, TRAINING, BenchTrainer, BenchWorker
from weight_sync.tools.bench.measurement import Measurement
from weight_sync.tools.bench.report import write_report
from weight_sync.tools.bench.workloads import WORKLOADS, MiB, Workload, gpt2_small, synthetic
from weight_sync.wire.planner import direct_threshold

logger = logging.getLogger(__name__)
TIMEOUT_S = 1800


class Progress:
    """The bench's progress bar (tqdm, on stderr): how many transfers of how many are done, and
    which one runs now -- workload, workers, strategy, warm-up or timed run -- shown before it
    starts, since one transfer can take a minute. On a terminal the clock ticks every second
    between updates, so a long transfer never looks hung. stdout stays the report's."""

    TICK_S = 1.0
    LABEL_WIDTH = 48

    def __init__(self, total: int) -> None:
        self._bar = tqdm(
            total=total,
            file=sys.stderr,
            dynamic_ncols=True,
            bar_format="{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} transfers [{elapsed}] {desc}",
        )
        self._closed = threading.Event()
        # Only a terminal redraws in place: a log file would just collect one line per tick.
        if sys.stderr.isatty():
            threading.Thread(target=self._tick, name="bench-progress", daemon=True).start()

    def _tick(self) -> None:
        while not self._closed.wait(self.TICK_S):
            self._bar.refresh()

    def running(self, label: str) -> None:
        """Show what runs now (until the next label). Padded, so that the bar keeps its width
        from one label to the next."""
        self._bar.set_description_str(f"{label:<{self.LABEL_WIDTH}}")

    def advance(self, steps: int = 1) -> None:
        self._bar.update(steps)

    def close(self) -> None:
        self._closed.set()
        self._bar.close()


def _workers(count: int) -> str:
    """How the progress bar counts workers: "1 worker", "7 workers"."""
    return f"{count} worker{'s' if count != 1 else ''}"


@dataclass(frozen=True)
class Case:
    """One measurement to take: a workload, a worker count, strategies, a config."""

    workload: Workload
    workers: int
    strategies: tuple[str, ...]
    config: tuple[tuple[str, Any], ...] = ()
    label: str = ""  # names the weight_sync variant, e.g. "weight_sync (all packed)"
    suite: str = "workloads"

    @property
    def worker_dtype(self) -> str | None:
        """What the workers hold: the push's cast dtype, if any."""
        return dict(self.config).get("cast_dtype")

    def sync_config(self) -> SyncConfig:
        # The group unless a case says otherwise: the baselines run over the push's own group.
        fields: dict[str, Any] = {"same_host": "group"}
        if self.workload.bucket_bytes is not None:
            fields["bucket_bytes"] = self.workload.bucket_bytes
        return SyncConfig(**{**fields, **dict(self.config)})


# What each safety option of SyncConfig costs, measured on W1 against the defaults.
OPTIONS: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = (
    ("checksum=True", (("checksum", True),)),
    ("staging=atomic", (("staging", "atomic"),)),
    ("check_finite=True", (("check_finite", True),)),
)


def plan_cases(
    workloads: Sequence[str],
    workers: int,
    strategies: Sequence[str],
    scaling: bool,
    sweep: bool,
    options: bool = False,
    same_host: Sequence[str] = (),
    delta: bool = False,
) -> list[Case]:
    cases = []
    for name in workloads:
        workload = WORKLOADS[name]()
        cases.append(Case(workload, workers, tuple(strategies)))
        if name in ("W1", "W3") and "weight_sync" in strategies:
            # What direct transfers buy: the same push with every tensor packed.
            cases.append(
                Case(
                    workload,
                    workers,
                    ("weight_sync",),
                    (("direct_min_bytes", None),),
                    "weight_sync (all packed)",
                )
            )
    if sweep:
        # Everything packed: with direct transfers on, W1's buckets carry only sub-MiB tensors
        # and the bucket size hardly matters. The sweep measures its own floor.
        cases.append(Case(gpt2_small(), workers, ("raw",), suite="bucket sweep"))
        for bucket_mib in (8, 16, 32, 64, 128, 256):
            config = (("bucket_bytes", bucket_mib * MiB), ("direct_min_bytes", None))
            cases.append(
                Case(
                    gpt2_small(),
                    workers,
                    ("weight_sync",),
                    config,
                    "weight_sync (all packed)",
                    suite="bucket sweep",
                )
            )
    if scaling:
        for count in (1, 3, 7):
            # 2 GB with 7 workers would need ~32 GB here (models + raw buffers): capped at 1 GB.
            sizes: tuple[int, ...] = (16, 64, 256, 1024) + ((2048,) if count <= 3 else ())
            for size_mb in sizes:
                cases.append(
                    Case(synthetic(size_mb * MiB), count, ("weight_sync", "raw"), suite="scaling")
                )
    for name in same_host:
        # Workers on the trainer's host: the shared-memory ring against the same push over the
        # group, the flat broadcast, and the memory-bandwidth limit (one write, N reads).
        workload = WORKLOADS[name]()
        cases.append(
            Case(
                workload,
                workers,
                ("weight_sync", "raw", "memcpy"),
                label="weight_sync (group)",
                suite="same host",
            )
        )
        cases.append(
            Case(
                workload,
                workers,
                ("weight_sync",),
                (("same_host", "shm"),),
                "weight_sync (shared memory)",
                suite="same host",
            )
        )
    if delta:
        # W1 as a policy trained in fp32 and served in bf16 (cast on the way), over the default
        # transports: dense pushes against delta pushes, after an RL step and after everything
        # changed. 'always': on one host delta=True would choose dense (weight_sync.delta.choice).
        for on in (False, True):
            delta_config: tuple[tuple[str, object], ...] = (
                ("cast_dtype", "bfloat16"),
                ("same_host", "shm"),
                ("delta", "always" if on else False),
            )
            cases.append(
                Case(
                    gpt2_small(), workers, TRAINING, delta_config, suite="delta" if on else "dense"
                )
            )
    if options:
        cases.append(Case(gpt2_small(), workers, ("raw", "weight_sync"), suite="options"))
        for label, variant in OPTIONS:
            cases.append(
                Case(
                    gpt2_small(),
                    workers,
                    ("weight_sync",),
                    variant,
                    f"weight_sync ({label})",
                    suite="options",
                )
            )
    return cases


class Bench:
    """The trainer and worker actors every case runs on. With ``device="cuda"`` each actor gets
    a GPU of its own and the weights live there (NCCL when every member has a GPU)."""

    def __init__(self, workers: int, device: str = "cpu") -> None:
        self.size = workers
        self.device = device
        self._attempts = 0  # transfers the current strategy has made (to skip the rest on failure)
        self._start()

    def _start(self) -> None:
        gpus = 1 if self.device == "cuda" else 0
        self.workers = [
            BenchWorker.options(num_gpus=gpus).remote(self.device)  # type: ignore[attr-defined]
            for _ in range(self.size)
        ]
        self.trainer = BenchTrainer.options(num_gpus=gpus).remote(  # type: ignore[attr-defined]
            self.workers, self.device
        )
        self.described = ray.get(self.trainer.describe.remote(), timeout=TIMEOUT_S)

    def _setup(self, case: Case) -> int:
        workers = self.workers[: case.workers]
        ray.get(
            [w.setup.remote(case.workload, case.worker_dtype) for w in workers], timeout=TIMEOUT_S
        )
        trained = case.suite in ("dense", "delta")
        return ray.get(
            self.trainer.setup.remote(case.workload, case.workers, case.sync_config(), trained),
            timeout=TIMEOUT_S,
        )

    def measure(self, case: Case, repeats: int, progress: Progress) -> list[Measurement]:
        """Every strategy of ``case``. A strategy that fails (a baseline running the machine out
        of memory, say) is recorded with its error, the actors are replaced, and the rest go on."""
        config = case.sync_config().sized_for(self.device)
        nbytes = self._setup(case)
        results = []
        for strategy in case.strategies:
            row = Measurement(
                case.workload.name,
                case.workload.title,
                case.label if strategy == "weight_sync" and case.label else strategy,
                case.workers,
                config.sized_bucket_bytes,
                direct_threshold(config.direct_min_bytes, self.device, config.sized_bucket_bytes),
                nbytes,
                suite=case.suite,
                device=self.described,
            )
            try:
                self._runs(case, strategy, row, repeats, progress)
            except (ray.exceptions.RayError, WeightSyncError) as exc:
                progress.running(f"{self._label(case, row)} failed: restarting the actors")
                progress.advance(repeats + 1 - self._attempts)
                row.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"
                logger.warning("%s on %s failed: %s", strategy, case.workload.name, row.error)
                self.close()
                self._start()
                self._setup(case)
            results.append(row)
        return results

    def _runs(
        self, case: Case, strategy: str, row: Measurement, repeats: int, progress: Progress
    ) -> None:
        workers = self.workers[: case.workers]
        self._attempts = 0
        for attempt in range(repeats + 1):
            run = f"run {attempt}/{repeats}" if attempt else "warm-up"
            progress.running(f"{self._label(case, row)}, {run}")
            ray.get([w.memory_reset.remote() for w in workers], timeout=TIMEOUT_S)
            seconds, trainer_extra, wire = ray.get(
                self.trainer.run.remote(strategy), timeout=TIMEOUT_S
            )
            worker_extra = max(
                ray.get([w.memory_peak.remote() for w in workers], timeout=TIMEOUT_S)
            )
            if attempt:  # the first run of each strategy is the warm-up
                row.seconds.append(seconds)
                row.trainer_extra.append(trainer_extra)
                row.worker_extra.append(worker_extra)
                if wire is not None:
                    row.wire_bytes.append(wire)
            self._attempts += 1
            progress.advance()

    @staticmethod
    def _label(case: Case, row: Measurement) -> str:
        """Names a strategy's transfers on the progress bar: workload, workers, strategy, and the
        suite where the same strategy runs in several (dense and delta pushes, say)."""
        suite = "" if case.suite == "workloads" else f"{case.suite}: "
        return f"{suite}{case.workload.name} to {_workers(case.workers)}, {row.strategy}"

    def close(self) -> None:
        try:
            ray.get(self.trainer.close.remote(), timeout=120)
        except ray.exceptions.RayError as exc:
            logger.warning("closing the benchmark trainer: %s", exc)
        finally:
            for actor in [self.trainer, *self.workers]:
                ray.kill(actor)


def run_bench(
    workloads: Sequence[str] = tuple(WORKLOADS),
    workers: int = 7,
    repeats: int = 5,
    strategies: Sequence[str] = STRATEGIES,
    scaling: bool = False,
    sweep: bool = False,
    options: bool = False,
    out: Path | None = None,
    address: str | None = None,
    scaling_repeats: int = 3,
    device: str = "cpu",
    same_host: Sequence[str] = (),
    delta: bool = False,
) -> list[Measurement]:
    """Run the benchmark; writes the report under ``out`` if given. Returns every measurement."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        raise ValueError(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}")
    unknown = (set(workloads) | set(same_host)) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown workloads {sorted(unknown)}; choose from {list(WORKLOADS)}")
    cases = plan_cases(workloads, workers, strategies, scaling, sweep, options, same_host, delta)
    started_here = not ray.is_initialized()
    if started_here:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if address is None:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
        else:
            ray.init(address=address)

    def repeats_for(case: Case) -> int:
        if case.workload.repeats is not None and case.suite == "workloads":
            return case.workload.repeats
        return scaling_repeats if case.suite == "scaling" else repeats

    size = max([workers, *(c.workers for c in cases)])
    if device == "cuda" and ray.cluster_resources().get("GPU", 0) < size + 1:
        if started_here:
            ray.shutdown()
        raise ValueError(
            f"device='cuda' needs {size + 1} GPUs in the Ray cluster (one trainer, {size} "
            f"workers); it has {ray.cluster_resources().get('GPU', 0):g}. Pass fewer --workers"
        )
    rows: list[Measurement] = []
    total = sum(len(c.strategies) * (repeats_for(c) + 1) for c in cases)
    # Warnings (a strategy that failed) print above the bar instead of through it.
    with closing(Progress(total)) as progress, logging_redirect_tqdm():
        progress.running(f"starting the trainer and {_workers(size)}")
        bench = Bench(size, device)
        try:
            for case in cases:
                rows += bench.measure(case, repeats_for(case), progress)
                if out is not None:  # keep what was measured even if a later case fails
                    write_report(rows, out)
        finally:
            progress.running("closing the actors")
            bench.close()
            if started_here:
                ray.shutdown()
    return rows
