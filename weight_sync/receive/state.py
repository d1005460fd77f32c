"""A worker's receive state machine: where its push stands, and which version it holds.

A push moves prepared -> receiving -> received -> (applying ->) committed, or back to idle when
it is cancelled before any byte moved, dropped with the group, or fails (its error kept for
``status``). A worker's version moves only on commit. The moment the first byte of a push may
reach the model, the worker stops claiming any version ("dirty") until a full push commits, so
it never reports a version whose weights it does not fully hold. With atomic staging no byte
reaches the model before commit, so a failed push leaves the old weights and the old version in
place.

A partial push (a subset of the tensors, announced as such) is accepted only on top of a
committed version; it moves ``version`` and leaves ``full_version`` -- the last push that covered
every tensor -- where it was, so the mix of versions is always stated, never silent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from weight_sync.delta.lineage import next_base
from weight_sync.errors import WeightSyncError
from weight_sync.receive.buckets import Staged
from weight_sync.wire.metadata import (
    Phase,
    PrepareRequest,
    ReceiveReport,
    StagingName,
    SyncPlan,
    SyncStatus,
)


@dataclass(frozen=True)
class Push:
    """A push this worker has accepted: what ``receive`` and ``commit`` will act on."""

    version: int
    plan: SyncPlan
    staging: StagingName
    checksum: bool
    partial: bool
    base: int | None  # full_version when prepared: what a partial push completes
    request: PrepareRequest  # its delta fields: built_on, new_base, delta, delta_bucket_bytes
    held: str | None  # delta_base when prepared
    in_place: bool  # every tensor of the push can be written in place (a delta can apply)
    # An atomic push's staging area, reserved when it was prepared (see buckets.staging_area).
    area: list[torch.Tensor] | None = None


class ReceiveState:
    """The versions a worker holds and the push it is in. Transitions only: what a push does
    to the bytes is ``weight_sync.receive.buckets``'s, and the checks before it are the
    Receiver's.

    Thread-safety: ``status`` may be called from another thread while a push runs (the
    actor's status concurrency group); it only reads attributes that are replaced whole.
    """

    def __init__(self) -> None:
        self.version: int | None = None  # committed version; None before the first / when dirty
        self.full_version: int | None = None  # the last committed push that covered everything
        self.dirty = False
        self.highest_version = 0  # highest version ever prepared: a new trainer starts above it
        # The trainer's base (see weight_sync.delta) these weights are bit for bit, if any.
        self.delta_base: str | None = None
        self._prepared: Push | None = None
        self._receiving: Push | None = None
        self._received: Push | None = None
        self._staged: Staged | None = None  # atomic staging: every bucket's bytes
        self._phase: Phase = "idle"
        self._progress = (0, 0)  # buckets done, of how many
        self._last: ReceiveReport | None = None
        self._last_error: str | None = None
        # How many times what the model holds changed: a push from many senders, whose lanes
        # each have a receiver of their own, tells by it whether anything else wrote the model
        # since its lanes did (``receive.inbound.Lanes``).
        self.changes = 0

    @property
    def prepared(self) -> Push | None:
        """The push prepared and not yet receiving, if any."""
        return self._prepared

    @property
    def staged(self) -> bool:
        """Whether a received push waits in the staging area for its commit."""
        return self._staged is not None

    def status(self, in_group: bool) -> SyncStatus:
        pushing = self._prepared or self._receiving or self._received
        done, total = self._progress
        return SyncStatus(
            version=self.version,
            full_version=self.full_version,
            dirty=self.dirty,
            phase=self._phase,
            pushing=pushing.version if pushing is not None else None,
            buckets_done=done,
            buckets_total=total,
            in_group=in_group,
            last=self._last,
            last_error=self._last_error,
        )

    def unprepare(self) -> None:
        """A new prepare begins: whatever it answers, the push prepared before is gone."""
        self._prepared = None

    def prepare(self, push: Push) -> None:
        self._prepared = push
        self.highest_version = max(self.highest_version, push.version)
        self._phase = "prepared"

    def cancel(self, version: int) -> None:
        """Drop prepared push ``version``; a push already receiving is not touched."""
        if self._prepared is not None and self._prepared.version == version:
            self._prepared, self._phase = None, "idle"

    def drop(self) -> None:
        """The group is gone: drop any push not yet committed (atomic: the old weights stay;
        streaming: the worker stays dirty)."""
        self._prepared, self._received, self._staged = None, None, None
        if self._phase in ("prepared", "received"):
            self._phase = "idle"

    def take_prepared(self) -> Push | None:
        """The prepared push, which a receive takes (or, when it is not the one, discards)."""
        push, self._prepared = self._prepared, None
        return push

    @contextmanager
    def receiving(self, push: Push) -> Iterator[None]:
        """``push`` is receiving for the duration; its progress counts its plan's buckets."""
        self._received, self._staged, self._receiving = None, None, push
        self._progress = (0, len(push.plan.buckets))
        self._phase = "receiving"
        try:
            yield
        finally:
            if self._receiving is push:
                self._receiving = None

    def expect(self, buckets: int) -> None:
        """The push sends ``buckets`` buckets after all (a delta's layouts, known from their
        headers: the sections' so far)."""
        self._progress = (self._progress[0], buckets)

    def advance(self) -> None:
        done, total = self._progress
        self._progress = (done + 1, total)

    def adopt(self, status: SyncStatus) -> None:
        """The model took a push by another route, which reports ``status``: hold what it says
        (versions, the push's buckets, last push, last error); whatever base these bytes were,
        they are not it any more."""
        self.version, self.full_version, self.dirty = (
            status.version,
            status.full_version,
            status.dirty,
        )
        self.delta_base = None
        self._progress = (status.buckets_done, status.buckets_total)
        self._last, self._last_error = status.last, status.last_error
        self.changes += 1

    def touch(self) -> None:
        """The model is about to change: until a commit, this worker holds no version."""
        self.version, self.full_version, self.dirty, self.delta_base = None, None, True, None
        self.changes += 1

    def stage(self, staged: Staged) -> None:
        self._staged = staged

    def received(self, push: Push, report: ReceiveReport) -> None:
        self._received, self._phase = push, "received"
        self._last = report

    def take_received(self, version: int) -> tuple[Push, Staged | None]:
        """The received push ``version`` and its staged bytes, for its commit. Raises
        ``WeightSyncError`` when this worker does not fully hold that push; either way nothing
        is left waiting for a commit."""
        push, staged = self._received, self._staged
        self._received, self._staged = None, None
        if push is None or push.version != version:
            held = push.version if push is not None else None
            self._phase = "idle"
            raise WeightSyncError(
                f"commit({version}) but this worker fully holds {held}; it keeps its state"
            )
        return push, staged

    def applying(self) -> None:
        """A staged push is being applied: the model changes from here on."""
        self._phase = "applying"
        self.touch()

    def commit(self, push: Push) -> None:
        """``push`` is in the model: claim its version, and the base its bytes now are."""
        self.version, self.dirty, self._phase = push.version, False, "idle"
        self.full_version = push.base if push.partial else push.version
        request = push.request
        self.delta_base = (
            next_base(push.held, request.built_on, request.new_base, not push.partial)
            if push.in_place
            else None
        )
        self._last_error = None
        self.changes += 1

    def fail(self, exc: BaseException) -> None:
        self._phase = "idle"
        self._last_error = f"{type(exc).__name__}: {exc}"[:1000]
