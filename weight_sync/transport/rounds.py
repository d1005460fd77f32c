"""Rounds: several senders' buckets moved to every receiving rank over one group, point to point.

The data plane of the NCCL design for a push from many senders (docs/many-senders.md, "On
GPUs"): one group over the senders and the receiving ranks, a root per sender, instead of a
group per sender. On one GPU, K communicators whose kernels each wait on their own peers can
deadlock one another; one communicator, with every rank posting its transfers in an order its
peers agree on, cannot. So each sender sends its buckets in order, each to every receiving rank
as one batch (``TorchGroup.exchange``), and each receiving rank takes them in rounds: round k is
the k-th bucket of every sender that has one (``schedule``), posted as one batch, which NCCL
runs as one ``ncclGroupStart/End``. A sender waits on no other sender; a round completes once
every sender in it has sent its bucket.

Over Gloo the same code runs as plain tagged sends and receives (no coalescing, no risk of
deadlock), which is how it is tested on CPU. Pure but for the group it is handed: what a bucket
holds, and when a push commits, are the caller's.

Across hosts a receiving rank relays (``lane_paths``): a lane enters another host at one of its
receiving ranks, a different one for each lane, which forwards each bucket to the others there,
so each sender's bucket crosses its link once per host, not once per receiving rank.

The lanes of a push, each an ordinary push on a thread of its own, hand their buckets one at a
time through ``Transport.broadcast``; ``SendLane`` and ``ReceiveLane`` are those lanes'
transports over one group, and ``Rounds`` is a receiving rank's scheduler across its lanes'
threads: it posts round k once every lane still in the push has handed its k-th buffer --
``schedule``'s order, without knowing the counts before (a lane that is ``done`` drops out of
the later rounds).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from weight_sync.errors import SyncTimeoutError, TransportError, WeightSyncError
from weight_sync.transport.base import Transport
from weight_sync.transport.shm import host_key
from weight_sync.transport.torch_group import TorchGroup, TorchWork
from weight_sync.wire.metadata import VOTE_AGREED

logger = logging.getLogger(__name__)


def schedule(counts: Sequence[int]) -> list[tuple[int, ...]]:
    """The lanes (indices into ``counts``, each lane's number of buckets) that move a bucket in
    each round: round k holds the k-th bucket of every lane that has one, in lane order. Every
    receiving rank derives the same rounds from the same counts, hence posts its batches in an
    order every sender agrees with: a sender's k-th send is in each receiver's round k."""
    if any(count < 0 for count in counts):
        raise ValueError(f"a lane cannot have a negative number of buckets: {list(counts)}")
    rounds = max(counts, default=0)
    return [tuple(lane for lane, count in enumerate(counts) if count > k) for k in range(rounds)]


@dataclass(frozen=True)
class LanePath:
    """One lane's way to every receiving rank of one group: its sender sends each bucket to
    ``targets``; receiving rank r takes it from ``via[r]``, the sender or the rank that relays
    the lane on r's host. (``Route``, in ``send.routes``, is another thing: how one member is
    reached -- the group, the shared-memory ring, CUDA IPC or a relay -- and the only ``Route``.)"""

    targets: tuple[int, ...]
    via: Mapping[int, int]

    def forwards(self, rank: int) -> list[int]:
        """The ranks ``rank`` relays this lane's buckets to, in rank order."""
        return sorted(r for r, source in self.via.items() if source == rank and r != rank)


def lane_paths(senders: int, hosts: Sequence[str]) -> list[LanePath]:
    """Each lane's ``LanePath`` over a group whose ranks ``0..senders-1`` send and the others
    receive, ``hosts[r]`` naming rank r's host. On its sender's own host a lane goes to every
    receiving rank directly (a GPU's fan-out over NVLink costs less than a relay's extra hop);
    on another host of several receiving ranks it enters at one, the ``lane mod R``-th of its R
    (in rank order), which relays it to the others. The entries differ by lane, so K senders
    cross K links into a host (one per GPU's NIC, on rails), not one: a single entry per host
    would cap the push at that entry's link, no faster than one sender. Pure: every rank derives
    the same paths from the same hosts."""
    if not 0 < senders < len(hosts):
        raise ValueError(
            f"a group of {len(hosts)} ranks cannot have {senders} senders and a receiving rank"
        )
    on: dict[str, list[int]] = {}
    for rank in range(senders, len(hosts)):
        on.setdefault(hosts[rank], []).append(rank)
    lanes = []
    for lane in range(senders):
        via: dict[int, int] = {}
        for host, ranks in on.items():
            entry = ranks[lane % len(ranks)]
            for rank in ranks:
                via[rank] = lane if host == hosts[lane] or rank == entry else entry
        targets = tuple(sorted(rank for rank, source in via.items() if source == lane))
        lanes.append(LanePath(targets, via))
    return lanes


