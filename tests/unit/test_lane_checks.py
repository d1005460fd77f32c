"""The members' check of a push before any byte moves, in rank 0's store
(``control.lane_store.Checks``), against a real ``TCPStore``: every member's answer read once
by slot, a silent one missing at the deadline or as soon as its call ended (its answer, set
late, deleted with its push's keys), rank 0's word to go ahead or not, and the layout posted once
per digest for the members that lack it."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from weight_sync.control.deadline import Deadline
from weight_sync.control.keys import KEPT_PUSHES
from weight_sync.control.lane_store import CHECKED, LAYOUT, Checks
from weight_sync.errors import SyncTimeoutError, WeightSyncError
from weight_sync.wire.lane_rules import layout_of


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def member(store: dist.TCPStore) -> Checks:
    """A member's end: a client of its own (a client serves one thread at a time)."""
    return Checks(dist.TCPStore("127.0.0.1", store.port, is_master=False))


def test_every_member_answers_by_slot_and_each_answer_is_read_once(store: dist.TCPStore) -> None:
    rank_0, members = Checks(store), [member(store) for _ in range(3)]
    threading.Timer(0.2, members[2].answer, args=(7, 3, ["a.weight: pushed [2], holds [3]"])).start()
    members[0].answer(7, 1, [])
    members[1].answer(7, 2, ["version 1 is not past 4"])
    began = time.monotonic()
    found = rank_0.answers(7, 3, Deadline(30, "test"))
    assert found == [[], ["version 1 is not past 4"], ["a.weight: pushed [2], holds [3]"]]
    assert time.monotonic() - began < 5  # once the last answered, not at the deadline
    assert not store.check([f"{CHECKED}7/{slot}" for slot in (1, 2, 3)])  # read once


def test_a_silent_member_is_missing_at_the_deadline_or_once_a_call_ended(
    store: dist.TCPStore,
) -> None:
    """Missing (None) when the deadline passed; with ``ended`` saying a member's call is over
    (it died or raised before answering), at once -- and an answer set meanwhile still read."""
    rank_0, answering = Checks(store), member(store)
    answering.answer(1, 1, [])
    began = time.monotonic()
    assert rank_0.answers(1, 2, Deadline(0.6, "test")) == [[], None]
    assert 0.5 < time.monotonic() - began < 5
    answering.answer(2, 1, [])
    began = time.monotonic()
    assert rank_0.answers(2, 2, Deadline(30, "test"), ended=lambda: True) == [[], None]
    assert time.monotonic() - began < 5  # not the 30 s


def test_an_answer_set_after_rank_0_stopped_looking_goes_with_its_push(
    store: dist.TCPStore,
) -> None:
    """A late member's answer, never read, stays only while its push's keys do (``KEPT_PUSHES``
    pushes), as rank 0's words do: a loop pushing for days past a member that is always late
    leaves no key behind."""
    rank_0, late = Checks(store), member(store)
    assert rank_0.answers(1, 1, Deadline(0.1, "test")) == [None]
    late.answer(1, 1, ["too late"])
    for push in range(2, 2 + KEPT_PUSHES):
        late.answer(push, 1, [])
        assert rank_0.answers(push, 1, Deadline(5, "test")) == [[]]
        assert store.check([f"{CHECKED}1/1"]) == (push < 1 + KEPT_PUSHES)


def test_an_answer_that_is_no_list_of_problems_is_one(store: dist.TCPStore) -> None:
    store.set(f"{CHECKED}3/1", "not json")
    store.set(f"{CHECKED}3/2", '{"a": 1}')
    found = Checks(store).answers(3, 2, Deadline(5, "test"))
    assert found[0] is not None and found[1] is not None
    [first], [second] = found[0], found[1]
    assert first.startswith("an answer that is no list of problems") and "not json" in first
    assert second.startswith("an answer that is no list of problems")


def test_a_layout_is_posted_once_per_digest_and_read_within_the_limit(
    store: dist.TCPStore,
) -> None:
    rank_0, reading = Checks(store), member(store)
    layout = layout_of([("w", torch.zeros(4, 3))], [0])
    rank_0.post_layout(layout)
    store.delete_key(f"{LAYOUT}{layout.digest}")
    rank_0.post_layout(layout)  # posted already: not again
    assert not store.check([f"{LAYOUT}{layout.digest}"])
    other = layout_of([("w", torch.zeros(5, 3))], [0])
    rank_0.post_layout(other)
    assert reading.layout(other.digest, 1 << 20) == other.wire
    with pytest.raises(WeightSyncError, match="exceeds"):
        reading.layout(other.digest, 8)
