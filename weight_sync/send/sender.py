"""Trainer side of the data plane: plan a push for the transport, pack its buckets, broadcast
them. What is sent was checked before (``weight_sync.wire.state_dict``); what it means -- dense weights,
or a delta's encoded blobs -- is the caller's business: this sends a plan's buckets."""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from weight_sync.config import SyncConfig
from weight_sync.control.deadline import Deadline
from weight_sync.transport import Transport, Work
from weight_sync.transport.devices import sized_for
from weight_sync.wire.checksums import Checksum, checksum_of, read_checksums
from weight_sync.wire.metadata import SyncPlan, TensorMeta, Tied
from weight_sync.wire.packing import Packer, Staging, byte_view, staging_slots
from weight_sync.wire.planner import direct_threshold, make_plan
from weight_sync.wire.state_dict import Entries, is_dtensor, wire_dtype

# ``Entries`` is named here too: callers that plan by hand (benchmarks/pack_paths.py) import it
# from this module.
__all__ = ["InFlight", "PushPlanner", "Sender"]

logger = logging.getLogger(__name__)

# Read column by column: see PushPlanner.plan.
_DTYPE, _SHAPE, _ITEMSIZE = map(operator.attrgetter, ("dtype", "shape", "itemsize"))


class PushPlanner:
    """Plans pushes for a transport whose buffers live on ``device``, reusing the last plan
    while the layout is unchanged -- the usual case in a training loop, which pushes the same
    names, dtypes and shapes every step -- so neither the plan nor its digest is rebuilt.

    Tensors of at least ``direct_min_bytes`` (resolved for ``device``: ``direct_threshold``)
    that are contiguous, already on ``device`` and not cast are sent from their own storage;
    the rest are packed (and cast while packing).
    """

    def __init__(self, config: SyncConfig, device: torch.device, collective: bool = True) -> None:
        """``collective``: whether a member takes the push through a collective rather than
        only through the rings (see ``direct_threshold``)."""
        self._config = sized_for(config, device)  # as given, if already sized
        self._device = device
        self._collective = collective
        self._last: _Planned | None = None

    def plan(self, entries: Entries) -> SyncPlan:
        # Column by column, as in entries._plain_entries: this runs on every push. The shapes are
        # compared one by one as they are read, not kept: thousands of torch.Size objects alive
        # at once would wake the garbage collector.
        names, tensors, tied = entries.names, entries.tensors, entries.tied
        dtypes = list(map(_DTYPE, tensors))
        casts = {dtype: wire_dtype(dtype, self._config.cast_dtype) for dtype in set(dtypes)}
        wire = list(map(casts.__getitem__, dtypes))
        direct = self._direct(tensors, dtypes, wire)
        last = self._last
        if (
            last is not None
            and last.names == names
            and last.dtypes == dtypes
            and last.direct == direct
            and last.tied == tied
            and all(map(operator.eq, map(_SHAPE, tensors), last.shapes))
        ):
            return last.plan
        metas = [
            TensorMeta.of(name, tensor, dtype)
            for name, tensor, dtype in zip(names, tensors, wire, strict=True)
        ]
        config = self._config
        plan = make_plan(metas, config.sized_bucket_bytes, config.alignment, direct, tied)
        shapes = [meta.shape for meta in metas]
        self._last = _Planned(list(names), dtypes, shapes, direct, list(tied), plan)
        return plan

    def _direct(
        self, tensors: list[torch.Tensor], dtypes: list[torch.dtype], wire: list[torch.dtype]
    ) -> list[bool]:
        """Which tensors are sent from their own storage: large enough (the full tensor's
        size, for a DTensor too), contiguous, on the transport's device and not cast."""
        config = self._config
        threshold = direct_threshold(
            config.direct_min_bytes, self._device.type, config.sized_bucket_bytes, self._collective
        )
        direct = [False] * len(tensors)
        if threshold is None:
            return direct
        sizes = map(operator.mul, map(torch.Tensor.numel, tensors), map(_ITEMSIZE, dtypes))
        large = itertools.compress(
            range(len(tensors)), map(operator.ge, sizes, itertools.repeat(threshold))
        )
        for index in large:
            tensor = tensors[index]
            direct[index] = (
                _is_contiguous(tensor)
                and tensor.device == self._device
                and dtypes[index] == wire[index]
            )
        return direct


@dataclass(frozen=True)
class _Planned:
    """A plan and the layout it was made for (a tensor's shape as its plan has it: a tuple)."""

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    direct: list[bool]
    tied: list[Tied]
    plan: SyncPlan


def _is_contiguous(tensor: torch.Tensor) -> bool:
    # A DTensor is gathered into a fresh, contiguous tensor just before it is sent.
    return is_dtensor(tensor) or tensor.is_contiguous()


