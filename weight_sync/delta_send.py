"""The trainer's send of a push when it keeps a baseline (``SyncConfig.delta``): dense or a
delta, the baseline brought up to date either way.

The delta layer decides what goes on the wire -- the header of change counts, then the buckets
of a plan whose tensors it encodes as they are read (``weight_sync.delta.transfer.outgoing``); the
``Sender`` broadcasts those buckets as it would any plan's, and knows nothing of deltas. This
module only puts the two in order, so neither imports the other.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weight_sync.deadline import Deadline
from weight_sync.delta.baseline import Baseline
from weight_sync.delta.transfer import density, encode_header, outgoing
from weight_sync.metadata import SyncPlan
from weight_sync.sender import Sender
from weight_sync.transport import Transport


@dataclass(frozen=True)
class Sent:
    checksums: list[int] | None  # per bucket, then per sparse blob
    wire_bytes: int  # what went over the transport, header included
    density: float | None = None  # of a delta: changed elements / elements (whole tensors count)
    scan_s: float = 0.0  # of a delta: the trainer's comparison with its copy, before any byte went


def send(
    transport: Transport,
    plan: SyncPlan,
    tensors: Sequence[torch.Tensor],
    baseline: Baseline,
    *,
    delta: bool,
    bucket_bytes: int,
    deadline: Deadline | None = None,
    with_checksums: bool = False,
) -> Sent:
    """Send ``plan`` dense or as a delta against ``baseline``, bringing it up to date either way.
    The caller brackets this with ``baseline.begin()`` and ``baseline.finish()``.

    A sender of its own per push: a delta's layout is a new plan every push, so there are no
    staging buffers worth keeping from one to the next."""
    started = time.perf_counter()
    counts = baseline.scan(plan, tensors) if delta else None
    scan_s = time.perf_counter() - started if delta else 0.0
    header_bytes = 0
    if counts:  # the header first: the workers size every receive that follows by it
        header = encode_header(counts)
        timeout = None if deadline is None else deadline.left(float("inf"))
        transport.broadcast(
            header.to(transport.device), src=transport.rank, timeout_s=timeout
        ).wait()
        header_bytes = header.numel()
    out = outgoing(
        plan, tensors, baseline, counts, bucket_bytes=bucket_bytes, with_checksums=with_checksums
    )
    try:
        sums = Sender(transport).send(
            out.plan, out.sources, deadline, with_checksums, on_packed=out.record
        )
    finally:
        out.close()
    if counts is None:
        return Sent(sums, plan.nbytes)
    if sums is not None and out.blob_sums is not None:
        sums += out.blob_sums
    return Sent(sums, header_bytes + out.plan.nbytes, density(plan, counts), scan_s)
