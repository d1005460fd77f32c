"""`weight-sync demo` on the GPUs a machine has: with fewer GPUs than actors they share them
(Ray's fractional GPUs), and the members on the trainer's GPU take the CUDA ring.

Skipped where there is no GPU (tests/conftest.py) or where Ray is not installed (the one-GPU
machines run the rest of the suite without it).

    pytest -m gpu tests/gpu/test_demo_on_gpu.py -v
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.distributed.harness import repo_env

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

DEMO = "from weight_sync.tools.cli import main; raise SystemExit(main(['demo', '--device', 'cuda', " \
       "'--workers', '7', '--steps', '3']))"  # fmt: skip


def test_the_demo_runs_on_the_gpus_found_and_verifies_every_worker() -> None:
    pytest.importorskip(
        "ray", reason="the demo needs Ray; this machine runs the GPU suite without it"
    )
    done = subprocess.run([sys.executable, "-c", DEMO], env=repo_env(), capture_output=True,
                          text=True, timeout=540, check=False)  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, (done.returncode, out, done.stderr[-4000:])
    assert "verified: 7/7 workers hold version 3" in out and "-- OK" in out, out
    routes = next(line for line in out.splitlines() if line.startswith("routes (workers): "))
    if torch.cuda.device_count() == 1:  # all eight actors on the one GPU: the colocated route
        assert "8 actors per GPU on 1 GPU" in out, out
        assert "7 through the trainer's GPU (CUDA IPC)" in routes, routes
    assert sum(int(part.split()[0]) for part in routes.split(": ")[1].split(", ")) == 7, routes
