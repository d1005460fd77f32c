"""Two edges of pushes from many senders, on real stores and real Gloo groups: a member reads
each lane's frames by push number, and the senders' own group forms among the trainer ranks
alone."""

from __future__ import annotations

import datetime
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import RankContext, run_ranks
from weight_sync import SyncConfig
from weight_sync.control.deadline import Deadline
from weight_sync.control.lane_store import BEGIN, COMMAND, Commands, Deaths, Verdicts
from weight_sync.control.store import PREFIX, ClientPlane
from weight_sync.errors import (
    SenderFailedError,
    TransportError,
    WeightSyncError,
    WorkerFailedError,
)
from weight_sync.receive.inbound import Inbound
from weight_sync.receive.member import Member
from weight_sync.receive.receiver import Receiver
from weight_sync.send.senders import Outbound, Senders
from weight_sync.transport import bind_listener
from weight_sync.transport.devices import CPU
from weight_sync.transport.rendezvous import open_store
from weight_sync.wire.blame import MemberGone

pytestmark = pytest.mark.timeout(120)


def _post(store: dist.Store, frames: list[tuple[str, dict]]) -> None:
    """A sender's commands, as ``lanes.Commands`` posts them (its store, the plane's prefix):
    each push's ``begin`` named under ``BEGIN`` too."""
    plane = dist.PrefixStore(PREFIX, store)
    for number, (op, arg) in enumerate(frames):
        if op == "begin":
            plane.set(f"{BEGIN}{arg['push']}", str(number))
        plane.set(f"{COMMAND}{number}", json.dumps({"op": op, "arg": arg}))


def test_a_member_skips_the_frames_of_a_push_it_gave_up_on() -> None:
    """Push 1 began only after this member had given up on it (its ``update`` would fail
    here, on a lane never initialised); asked for push 2, the member skips push 1 whole and
    ends with push 2's own word. Asked for an earlier push than the sender's next, it raises
    and leaves that push's frames for the receive that asks for it."""
    listener = bind_listener("127.0.0.1")
    port = listener.getsockname()[1]
    store = open_store("127.0.0.1", port, 1, 30, listener)
    _post(store, [
        ("begin", {"push": 1}),
        ("update", {"version": 1}),
        ("end", {"push": 1, "version": 1}),
        ("begin", {"push": 2}),
        ("end", {"push": 2, "error": "push 2 called off by the test"}),
        ("begin", {"push": 3}),
        ("end", {"push": 3, "error": "push 3 called off by the test"}),
    ])  # fmt: skip
    lane = Inbound("127.0.0.1", port, 1, lambda: CPU, 30)
    try:
        with pytest.raises(WeightSyncError, match="push 2 called off by the test"):
            lane.receive(10, push=2)
        with pytest.raises(WeightSyncError, match="began push 3, past push 2"):
            lane.receive(10, push=2)
        with pytest.raises(WeightSyncError, match="push 3 called off by the test"):
            lane.receive(10, push=3)  # push 3's frames were left for it
    finally:
        lane.member.shutdown()
        del lane, store


def test_old_pushes_leave_the_store_and_a_member_far_behind_skips_them() -> None:
    """A sender's commands of pushes two or more before the current one are deleted; a member
    that fell further behind (its next command deleted) starts from the push it is asked for,
    rather than wait for a key that will never come back."""
    out = Outbound(SyncConfig(push_timeout_s=30), receivers=1)
    for push in range(1, 6):
        out.commands.post("begin", {"push": push}, new_push=True)
        out.commands.post("end", {"push": push, "error": f"push {push} called off by the test"})
    store = dist.PrefixStore(PREFIX, open_store(*out.address, 1, 30, None))
    lane = Inbound(*out.address, 1, lambda: CPU, 30)
    try:
        # Pushes 4 and 5 stay: commands 6 to 9.
        assert [store.check([f"{COMMAND}{n}"]) for n in range(10)] == [False] * 6 + [True] * 4
        assert [store.check([f"{BEGIN}{push}"]) for push in range(1, 6)] == [False] * 3 + [True] * 2
        with pytest.raises(WeightSyncError, match="push 4 called off by the test"):
            lane.receive(10, push=4)  # this member's next command was 0, deleted long ago
    finally:
        lane.member.shutdown()
        out.close()


