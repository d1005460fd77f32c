"""Modules that moved keep their old import paths for one release, with a DeprecationWarning that
names the new path (weight_sync._moved)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

MOVED = [
    ("weight_sync.sharded", "weight_sync.send.sharded", "push_sharded"),
    ("weight_sync.sharded", "weight_sync.send.sharded", "ShardedSource"),
    ("weight_sync.routes", "weight_sync.send.routes", "choose_routes"),
    ("weight_sync.mailbox", "weight_sync.store_plane", "ClientPlane"),
    ("weight_sync.launch", "weight_sync.torchrun", "JobSync"),
    ("weight_sync.job", "weight_sync.ray_job", "main"),
    ("weight_sync.verify", "weight_sync.checksums", "state_dict_digests"),
    ("weight_sync.entries", "weight_sync.send.checks", "check_state_dict"),
]


@pytest.mark.parametrize(("old", "new", "name"), MOVED)
def test_an_old_path_gives_the_same_object_and_says_where_it_went(
    old: str, new: str, name: str
) -> None:
    stub = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}"):
        got = getattr(stub, name)
    assert got is getattr(importlib.import_module(new), name)


def test_an_old_path_has_nothing_the_new_one_lacks() -> None:
    stub = importlib.import_module("weight_sync.sharded")
    with pytest.warns(DeprecationWarning), pytest.raises(AttributeError):
        stub.no_such_thing  # noqa: B018


def test_a_star_import_of_an_old_path_brings_the_new_names() -> None:
    names: dict[str, object] = {}
    with pytest.warns(DeprecationWarning, match="weight_sync.launch moved to weight_sync.torchrun"):
        exec("from weight_sync.launch import *", names)
    from weight_sync.torchrun import JobSync

    assert names["JobSync"] is JobSync
    assert "_forward" not in names and "forward" not in names


def test_the_old_job_command_still_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "weight_sync.job", "--help"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--workers" in done.stdout
    assert "weight_sync.job moved to weight_sync.ray_job" in done.stderr
