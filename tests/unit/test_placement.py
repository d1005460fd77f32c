"""Placement and job planning, as tables (no cluster)."""

import argparse
import math

import pytest

from weight_sync.tools.demo import resolve_device
from weight_sync.actors.placement import bundles_for, describe_share
from weight_sync.tools.ray_job import _sync_config, model_shapes

GPU = {"GPU": 1.0, "CPU": 1.0}
CPU = {"CPU": 0.1}


def shared(share: float) -> dict[str, float]:
    return {"GPU": share, "CPU": 0.1}


@pytest.mark.parametrize(
    ("workers", "cluster_gpus", "node_gpus", "gpus", "spread", "bundle", "strategy"),
    [
        (7, 8, 8, "auto", False, GPU, "STRICT_PACK"),  # the reference layout: 1 + 7 on one node
        (7, 16, 8, "auto", True, GPU, "SPREAD"),  # scaled out on request
        (7, 0, 0, "auto", False, CPU, "PACK"),  # the CPU fallback these machines use
        (2, 0, 0, "auto", True, CPU, "SPREAD"),
        (3, 8, 8, "no", False, CPU, "PACK"),  # forced off
        (7, 1, 1, "auto", False, shared(0.125), "STRICT_PACK"),  # one GPU: all 8 colocated
        (7, 4, 4, "auto", False, shared(0.5), "STRICT_PACK"),  # two actors per GPU
        (7, 3, 3, "yes", False, shared(0.3333), "STRICT_PACK"),  # 3 per GPU; 3 x 0.3333 <= 1
        (7, 16, 4, "auto", False, shared(0.5), "STRICT_PACK"),  # packed: the largest node counts
        (7, 16, 4, "auto", True, GPU, "SPREAD"),  # spread: the cluster's GPUs count
        (1, 1, 1, "auto", False, shared(0.5), "STRICT_PACK"),
        (7, 1.5, None, "auto", False, shared(0.125), "STRICT_PACK"),  # whole GPUs only
    ],
)
def test_bundles_table(workers, cluster_gpus, node_gpus, gpus, spread, bundle, strategy) -> None:
    layout = bundles_for(workers, cluster_gpus=cluster_gpus, node_gpus=node_gpus, gpus=gpus,
                         spread=spread)  # fmt: skip
    assert layout.bundles == (bundle,) * (workers + 1) and layout.strategy == strategy
    assert layout.workers == workers and layout.gpus == ("GPU" in bundle)
    assert layout.gpu_share == bundle.get("GPU", 0.0)
    if layout.gpus:  # the shares fit on the GPUs counted
        per_gpu = math.floor(1 / layout.gpu_share)
        pool = cluster_gpus if spread or node_gpus is None else node_gpus
        assert per_gpu * math.floor(pool) >= workers + 1


@pytest.mark.parametrize(
    ("workers", "cluster_gpus", "node_gpus", "gpus", "message"),
    [
        (1, 0, 0, "yes", "need at least one GPU, the largest node has 0"),
        (7, 2, 0.5, "auto", "need at least one GPU, the largest node has 0.5"),
        (0, 8, 8, "auto", "workers must be >= 1"),
    ],
)
def test_bundles_refused(workers, cluster_gpus, node_gpus, gpus, message) -> None:
    with pytest.raises(ValueError, match=message):
        bundles_for(workers, cluster_gpus=cluster_gpus, node_gpus=node_gpus, gpus=gpus)


@pytest.mark.parametrize(("actors", "share", "words"), [
    (8, 0.0, "CPU bundles"), (8, 1.0, "a GPU each"), (8, 0.125, "8 actors per GPU on 1 GPU"),
    (8, 0.3333, "3 actors per GPU on 3 GPUs"), (2, 0.5, "2 actors per GPU on 1 GPU"),
])  # fmt: skip
def test_how_the_actors_sit_in_words(actors: int, share: float, words: str) -> None:
    assert describe_share(actors, share) == words


@pytest.mark.parametrize(("device", "gpus", "expected"), [
    ("auto", 0, "cpu"), ("auto", 1, "cuda"), ("auto", 8, "cuda"), ("cpu", 8, "cpu"),
    ("cuda", 1, "cuda"),
])  # fmt: skip
def test_the_demo_device(device: str, gpus: float, expected: str) -> None:
    assert resolve_device(device, gpus) == expected


def test_the_demo_refuses_cuda_without_a_gpu_saying_what_to_do() -> None:
    with pytest.raises(ValueError, match="has 0 GPUs; use --device cpu"):
        resolve_device("cuda", 0)
    with pytest.raises(ValueError, match="cannot use a GPU; install a CUDA build of torch"):
        resolve_device("cuda", 1, torch_has_cuda=False)
    assert resolve_device("auto", 1, torch_has_cuda=False) == "cpu"  # a GPU this torch can't use


@pytest.mark.parametrize(
    ("size_mb", "shapes"),
    [
        (8, [(2_000_000,)]),
        (32, [(3906, 1024), (3906, 1024), (512,)]),  # 16 MB tensors, then the rest
        (0.5, [(125_000,)]),
    ],
)
def test_model_shapes_add_up_to_the_size(size_mb: float, shapes: list) -> None:
    got = model_shapes(size_mb)
    assert got == [*shapes, (1024,), (1024,), (1024,), (1024,)]  # and four small ones
    assert sum(math.prod(shape) for shape in got[:-4]) * 4 == size_mb * 1e6


NODE_A = {"node_id": "a", "ip": "10.0.0.1", "pid": "1"}
NODE_B = {"node_id": "b", "ip": "10.0.0.2", "pid": "2"}


@pytest.mark.parametrize(
    ("flags", "nodes", "want"),
    [
        ({}, [NODE_A, NODE_A], {"master_addr": "127.0.0.1"}),  # one node: loopback
        ({}, [NODE_A, NODE_B], {"master_addr": "10.0.0.1"}),  # another node: the trainer's IP
        ({"master_addr": "10.9.9.9"}, [NODE_A, NODE_B], {"master_addr": "10.9.9.9"}),
        ({"interface": "eth1"}, [NODE_A, NODE_B], {"interface": "eth1"}),
        ({"bucket_mb": 64}, [NODE_A], {"master_addr": "127.0.0.1", "bucket_bytes": 64 << 20}),
    ],
)
def test_job_chooses_where_the_group_listens(flags, nodes, want) -> None:
    args = argparse.Namespace(
        **{"bucket_mb": None, "interface": None, "master_addr": None, **flags}
    )
    assert _sync_config(args, nodes) == want
