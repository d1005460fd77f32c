"""Rank processes forked from a server that imported torch and weight_sync once.

A spawned rank imports torch, torch.distributed and weight_sync before it runs a line of its
test: ~1.5 CPU-seconds each, the largest share of a multi-rank test on 2 cores. multiprocessing's
``forkserver`` pays that once per pytest process: the server imports ``PRELOAD`` and every rank
is a fork of it -- a real, separate process with its own Gloo group, as a spawned one, never a
fork of pytest itself (whose threads a fork would copy in whatever state they are). The server
holds no CUDA context, so forked ranks may use CUDA (the GPU tests do).

One test keeps ``mp.spawn`` word for word (tests/launch/test_launchers.py::test_mp_spawn_steps):
what a user's launch does is tested there; elsewhere the start method is not what is tested.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# One list for every user: the server starts once per process, with the list set first.
PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.fsdp", "weight_sync.receive.receiver",
    "weight_sync.send.sender", "weight_sync.launch.job_sync", "tests.zoo", "tests.launch.job",
    "tests.launch.sharded_job",
]  # fmt: skip


def context() -> multiprocessing.context.BaseContext:
    """multiprocessing's forkserver context, its server (once started) holding ``PRELOAD``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int) -> mp.ProcessContext:
    """``mp.start_processes(fn, args, nprocs, join=False)`` with ranks forked from the server:
    ``fn(index, *args)`` in each, as ``mp.spawn`` would call it."""
    context()
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
