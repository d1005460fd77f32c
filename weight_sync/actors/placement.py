"""Placement: reserve one bundle per actor (trainer + workers) with a Ray placement group.

The reference layout is one node of 8 GPUs: the trainer on one GPU, a worker on each of the
other 7, all on one node so NCCL can use NVLink (``STRICT_PACK``). ``spread=True`` asks for
``SPREAD`` instead, to scale out across nodes. With fewer GPUs than actors, the actors share
them through Ray's fractional GPUs (8 actors on one GPU: 0.125 each) -- the colocated
deployment, never an error. On a cluster without GPUs (CI, laptops) the same layout is reserved
with fractional CPU bundles, so the code path is the one a GPU cluster runs.

``bundles_for`` is pure (tested as a table); ``reserve`` talks to Ray.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from typing_extensions import Self

from weight_sync.errors import SyncTimeoutError

logger = logging.getLogger(__name__)

GpuChoice = Literal["auto", "yes", "no"]
TRAINER_BUNDLE = 0  # bundle 0 is the trainer's; bundle i + 1 is worker i's


@dataclass(frozen=True)
class Layout:
    """What to reserve: one bundle per actor and how to place the bundles. ``gpu_share``: the
    GPU each actor holds (1.0: one of its own; 0.125: eight actors on one GPU; 0.0: none)."""

    bundles: tuple[dict[str, float], ...]
    strategy: str
    gpu_share: float = 0.0

    @property
    def gpus(self) -> bool:
        """Whether the actors hold GPUs (whole or shared)."""
        return self.gpu_share > 0

    @property
    def workers(self) -> int:
        return len(self.bundles) - 1

    def describe(self) -> str:
        """How the actors sit, in words: "CPU bundles", "a GPU each", "8 actors on 1 GPU"."""
        return describe_share(len(self.bundles), self.gpu_share)


def gpu_share(actors: int, gpus: float) -> float:
    """The GPU each of ``actors`` takes when ``gpus`` GPUs are there for them: a whole one where
    there are enough, else an equal fraction, so that actors share GPUs through Ray's
    fractional GPUs -- the colocated deployment, where members on the trainer's GPU take the
    CUDA ring. Rounded down to Ray's resolution (1e-4), so that the shares fit (pure)."""
    whole = math.floor(gpus)
    if whole < 1:
        raise ValueError(f"{actors} actors cannot share {gpus:g} GPUs: at least one is needed")
    if whole >= actors:
        return 1.0
    return math.floor(10_000 / math.ceil(actors / whole)) / 10_000


def describe_share(actors: int, share: float) -> str:
    if share <= 0:
        return "CPU bundles"
    if share >= 1:
        return "a GPU each"
    per_gpu = round(1 / share)
    gpus = math.ceil(actors / per_gpu)
    return f"{min(per_gpu, actors)} actors per GPU on {gpus} GPU{'s' if gpus > 1 else ''}"


def bundles_for(
    workers: int,
    *,
    cluster_gpus: float,
    node_gpus: float | None = None,
    gpus: GpuChoice = "auto",
    spread: bool = False,
    cpus_per_actor: float = 1.0,
    cpus_per_actor_without_gpus: float = 0.1,
) -> Layout:
    """The bundles for a trainer and ``workers`` workers.

    ``gpus="auto"`` uses GPUs when the cluster has any, and CPU bundles when it has none;
    ``"yes"``/``"no"`` force the choice. With GPUs, each actor gets one of its own where there
    are enough -- on the largest node (``node_gpus``, default ``cluster_gpus``) when the actors
    are packed on one node, in the whole cluster when spread -- and otherwise an equal
    fraction of them (``gpu_share``), actors sharing GPUs; the actors sharing then take the
    CPU of a CPU bundle each, not a core each.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    actors = workers + 1
    use_gpus = gpus == "yes" or (gpus == "auto" and cluster_gpus > 0)
    if not use_gpus:
        bundle = {"CPU": cpus_per_actor_without_gpus}
        return Layout(tuple(dict(bundle) for _ in range(actors)), "SPREAD" if spread else "PACK")
    pool = cluster_gpus if spread or node_gpus is None else node_gpus
    if pool < 1:
        raise ValueError(
            f"a trainer and {workers} workers on GPUs need at least one GPU, the "
            f"{'cluster' if spread or node_gpus is None else 'largest node'} has {pool:g}; "
            "add a GPU node or pass gpus='no'"
        )
    share = gpu_share(actors, pool)
    cpus = cpus_per_actor if share >= 1 else cpus_per_actor_without_gpus
    bundle = {"GPU": share, "CPU": cpus}
    strategy = "SPREAD" if spread else "STRICT_PACK"
    return Layout(tuple(dict(bundle) for _ in range(actors)), strategy, share)


def largest_node_gpus() -> float:
    """The GPUs of the connected Ray cluster's largest live node (0 with none)."""
    return max(
        (node["Resources"].get("GPU", 0.0) for node in ray.nodes() if node.get("Alive")),
        default=0.0,
    )


class Placement:
    """A reserved placement group and the Ray options that put each actor in its bundle."""

    def __init__(self, layout: Layout, group: PlacementGroup) -> None:
        self.layout = layout
        self.group = group

    def trainer_options(self) -> dict[str, Any]:
        """``.options(**placement.trainer_options())`` for the trainer actor."""
        return self._options(TRAINER_BUNDLE)

    def worker_options(self, index: int) -> dict[str, Any]:
        """``.options(**placement.worker_options(i))`` for worker ``i``."""
        if not 0 <= index < self.layout.workers:
            raise IndexError(f"worker {index} outside 0..{self.layout.workers - 1}")
        return self._options(index + 1)

    def remove(self) -> None:
        remove_placement_group(self.group)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def _options(self, bundle: int) -> dict[str, Any]:
        resources = self.layout.bundles[bundle]
        return {
            "num_cpus": resources.get("CPU", 0.0),
            "num_gpus": resources.get("GPU", 0.0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=bundle
            ),
        }


def reserve(
    workers: int,
    *,
    gpus: GpuChoice = "auto",
    spread: bool = False,
    cpus_per_actor: float = 1.0,
    timeout_s: float = 120.0,
) -> Placement:
    """Reserve bundles for a trainer and ``workers`` workers on the connected Ray cluster.

    Raises ``SyncTimeoutError`` if the cluster cannot fit them within ``timeout_s`` (the
    reservation is released), naming what was asked for.
    """
    layout = bundles_for(
        workers,
        cluster_gpus=ray.cluster_resources().get("GPU", 0.0),
        node_gpus=largest_node_gpus(),
        gpus=gpus,
        spread=spread,
        cpus_per_actor=cpus_per_actor,
    )
    if not layout.gpus:
        logger.info("no GPUs in the cluster: reserving CPU bundles for %d actors", workers + 1)
    group = placement_group(list(layout.bundles), strategy=layout.strategy, name="")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise SyncTimeoutError(
            f"the cluster could not fit {len(layout.bundles)} bundles of {layout.bundles[0]} "
            f"({layout.strategy}) within {timeout_s:.0f}s; check `ray status` for free resources"
        )
    return Placement(layout, group)
