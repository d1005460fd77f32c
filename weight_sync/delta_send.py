"""The trainer's send of a push when it keeps a baseline (``SyncConfig.delta``): dense or a
delta, the baseline brought up to date either way.

The delta layer decides what goes on the wire -- per section of the plan, the header of change
counts, then the buckets of a plan whose tensors it encodes as they are read
(``weight_sync.delta.transfer.outgoing``); the ``Sender`` broadcasts those buckets as it would
any plan's, and knows nothing of deltas. This module only puts the two in order, so neither
imports the other, and keeps the scan one section ahead of the wire.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from typing_extensions import Self

from weight_sync.deadline import Deadline
from weight_sync.delta.baseline import Baseline
from weight_sync.delta.layout import Section, sections
from weight_sync.delta.transfer import Outgoing, density, encode_header, outgoing
from weight_sync.metadata import SyncPlan
from weight_sync.sender import Sender
from weight_sync.transport import Transport


@dataclass(frozen=True)
class Sent:
    checksums: list[int] | None  # per bucket, then per sparse blob
    wire_bytes: int  # what went over the transport, header included
    density: float | None = None  # of a delta: changed elements / elements (whole tensors count)
    scan_s: float = 0.0  # of a delta: how long the send waited for the trainer's scan


def send(
    transport: Transport,
    plan: SyncPlan,
    tensors: Sequence[torch.Tensor],
    baseline: Baseline,
    *,
    delta: bool,
    bucket_bytes: int,
    sections_asked: int = 1,
    deadline: Deadline | None = None,
    with_checksums: bool = False,
) -> Sent:
    """Send ``plan`` dense or as a delta against ``baseline``, bringing it up to date either way.
    The caller brackets this with ``baseline.begin()`` and ``baseline.finish()``.

    A delta goes in ``sections(plan, sections_asked)``: each section's header, then its buckets.
    The scan runs on a thread of its own, section after section, so that section k+1 is compared
    while section k is packed and on the wire: the first byte waits only for the first section's
    scan, not the whole model's (W1 over 1 Gbit/s: the scan was 0.12 of a 0.30 s push).

    A sender of its own per section: a delta's layout is a new plan every push, so there are no
    staging buffers worth keeping from one to the next."""
    if not delta:
        dense = outgoing(plan, tensors, baseline, None, bucket_bytes=bucket_bytes)
        return Sent(_send(transport, dense, deadline, with_checksums), plan.nbytes)
    parts = sections(plan, sections_asked)
    sums: list[int] | None = [] if with_checksums else None
    wire_bytes = changed = 0
    waited = 0.0
    with _Scans(baseline, plan, tensors, parts) as scans:
        for number, part in enumerate(parts):
            started = time.perf_counter()
            counts = scans.counts(number)
            waited += time.perf_counter() - started
            changed += sum(counts)
            if counts:  # the header first: the workers size every receive that follows by it
                header = encode_header(counts)
                timeout = None if deadline is None else deadline.left(float("inf"))
                transport.broadcast(
                    header.to(transport.device), src=transport.rank, timeout_s=timeout
                ).wait()
                wire_bytes += header.numel()
            own = tensors[part.first : part.stop]
            out = outgoing(part.plan, own, baseline, counts, bucket_bytes=bucket_bytes,
                           with_checksums=with_checksums)  # fmt: skip
            part_sums = _send(transport, out, deadline, with_checksums)
            wire_bytes += out.plan.nbytes
            if sums is not None and part_sums is not None:
                sums += part_sums
    return Sent(sums, wire_bytes, density(plan, changed), waited)


def _send(
    transport: Transport, out: Outgoing, deadline: Deadline | None, with_checksums: bool
) -> list[int] | None:
    """Broadcast ``out``'s buckets; its checksums, per bucket then per sparse blob."""
    try:
        sums = Sender(transport).send(
            out.plan, out.sources, deadline, with_checksums, on_packed=out.record
        )
    finally:
        out.close()
    if sums is not None and out.blob_sums is not None:
        sums += out.blob_sums
    return sums


class _Scans:
    """The scans of a delta's sections, in order, on one thread, as far ahead of the sending as
    they get. Leaving waits for the scan under way and drops the rest: nothing touches the
    baseline once the send is over, whatever became of it.

    The first section is compared on all of the baseline's threads (nothing else runs yet), the
    others on one fewer: the section before is being packed and broadcast meanwhile, and that
    core is left to it. On 2 cores (W1 over 1 Gbit/s, 3 far workers, medians of 21 pushes) four
    sections scanned on one thread took 0.25 s against 0.30 s for one section on both; four
    sections on both cores were no faster than one (scan and packing fought for the cores)."""

    def __init__(
        self, baseline: Baseline, plan: SyncPlan, tensors: Sequence[torch.Tensor],
        parts: Sequence[Section],
    ) -> None:  # fmt: skip
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-sync-scan-ahead")
        threads = [baseline.threads] + [max(1, baseline.threads - 1)] * (len(parts) - 1)
        try:
            self._futures = [
                self._pool.submit(
                    baseline.scan, part.plan, tensors[part.first : part.stop], plan, n
                )
                for part, n in zip(parts, threads, strict=True)
            ]
        except BaseException:  # none may go on scanning once this has raised
            self._pool.shutdown(wait=True, cancel_futures=True)
            raise

    def counts(self, number: int) -> list[int]:
        return self._futures[number].result()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
