"""NCCL failure semantics on one GPU (skipped where there is none; see tests/conftest.py).

Runs as written on a machine with one NVIDIA GPU, a CUDA build of torch and no Ray: nothing
here imports Ray, directly or through tests.distributed.harness. Every NCCL group lives in a
spawned rank (``run_ranks``), so a process killed by a watchdog shows as a rank that never
reported, not as a dead pytest.

    pytest -m gpu tests/gpu/test_nccl.py -v
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import RankContext, repo_env, run_ranks
from weight_sync.errors import SyncTimeoutError, TransportError
from weight_sync.transport import TorchGroup, teardown
from weight_sync.transport.nccl import judge, local_report
from weight_sync.transport.rendezvous import open_store
from weight_sync.transport.torch_group import TorchWork

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

DEVICE = torch.device("cuda", 0)
ALIVE_FOR_S = 75  # past the ~60 s after which a default watchdog std::terminates the process


def gpu_sleep(seconds: float) -> None:
    """Keep the current stream of DEVICE busy for about ``seconds`` (a spin kernel)."""
    with torch.cuda.device(DEVICE):
        khz = getattr(torch.cuda.get_device_properties(DEVICE), "clock_rate", 0) or 2_000_000
        torch.cuda._sleep(int(seconds * khz * 1000))


def random_bytes(seed: int, n: int = 1 << 22) -> torch.Tensor:
    """A payload on DEVICE, made and synchronised before anything else is queued: a pageable
    host-to-device copy synchronises the stream, so made after a spin kernel it would wait the
    spin out on the host, and a collective posted after it would find an idle GPU."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator).to(DEVICE)
    torch.cuda.synchronize(DEVICE)
    return data


def post_behind_a_spin(group: TorchGroup, payload: torch.Tensor, seconds: float) -> TorchWork:
    """Queue a spin kernel of ``seconds``, then post a broadcast of ``payload`` behind it (the
    NCCL stream waits on the current one); assert that the host got here before the spin
    ended and that the broadcast was not complete when posted -- else the test tests nothing."""
    queued = time.monotonic()
    gpu_sleep(seconds)
    work = group.broadcast(payload, src=0)
    assert time.monotonic() - queued < seconds / 2, "the host waited for the spin kernel"
    assert not work.finished(time.monotonic()), "the broadcast was complete when posted"
    return work


def push_once(group: TorchGroup, seed: int) -> bool:
    """A one-rank "push": broadcast a buffer, order a kernel after it without a host wait
    (``after``), wait, vote. True if every byte is what was sent."""
    sent = random_bytes(seed)
    buffer = sent.clone()
    work = group.broadcast(buffer, src=0)
    work.after()
    copy = buffer.clone()  # queued on the current stream after the collective
    work.wait()
    same = bool(torch.equal(copy, sent))
    return same and group.vote(7) == 7


def one_rank_rank(ctx: RankContext, mode: str) -> list[bool]:
    ctx.ports(2)
    outcomes = []
    for index in range(2):  # join, push, close; then again: a process rejoins
        spec = ctx.spec(mode, port_index=index, world_size=1, backend="nccl",
                        group_id=f"{ctx.group_id}{index:02x}")  # fmt: skip
        group = TorchGroup.join(spec, ctx.listener(index), DEVICE)
        try:
            outcomes.append(group.device == DEVICE and push_once(group, seed=index))
        finally:
            group.close()
    return outcomes


@pytest.mark.parametrize("mode", ["standalone", "world"])
def test_one_rank_nccl_group_broadcasts_votes_closes_and_rejoins(mode: str) -> None:
    [outcomes] = run_ranks(one_rank_rank, 1, mode, timeout_s=180)
    assert outcomes == [True, True]


