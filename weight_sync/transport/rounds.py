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
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import torch

from weight_sync.transport.torch_group import TorchGroup, TorchWork

logger = logging.getLogger(__name__)

DEPTH = 2  # batches a rank keeps in flight: the next one posted while one is on the wire


def schedule(counts: Sequence[int]) -> list[tuple[int, ...]]:
    """The lanes (indices into ``counts``, each lane's number of buckets) that move a bucket in
    each round: round k holds the k-th bucket of every lane that has one, in lane order. Every
    receiving rank derives the same rounds from the same counts, hence posts its batches in an
    order every sender agrees with: a sender's k-th send is in each receiver's round k."""
    if any(count < 0 for count in counts):
        raise ValueError(f"a lane cannot have a negative number of buckets: {list(counts)}")
    rounds = max(counts, default=0)
    return [tuple(lane for lane, count in enumerate(counts) if count > k) for k in range(rounds)]


def send(
    group: TorchGroup,
    buckets: Iterable[torch.Tensor],
    receivers: Sequence[int],
    timeout_s: float | None = None,
    depth: int = DEPTH,
) -> int:
    """A sender's part: each of ``buckets`` (contiguous uint8, on the group's device for NCCL)
    to every rank of ``receivers`` as one batch, in order, at most ``depth`` batches in flight:
    bucket k's batch is done before bucket k + ``depth`` is taken from ``buckets``, so a caller
    may make them in ``depth`` buffers taken in turn. ``timeout_s`` bounds each batch from when
    it could start. Returns how many buckets were sent; raises the group's
    ``SyncTimeoutError``/``TransportError`` (it aborts) if a receiving rank fails."""
    if not receivers:
        raise ValueError("a sender needs at least one receiving rank")
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    flight: deque[TorchWork] = deque()
    sent = 0
    upcoming = iter(buckets)
    while True:
        if len(flight) == depth:  # before the next bucket is made: it may reuse a buffer
            flight.popleft().wait()
        bucket = next(upcoming, None)
        if bucket is None:
            break
        flight.append(group.exchange([(bucket, rank) for rank in receivers], [], timeout_s))
        sent += 1
    while flight:
        flight.popleft().wait()
    return sent


def receive(
    group: TorchGroup,
    lanes: Sequence[tuple[int, Sequence[int]]],
    land: Callable[[int, int, torch.Tensor], None],
    timeout_s: float | None = None,
    depth: int = DEPTH,
) -> None:
    """A receiving rank's part: every lane's buckets (``lanes``: each sender's rank in the
    group and its buckets' sizes, in lane order), round by round (``schedule``), each round one
    batch, at most ``depth`` rounds in flight. ``land(lane, k, bucket)`` is called once round
    k is in, for each of its lanes in lane order; the buffer is received into again ``depth``
    rounds later, so ``land`` copies out what it keeps (on NCCL, on this thread's current
    stream: each post orders NCCL's stream after it). Staging is ``depth`` buffers per lane,
    each the size of the lane's largest bucket, on the group's device. Raises the group's
    ``SyncTimeoutError``/``TransportError`` (it aborts) if a sender fails."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    rounds = schedule([len(sizes) for _, sizes in lanes])
    staging = [
        [torch.empty(max(sizes, default=0), dtype=torch.uint8, device=group.device)
         for _, sizes in lanes]
        for _ in range(min(depth, len(rounds)))
    ]  # fmt: skip

    def buffer(k: int, lane: int) -> torch.Tensor:
        return staging[k % depth][lane][: lanes[lane][1][k]]

    def post(k: int) -> TorchWork:
        batch = [(buffer(k, lane), lanes[lane][0]) for lane in rounds[k]]
        return group.exchange([], batch, timeout_s)

    flight = deque(post(k) for k in range(min(depth, len(rounds))))
    for k, present in enumerate(rounds):
        flight.popleft().wait()
        for lane in present:
            land(lane, k, buffer(k, lane))
        if k + depth < len(rounds):
            flight.append(post(k + depth))
    logger.debug("rank %d received %d rounds from %d lanes", group.rank, len(rounds), len(lanes))
