"""Placement and job planning, as tables (no cluster)."""

import argparse
import math

import pytest

from weight_sync.job import _sync_config, model_shapes
from weight_sync.placement import bundles_for

GPU = {"GPU": 1.0, "CPU": 1.0}
CPU = {"CPU": 0.1}


@pytest.mark.parametrize(
    ("workers", "cluster_gpus", "gpus", "spread", "bundle", "strategy"),
    [
        (7, 8, "auto", False, GPU, "STRICT_PACK"),  # the reference layout: 1 + 7 on one node
        (7, 16, "auto", True, GPU, "SPREAD"),  # scaled out on request
        (7, 0, "auto", False, CPU, "PACK"),  # the CPU fallback these machines use
        (2, 0, "auto", True, CPU, "SPREAD"),
        (3, 8, "no", False, CPU, "PACK"),  # forced off
    ],
)
def test_bundles_table(workers, cluster_gpus, gpus, spread, bundle, strategy) -> None:
    layout = bundles_for(workers, cluster_gpus=cluster_gpus, gpus=gpus, spread=spread)
    assert layout.bundles == (bundle,) * (workers + 1) and layout.strategy == strategy
    assert layout.workers == workers and layout.gpus == ("GPU" in bundle)


@pytest.mark.parametrize(
    ("workers", "cluster_gpus", "gpus", "message"),
    [
        (7, 4, "auto", "need 8 GPUs, the cluster has 4"),
        (1, 0, "yes", "need 2 GPUs, the cluster has 0"),
        (0, 8, "auto", "workers must be >= 1"),
    ],
)
def test_bundles_refused(workers, cluster_gpus, gpus, message) -> None:
    with pytest.raises(ValueError, match=message):
        bundles_for(workers, cluster_gpus=cluster_gpus, gpus=gpus)


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
    args = argparse.Namespace(**{"bucket_mb": None, "interface": None, "master_addr": None, **flags})
    assert _sync_config(args, nodes) == want
