"""Who a process is in a launched job, read from its launcher's variables (pure)."""

from __future__ import annotations

import pytest

from weight_sync.launch.job_sync import LaunchEnv, launch_env

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "10.0.0.1"}
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1"}  # fmt: skip


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        (TORCHRUN, LaunchEnv(3, 8, 3, "torchrun")),
        (OPEN_MPI, LaunchEnv(1, 4, 1, "mpirun")),
        ({**OPEN_MPI, **TORCHRUN}, LaunchEnv(3, 8, 3, "torchrun")),  # torchrun's win
        ({"RANK": "0", "WORLD_SIZE": "2"}, LaunchEnv(0, 2, 0, "torchrun")),  # no LOCAL_RANK
        ({}, None),  # mp.spawn: none set
        ({"PATH": "/usr/bin"}, None),
    ],
)
def test_launch_env_reads_the_launcher(environ: dict[str, str], expected: LaunchEnv | None) -> None:
    assert launch_env(environ) == expected


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "0"}, "must both be integers"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "must both be integers"),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "must both be integers"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "outside a world of 2"),
    ],
)
def test_launch_env_refuses_half_set_variables(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        launch_env(environ)
