"""How a sync group ends, on real Gloo ranks: a close from another thread, the trainer leaving
while members wait, a per-op bound counted from when the op could start, a new group after an
aborted one. The same code paths serve NCCL (see weight_sync.transport.torch_group); the NCCL
specifics are in tests/gpu/test_nccl.py."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest
import torch

from tests.distributed.harness import RankContext, run_ranks
from weight_sync.errors import SyncTimeoutError, WeightSyncError
from weight_sync.transport import TorchGroup

pytestmark = pytest.mark.timeout(120)

LONG_S = 30  # collective_timeout_s: nothing below may wait for it


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()


def close_from_another_thread_rank(ctx: RankContext, mode: str) -> dict:
    """Rank 1 waits in a broadcast that rank 0 never sends; its main thread closes the group."""
    group = TorchGroup.join(ctx.spec(mode, collective_timeout_s=LONG_S), ctx.listener(0))
    if ctx.rank == 0:
        time.sleep(3)  # never sends; stays alive well past the member's close
        group.close()
        return {}
    work = group.broadcast(torch.zeros(1 << 16, dtype=torch.uint8), src=0)
    raised: dict = {}

    def waiter() -> None:
        try:
            work.wait()
            raised["what"] = "returned"
        except Exception as exc:
            raised["what"] = type(exc).__name__
        raised["at"] = time.monotonic()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)  # the waiter is inside its wait now
    started = time.monotonic()
    group.close()
    close_s = time.monotonic() - started
    thread.join(5)
    return {
        "close_s": close_s,
        "what": raised.get("what"),
        "raised_after_s": raised["at"] - started,
    }


@pytest.mark.parametrize("mode", ["standalone", "world"])
def test_close_from_another_thread_returns_at_once_and_ends_the_wait(mode: str) -> None:
    _, member = run_ranks(close_from_another_thread_rank, 2, mode)
    assert member["what"] == "TransportError", member
    # "At once": without the close the wait would end at rank 0's close (3 s) or the
    # collective's bound (30 s). The close itself took 0.20 s once in CI with the suite running
    # beside it on a slow day (a fixed loop 2.2x its usual time), so 1 s, not 0.1.
    assert member["close_s"] < 1.0, member
    assert member["raised_after_s"] < 0.5, member


def trainer_leaves_rank(ctx: RankContext, mode: str, how: str) -> dict:
    """Members wait in a broadcast the trainer never posts; the trainer leaves after a second,
    cleanly (``close``) or on a failure path (``abort``), and stays alive afterwards."""
    group = TorchGroup.join(ctx.spec(mode, collective_timeout_s=LONG_S), ctx.listener(0))
    if ctx.rank == 0:
        time.sleep(1.0)
        left_at = time.time()
        group.close() if how == "close" else group.abort("the push failed")
        time.sleep(4)  # alive: neither process exit nor a closed socket is what tells them
        return {"left_at": left_at}
    work = group.broadcast(torch.zeros(1 << 16, dtype=torch.uint8), src=0)
    try:
        work.wait()
        what = "returned"
    except Exception as exc:
        what = type(exc).__name__
    raised_at = time.time()
    group.close()
    return {"what": what, "raised_at": raised_at}


@pytest.mark.parametrize(("mode", "how"), [("standalone", "close"), ("world", "close"),
                                           ("standalone", "abort")])  # fmt: skip
def test_members_stop_at_once_when_the_trainer_leaves(mode: str, how: str) -> None:
    trainer, *members = run_ranks(trainer_leaves_rank, 3, mode, how)
    for member in members:
        assert member["what"] == "TransportError", member
        # collective_timeout_s is 30 s; the abort key is read within _LOOK_EVERY_S.
        assert member["raised_at"] - trainer["left_at"] < 1.0, (trainer, member)


def pipelined_bound_rank(ctx: RankContext) -> list[str]:
    """The member posts two broadcasts at once, each bounded at 2 s; the trainer sends them 1.5 s
    apart. The second is on time counted from the first's completion, late counted from its
    posting: it must succeed. A third, never sent, times out at its own bound."""
    group = TorchGroup.join(ctx.spec("standalone", collective_timeout_s=LONG_S), ctx.listener(0))
    buffers = [torch.full((4096,), i, dtype=torch.uint8) for i in range(1, 3)]
    outcomes = []
    try:
        if ctx.rank == 0:
            for buffer in buffers:
                time.sleep(1.5)
                group.broadcast(buffer, src=0, timeout_s=2.0).wait()
            time.sleep(4)  # the third broadcast is never sent
            return outcomes
        works = [group.broadcast(torch.zeros(4096, dtype=torch.uint8), 0, 2.0) for _ in buffers]
        for work in works:
            work.wait()
            outcomes.append("ok")
        started = time.monotonic()
        try:
            group.broadcast(torch.zeros(16, dtype=torch.uint8), 0, timeout_s=1.0).wait()
        except SyncTimeoutError:
            outcomes.append(f"{time.monotonic() - started:.3f}")
        return outcomes
    finally:
        group.close()


def test_each_bound_counts_from_when_the_op_could_start() -> None:
    _, member = run_ranks(pipelined_bound_rank, 2)
    assert member[:2] == ["ok", "ok"]
    assert 1.0 <= float(member[2]) < 1.5, member  # timed out at its own bound


def rejoin_after_abort_rank(ctx: RankContext) -> dict:
    """A member's broadcast times out (the trainer never sends), which aborts the group; then
    both form a new group in the same processes and broadcast bit-exactly."""
    ctx.ports(2)
    first = TorchGroup.join(ctx.spec("standalone", collective_timeout_s=LONG_S), ctx.listener(0))
    result: dict = {}
    if ctx.rank == 0:
        time.sleep(2.5)  # sends nothing; leaves cleanly once the member has given up
        first.close()
    else:
        started = time.monotonic()
        try:
            first.broadcast(torch.zeros(1024, dtype=torch.uint8), 0, timeout_s=1.0).wait()
        except SyncTimeoutError:
            result["timed_out_after_s"] = time.monotonic() - started
        first.close()  # already aborted: a no-op
    spec = ctx.spec("standalone", port_index=1, group_id=ctx.group_id[::-1])
    second = TorchGroup.join(spec, ctx.listener(1))
    try:
        seeded = torch.Generator().manual_seed(5)
        payload = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=seeded)
        buffer = payload.clone() if ctx.rank == 0 else torch.zeros_like(payload)
        second.broadcast(buffer, src=0).wait()
        result["digest"] = digest(buffer)
        result["vote"] = second.vote(ctx.rank + 1)
    finally:
        second.close()
    return result


def test_a_process_forms_a_new_group_after_an_aborted_one() -> None:
    trainer, member = run_ranks(rejoin_after_abort_rank, 2)
    assert 1.0 <= member["timed_out_after_s"] < 1.5, member
    assert member["digest"] == trainer["digest"]
    assert member["vote"] == trainer["vote"] == 2


def failed_exchange_kept_rank(ctx: RankContext, when: str) -> dict:
    """Rank 0 sends rank 2 a bucket rank 2 never takes; rank 1 dies, which fails rank 2's
    receive from it -- ``when`` "waiting": while rank 2 waits on it; "posting": as rank 2 posts
    it, in a batch after a receive from rank 0 that is posted -- and the group aborts there.
    Rank 2 keeps the error, as a lane keeps its failure until its sender's push ends: its
    traceback must not keep the group's connections open, or rank 0's send waits out its 30 s
    bound rather than failing as rank 2 leaves it."""
    group = TorchGroup.join(ctx.spec("standalone", collective_timeout_s=LONG_S), ctx.listener(0))
    # Every rank's group formed before rank 1 dies: join returns on rank 1 once its own side of
    # Gloo's full mesh is up, possibly before rank 2's (CI saw rank 2's join fail that way).
    group.vote(0)
    started = time.monotonic()
    if ctx.rank == 1:
        time.sleep(1.0 if when == "waiting" else 0.0)
        os._exit(9)
    kept: list[BaseException] = []
    where = "post"  # where it failed, if it did
    try:
        if ctx.rank == 0:
            buckets = [(torch.ones(1 << 16, dtype=torch.uint8), 2) for _ in range(2)]
            work = group.exchange(buckets, [])
        elif when == "waiting":
            work = group.exchange([], [(torch.empty(1 << 16, dtype=torch.uint8), 1)])
        else:
            time.sleep(1.0)  # rank 1 is gone: its receive fails as it is posted
            takes = [(torch.empty(1 << 16, dtype=torch.uint8), peer) for peer in (0, 1)]
            work = group.exchange([], takes)
        where = "wait"
        work.wait()
        what = "returned"
    except WeightSyncError as exc:
        kept.append(exc)
        what = type(exc).__name__
    ended = time.monotonic() - started
    if ctx.rank == 2:
        time.sleep(3)  # alive, the error kept, while rank 0 waits
    group.close()
    return {"what": what, "where": where, "seconds": ended}


@pytest.mark.parametrize("when", ["waiting", "posting"])
def test_an_error_kept_after_a_failed_exchange_does_not_hold_the_group_open(when: str) -> None:
    trainer, _, member = run_ranks(failed_exchange_kept_rank, 3, when, expect_dead={1})
    assert member["what"] == "TransportError", member
    assert member["where"] == when[:4], member
    assert trainer["what"] == "TransportError", trainer
    # Not rank 2 leaving at 4 s, nor the 30 s bound: 1.02-1.04 s beside a 2-process CPU hog
    # (2026-12-02, eight runs).
    assert trainer["seconds"] < 2.5, trainer
