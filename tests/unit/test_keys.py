"""A store's keys (``weight_sync.control.keys``), against a real ``TCPStore``: the three ways a
wait ends -- the keys are there, the deadline passed, the store's process is gone -- told apart,
keys read once deleted, and those kept for a push's readers deleted once newer pushes posted
theirs (``Retention``)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from weight_sync.control.deadline import Deadline
from weight_sync.control.keys import (
    Retention,
    StoreGoneError,
    read_bounded,
    take,
    wait_all,
    wait_one,
)
from weight_sync.errors import SyncTimeoutError, WeightSyncError


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_a_wait_returns_once_every_key_is_set(store: dist.TCPStore) -> None:
    """As soon as the last key is set by another client (a client is used by one thread at a
    time: a wait holds it), not at the deadline."""
    other = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    threading.Timer(0.2, other.set, args=("b", "2")).start()
    store.set("a", "1")
    began = time.monotonic()
    assert wait_all(store, ["a", "b"], Deadline(30, "test")) == {"a": b"1", "b": b"2"}
    assert time.monotonic() - began < 20
    assert wait_one(store, "b", Deadline(30, "test")) == b"2"


def test_at_the_deadline_a_wait_returns_the_keys_set_and_a_single_key_raises(
    store: dist.TCPStore,
) -> None:
    store.set("a", "1")
    began = time.monotonic()
    assert wait_all(store, ["a", "never"], Deadline(0.5, "test")) == {"a": b"1"}
    assert time.monotonic() - began >= 0.5
    with pytest.raises(SyncTimeoutError, match="budget"):
        wait_one(store, "never", Deadline(0.3, "test"))


def test_keys_taken_are_deleted_whether_set_or_not(store: dist.TCPStore) -> None:
    store.set("b", "2")
    assert take(store, ["b", "never"]) == {"b": b"2"}
    assert not store.check(["b"]) and take(store, ["b"]) == {}


def test_a_control_message_past_its_limit_is_refused(store: dist.TCPStore) -> None:
    store.set("m", "x" * 17)
    assert read_bounded(store, "m", 17) == "x" * 17
    with pytest.raises(WeightSyncError, match="exceeds 16"):
        read_bounded(store, "m", 16)


@pytest.mark.timeout(60)
def test_a_store_whose_process_died_ends_the_wait_at_once() -> None:
    """Not at the deadline: the connection closes with the process, and the wait says so."""
    script = (
        "import time, torch.distributed as d\n"
        "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
        "print(s.port, flush=True)\n"
        "time.sleep(600)\n"
    )
    host = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, is_master=False)
        threading.Timer(0.5, host.kill).start()
        began = time.monotonic()
        with pytest.raises(StoreGoneError, match="stopped answering"):
            wait_one(client, "never", Deadline(30, "test"))
        assert time.monotonic() - began < 20
    finally:
        host.kill()
        host.wait(10)


# Generations posted in order (each a list of (generation, keys)), how many are kept, and the
# keys deleted after each post.
RETAINED = [
    ([(1, ["a"]), (2, ["b"]), (3, ["c"])], 2, [[], [], ["a"]]),
    ([(1, ["a"]), (1, ["a2"]), (2, ["b"]), (3, ["c"])], 2, [[], [], [], ["a", "a2"]]),
    ([(1, ["a"]), (2, ["b"]), (1, ["a3"]), (3, ["c"])], 2, [[], [], [], ["a", "a3"]]),
    ([(1, ["a"]), (2, ["b"]), (3, ["c"]), (4, ["d"])], 1, [[], ["a"], ["b"], ["c"]]),
    ([("x", ["p/x"]), ("y", ["p/y"]), ("x", []), ("z", ["p/z"])], 2, [[], [], [], ["p/x"]]),
]  # fmt: skip


@pytest.mark.parametrize(("posts", "kept", "deleted"), RETAINED)
def test_a_generation_past_those_kept_deletes_the_oldest_ones_keys(
    posts: list[tuple[object, list[str]]], kept: int, deleted: list[list[str]]
) -> None:
    """Keys posted for a generation still kept join it; a new generation past ``kept`` takes
    the oldest one's keys with it, every key it was given -- the oldest by first post, not by
    last use (a plan used again is posted again once gone)."""
    gone: list[list[str]] = []
    retention = Retention(lambda key, value: None, gone.append, kept)
    for (generation, keys), want in zip(posts, deleted, strict=True):
        before = len(gone)
        retention.posted(generation, keys)
        assert (gone[before] if len(gone) > before else []) == want
        assert generation in retention


def test_retention_deletes_from_a_real_store(store: dist.TCPStore) -> None:
    retention = Retention.in_store(store, kept=1)
    retention.post(1, "cmd/0", "x")
    retention.posted(1, ["cmd/never-set"])  # a key never set is no error when it goes
    retention.post(2, "cmd/1", "y")
    assert not store.check(["cmd/0"]) and store.get("cmd/1") == b"y"
