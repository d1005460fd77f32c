"""The test session's cleanup of what engines leave in /dev/shm (tests/shm_leftovers.py): it
removes only what appeared during the run and nothing still maps or holds open."""

from __future__ import annotations

import mmap
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