class Sender:
    """Broadcasts a plan's buckets from this rank: packing bucket k+1 while bucket k is on the wire.

    On a GPU (NCCL) a steady-state push synchronises with the host once, at its end: packing
    runs on the current stream, each broadcast is ordered after it by the process group (its
    NCCL stream waits on the current one: ProcessGroupNCCL.cpp, ``collective`` ->
    ``syncStream``), and before a staging buffer is packed again the current stream waits for
    the broadcast still reading it (``Work.after``: ``WorkNCCL::synchronizeStream``, an event
    wait on the device) -- the host never polls in between. On the host (Gloo, the ring)
    ``after`` is ``wait``, and the loop is what it always was there.
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        # The last plan's staging buffers and packing, kept: a training loop pushes one plan
        # over and over, and packs it then with no work per tensor (see packing.Staging).
        self._staging: Staging | None = None

    @property
    def transport(self) -> Transport:
        return self._transport

    def send(
        self,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        deadline: Deadline | None = None,
        with_checksums: bool = False,
        on_packed: Callable[[int, torch.Tensor], None] | None = None,
    ) -> list[int] | None:
        """Broadcast every bucket; returns each bucket's checksum (``checksums.checksum``) if
        ``with_checksums``.

        Each collective is bounded by the group's timeout and by what is left of ``deadline``.
        ``on_packed(index, data)`` sees each bucket's bytes as it goes out, while the bucket
        before it is still on the wire: the caller's own use of the bytes packed (a copy kept of
        what the workers now hold) costs no second packing.
        """
        return self.start(plan, tensors, deadline, with_checksums, on_packed).finish()

    def start(
        self,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        deadline: Deadline | None = None,
        with_checksums: bool = False,
        on_packed: Callable[[int, torch.Tensor], None] | None = None,
    ) -> InFlight:
        """``send`` up to its one host synchronisation: every bucket packed and its broadcast
        posted; ``finish`` on what this returns waits for them. Split so that the GPU suite can
        check that nothing before ``finish`` synchronises with the host."""
        transport = self._transport
        sums: list[Checksum] | None = [] if with_checksums else None
        works: list[Work] = []
        if not plan.buckets:
            return InFlight(works, sums)
        # GPU tensors over a host transport: their bytes cross in pinned buffers.
        crossing = _cuda_devices(tensors) if transport.device.type == "cpu" else []
        if (
            self._staging is None
            or self._staging.plan is not plan
            or (crossing and not self._staging.pinned)
        ):
            self._staging = Staging(plan, transport.device, pinned=bool(crossing))
        packer = Packer(plan, tensors, self._staging)
        buffers = self._staging.buffers
        slots = staging_slots(plan)
        # On a GPU two broadcasts stay in flight, so the NCCL stream never idles between
        # buckets. On the host (where ``after`` is ``wait``) one, as before: a second one in
        # flight measured no faster on Gloo over 2 cores (it competes with packing for them).
        in_flight = 2 if transport.device.type == "cuda" else 1
        for index, bucket in enumerate(plan.buckets):
            if index >= 2:
                # The broadcast two buckets back read the staging buffer this bucket may be
                # packed into: stream order, not a host wait (on the host, long done already).
                works[index - 2].after()
            slot = slots[index]
            if slot is None:  # direct: the tensor's own bytes go on the wire
                data = byte_view(tensors[bucket.segments[0].tensor])
                assert data.device == transport.device
            else:
                data = packer.pack(index, buffers[slot])
                for device in crossing:  # Gloo reads the bytes from its own threads
                    torch.cuda.current_stream(device).synchronize()
            if sums is not None:
                sums.append(checksum_of(data))
            if on_packed is not None:
                on_packed(index, data)
            if in_flight == 1 and index >= 1:
                works[index - 1].after()
            timeout = None if deadline is None else deadline.left(float("inf"))
            works.append(transport.broadcast(data, src=transport.rank, timeout_s=timeout))
        logger.debug("posted %d buckets, %d bytes", len(plan.buckets), plan.nbytes)
        return InFlight(works, sums)


@dataclass
class InFlight:
    """A push's broadcasts, posted, and its checksums, queued (see ``Sender.start``)."""

    works: list[Work]
    sums: list[Checksum] | None

    def finish(self) -> list[int] | None:
        """The push's one host synchronisation: a bounded wait on every broadcast, in order (one
        already complete returns at once), then every checksum read in one copy."""
        works, self.works = self.works, []
        for work in works:
            work.wait()
        return None if self.sums is None else read_checksums(self.sums)


def _cuda_devices(tensors: Sequence[torch.Tensor]) -> list[torch.device]:
    """The GPUs among ``tensors`` (copies from each run on that device's current stream). None
    where CUDA was never initialised in this process, and none for a sequence that makes its
    tensors on demand (encoded as they are read, always on the host): reading it would make them."""
    if not torch.cuda.is_initialized() or not isinstance(tensors, list | tuple):
        return []
    return list({tensor.device for tensor in tensors if tensor.is_cuda})
