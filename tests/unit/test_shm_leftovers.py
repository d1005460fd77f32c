"""The test session's cleanup of what engines leave in /dev/shm (tests/shm_leftovers.py): it
removes only what appeared during the run and nothing still maps or holds open."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from tests import shm_leftovers


def test_new_leftovers_go_and_what_is_in_use_or_older_stays(tmp_path: Path) -> None:
    root = tmp_path.resolve()
    for name in ("psm_older", "unrelated"):
        (root / name).write_bytes(b"x")
    before = shm_leftovers.entries(root)
    assert before == {"psm_older"}
    for name in (
        "psm_left",
        "vllm_dist_ab-tp:0-[0-1]-cpushm_0",
        "sglang_stats",
        "sem.mp-crash",
        "psm_mapped",
        "psm_open",
    ):
        (root / name).write_bytes(b"x" * mmap.PAGESIZE)
    with (root / "psm_mapped").open("r+b") as file:
        mapped = mmap.mmap(file.fileno(), mmap.PAGESIZE)  # stays mapped once the file is closed
    try:
        with (root / "psm_open").open("rb"):
            removed = shm_leftovers.remove_new(before, root)
    finally:
        mapped.close()
    assert removed == [
        "psm_left",
        "sem.mp-crash",
        "sglang_stats",
        "vllm_dist_ab-tp:0-[0-1]-cpushm_0",
    ]
    assert sorted(path.name for path in root.iterdir()) == [
        "psm_mapped", "psm_older", "psm_open", "unrelated",
    ]  # fmt: skip


def test_a_semaphore_mapped_under_the_name_it_was_made_as_stays(tmp_path: Path) -> None:
    """As glibc makes a POSIX semaphore (``sem.mp-*``): a file under a temporary name, mapped,
    linked to its own name, the first name unlinked. Live, it is mapped only under a name that
    is gone: kept by its inode. (A suite removing by name deleted another run's semaphores as
    its engines started: their workers failed to rebuild their locks.)"""
    root = tmp_path.resolve()
    made = root / "sem.Xy12ab"
    made.write_bytes(b"x" * mmap.PAGESIZE)
    with made.open("r+b") as file:
        mapped = mmap.mmap(file.fileno(), mmap.PAGESIZE)
    try:
        os.link(made, root / "sem.mp-live")
        made.unlink()
        (root / "sem.mp-dead").write_bytes(b"x")  # a crash path's: nobody maps it
        assert shm_leftovers.remove_new(set(), root) == ["sem.mp-dead"]
        assert sorted(path.name for path in root.iterdir()) == ["sem.mp-live"]
    finally:
        mapped.close()