def lane_paths_over(
    group: TorchGroup, senders: int, timeout_s: float | None = None
) -> list[LanePath]:
    """``lane_paths`` of ``group`` from every rank's host (``shm.host_key``: one kernel and one
    network namespace), shared by one all-reduce, then every pair of ranks they join connected
    (``connect``): every rank of ``group`` calls it at once, right after joining. A rank with
    no key is a host of its own: nothing is relayed to it."""
    key = host_key()
    mine = (
        int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "big") + 1
        if key
        else 0
    )
    keys = group.share(mine, timeout_s)
    hosts = [f"{value:014x}" if value else f"rank {rank}" for rank, value in enumerate(keys)]
    lanes = lane_paths(senders, hosts)
    connect(group, lanes, timeout_s)
    return lanes


def connect(group: TorchGroup, lanes: Sequence[LanePath], timeout_s: float | None = None) -> None:
    """One byte over every pair of ranks ``lanes`` join, each way it goes, as one batch on
    every rank. NCCL connects a pair of ranks at their first transfer, blocking the posting
    thread until the peer posts too; here that is now, before any round, rather than inside a
    round's post while a bucket is in flight (and, for a relay, under ``Rounds``' lock)."""
    here = group.rank
    to = {rank for route in lanes for rank, source in route.via.items() if source == here}
    of = {route.via[here] for route in lanes if here in route.via}
    byte = functools.partial(torch.zeros, 1, dtype=torch.uint8, device=group.device)
    sends, receives = [(byte(), r) for r in sorted(to)], [(byte(), r) for r in sorted(of)]
    if sends or receives:
        group.exchange(sends, receives, timeout_s).wait()


class _LaneEnd:
    """What a lane over one group keeps of its own small group (``lane``): its rank, its votes
    and leaving it. Its bytes are the one group's (the subclasses')."""

    def __init__(self, lane: Transport) -> None:
        self._lane = lane
        self.tally_is_final = lane.tally_is_final

    @property
    def rank(self) -> int:
        return self._lane.rank

    @property
    def world_size(self) -> int:
        return self._lane.world_size

    def vote(self, code: int, timeout_s: float | None = None) -> int:
        return self._lane.vote(code, timeout_s)

    def tally(self, code: int, timeout_s: float | None = None) -> int:
        return self._lane.tally(code, timeout_s)

    def announce(self, code: int, timeout_s: float | None = None) -> int:
        return self._lane.announce(code, timeout_s)

    def close(self) -> None:
        self._lane.close()


class SendLane(_LaneEnd):
    """A sender's lane over one group: each bucket the lane's push broadcasts goes instead to
    every rank of ``receivers`` in ``group`` as one batch; the rest is
    the lane's own group's, so the protocol above runs unchanged. ``group`` is not the lane's
    to close: every lane shares it."""

    def __init__(self, lane: Transport, group: TorchGroup, receivers: Sequence[int]) -> None:
        if not receivers:
            raise ValueError("a sender needs at least one receiving rank")
        super().__init__(lane)
        self._group, self._receivers = group, list(receivers)

    @property
    def device(self) -> torch.device:
        return self._group.device

    def broadcast(
        self, tensor: torch.Tensor, src: int, timeout_s: float | None = None
    ) -> TorchWork:
        if src != self.rank:
            raise ValueError(
                f"a sender's lane broadcasts from its own rank ({self.rank}), not {src}"
            )
        return self._group.exchange([(tensor, rank) for rank in self._receivers], [], timeout_s)


