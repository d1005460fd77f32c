"""Keys of a ``torch.distributed`` store: the one way the store-based planes wait on them, and
the one way the keys a push leaves for others go (``Retention``; an answer read once goes with
``take``).

A store's ``wait`` blocks in C++ until every key it is given is set, and ends in one of three
ways the callers must tell apart: the keys are there; its timeout passed (``DistStoreError``:
someone never wrote -- late, frozen or dead); or the store's own process is gone
(``DistNetworkError``, or another ``RuntimeError`` from a closed socket: whoever hosted it died
or left). Every wait here is bounded by the caller's ``Deadline``, cut into waits of at most a
day (a store's timeout is a ``timedelta`` the C++ side holds in milliseconds).

A ``TCPStore`` client serves one call at a time: while one thread waits, another thread's
``set`` on the same client waits behind it. Each party of a push therefore waits on a client of
its own; the trainer's reply mailbox (``control.store``) does not wait here at all -- it polls
many keys from one thread under the lock every post takes, and a blocking wait would hold it.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch.distributed as dist

from weight_sync.control.deadline import Deadline
from weight_sync.errors import SyncTimeoutError, WeightSyncError, first_line

LONGEST_WAIT_S = 86400.0  # one store wait; a longer deadline waits again
KEPT_PUSHES = 2  # pushes whose keys stay in a store: a member one push behind still finds them
KEPT_PLANS = 4  # distinct plans (layouts) kept in a store; one gone is posted again when used


class StoreGoneError(WeightSyncError):
    """The store's process is gone (its host died or left) while a key was awaited. Internal:
    each caller says whose store it was, and what that means for its push."""


def wait_all(store: Any, keys: Sequence[str], deadline: Deadline) -> dict[str, bytes]:
    """The values of ``keys`` once every one is set, or of those set when ``deadline`` is spent
    (the others are missing: whoever writes them is late or dead -- the caller names them).
    Raises ``StoreGoneError`` if the store's process is gone."""
    try:
        while True:
            try:
                store.wait(list(keys), _left(deadline))
            except SyncTimeoutError:  # the deadline was spent before this wait
                break
            except dist.DistStoreError:  # this wait timed out: the next ``_left`` says if spent
                continue
            # Every key is set: read at once, one round trip (not a look and a read per key,
            # which a loaded host pays for in context switches on every step of every push).
            return dict(zip(keys, store.multi_get(list(keys)), strict=True))
        return _read(store, keys)  # the deadline's: those set, each looked for
    except RuntimeError as exc:
        raise StoreGoneError(f"the store stopped answering ({first_line(exc)})") from exc


def wait_one(store: Any, key: str, deadline: Deadline) -> bytes:
    """``key``'s value once it is set. Raises ``SyncTimeoutError`` (the deadline's own) when it
    was not set in time, ``StoreGoneError`` if the store's process is gone."""
    value = wait_all(store, [key], deadline).get(key)
    if value is None:
        deadline.left(0.0)  # raises: spent
        raise AssertionError("wait_all returned before the deadline without the key")
    return value


def take(store: Any, keys: Sequence[str]) -> dict[str, bytes]:
    """The values of those of ``keys`` that are set, and every one of ``keys`` deleted: an
    answer is read once, and a loop pushing for days leaves no key behind. Never waits."""
    values = _read(store, keys)
    delete(store, keys)
    return values


def delete(store: Any, keys: Sequence[str]) -> None:
    """Delete ``keys`` (those not set are no error)."""
    for key in keys:
        store.delete_key(key)


def read_bounded(store: Any, key: str, limit: int) -> str:
    """A control message set before it is asked for (no wait), refused past ``limit`` bytes."""
    value = store.get(key).decode()
    if len(value) > limit:
        raise WeightSyncError(f"control message {key!r} of {len(value)} bytes exceeds {limit}")
    return str(value)


def _read(store: Any, keys: Sequence[str]) -> dict[str, bytes]:
    return {key: store.get(key) for key in keys if store.check([key])}


def _left(deadline: Deadline) -> datetime.timedelta:
    return datetime.timedelta(seconds=deadline.left(LONGEST_WAIT_S))


class Retention:
    """The keys a store holds for its readers, by generation (a push by its number, a plan by
    its digest): those of the last ``kept`` generations stay, an older one's are deleted as a
    new one is posted. A loop pushing for days leaves no key behind, while a member a push late
    still finds its own. ``put`` sets a key and ``delete`` removes keys, each under whatever
    lock its owner's other uses of the store take."""

    def __init__(
        self,
        put: Callable[[str, str], None],
        delete: Callable[[list[str]], None],
        kept: int = KEPT_PUSHES,
    ) -> None:
        assert kept >= 1, "a store keeps at least the generation in use"
        self._put, self._delete, self._kept = put, delete, kept
        self._keys: dict[Hashable, list[str]] = {}  # by generation, the oldest first

    @classmethod
    def in_store(cls, store: Any, kept: int = KEPT_PUSHES) -> Retention:
        """Over a store used by one thread (no lock of its owner's to take)."""
        return cls(store.set, functools.partial(delete, store), kept)

    def __contains__(self, generation: Hashable) -> bool:
        return generation in self._keys

    def post(self, generation: Hashable, key: str, value: str) -> None:
        """Set ``key`` for ``generation`` (see ``posted``)."""
        self._put(key, value)
        self.posted(generation, [key])

    def posted(self, generation: Hashable, keys: Sequence[str]) -> None:
        """``keys`` were set for ``generation`` (by other clients too: every sender reports in
        rank 0's store); a new generation past ``kept`` takes the oldest one's keys with it."""
        if generation in self._keys:
            self._keys[generation].extend(keys)
            return
        self._keys[generation] = list(keys)
        while len(self._keys) > self._kept:
            self._delete(self._keys.pop(next(iter(self._keys))))