def timeout_rank(ctx: RankContext) -> dict:
    """The process first lives in a "user's world" of its own (NCCL, default environment:
    watchdog and heartbeat monitor on). Our group's collective is made to time out; the process
    must still be alive ALIVE_FOR_S later, its world still working, and a new group must push."""
    ctx.ports(3)
    world_store = open_store("127.0.0.1", ctx.ports()[2], 1, 30, ctx.listener(2))
    dist.init_process_group("nccl", store=world_store, rank=0, world_size=1, device_id=DEVICE,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    probe = torch.ones(1, device=DEVICE)
    dist.all_reduce(probe)
    result: dict = {}
    spec = ctx.spec("standalone", world_size=1, backend="nccl", collective_timeout_s=2)
    group = TorchGroup.join(spec, ctx.listener(0), DEVICE)
    payload = random_bytes(1)
    started = time.monotonic()
    work = post_behind_a_spin(group, payload, 10)  # the NCCL stream waits behind the spin
    try:
        work.wait()
        result["outcome"] = "returned"
    except SyncTimeoutError:
        result["outcome"] = "SyncTimeoutError"
    result["raised_after_s"] = time.monotonic() - started
    group.close()
    time.sleep(ALIVE_FOR_S)
    dist.all_reduce(probe)  # the user's world is unharmed
    torch.cuda.synchronize(DEVICE)
    result["world_ok"] = probe.item() == 1.0
    dist.destroy_process_group()
    spec = ctx.spec("standalone", port_index=1, world_size=1, backend="nccl",
                    group_id=ctx.group_id[::-1])  # fmt: skip
    again = TorchGroup.join(spec, ctx.listener(1), DEVICE)
    try:
        result["pushed"] = push_once(again, seed=2)
    finally:
        again.close()
    return result


def test_a_timed_out_collective_raises_and_leaves_the_process_alive() -> None:
    [result] = run_ranks(timeout_rank, 1, timeout_s=ALIVE_FOR_S + 120)
    assert result["outcome"] == "SyncTimeoutError"
    assert 2.0 <= result["raised_after_s"] < 3.0, result
    assert result["world_ok"] and result["pushed"], result


def close_from_another_thread_rank(ctx: RankContext) -> dict:
    spec = ctx.spec("standalone", world_size=1, backend="nccl", collective_timeout_s=60)
    group = TorchGroup.join(spec, ctx.listener(0), DEVICE)
    work = post_behind_a_spin(group, random_bytes(3), 5)
    raised: dict = {}

    def waiter() -> None:
        try:
            work.wait()
            raised["what"] = "returned"
        except TransportError:
            raised["what"] = "TransportError"
        raised["at"] = time.monotonic()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    started = time.monotonic()
    group.close()
    close_s = time.monotonic() - started
    thread.join(10)
    torch.cuda.synchronize(DEVICE)  # the spin kernel ends; nothing hangs behind the abort
    return {
        "close_s": close_s,
        "what": raised.get("what"),
        "raised_after_s": raised["at"] - started,
    }


def test_close_from_another_thread_during_a_posted_op_returns_at_once() -> None:
    [result] = run_ranks(close_from_another_thread_rank, 1, timeout_s=120)
    assert result["what"] == "TransportError", result
    assert result["close_s"] < 0.1, result
    assert result["raised_after_s"] < 0.2, result


def test_the_check_in_report_names_this_gpu_and_refuses_sharing_it() -> None:
    report = local_report(DEVICE)
    assert len(report.gpu) >= 32 and report.nccl.count(".") >= 2  # a UUID; major.minor.patch
    verdict = judge({0: report, 1: report}, 2)
    assert not verdict.ok and verdict.ranks == (1,)


# A process that times out a push and exits at once: the abort's thread is still inside
# ProcessGroupNCCL::abort (waiting for ncclCommAbort behind the spin) when the main thread ends.
EXIT_AFTER_TIMEOUT = """
import sys, time
import torch
from tests.gpu.test_nccl import DEVICE, post_behind_a_spin, random_bytes
from weight_sync.errors import SyncTimeoutError
from weight_sync.wire.metadata import GroupSpec
from weight_sync.transport import TorchGroup, bind_listener, teardown
teardown.EXIT_WAIT_S = {exit_wait_s}
listener = bind_listener("127.0.0.1")
spec = GroupSpec(group_id="5eed" * 4, address="127.0.0.1", port=listener.getsockname()[1],
                 world_size=1, rank=0, backend="nccl", mode="standalone",
                 rendezvous_timeout_s=60, collective_timeout_s=2)
group = TorchGroup.join(spec, listener, DEVICE)
work = post_behind_a_spin(group, random_bytes(1), {spin_s})
try:
    work.wait()
    sys.exit("the broadcast returned")
except SyncTimeoutError:
    pass
group.close()
print("closed; running:", teardown.running(), flush=True)
"""


@pytest.mark.parametrize(("spin_s", "exit_wait_s", "waited"), [(5, 10, True), (20, 2, False)])
def test_a_process_exits_cleanly_right_after_a_timed_out_close(
    spin_s: float, exit_wait_s: float, waited: bool
) -> None:
    """Never std::terminate: the exit waits for the abort (which ends with the spin, within
    the bound) and exits 0, or, past the bound, names it and ends the process at once with
    teardown.FORCED_EXIT_STATUS."""
    code = EXIT_AFTER_TIMEOUT.format(spin_s=spin_s, exit_wait_s=exit_wait_s)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=repo_env(), capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    took = time.monotonic() - started
    expected = 0 if waited else teardown.FORCED_EXIT_STATUS
    assert done.returncode == expected, (done.returncode, done.stdout, done.stderr)
    assert "closed; running: ['weight-sync-abort(" in done.stdout, done.stdout
    assert "terminate called" not in done.stderr, done.stderr
    if waited:
        assert "teardowns still running" not in done.stderr, done.stderr
    else:
        assert "teardowns still running after 2." in done.stderr, done.stderr
        assert "s: weight-sync-abort(" in done.stderr, done.stderr
        assert took < spin_s, took