class Rounds:
    """A receiving rank's rounds across the threads of its lanes (one per sender; ``senders``:
    each lane's sender, as a rank of ``group``). Each push, ``begin`` names the lanes that take
    part; each lane's thread then hands its buffers in order (``hand``, through its
    ``ReceiveLane``) and says when it is ``done``. Round k is posted, as one batch, by whichever
    thread completes it: once every lane still in the push has handed its k-th buffer -- which
    is ``schedule``'s round k, since a lane is done only after its last bucket. So every
    receiving rank posts the same rounds in the same order, and no thread waits on another
    lane's round but through its own.

    A lane that fails mid-push leaves the group unusable (see ``done``): the group is aborted,
    and every later push over it fails; a caller forms a new one.

    NCCL: each post orders NCCL's stream after the posting thread's current stream only
    (``ProcessGroupNCCL::pointToPoint`` -> ``syncStream``), and each lane's receive runs on a
    stream of its own, so a round posted by one lane's thread would not wait for the kernels
    another lane queued on a buffer (its unpacking of the bucket the buffer held two rounds
    before). So ``hand`` records an event on the handing thread's stream, and rounds are posted
    from a stream of their own that waits on every event of the round.

    Relayed (``lane_paths``): where this rank relays, round k is two batches. The first takes the
    buckets of the lanes whose sender sends to this rank; the second relays those to the rest
    of this host and takes the lanes relayed to this rank (in the first, two ranks relaying to
    each other would each wait for the other's second). Over NCCL a rank that takes lanes
    relayed to it and lanes straight from their senders takes them in two batches too, so that
    every batch's peers are in the same phase as it. A batch cannot send what it receives;
    two need no copy and no count of a lane's buckets in advance: bucket k is relayed in round
    k, from the lane's own buffer, before the lane has it back. NCCL runs the second after the
    first on the group's stream (and the rounds' stream waits on the first's end, to be sure).
    Gloo may read a send's buffer from the moment it is posted, so there the second is posted
    once the first is waited on, by the first of the round's lanes to wait for it. Each lane
    waits for each of its buckets (or fails, and aborts the group), and for round k before
    round k + 1, so the second batches go out in round order: a caller that waited out of
    order would swap buckets between two ranks of a host."""

    def __init__(
        self, group: TorchGroup, senders: Sequence[int], paths: Sequence[LanePath] | None = None
    ) -> None:
        """``paths``: each lane's (``lane_paths_over``); None: every lane straight from its
        sender, nothing relayed."""
        if paths is not None and len(paths) != len(senders):
            raise ValueError(f"{len(paths)} lane paths for {len(senders)} lanes")
        self.group = group
        self._senders = list(senders)
        # Where each lane's buckets come from here (its sender, or the rank that relays it on
        # this host) and whom this rank relays them to.
        here = group.rank
        self._source = self._senders if paths is None else [p.via[here] for p in paths]
        self._forwards = [p.forwards(here) for p in paths] if paths else [[] for _ in senders]
        self._changed = threading.Lock()
        self._open: set[int] = set()
        self._handed: dict[int, deque[_Handed]] = {lane: deque() for lane in range(len(senders))}
        self._posted = 0  # rounds posted this push
        self._count = dict.fromkeys(self._handed, 0)  # buffers each lane handed this push
        self._agreed: set[int] = set()  # lanes whose members agreed to this push: bytes follow
        self._stream = torch.cuda.Stream(group.device) if group.is_nccl else None

    def lane(self, index: int, lane: Transport) -> ReceiveLane:
        """Lane ``index``'s transport, its votes on ``lane`` (its own small group)."""
        if not 0 <= index < len(self._senders):
            raise ValueError(f"no lane {index}: this rank takes {len(self._senders)} lanes")
        return ReceiveLane(self, index, lane)

    def begin(self, lanes: Iterable[int]) -> None:
        """A push, over ``lanes`` (the others send nothing in it)."""
        with self._changed:
            assert not any(self._handed.values()), "a push began before the last one ended"
            self._open, self._posted = set(lanes), 0
            self._count = dict.fromkeys(self._handed, 0)
            self._agreed = set()

    def agreed(self, lane: int) -> None:
        """``lane``'s members agreed to the push (its vote before any byte): its sender sends
        its buckets, which this rank must take or abort (see ``done``)."""
        with self._changed:
            self._agreed.add(lane)

    def hand(self, lane: int, buffer: torch.Tensor, timeout_s: float | None) -> _Handed:
        """``lane``'s next buffer to receive into; its work completes with its round."""
        handed = _Handed(buffer, timeout_s if timeout_s is not None else self.group.timeout_s)
        if self._stream is not None:  # what this lane queued on the buffer, for the post to wait on
            handed.ready = torch.cuda.Event()
            handed.ready.record(torch.cuda.current_stream(self.group.device))
        with self._changed:
            if lane not in self._open:
                raise WeightSyncError(f"lane {lane} handed a bucket outside a push it is part of")
            self._handed[lane].append(handed)
            self._count[lane] += 1
            self._post_ready()
        return handed

    def done(self, lane: int, failed: bool = False) -> None:
        """``lane`` hands nothing more this push: the later rounds go on without it. A lane
        that ``failed`` once its members agreed to the push (its sender sends), or that leaves a
        buffer unposted, aborts the group: its sender's later buckets would match no receive
        here (on NCCL, the rounds of this rank would no longer be its peers'), so every rank is
        told now rather than at its bound. One refused before any byte leaves it whole."""
        with self._changed:
            if lane not in self._open:
                return
            self._open.discard(lane)
            stranded, self._handed[lane] = self._handed[lane], deque()
            sending = lane in self._agreed or self._count[lane] > 0
            if stranded or (failed and sending):
                self.group.abort(f"lane {lane} ended mid-push on rank {self.group.rank}")
                for handed in stranded:
                    handed.fail(TransportError("the lane ended before its round was posted"))
            self._post_ready()

    def _post_ready(self) -> None:
        """Post every round whose buffers are all in (under the lock)."""
        while self._open and all(self._handed[lane] for lane in self._open):
            present = sorted(self._open)
            batch = [self._handed[lane].popleft() for lane in present]
            bound = max(handed.timeout_s for handed in batch)
            try:
                posted = self._post(present, batch, bound)
            except Exception as exc:  # the group aborted itself, or this round was refused
                failure = self._failed(f"posting round {self._posted + 1}", exc)
                for handed in batch:
                    handed.fail(failure)
                continue
            for handed in batch:
                handed.posted(posted)
            self._posted += 1
            logger.debug(
                "rank %d posted round %d: lanes %s", self.group.rank, self._posted, present
            )

    def _failed(self, what: str, exc: Exception) -> WeightSyncError:
        """Abort the group (``what`` failed, on this rank's side of a round) and say why."""
        self.group.abort(f"{what} failed: {exc}")
        if isinstance(exc, WeightSyncError):
            return exc
        return TransportError(f"{what} failed: {exc}")

    def _post(self, present: list[int], batch: list[_Handed], bound: float) -> _Round:
        """Round ``present`` (its lanes, in order; ``batch``: their buffers): one batch, or two
        where this rank relays, or over NCCL takes lanes both straight and relayed (see the
        class)."""
        direct: list[tuple[torch.Tensor, int]] = []
        relayed: list[tuple[torch.Tensor, int]] = []
        forwards: list[tuple[torch.Tensor, int]] = []
        for lane, handed in zip(present, batch, strict=True):
            source = self._source[lane]
            if source != self._senders[lane]:
                relayed.append((handed.buffer, source))
                continue
            direct.append((handed.buffer, source))
            forwards += [(handed.buffer, rank) for rank in self._forwards[lane]]
        with self._posting():
            if self._stream is not None:
                for handed in batch:
                    assert handed.ready is not None
                    self._stream.wait_event(handed.ready)
            nccl = self._stream is not None
            if not forwards and not (nccl and direct and relayed):
                return _Round(self.group.exchange([], direct + relayed, bound))
            first = self.group.exchange([], direct, bound)
            if not nccl:
                number = self._posted + 1
                relay = functools.partial(self._relay, number, forwards, relayed, bound)
                return _Round(first, relay)
            first.after()  # the rounds' stream waits for the first batch's end
            return _Round(first, second=self.group.exchange(forwards, relayed, bound))

    def _posting(self) -> AbstractContextManager[object]:
        # NCCL: on the rounds' stream, which NCCL's stream then waits on (see the class).
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()

    def _relay(
        self,
        number: int,
        forwards: list[tuple[torch.Tensor, int]],
        relayed: list[tuple[torch.Tensor, int]],
        bound: float,
    ) -> TorchWork:
        """Gloo: round ``number``'s second batch, once its first is in."""
        try:
            return self.group.exchange(forwards, relayed, bound)
        except Exception as exc:
            raise self._failed(f"relaying round {number}", exc) from exc


