"""A member that passes the push on to the others of its host: one crossing of the link per host.

Gloo's broadcast is a binomial tree over the ranks: three members on a far host make the trainer
send the payload across the link twice (to two of them, the third hearing from one), and every
doubling of members adds a crossing. With a relay, only the first member of each far host (its
*leader*) is a rank of the broadcast group; it writes every buffer it receives into a
shared-memory ring of its own (``weight_sync.transport.shm``), from which the host's other
members (its *followers*, route ``"relay"``) read, as the trainer's own host reads the
trainer's ring. The bytes cross the link once and the host's memory bus N-1 times.

``Relay`` is the leader's end: a ``Transport`` made of its rank in the group (upstream) and
rank 0 of its ring (downstream). What the members see is unchanged:

* a broadcast completes once the bytes are here and have gone into the ring (forwarded in the
  order they were posted, each before its buffer can be reused: the receiver waits on its
  broadcasts in order and reuses a buffer only after waiting on it);
* a vote gathers the followers' codes before the leader votes upstream, and tells them the
  outcome after, so "every member has received" still means every member;
* a failure on either side fails both: a follower that dies makes the leader's forward fail
  (the leader then leaves the group, as a member does, and the trainer's broadcast fails at
  once); a leader that dies or leaves hangs up on its followers, which fail at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from weight_sync.errors import TransportError, WeightSyncError
from weight_sync.transport.base import Transport, Work
from weight_sync.transport.ring import RingSent
from weight_sync.transport.shm import ShmWriter
from weight_sync.transport.torch_group import TorchGroup
from weight_sync.wire.metadata import GroupSpec

logger = logging.getLogger(__name__)


class _Forwarded:
    """One broadcast through a relay. ``after``: received here, and on its way into the ring --
    the buffer is still being read until the next broadcast's ``after`` returns, so it must not
    be written before then (the receiver only reads a bucket it applies, and reuses its buffer
    two buckets on); ``wait``: in the ring, and copied out by every follower."""

    def __init__(self, relay: Relay, tensor: torch.Tensor, upstream: Work) -> None:
        self._relay, self.tensor, self.upstream = relay, tensor, upstream
        self.forward: Future[RingSent] | None = None  # its write into the ring, once received

    def after(self) -> None:  # host buffers: nothing to order on a stream
        self._relay.received(self)

    def wait(self) -> None:
        self._relay.received(self)
        self._relay.delivered(self)


class Relay:
    """A leader's end of the push: its rank in the group, and the writer of its host's ring.
    Implements ``Transport``; owns both parts (``close`` closes them).

    Each received buffer is written into the ring by a thread of the relay's own, so that the
    next receive from the link is posted while this one goes to the followers. A buffer is
    handed back for reuse (the ``after`` of the next broadcast returns) only once its write is
    done; only that thread touches the ring between votes.
    """

    def __init__(self, upstream: Transport, downstream: ShmWriter) -> None:
        if upstream.device.type != "cpu":
            raise ValueError("a relay forwards host buffers (a Gloo push); NCCL relays itself")
        self._up, self._down = upstream, downstream
        self._pending: deque[_Forwarded] = deque()  # posted, not yet received (in order)
        self._last: Future[RingSent] | None = None  # the latest write into the ring
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="weight-sync-relay")
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def join(cls, spec: GroupSpec) -> Relay:
        """Join the group as ``spec.rank`` and take this host's followers into a ring of our own.

        The ring listens before the group's rendezvous (followers dial it as they are asked to
        join, and wait for it while it is not there yet); they are taken in once the group has
        formed, within the same rendezvous bound."""
        assert spec.relay is not None and spec.transport == "group"
        started = time.monotonic()
        ring = ShmWriter(
            spec.relay.group_id,
            spec.relay.readers,
            spec.relay.slot_bytes,
            spec.collective_timeout_s,
        )
        try:
            group = TorchGroup.join(spec)
        except BaseException:
            ring.close()
            raise
        try:
            ring.accept(max(spec.rendezvous_timeout_s - (time.monotonic() - started), 1.0))
        except BaseException:
            ring.close()
            group.close()
            raise
        logger.info("relaying to %d member(s) of this host", spec.relay.readers)
        return cls(group, ring)

    @property
    def rank(self) -> int:
        return self._up.rank

    @property
    def world_size(self) -> int:
        return self._up.world_size

    @property
    def device(self) -> torch.device:
        return self._up.device

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> Work:
        work = _Forwarded(self, tensor, self._up.broadcast(tensor, src, timeout_s))
        with self._lock:
            self._pending.append(work)
        return work

    def received(self, work: _Forwarded) -> None:
        """Receive every broadcast posted up to ``work``, in order, and start writing each into
        the ring once the one before it is written (so that its buffer may be reused). A
        failure on either side closes the relay."""
        with self._failing_closes():
            while work.forward is None:
                first = self._pending.popleft()
                first.upstream.wait()
                if self._last is not None:
                    self._last.result()
                first.forward = self._last = self._writer.submit(
                    self._down.broadcast, first.tensor, 0
                )

    def delivered(self, work: _Forwarded) -> None:
        """Wait until every follower has copied ``work`` out of the ring."""
        with self._failing_closes():
            assert work.forward is not None and self._last is not None
            self._last.result()  # every write so far is done: the ring is this thread's
            work.forward.result().wait()

    tally_is_final = True  # a member votes: the outcome is what ``vote`` returns

    def vote(self, code: int, timeout_s: float | None = None) -> int:
        """The followers' codes with this member's, upstream; the outcome back to them, all
        within ``timeout_s``. Once the group has agreed, this member holds what it agreed on:
        a follower that cannot hear the outcome is hung up on (and fails), not this member."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._failing_closes():
            if self._pending:
                raise TransportError("a vote while broadcasts are still in flight on this relay")
            if self._last is not None:
                self._last.result()
            code = self._down.tally(code, timeout_s)
            outcome = self._up.vote(code, _left(deadline))
        try:
            self._down.announce(outcome, _left(deadline))
        except WeightSyncError as exc:
            logger.warning("a follower missed the outcome of a vote (%s): hanging up on them", exc)
            self._down.hang_up()
        return outcome

    def tally(self, code: int, timeout_s: float | None = None) -> int:
        raise TypeError("tally and announce are the trainer's halves of a vote; a relay votes")

    def announce(self, code: int, timeout_s: float | None = None) -> int:
        raise TypeError("tally and announce are the trainer's halves of a vote; a relay votes")

    def close(self) -> None:
        """Leave the group, hang up on the followers (they fail at once, and so does the
        writer's wait on them), let the writer's copy end, then free the ring. Idempotent; safe
        from another thread while a receive runs (it fails)."""
        if self._closed:
            return
        self._closed = True
        self._up.close()
        self._down.hang_up()
        self._writer.shutdown(wait=True, cancel_futures=True)
        self._down.close()

    @contextmanager
    def _failing_closes(self) -> Iterator[None]:
        """Hold the relay while a step runs; a failure closes it, and reaches the caller as a
        ``WeightSyncError`` even when it is the relay's own machinery that broke off (a write
        cancelled, an empty queue: the relay was closed from another thread)."""
        with self._lock:
            try:
                if self._closed:
                    raise TransportError("this relay has left the group")
                yield
            except Exception as exc:
                self._pending.clear()
                self.close()
                if isinstance(exc, WeightSyncError):
                    raise
                raise TransportError(f"the relay broke off: {exc!r}") from exc
            except BaseException:
                self._pending.clear()
                self.close()
                raise


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 1e-3)
