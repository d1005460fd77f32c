"""Placement: reserve one bundle per actor (trainer + workers) with a Ray placement group.

The reference layout is one node of 8 GPUs: the trainer on one GPU, a worker on each of the
other 7, all on one node so NCCL can use NVLink (``STRICT_PACK``). ``spread=True`` asks for
``SPREAD`` instead, to scale out across nodes. On a cluster without GPUs (CI, laptops) the same
layout is reserved with fractional CPU bundles, so the code path is the one a GPU cluster runs.

``bundles_for`` is pure (tested as a table); ``reserve`` talks to Ray.
"""

from __future__ import annotations

import logging
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
    """What to reserve: one bundle per actor and how to place the bundles."""

    bundles: tuple[dict[str, float], ...]
    strategy: str
    gpus: bool

    @property
    def workers(self) -> int:
        return len(self.bundles) - 1


def bundles_for(
    workers: int,
    *,
    cluster_gpus: float,
    gpus: GpuChoice = "auto",
    spread: bool = False,
    cpus_per_actor: float = 1.0,
    cpus_per_actor_without_gpus: float = 0.1,
) -> Layout:
    """The bundles for a trainer and ``workers`` workers.

    ``gpus="auto"`` uses one GPU per actor when the cluster has enough of them, and falls back
    to CPU bundles when it has none; a cluster with some GPUs but too few is an error (half a
    GPU layout is rarely what anyone wants). ``"yes"``/``"no"`` force the choice.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    actors = workers + 1
    use_gpus = gpus == "yes" or (gpus == "auto" and cluster_gpus > 0)
    if use_gpus and cluster_gpus < actors:
        raise ValueError(
            f"a trainer and {workers} workers need {actors} GPUs, the cluster has "
            f"{cluster_gpus:g}; use fewer workers, add GPU nodes, or pass gpus='no'"
        )
    if use_gpus:
        bundle = {"GPU": 1.0, "CPU": cpus_per_actor}
        strategy = "SPREAD" if spread else "STRICT_PACK"
    else:
        bundle = {"CPU": cpus_per_actor_without_gpus}
        strategy = "SPREAD" if spread else "PACK"
    return Layout(tuple(dict(bundle) for _ in range(actors)), strategy, use_gpus)


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
        workers, cluster_gpus=ray.cluster_resources().get("GPU", 0.0), gpus=gpus,
        spread=spread, cpus_per_actor=cpus_per_actor,
    )  # fmt: skip
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