def test_a_member_new_to_a_lane_goes_straight_to_the_push_it_is_asked_for() -> None:
    """A member that joins a sender with history (a worker whose lanes were made again) reads
    from the push it is asked for, not from the floor: the sender deletes older commands as it
    begins each push, and a member still reading them then would wait for a key that never
    comes back (here: pushes 1 and 2 deleted after the floor was read, which still says 0)."""
    listener = bind_listener("127.0.0.1")
    port = listener.getsockname()[1]
    store = open_store("127.0.0.1", port, 1, 30, listener)
    _post(store, [
        ("begin", {"push": 1}),
        ("end", {"push": 1, "error": "push 1 called off by the test"}),
        ("begin", {"push": 2}),
        ("end", {"push": 2, "error": "push 2 called off by the test"}),
        ("begin", {"push": 3}),
        ("end", {"push": 3, "error": "push 3 called off by the test"}),
    ])  # fmt: skip
    plane = dist.PrefixStore(PREFIX, store)
    for number in range(4):
        plane.delete_key(f"{COMMAND}{number}")
    lane = Inbound("127.0.0.1", port, 1, lambda: CPU, 30)
    try:
        with pytest.raises(WeightSyncError, match="push 3 called off by the test"):
            lane.receive(10, push=3)
    finally:
        lane.member.shutdown()
        del lane, store


def test_rank_0_deletes_the_reports_of_settled_pushes() -> None:
    """The senders' reports and rank 0's verdict stay two pushes, then go; a lone sender's
    verdict, which nobody else reads, is never stored."""
    listener = bind_listener("127.0.0.1")
    store = open_store("127.0.0.1", listener.getsockname()[1], 1, 30, listener)
    verdicts, alone = Verdicts(store, senders=2), Verdicts(store, senders=1)
    for push in range(1, 6):
        outcome = {"nbytes": push, "buckets": 1, "wire": push}
        store.set(f"{push}/1", json.dumps(outcome))  # sender 1's report, as its client sets it
        assert verdicts.settle(push, 0, outcome, Deadline(10, "the test"))["nbytes"] == 2 * push
    held = [store.check([f"{push}/0", f"{push}/1", f"{push}/verdict"]) for push in range(1, 6)]
    assert held == [False, False, False, True, True]
    keys = store.num_keys()
    assert alone.settle(9, 0, {"nbytes": 9, "buckets": 1, "wire": 9}, Deadline(10, "the test"))
    assert store.num_keys() == keys


def test_a_lane_broken_by_a_worker_found_dead_on_another_raises_that_worker() -> None:
    """A receiving worker died mid-push: sender 0's lane found it dead, sender 1's broke first,
    naming no one. Sender 0 is blamed (its own error says more); sender 1 raises
    ``WorkerFailedError`` for the dead worker, not a ``SenderFailedError`` blaming rank 0."""
    listener = bind_listener("127.0.0.1")
    port = listener.getsockname()[1]
    store = open_store("127.0.0.1", port, 1, 30, listener)
    verdicts = Verdicts(store, senders=2)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(30))
    of_sender_1 = Verdicts(client, senders=2)  # a store client of its own, as each sender has
    found = {"error": "WorkerFailedError: push failed on 1 worker(s): worker 1: died",
             "broken": False, "dead": [1]}  # fmt: skip
    broken = {"error": "TransportError: a collective failed", "broken": True, "dead": []}
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(of_sender_1.settle, 7, 1, broken, Deadline(10, "the test"))
        with pytest.raises(SenderFailedError) as blamed:
            verdicts.settle(7, 0, found, Deadline(10, "the test"))
        with pytest.raises(WorkerFailedError) as raised:
            other.result(timeout=10)
    assert blamed.value.senders == [0]
    assert raised.value.workers == [1] and "worker 1: died" in str(raised.value)


