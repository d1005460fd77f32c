"""The dedicated sync group, built from torch.distributed parts.

Three ways to build it (``transport.forming``), one way to use it (here; a collective in
flight is a ``transport.work.TorchWork``):

* ``world`` -- the textbook path for processes with no torch.distributed world of their own:
  ``init_process_group`` makes the sync world and ``new_group`` the broadcast group. The library
  then owns the process's default group and destroys it on close.
* ``job`` -- for the ranks of one launched job (``torchrun``, ``mpirun``: ``weight_sync.launch.job_sync``),
  which already share a default group: ``new_group`` over it, beside it, every rank of the job a
  member. The job keeps its default group; we destroy only ours.
* ``standalone`` -- for processes that already live in a world (an FSDP trainer, a
  tensor-parallel engine): a ``ProcessGroupGloo``/``ProcessGroupNCCL`` over a ``PrefixStore`` on
  our own ``TCPStore``. It never reads or touches the default group, and is driven through the
  group object's own methods (``dist.broadcast(group=...)`` refuses unregistered groups).

Either way the result is a ``ProcessGroup`` whose ``broadcast`` we call directly; ``exchange``
posts point-to-point batches on the same group, for several senders over one group
(``transport.rounds``).

Failure semantics are ours, not the backend's, and the same on Gloo and NCCL:

* Every wait is our own loop (``TorchGroup._settle``): it notices completion at once (Gloo: its
  C++ ``wait`` in 50 ms slices, which returns on completion; NCCL: ``is_completed`` with a
  backoff of at most 1 ms), and between slices looks at three things: whether this group was
  closed or aborted locally (another thread's ``close``), the ``abort`` key in the group's own
  store (a peer that left on a failure path, or the trainer leaving; a store that no longer
  answers means the trainer is gone), and the op's own bound.
* Each op's bound runs from when it could start: the later of its posting and the completion of
  the op posted before it on this group. A pipelined sender posts bucket k+1 while k is on the
  wire; k+1 cannot start before k ends (NCCL runs a group's ops in stream order), so timing it
  from its posting would charge it k's time. The previous op's completion is taken as when this
  process first saw it, which errs on the side of a later start (a looser bound), never a
  spurious timeout. NCCL needs this loop: it ignores ``BroadcastOptions.timeout`` (every WorkNCCL
  gets the group's ``options_->timeout``: ``ProcessGroupNCCL::assignTimeoutToWork``).
* A timed-out or failed op aborts the group (never ``shutdown``, which finalises and would wait
  for the op) and raises ``SyncTimeoutError`` / ``TransportError``. ``close`` with work in flight
  or a wait running, and ``abort``, abort too; only a ``close`` with nothing in flight shuts the
  group down cleanly. Aborts run on a background thread that ``close`` waits on for at most
  ``_CLOSE_WAIT_S``: a Gloo group's destructor waits for its ops to end, and ``ncclCommAbort``
  may take a while, neither of which a leaving member should sit through. That thread is a
  ``teardown``: an exit waits for it, within a bound, so that it is never killed inside the
  abort (which would end the process in ``std::terminate``).
* The trainer (rank 0) writes the abort key whenever it leaves, and any rank writes it when it
  aborts, so that peers stop at once: Gloo peers used to learn from the closed sockets, but only
  once our side's ops had ended; NCCL peers learn nothing at all from a peer's abort.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import functools
import json
import logging
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from weight_sync.control.futures import Backoff
from weight_sync.errors import (
    GroupFormationError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
)
from weight_sync.transport import nccl, teardown
from weight_sync.transport.forming import (
    GroupHandle,
    device_for,
    gloo_group,
    job_group,
    join_world,
    rendezvous_error,
)
from weight_sync.transport.rendezvous import open_store
from weight_sync.transport.work import GlooBatch, TorchWork
from weight_sync.wire.metadata import GroupSpec

logger = logging.getLogger(__name__)

ABORT_KEY = "abort"  # in the group's own PrefixStore: see TorchGroup._tell_peers
_LOOK_EVERY_S = 0.05  # how often a wait looks at the local state, the abort key and its bound
_LOST_GRACE_S = 1.0  # how long a wait goes on once the store stopped answering (see _look)
_STORE_LINGER_S = 0.15  # rank 0 keeps serving the abort key this long after leaving
_CLOSE_WAIT_S = 0.05  # how long close()/abort() wait for a background abort before returning
_NCCL_MAX_PAUSE_S = 1e-3  # the longest sleep between two is_completed() polls (NCCL)


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"  # left cleanly (shutdown)
    ABORTED = "aborted"


class TorchGroup:
    """A member of the dedicated sync group (implements ``Transport``)."""

    def __init__(
        self,
        spec: GroupSpec,
        pg: GroupHandle,
        store: dist.Store,
        ours: dist.Store,
        device: torch.device,
    ) -> None:
        self._spec = spec
        self._pg: GroupHandle | None = pg
        self._store: dist.Store | None = store  # rank 0: the TCPStore server itself
        self._ours: dist.Store | None = ours  # the group's PrefixStore: the abort key
        self._device = device
        self._timeout = datetime.timedelta(seconds=spec.collective_timeout_s)
        self._works: weakref.WeakSet[TorchWork] = weakref.WeakSet()
        self._last: weakref.ref[TorchWork] | None = None  # the op posted last
        self._lock = threading.Lock()  # state, posting, the works
        self._state = _State.OPEN
        self._waiters = 0
        self._posted = 0  # ops posted on this group (collectives and exchanges)
        self._collectives = 0  # collectives posted on this group: the same on every rank
        # NCCL, once aborted: the work objects of collectives that may still run. In blocking-wait
        # mode nothing else owns a WorkNCCL (workEnqueue skips workMetaList_), and its tensor stash
        # (``stashed_for_allocator_safety_``, the only thing keeping the caching allocator from
        # handing the buffers on while the NCCL stream still uses them) goes with it; so they are
        # dropped only once ncclCommAbort has returned (see ``_abort``).
        self._held: list[dist.Work] = []
        self._done_through = 0  # the highest op seq seen complete (see close)

    @classmethod
    def join(
        cls,
        spec: GroupSpec,
        listener: socket.socket | None = None,
        device: torch.device | None = None,
    ) -> TorchGroup:
        """Join (rank 0: create, taking over ``listener``) the group that ``spec`` describes.

        ``device``: where this member's buffers live. NCCL needs it (a CUDA device with an
        index): a thread's current device is no guide, since pushes run on whatever thread the
        caller has. Gloo uses the CPU (None or ``cpu``).

        Blocks until the group has formed or ``spec.rendezvous_timeout_s`` passes. For NCCL
        "formed" means a checked communicator: every rank checks in through the store first
        (GPU, NCCL version and settings; see ``nccl.judge``), then the communicator is created
        eagerly and proven with a warm-up all-reduce (``nccl.connect``). Failures raise
        ``GroupFormationError`` naming the ranks to blame, on every rank.
        """
        if (listener is not None) != (spec.rank == 0):
            raise ValueError("rank 0 and only rank 0 passes the listening socket")
        device = device_for(spec.backend, device)
        deadline = time.monotonic() + spec.rendezvous_timeout_s
        store = open_store(
            spec.address, spec.port, spec.world_size, spec.rendezvous_timeout_s, listener
        )
        rendezvous = datetime.timedelta(seconds=spec.rendezvous_timeout_s)
        collective = datetime.timedelta(seconds=spec.collective_timeout_s)
        ours = PrefixStore(f"weight_sync/{spec.group_id}/", store)  # random per group
        if spec.backend == "nccl":  # before any NCCL call: who is there, and can they agree?
            try:
                nccl.check_in(ours, spec, nccl.local_report(device), deadline)
            except RuntimeError as exc:  # the store: DistNetworkError when the trainer is gone
                raise rendezvous_error(exc, spec) from exc
        pg: GroupHandle
        try:
            if spec.mode == "world":
                pg = join_world(spec, ours, rendezvous, collective)
            elif spec.mode == "job":
                pg = job_group(spec, ours, rendezvous)
            elif spec.backend == "gloo":
                pg = gloo_group(spec, ours, rendezvous, collective)
            else:
                pg = cast(GroupHandle, nccl.nccl_group(spec, ours, collective))
        except RuntimeError as exc:
            raise rendezvous_error(exc, spec) from exc
        group = cls(spec, pg, store, ours, device)
        if spec.backend == "nccl":
            try:
                backend = group._backend(pg)
                nccl.require_process_group_nccl(backend, spec.mode)
                nccl.connect(backend, device, ours, spec, deadline)
            except GroupFormationError:
                group._abort("the sync group did not form", tell_peers=False)
                raise
            except RuntimeError as exc:  # the store failed under the outcomes: a typed error,
                group._abort("the sync group did not form", tell_peers=False)  # and no live PG
                raise rendezvous_error(exc, spec) from exc
        logger.info(
            "joined sync group %s as rank %d/%d (%s, %s, %s) via %s:%d",
            spec.group_id,
            spec.rank,
            spec.world_size,
            spec.backend,
            spec.mode,
            device,
            spec.address,
            spec.port,
        )
        return group

    @property
    def rank(self) -> int:
        return self._spec.rank

    @property
    def world_size(self) -> int:
        return self._spec.world_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_nccl(self) -> bool:
        return self._spec.backend == "nccl"

    @property
    def process_group(self) -> GroupHandle:
        """The underlying group object, for tools that need other collectives on the same
        group (the benchmark's baselines). weight_sync itself only broadcasts."""
        if self._pg is None:
            raise TransportError("the sync group is closed")
        return self._pg

    def broadcast(
        self, tensor: torch.Tensor, src: int, timeout_s: float | None = None
    ) -> TorchWork:
        self._check_buffer(tensor)
        timeout = self._bound(timeout_s)
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        # The op's bound is our wait's (from when the op could start, see the module docstring).
        # Gloo's own per-op timer starts when a worker thread picks the op up, possibly while
        # the op before it still runs, so it gets only the group's timeout, as a backstop.
        options.timeout = self._timeout
        return self._post(lambda pg: pg.broadcast([tensor], options), timeout)

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        receives: Sequence[tuple[torch.Tensor, int]],
        timeout_s: float | None = None,
    ) -> TorchWork:
        """Start one batch of point-to-point transfers: each ``(buffer, rank)`` of ``sends`` to
        that rank of the group, each of ``receives`` from it (contiguous uint8 buffers); returns
        at once, one work for the whole batch, bounded as ``broadcast`` is.

        What several senders pushing over one group are made of (``transport.rounds``). NCCL:
        the batch is one ``ncclGroupStart/End``, as ``dist.batch_isend_irecv`` makes for a
        registered group (``_coalescing_manager``), called here on the backend itself
        (``Backend._start_coalescing``/``_end_coalescing``) since a standalone group is no
        registered ``ProcessGroup``: a rank's transfers with several peers then progress
        together instead of waiting on each other, provided every rank posts its batches in an
        order its peers agree on. Gloo does not coalesce: one send or receive per pair, matched
        in order per pair (see ``GlooBatch`` for how they are waited on)."""
        if not sends and not receives:
            raise ValueError("an exchange needs at least one send or receive")
        for tensor, peer in (*sends, *receives):
            self._check_buffer(tensor)
            if not 0 <= peer < self.world_size or peer == self.rank:
                raise ValueError(
                    f"rank {self.rank} cannot exchange with rank {peer} of a group of "
                    f"{self.world_size}"
                )
        timeout = self._bound(timeout_s)

        def start(pg: GroupHandle) -> dist.Work:
            backend = cast(Any, self._backend(pg))
            if not self.is_nccl:
                # Loops, not comprehensions: a comprehension is a function of its own (<= 3.11)
                # whose closure holds ``backend`` past a failed post (see ``_post``).
                works = []
                for tensor, peer in sends:
                    works.append(backend.send([tensor], peer, 0))
                for tensor, peer in receives:
                    works.append(backend.recv([tensor], peer, 0))
                return cast(dist.Work, GlooBatch(works, timeout.total_seconds()))
            # The backend's own binding takes no device (only ProcessGroup's does): NCCL reads
            # the current one, and keeps the open group in a thread-local count, so start, ops
            # and end stay on this thread, under the lock.
            with torch.cuda.device(self._device):
                backend._start_coalescing()
                try:
                    for tensor, peer in sends:
                        backend.send([tensor], peer, 0)
                    for tensor, peer in receives:
                        backend.recv([tensor], peer, 0)
                except BaseException:
                    # Close the group the failed op left open, or this thread's later posts
                    # would join it; what it posted may still run (see _held).
                    with contextlib.suppress(Exception):
                        self._held.append(backend._end_coalescing())
                    raise
                return cast(dist.Work, backend._end_coalescing())

        return self._post(start, timeout, collective=False)

    # One all-reduce tells every rank the outcome at once: nothing is left to announce.
    tally_is_final = True

    def vote(self, code: int, timeout_s: float | None = None) -> int:
        return self.tally(code, timeout_s)

    def tally(self, code: int, timeout_s: float | None = None) -> int:
        """The largest code of the group, on every rank (one all-reduce)."""
        timeout = self._bound(timeout_s)
        codes = torch.tensor([code], dtype=torch.int32, device=self._device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        options.timeout = self._timeout  # a backstop, as in broadcast
        self._post(lambda pg: pg.allreduce([codes], options), timeout).wait()
        return int(codes.item())

    def announce(self, code: int, timeout_s: float | None = None) -> int:
        return code

    def share(self, value: int, timeout_s: float | None = None) -> list[int]:
        """Every rank's ``value`` (0 to 2**62), in rank order, on every rank: one all-reduce,
        each rank filling its own slot."""
        if not 0 <= value < 2**62:
            raise ValueError(f"a shared value is between 0 and 2**62, not {value}")
        timeout = self._bound(timeout_s)
        values = torch.zeros(self.world_size, dtype=torch.int64, device=self._device)
        values[self.rank] = value
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        options.timeout = self._timeout  # a backstop, as in broadcast
        self._post(lambda pg: pg.allreduce([values], options), timeout).wait()
        return [int(v) for v in values.tolist()]

    def close(self) -> None:
        """Leave the group. With nothing in flight and no wait running, cleanly (``shutdown``);
        otherwise as ``abort`` does, never waiting on the op in flight. Idempotent, and safe to
        call from another thread while a wait runs (that wait raises ``TransportError``)."""
        now = time.monotonic()
        with self._lock:
            if self._state is not _State.OPEN:
                return
            busy = self._waiters > 0 or any(not w.finished(now) for w in list(self._works))
            # A handle dropped unwaited leaves the WeakSet, but its op may still run: NCCL's
            # shutdown would then wait for it forever. Its ops end in posting order, so the
            # group is idle only once the last one posted was seen complete.
            busy = busy or (self.is_nccl and self._done_through < self._posted)
            if not busy:
                self._state = _State.CLOSED
                pg, self._pg = self._pg, None
                handles = list(self._works)
        if busy:
            self.abort("it left with a collective in flight")
            return
        for handle in handles:  # Gloo: a live work handle keeps the connections open
            handle.release()
        if self.rank == 0:  # members may wait in a collective we will never post: tell them
            self._tell_peers("the trainer left the sync group", abort=False)
        try:
            if self._spec.mode == "world":
                with nccl.env_window({}):  # the lock: no other thread builds a world meanwhile
                    dist.destroy_process_group()  # the sync world and every group in it
            elif self._spec.mode == "job":
                with nccl.env_window({}):
                    dist.destroy_process_group(cast(dist.ProcessGroup, pg))  # ours, not the job's
            else:
                cast(GroupHandle, pg).shutdown()
        except (RuntimeError, ValueError) as exc:  # a dead peer, or the job's world destroyed
            logger.warning("closing sync group %s: %s", self._spec.group_id, exc)  # before us
        del pg
        self._drop_store()
        logger.info("left sync group %s (rank %d)", self._spec.group_id, self.rank)

    def _saw_done(self, seq: int) -> None:
        """The op ``seq`` completed, and with it every op posted before it (stream order)."""
        self._done_through = max(self._done_through, seq)

    @property
    def timeout_s(self) -> float:
        """The bound of an op posted without one (the spec's ``collective_timeout_s``)."""
        return self._timeout.total_seconds()

    def abort(self, reason: str = "it aborted") -> None:
        """Leave on a failure path: abort the group (never finalise: that would wait for work in
        flight) and tell the peers through the store, so they stop at once. Returns within
        about ``_CLOSE_WAIT_S``; the abort itself may finish on a background thread."""
        self._abort(reason, tell_peers=True)

    # -- internals ------------------------------------------------------------------------

    def _check_buffer(self, tensor: torch.Tensor) -> None:
        """A buffer this group may move: contiguous uint8, on the group's device for NCCL."""
        assert tensor.dtype == torch.uint8 and tensor.is_contiguous()
        if self.is_nccl and tensor.device != self._device:
            raise ValueError(
                f"an NCCL sync group on {self._device} got a buffer on {tensor.device}"
            )

    def _post(
        self,
        start: Callable[[GroupHandle], dist.Work],
        timeout: datetime.timedelta,
        collective: bool = True,
    ) -> TorchWork:
        """Post one op (under the lock, so that no close slips in between the check and the
        post) and return its handle, chained to the op posted before it. ``collective``: every
        rank posts it (counted in ``_collectives``); else a point-to-point batch."""
        with self._lock:
            pg = self._open()
            try:
                work = start(pg)
            except Exception as exc:  # the group may hold a half-posted op: abort it
                failure: Exception = exc
            else:
                previous = self._last() if self._last is not None else None
                self._posted += 1
                self._collectives += int(collective)
                handle = TorchWork(
                    self, work, timeout.total_seconds(), self._posted, previous, self._collectives
                )
                self._works.add(handle)
                self._last = weakref.ref(handle)
                return handle
        # The failure's traceback holds the frames that posted it, and in them the group and
        # the ops posted before the one that failed: Gloo's connections stay open while those
        # live, so a peer's send to this rank would wait out its bound -- for as long as a
        # lane keeps the error, or until a garbage collection finds the frame's cycle. Let go
        # before the abort, so that the group's last reference is the abort's (its destructor
        # waits for its ops: on the abort's thread, not this one).
        del pg
        traceback.clear_frames(failure.__traceback__)
        self._abort(f"posting a collective failed: {failure}", tell_peers=True)
        raise _collective_error(failure, timeout) from failure

    def _settle(self, handle: TorchWork, work: dist.Work) -> None:
        """Wait for ``work`` (``handle``'s) as the module docstring says; raise typed errors."""
        backoff = Backoff(1e-4, _NCCL_MAX_PAUSE_S)
        next_look = time.monotonic() + _LOOK_EVERY_S
        lost_at: list[float] = []  # when the store stopped answering, if it did
        with self._waiting():
            try:
                # The local state first: once another thread aborts, a NCCL poll may block on
                # the communicator's mutex (NCCLComm::abort holds it through ncclCommAbort).
                while True:
                    self._raise_if_left()
                    if self._poll(work):
                        break
                    now = time.monotonic()
                    if now >= next_look:
                        self._look(handle, lost_at, now)
                        next_look = now + _LOOK_EVERY_S
                    if handle.overdue(now):
                        bound = handle.bound_s
                        self._abort(f"a collective ran past its {bound}s bound", tell_peers=True)
                        raise SyncTimeoutError(
                            f"a collective did not finish within {bound}s of when it could "
                            "start; a worker may be frozen or overloaded -- raise "
                            "collective_timeout_s or check the workers"
                        )
                    if self.is_nccl:
                        backoff.sleep()
                handle.done_at = time.monotonic()
                # Completed: NCCL (blocking-wait mode) orders the current stream after it and
                # raises its error, if any (WorkNCCL::wait); Gloo returns or raises at once.
                work.wait()
                self._saw_done(handle.seq)
                return
            except WeightSyncError:
                raise
            except RuntimeError as exc:
                failure: Exception = exc
            finally:
                if self.is_nccl and self._state is not _State.OPEN:
                    self._held.append(work)  # may still run: kept until the abort is done
                del work
        self._abort(f"a collective failed: {failure}", tell_peers=True)
        raise _collective_error(failure, datetime.timedelta(seconds=handle.bound_s)) from failure

    def _poll(self, work: dist.Work) -> bool:
        """Whether ``work`` has completed (successfully or not), waiting at most one slice."""
        if self.is_nccl:
            return work.is_completed()  # WorkNCCL::isCompleted: an event query, no host block
        try:  # c10d Work::wait(timeout): returns on completion; "Operation timed out!" if not
            work.wait(datetime.timedelta(seconds=_LOOK_EVERY_S))
            return True
        except RuntimeError:
            return work.is_completed()  # failed (the final wait raises it) or just a slice

    @contextmanager
    def _waiting(self) -> Iterator[None]:
        with self._lock:
            self._waiters += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiters -= 1

    def _raise_if_left(self) -> None:
        if self._state is not _State.OPEN:
            raise TransportError(
                f"the sync group was {self._state.value} while this collective waited (another "
                "thread closed it, or a failure aborted it); the next push rebuilds it"
            )

    def _look(self, handle: TorchWork, lost_at: list[float], now: float) -> None:
        """Raise ``TransportError`` (aborting the group) if a peer says this wait is in vain.

        The abort key ends it at once if a peer aborted, or if the trainer left cleanly before
        posting this collective (``handle.collectives`` beyond the trainer's count; one it did
        post may still be finishing on its way to us; a point-to-point batch waits on, ended by
        the closed connection or its bound). A store that stopped answering means the trainer
        is gone: the op gets ``_LOST_GRACE_S`` to finish what is already on its way."""
        ours = self._ours
        if ours is None:
            self._raise_if_left()
            return
        try:
            notice = json.loads(ours.get(ABORT_KEY)) if ours.check([ABORT_KEY]) else None
        except RuntimeError as exc:  # DistNetworkError & co: the store's owner is gone
            lost_at.append(now)
            if now - lost_at[0] < _LOST_GRACE_S:
                return
            why = f"the trainer's rendezvous store stopped answering ({exc})"
        else:
            if notice is None:
                return
            posted = notice.get("posted")
            if not notice["abort"] and (posted is None or handle.collectives <= posted):
                return
            why = f"rank {notice['rank']}: {notice['why']}"
        self._abort(f"a peer left: {why}", tell_peers=False)
        raise TransportError(
            f"the sync group was abandoned by a peer ({why}); the trainer left or a member "
            "failed -- see the trainer's error. The next push rebuilds the group."
        )

    def _tell_peers(self, why: str, abort: bool = True) -> None:
        """Write the abort key: who, why, whether it aborted (every wait ends) or left cleanly
        (waits for collectives beyond ``posted`` end), best effort."""
        ours = self._ours
        if ours is None:
            return
        notice = {"rank": self.rank, "why": why, "abort": abort, "posted": self._collectives}
        try:
            ours.set(ABORT_KEY, json.dumps(notice))
        except RuntimeError as exc:  # nobody left to tell
            logger.debug("sync group %s: could not set the abort key: %s", self._spec.group_id, exc)

    def _drop_store(self) -> None:
        """Forget the store. Rank 0 serves it (the TCPStore server lives in this process): it
        keeps serving for ``_STORE_LINGER_S`` so that waiting members read the abort key
        rather than find the store gone."""
        held = [self._store, self._ours]
        self._store = self._ours = None
        if self.rank == 0:
            timer = threading.Timer(_STORE_LINGER_S, held.clear)
            timer.daemon = True
            timer.start()

    def _abort(self, reason: str, tell_peers: bool) -> None:
        with self._lock:
            if self._state is not _State.OPEN:
                return
            self._state = _State.ABORTED
            pg, self._pg = self._pg, None
            handles = list(self._works)
            if self.is_nccl:
                self._held.extend(h._work for h in handles if h._work is not None)
        for handle in handles:
            handle.release()
        logger.warning(
            "aborting sync group %s (rank %d): %s", self._spec.group_id, self.rank, reason
        )
        if tell_peers or self.rank == 0:
            self._tell_peers(reason)
        if self._spec.mode == "world":
            # Global state: cleared now, under the lock world-mode joins take, so that it can
            # never clear a world built after this returns. Our group object survives in ``pg``.
            with nccl.env_window({}):
                self._quietly(
                    lambda: nccl.abort_backend(dist.distributed_c10d._abort_process_group)
                )
        holder = [cast(GroupHandle, pg)]
        del pg
        finished = threading.Event()

        def finish() -> None:
            target = holder.pop()
            try:
                if self._spec.mode == "job":  # Gloo: unregistered, its ops fail as peers leave
                    with nccl.env_window({}):
                        self._quietly(
                            functools.partial(
                                dist.destroy_process_group, cast(dist.ProcessGroup, target)
                            )
                        )
                elif self._spec.mode != "world":
                    self._quietly(functools.partial(nccl.abort_backend, target.abort))
            finally:
                del target  # Gloo's destructor waits for its ops to end: here, not in close()
                self._held.clear()  # the communicator is aborted: its kernels use nothing more
                finished.set()

        teardown.start(f"weight-sync-abort({self._spec.group_id}, rank {self.rank})", finish)
        finished.wait(_CLOSE_WAIT_S)
        self._drop_store()

    def _quietly(self, step: Callable[[], object]) -> None:
        """Run a teardown step; a failure there is logged, never raised (we are leaving)."""
        try:
            step()
        except Exception as exc:
            logger.warning("tearing down sync group %s: %s", self._spec.group_id, exc)

    def _open(self) -> GroupHandle:
        if self._state is not _State.OPEN or self._pg is None:
            raise TransportError(
                f"the sync group is {self._state.value}; the next push rebuilds it"
            )
        return self._pg

    def _bound(self, timeout_s: float | None) -> datetime.timedelta:
        """One collective's timeout: the group's, or less where the push has less left."""
        if timeout_s is None:
            return self._timeout
        return min(self._timeout, datetime.timedelta(seconds=max(timeout_s, 1e-3)))

    def _backend(self, pg: GroupHandle) -> object:
        """The ProcessGroupNCCL behind ``pg``: world and job modes wrap it in a ProcessGroup,
        and under TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps that backend once more in a
        ``_ProcessGroupWrapper`` (its collectives checked against a Gloo group), which has
        none of the methods we call on the backend itself."""
        if self._spec.mode not in ("world", "job"):
            return pg
        backend = cast(dist.ProcessGroup, pg)._get_backend(self._device)
        wrapper = getattr(dist.distributed_c10d, "_ProcessGroupWrapper", None)
        while wrapper is not None and isinstance(backend, wrapper):
            backend = backend.wrapped_pg
        return backend


def _collective_error(exc: Exception, timeout: datetime.timedelta) -> Exception:
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return SyncTimeoutError(
            f"a collective did not finish within {timeout.total_seconds()}s ({text}); a worker "
            "may be frozen or overloaded -- raise collective_timeout_s or check the workers"
        )
    return TransportError(
        f"a collective failed ({text}); a member of the sync group probably died -- check the "
        "workers' logs. The next push rebuilds the group."
    )
