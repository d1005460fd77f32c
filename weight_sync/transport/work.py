"""A collective in flight on a ``TorchGroup`` (``TorchWork``), and Gloo's point-to-point works
of one ``exchange`` waited on as one (``GlooBatch``). The loop that waits on them within
their bounds is ``TorchGroup._settle``.
"""

from __future__ import annotations

import datetime
import time
import weakref
from typing import TYPE_CHECKING, cast

import torch.distributed as dist

from weight_sync.errors import (
    TransportError,
    WeightSyncError,
)

if TYPE_CHECKING:
    from weight_sync.transport.torch_group import TorchGroup


class TorchWork:
    """A collective in flight on a ``TorchGroup``.

    A Gloo work handle keeps the group's connections alive, so a handle lingering in an
    exception's traceback would keep peers blocked on us until their timeout instead of failing
    at once. The handle is therefore dropped as soon as it has been waited on, and by
    ``TorchGroup.close`` for handles nobody waited on.
    """

    def __init__(
        self,
        group: TorchGroup,
        work: dist.Work,
        bound_s: float,
        seq: int,
        previous: TorchWork | None,
        collectives: int,
    ) -> None:
        self._group = group
        self.seq = seq  # this process's posting order: ops on a group end in it
        # The group's collectives posted up to this op, the same count on every rank (1 for the
        # first); point-to-point batches (``exchange``) differ across ranks and are not counted.
        self.collectives = collectives
        self._work: dist.Work | None = work
        self._bound_s = bound_s
        self._posted = time.monotonic()
        self._previous = weakref.ref(previous) if previous is not None else None
        self._start: float | None = None if previous is not None else self._posted
        self.done_at: float | None = None  # when this process saw it complete (or gave it up)
        self._settled = False
        self._failure: WeightSyncError | None = None

    def wait(self) -> None:
        """Block until the collective is done (see ``TorchGroup._settle``). Once it has been
        waited on (here or by ``after`` on Gloo), later calls return or raise the same again."""
        if self._settled:
            if self._failure is not None:
                raise self._failure
            return
        work, self._work = self._work, None
        if work is None:
            raise TransportError("this collective was abandoned: the sync group was closed")
        try:
            self._group._settle(self, work)
        except WeightSyncError as exc:
            self._failure = exc
            raise
        finally:
            self._settled = True
            del work  # not even this frame may keep it alive in the traceback

    def after(self) -> None:
        """NCCL: ``WorkNCCL::synchronize`` -> ``synchronizeStream`` makes the current stream of
        the work's device wait on the collective's end event (``ncclEndEvent_->block``), and
        does not block the host; ``wait`` still follows. Gloo: there is no stream to order, so
        this is ``wait``."""
        if not self._group.is_nccl or self._settled:
            self.wait()
            return
        work = self._work
        if work is None:
            raise TransportError("this collective was abandoned: the sync group was closed")
        self._group._raise_if_left()
        work.synchronize()

    def release(self) -> None:
        self._work = None
        if self.done_at is None:
            self.done_at = time.monotonic()

    def finished(self, now: float) -> bool:
        """Whether this op is known to be over (done, failed, released), recording when."""
        if self.done_at is None:
            work = self._work
            if work is None or work.is_completed():
                self.done_at = now
                if work is not None:
                    self._group._saw_done(self.seq)
        return self.done_at is not None

    def overdue(self, now: float) -> bool:
        """Whether this op has run past its bound, counted from when it could start. While the
        op before it still runs, this one has not started and that one's bound applies."""
        if self._start is None:
            previous = self._previous() if self._previous is not None else None
            if previous is None:  # dropped unwaited: we cannot know better than our posting
                self._start = self._posted
            elif previous.finished(now):
                self._start = max(self._posted, cast(float, previous.done_at))
            else:
                return previous.overdue(now)
            self._previous = None
        return now - self._start > self._bound_s

    @property
    def bound_s(self) -> float:
        return self._bound_s


class GlooBatch:
    """Gloo's point-to-point works of one ``exchange``, as one work.

    They cannot be polled as a collective is (``TorchGroup._poll``): a send's or receive's
    ``is_completed`` stays False until ``wait`` returns (``SendWork``/``RecvWork`` override only
    ``wait``), a ``wait(timeout)`` that runs out signals "Application timeout caused pair
    closure" to every pair of the group's context (gloo's ``unbound_buffer``), and a second
    ``wait`` of a receive waits for a second message. So the batch is waited on once, whatever
    slice is asked, for the whole of its bound: a peer that dies closes its sockets, which ends
    the wait at once; only a frozen one costs the bound. Meanwhile neither the abort key nor a
    ``close`` from another thread ends the wait (a helper thread could, at the price of a thread
    per batch that an exit must wait out). Later calls return or raise the same."""

    def __init__(self, works: list[dist.Work], bound_s: float) -> None:
        self._works = works
        self._bound_s = bound_s
        self._failure: RuntimeError | None = None
        self._done = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._done:
            deadline = time.monotonic() + self._bound_s
            work: dist.Work | None = None
            try:
                for work in self._works:
                    left = max(deadline - time.monotonic(), 1e-3)
                    work.wait(datetime.timedelta(seconds=left))
            except RuntimeError as exc:
                self._failure = exc
            finally:
                self._done = True
                # A live Gloo work keeps its connections open, and a peer's send to this rank
                # then waits out its bound: none may outlive this wait, not even as this
                # frame's ``work``, which the failure's traceback keeps.
                self._works, work = [], None
        if self._failure is not None:
            raise self._failure
        return True

    def is_completed(self) -> bool:
        return self._done