def test_a_member_rank_0_found_dead_is_told_to_the_lane_of_another_sender() -> None:
    """Rank 0's call on a member found it dead (``Deaths.tell``): the lane of another sender,
    watching that push, fails what the member owes it at once, naming why (its own store cannot
    tell a dead member from a slow one); a death told of another push changes nothing there."""
    rank_0, other = [_lane_plane() for _ in range(2)]
    told = Deaths(rank_0)
    watching = Deaths(other, rank_0.address, 30)
    try:
        watching.watch(7)
        awaited = other.receive(3, atomic=False, timeout_s=30)  # its lane's round of push 7
        told.tell(6, [1], "actor died (an older push's)")
        time.sleep(0.5)  # several looks
        assert not any(answer.done() for answer in awaited)
        started = time.monotonic()
        told.tell(7, [2], "actor died (fault injection)")
        with pytest.raises(MemberGone, match="fault injection"):
            awaited[1].result(timeout=10)
        print(f"told in {time.monotonic() - started:.3f}s")
        assert not awaited[0].done()
        watching.watch(None)
    finally:
        watching.close()
        for plane in (rank_0, other):
            plane.close()


def _lane_plane() -> ClientPlane:
    """A sender's lane's plane, as ``Outbound`` makes it."""
    commands = Commands()
    commands.plane = plane = ClientPlane(commands, 2, SyncConfig())
    return plane


def _one_replica_pushes(ctx: RankContext) -> dict[str, object]:
    """A world of three ranks that make their groups together (as device meshes are made); only
    ranks 1 and 2 -- one replica of a hybrid-sharded trainer -- make a ``Senders``."""
    store = open_store("127.0.0.1", ctx.ports()[0], ctx.world_size, 30, ctx.listener(0))
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    replica = dist.new_group([1, 2])
    seen: dict[str, object] | None = None
    if ctx.rank in (1, 2):
        senders = Senders(SyncConfig(push_timeout_s=60), replica, lambda config: 1, "the test")
        try:
            seen = {"rank": senders.rank, "senders": senders.senders,
                    "endpoints": len(senders.endpoints),
                    "members": senders.members,
                    "word": senders.from_rank_0(lambda: 7)}  # fmt: skip
        finally:
            senders.close()
    # The world goes on making groups together: its ranks still name them alike (a group
    # made on some ranks only must not advance their count of groups).
    later = dist.new_group([0, 1, 2])
    total = torch.tensor([ctx.rank + 1])
    dist.all_reduce(total, group=later)
    dist.destroy_process_group()
    return {**(seen or {}), "total": int(total)}


def test_the_senders_group_forms_among_the_trainer_ranks_alone() -> None:
    results = run_ranks(_one_replica_pushes, 3, timeout_s=60)
    assert results[0] == {"total": 6}
    for rank in (1, 2):
        assert results[rank] == {
            "rank": rank - 1, "senders": 2, "endpoints": 2, "members": 1, "word": 7, "total": 6,
        }  # fmt: skip


def _a_sender_cannot_listen(ctx: RankContext) -> tuple[str, str, float]:
    """Two trainer ranks make a ``Senders``; rank 1's lane cannot listen (an address that is
    not this host's)."""
    store = open_store("127.0.0.1", ctx.ports()[0], ctx.world_size, 30, ctx.listener(0))
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    address = "127.0.0.1" if ctx.rank == 0 else "192.0.2.1"  # TEST-NET-1: on no host
    started = time.monotonic()
    try:
        Senders(SyncConfig(master_addr=address, push_timeout_s=60), None, lambda _: 1, "the test")
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - started
    finally:
        dist.destroy_process_group()
    return "nothing", "", time.monotonic() - started


def test_a_sender_that_cannot_listen_fails_every_sender_at_once() -> None:
    """Each sender's own error, and the others told before they wait for its endpoint: not
    at the senders' bound (60 s here)."""
    (kind, why, took), (own, own_why, own_took) = run_ranks(_a_sender_cannot_listen, 2)
    assert kind == TransportError.__name__ and "trainer rank 1 could not listen" in why, why
    assert own == TransportError.__name__ and "192.0.2.1" in own_why, own_why
    assert took < 20 and own_took < 20, (took, own_took)