class _Round:
    """A posted round, waited on by the threads of every lane in it: one at a time, since a
    ``TorchWork`` lets go of its handle to the first waiter (the others then get its outcome).
    A relayed round has a ``second`` batch: posted with the first (NCCL), or by ``then`` once
    the first is waited on (Gloo)."""

    def __init__(
        self,
        work: TorchWork,
        then: Callable[[], TorchWork] | None = None,
        second: TorchWork | None = None,
    ) -> None:
        self._works = [work] if second is None else [work, second]
        self._then = then
        self._failure: WeightSyncError | None = None
        self._lock = threading.Lock()

    def wait(self) -> None:
        self._each(lambda work: work.wait())

    def after(self) -> None:
        self._each(lambda work: work.after())

    def _each(self, step: Callable[[TorchWork], None]) -> None:
        with self._lock:
            if self._failure is not None:
                raise self._failure
            try:
                step(self._works[0])
                if self._then is not None:
                    then, self._then = self._then, None
                    self._works.append(then())
                for work in self._works[1:]:
                    step(work)
            except WeightSyncError as exc:
                self._failure = exc
                raise


class _Handed:
    """A buffer handed to ``Rounds``: a ``Work`` once its round is posted. Until then a wait
    waits for the round's other lanes, as long as the round's own bound."""

    def __init__(self, buffer: torch.Tensor, timeout_s: float) -> None:
        self.buffer, self.timeout_s = buffer, timeout_s
        self.ready: torch.cuda.Event | None = None  # NCCL: the handing stream's work on it
        self._ready = threading.Event()
        self._round: _Round | None = None
        self._error: WeightSyncError | None = None

    def posted(self, round_: _Round) -> None:
        self._round = round_
        self._ready.set()

    def fail(self, error: WeightSyncError) -> None:
        self._error = error
        self._ready.set()

    def wait(self) -> None:
        self._posted().wait()

    def after(self) -> None:
        self._posted().after()

    def _posted(self) -> _Round:
        if not self._ready.wait(self.timeout_s):
            raise SyncTimeoutError(
                f"the round of a bucket was not posted in {self.timeout_s:.0f} s: another lane "
                "of this rank did not hand its bucket (its sender stalled?) -- check the senders"
            )
        if self._error is not None:
            raise self._error
        assert self._round is not None
        return self._round


class ReceiveLane(_LaneEnd):
    """A receiving rank's end of one lane over one group: each bucket the lane's receive takes
    is handed to the rank's ``Rounds``; the rest is the lane's own group's."""

    def __init__(self, rounds: Rounds, index: int, lane: Transport) -> None:
        super().__init__(lane)
        self._rounds, self._index = rounds, index

    @property
    def device(self) -> torch.device:
        return self._rounds.group.device

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> _Handed:
        if src == self.rank:
            raise ValueError("a receiving rank's lane takes buckets; it broadcasts none")
        return self._rounds.hand(self._index, tensor, timeout_s)

    def vote(self, code: int, timeout_s: float | None = None) -> int:
        verdict = super().vote(code, timeout_s)
        if verdict == VOTE_AGREED:  # before the bytes: the sender sends (after them: no matter)
            self._rounds.agreed(self._index)
        return verdict

    def close(self) -> None:
        self._rounds.done(self._index, failed=True)  # left mid-push: see ``Rounds.done``
        super().close()
