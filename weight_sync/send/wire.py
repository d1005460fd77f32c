"""What goes on the wire for each push, dense or a delta, and why: the push's one seam with the
delta layer.

``Pusher`` asks a ``Wire`` what this push offers the members (``Wire.decide``: a delta, and the
bases it is built on and makes), hands it the sender when the bytes go (``Wire.send``), and tells
it what the members did (``Wire.bases_after``, ``Wire.sent``); it never touches the trainer's
copy of the members' weights (``delta.baseline.Baseline``) or the dense-or-delta timing
(``delta.choice.DeltaChoice``), which live here. Without ``SyncConfig.delta`` every push is dense
and the ``Sender`` broadcasts the plan's own buckets.

With a baseline, the delta layer decides what goes on the wire -- per section of the plan, the
header of change counts, then the buckets of a plan whose tensors it encodes as they are read
(``weight_sync.delta.transfer.outgoing``); the ``Sender`` broadcasts those buckets as it would
any plan's, and knows nothing of deltas. This module puts the two in order, so that neither
imports the other, and keeps the scan one section ahead of the wire.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from typing_extensions import Self

from weight_sync.config import SyncConfig
from weight_sync.control.deadline import Deadline
from weight_sync.delta.baseline import Baseline
from weight_sync.delta.choice import Choice, DeltaChoice
from weight_sync.delta.layout import DELTA_SECTIONS, Section, sections
from weight_sync.delta.lineage import next_base
from weight_sync.delta.transfer import Outgoing, density, encode_header, outgoing
from weight_sync.send.sender import Sender
from weight_sync.transport import Transport
from weight_sync.wire.metadata import PrepareRequest, SyncPlan


@dataclass(frozen=True)
class Decision:
    """How one push goes, as far as the trainer knows before asking the members: the fields of
    its ``PrepareRequest`` that say so, and the choice they came from."""

    choice: Choice
    sharded: bool
    built_on: str | None  # the base a delta is computed against (the baseline's), if any
    new_base: str | None  # the base the members hold once they commit this push
    delta: bool

    def request_fields(self, bucket_bytes: int) -> dict[str, object]:
        return {
            "built_on": self.built_on,
            "new_base": self.new_base,
            "delta": self.delta,
            "delta_bucket_bytes": bucket_bytes if self.delta else 0,
            "delta_sections": DELTA_SECTIONS if self.delta else 1,
        }


def as_dense(request: PrepareRequest) -> PrepareRequest:
    """``request`` sent dense, for members that do not hold its base (the broadcast costs what
    its largest stream costs, so all of them take it dense)."""
    return request.model_copy(update={"delta": False, "delta_bucket_bytes": 0, "delta_sections": 1})


class Wire:
    """Dense or delta for one updater's pushes (``SyncConfig.delta``), and the baseline a delta
    is computed against."""

    def __init__(self, config: SyncConfig) -> None:
        self._config = config
        self._baseline = Baseline() if config.delta else None
        self._choice = DeltaChoice(config.delta)
        self._far = False  # some member of the current group receives across a network link

    def reached(self, far: bool) -> None:
        """A group was formed whose members are ``far`` (or not): where that changed, what was
        timed no longer holds."""
        if far != self._far:
            self._choice.forget()
            self._far = far

    def decide(self, version: int, sharded: bool, bases: Sequence[str | None]) -> Decision:
        """Push ``version`` as a delta when the choice says so, the trainer keeps a baseline and
        every member holds it (``bases``, as far as the trainer knows: each member checks again
        when it prepares)."""
        choice, baseline = self._choice.choose(self._far), self._baseline
        built_on = new_base = None
        if baseline is not None and (sharded or not choice.keep_baseline):
            baseline.forget()  # gathered bucket by bucket (nothing to compare), or not worth it
        elif baseline is not None:
            built_on, new_base = baseline.id, baseline.name_for(version)
        delta = choice.delta and built_on is not None and all(held == built_on for held in bases)
        return Decision(choice, sharded, built_on, new_base, delta)

    def send(
        self,
        sender: Sender,
        request: PrepareRequest,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        deadline: Deadline,
        bucket_bytes: int,
    ) -> Sent:
        """Broadcast push ``request`` through ``sender``: the plan's own buckets, or -- where
        the trainer keeps a baseline -- dense or a delta against it, bringing it up to date.
        ``bucket_bytes``: the group's (``SyncConfig.sized_for`` its device)."""
        checksum, baseline = self._config.checksum, self._baseline
        if baseline is None or request.new_base is None:
            return Sent(sender.send(plan, tensors, deadline, checksum), plan.nbytes)
        baseline.begin()
        sent = send_with_baseline(
            sender.transport,
            plan,
            tensors,
            baseline,
            delta=request.delta,
            bucket_bytes=bucket_bytes,
            sections_asked=request.delta_sections,
            deadline=deadline,
            with_checksums=checksum,
        )
        baseline.finish(plan, request.version, request.partial)
        return sent

    @staticmethod
    def bases_after(
        held: Sequence[str | None], request: PrepareRequest, in_place: Sequence[bool]
    ) -> list[str | None]:
        """The base each member holds once push ``request`` committed (``in_place``: which of
        them wrote every tensor in place; the others' bases are unknown)."""
        full = not request.partial
        return [
            next_base(base, request.built_on, request.new_base, full) if ready else None
            for base, ready in zip(held, in_place, strict=True)
        ]

    def sent(
        self, decision: Decision, request: PrepareRequest, seconds: float, payload_bytes: int
    ) -> str:
        """A push went out as ``request`` and took ``seconds`` until every member had it: timed
        for the next choice. Returns why it went the way it did (``PushResult.delta_reason``)."""
        went = _as_sent(decision, request)
        if request.built_on is not None:  # the first push into a copy also allocates it
            self._choice.record(went, seconds, payload_bytes)
        return went.reason


def _as_sent(decision: Decision, request: PrepareRequest) -> Choice:
    """The way a push went, and why: as chosen, or dense where a delta could not be sent."""
    choice = decision.choice
    if decision.sharded and choice.keep_baseline:
        return Choice(False, "a sharded source is gathered bucket by bucket: dense", False)
    if request.delta == choice.delta:
        return choice
    if request.built_on is None:
        why = "the trainer holds no copy of the workers' weights yet: dense"
    else:
        why = "a worker does not hold the trainer's base: dense for all"
    return Choice(request.delta, why, choice.keep_baseline)


@dataclass(frozen=True)
class Sent:
    checksums: list[int] | None  # per bucket, then per sparse blob
    wire_bytes: int  # what went over the transport, header included
    density: float | None = None  # of a delta: changed elements / elements (whole tensors count)
    scan_s: float = 0.0  # of a delta: how long the send waited for the trainer's scan


def send_with_baseline(
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
            out = outgoing(
                part.plan,
                own,
                baseline,
                counts,
                bucket_bytes=bucket_bytes,
                with_checksums=with_checksums,
            )
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
        self,
        baseline: Baseline,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        parts: Sequence[Section],
    ) -> None:
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