def _a_receiving_rank_cannot_follow(ctx: RankContext) -> tuple[str, str, float]:
    """A job of two senders and two receiving ranks makes a ``JobSync``; rank 3 cannot follow
    the senders' lanes (fault injection: dialling their stores raises there)."""
    import weight_sync.launch.job_sync as torchrun
    from weight_sync.receive import member

    store = open_store("127.0.0.1", ctx.ports()[0], ctx.world_size, 30, ctx.listener(0))
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    if ctx.rank == 3:

        def cannot(*args: object, **kwargs: object) -> None:
            raise TransportError("the senders' stores are out of reach (fault injection)")

        member.Lanes = cannot  # type: ignore[assignment,misc]
    started = time.monotonic()
    try:
        sync = torchrun.JobSync(SyncConfig(rendezvous_timeout_s=60), senders=2)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - started
    finally:
        dist.destroy_process_group()
    sync.close()
    return "nothing", "", time.monotonic() - started


def test_a_receiving_rank_that_cannot_follow_the_lanes_fails_every_rank_at_once() -> None:
    """Rank 3 raises its own error; every other rank a ``TransportError`` naming it, before
    the job's next collective would have waited for it (60 s here)."""
    results = run_ranks(_a_receiving_rank_cannot_follow, 4)
    *others, (own, own_why, own_took) = results
    assert own == TransportError.__name__ and "fault injection" in own_why, own_why
    for kind, why, took in others:
        assert kind == TransportError.__name__ and "rank(s) [3] could not follow" in why, why
        assert took < 20, results
    assert own_took < 20, results


def _senders_after_one_closed(ctx: RankContext) -> int:
    """Two ``Senders`` on the same ranks (two pools of workers), the first closed, then a
    third made: its control group must be named apart from the second's, still alive."""
    store = open_store("127.0.0.1", ctx.ports()[0], ctx.world_size, 30, ctx.listener(0))
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    config = SyncConfig(push_timeout_s=30)
    first = Senders(config, None, lambda _: 1, "the test")
    second = Senders(config, None, lambda _: 1, "the test")
    first.close()
    third = Senders(config, None, lambda _: 1, "the test")
    try:
        return second.from_rank_0(lambda: 3) + third.from_rank_0(lambda: 4)
    finally:
        second.close()
        third.close()
        dist.destroy_process_group()


def test_senders_made_after_others_closed_form_their_own_group() -> None:
    """A closed ``Senders`` leaves its control group registered: unregistering it would name
    the next group made from these ranks like one still alive ("already created")."""
    assert run_ranks(_senders_after_one_closed, 2, timeout_s=60) == [7, 7]


def test_a_member_keeps_the_lanes_of_the_last_two_fronts() -> None:
    """A worker pushed to by two fronts in turn (one process's updater, every rank's) keeps
    both lane sets, each dialled once; a third front's lanes take the place of the least
    recently used, which are left; the senders' leaving lets theirs go."""
    listeners = [bind_listener("127.0.0.1") for _ in range(3)]
    ports = [listener.getsockname()[1] for listener in listeners]
    stores = [open_store("127.0.0.1", p, 1, 30, lis) for p, lis in zip(ports, listeners)]
    a, b, c = ([("127.0.0.1", port)] for port in ports)
    member = Member(Receiver(CPU))
    try:
        first = member.follow(a, 1, 30)
        second = member.follow(b, 1, 30)
        assert member.lanes is second and member.lanes_from(a) is first
        assert member.follow(a, 1, 30) is first and member.lanes is first  # not dialled again
        third = member.follow(c, 1, 30)  # b's lanes were the least recently used
        assert member.lanes_from(b) is None and second._closed and not first._closed
        assert member.lanes_from(a) is first and member.lanes_from(c) is third
        member.leave(a)  # a's senders closed
        assert member.lanes_from(a) is None and first._closed and member.lanes is third
        member.close()
        assert member.lanes is None and member.lanes_from(c) is None and third._closed
    finally:
        member.close()
        del stores
