"""What inference engines leave in /dev/shm when their processes end without cleaning up after
themselves: Python's shared-memory segments (``psm_*``; vLLM's message queues are 160-240 MiB
each, and their creator unlinks them only in ``__del__``, which a worker stopped by a signal never
runs), vLLM-CPU's tensor-parallel communicator (``vllm_dist_<id>-...-cpushm_<rank>``, 4 MiB a
rank: made by its C++ ``init_shm_manager`` in ``device_communicators/cpu_communicator.py``, and
left behind by a TP=2 engine in every CI run and in one of two runs of its test alone), SGLang's load
statistics (``sglang_*``) and the semaphores of a crash path (``sem.mp-*``). A CI run left ~1 GB
there (eight ``psm_*`` in the run of 2026-11-25, early morning).

The test session removes what appeared while it ran and no live process still maps or holds
open, so that a run never deletes the memory of an engine it did not start, or one still up."""

from __future__ import annotations

import contextlib
from pathlib import Path

SHM = Path("/dev/shm")
PREFIXES = ("psm_", "vllm_dist_", "sglang_", "sem.mp-")


def entries(root: Path = SHM) -> set[str]:
    """The names under ``root`` an engine may leave behind."""
    if not root.is_dir():
        return set()
    return {path.name for path in root.iterdir() if path.name.startswith(PREFIXES)}


def in_use(root: Path = SHM) -> set[str]:
    """Names under ``root`` that a live process maps or holds open (as far as /proc shows:
    every process, for root; this user's otherwise)."""
    used: set[str] = set()
    prefix = f"{root}/"
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            for line in (proc / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1]
                if path.startswith(prefix):
                    used.add(path[len(prefix) :].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = str(fd.readlink())
                    if target.startswith(prefix):
                        used.add(target[len(prefix) :])
    return used


def remove_new(before: set[str], root: Path = SHM) -> list[str]:
    """Remove the entries that appeared since ``before`` and nothing uses; the names removed."""
    left = sorted(entries(root) - before - in_use(root))
    for name in left:
        (root / name).unlink(missing_ok=True)
    return left
