"""Many groups at once on one host: no port clash, and nothing left behind after close()."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.distributed.harness import RankContext, run_ranks
from weight_sync.transport import TorchGroup

pytestmark = pytest.mark.timeout(180)
GROUPS = 20


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return count


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))  # native threads too (Gloo's, the store's)


def _listening_ports() -> set[int]:
    """Ports this process listens on (TCP state 0A), from /proc/net/tcp{,6} and our inodes."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def many_groups_rank(ctx: RankContext, count: int) -> dict:
    """Rank 0 holds rank 0 of ``count`` standalone groups, rank 1 the other end; every group is
    formed at the same time from its own thread, then each broadcasts its own value."""
    torch.set_num_threads(1)
    sockets_before = _sockets()
    ports = ctx.ports(count)  # rank 0 binds them all at once (port 0 each)
    before = (sockets_before, _threads())  # after the port exchange (its queue has a thread)
    python_threads = threading.active_count()

    def one(index: int) -> tuple[TorchGroup, bool]:
        spec = ctx.spec("standalone", port_index=index, group_id=f"{index:08x}{ctx.group_id}")
        group = TorchGroup.join(spec, ctx.listener(index))
        data = torch.full((4096,), index if ctx.rank == 0 else 255, dtype=torch.uint8)
        group.broadcast(data, src=0).wait()
        return group, bool((data == index).all())

    with ThreadPoolExecutor(count) as pool:
        formed = list(pool.map(one, range(count)))
    correct = [ok for _, ok in formed]
    groups = [group for group, _ in formed]  # alive until closed: close() must do the work
    for group in groups:
        group.close()
    deadline = time.monotonic() + 10  # native threads may take a moment to exit
    while time.monotonic() < deadline and (_sockets(), _threads()) > before:
        time.sleep(0.1)
    assert groups  # still referenced here
    return {
        "correct": correct,
        "ports": ports,
        "before": before,
        "after": (_sockets(), _threads()),
        "listening": _listening_ports(),
        "python_threads": (python_threads, threading.active_count()),
    }


def test_twenty_groups_form_at_once_and_leave_nothing_behind() -> None:
    results = run_ranks(many_groups_rank, 2, GROUPS, timeout_s=150)
    assert len(set(results[0]["ports"])) == GROUPS  # the kernel gave every group its own port
    for rank, result in enumerate(results):
        assert all(result["correct"]), f"rank {rank}: {result['correct']}"
        sockets, threads = result["after"]
        assert sockets <= result["before"][0], f"rank {rank} leaked sockets: {result}"
        assert threads <= result["before"][1], f"rank {rank} leaked threads: {result}"
        assert not result["listening"], f"rank {rank} still listens on {result['listening']}"
        assert result["python_threads"][1] <= result["python_threads"][0]
