"""What the packer reads for a delta push: whole tensors as they are, blobs encoded on demand,
each once, ahead of the packer on a few threads (``Sources``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from weight_sync.delta.layout import (
    DeltaLayout,
)
from weight_sync.wire.metadata import SyncPlan

if TYPE_CHECKING:
    from weight_sync.delta.baseline import Baseline


class Sources(Sequence[torch.Tensor]):
    """The tensors ``Packer`` reads for a delta layout, blobs made on demand, each once: a blob
    is kept until the packer reads a blob of a later bucket than its last (a blob split over
    buckets is read again in the next one, and not necessarily first there: the packer copies a
    bucket's whole small blobs before the rest), since encoding a sparse blob again would find
    nothing left to send.

    Blobs not encoded by the scan are encoded ahead of the packer, in the order it reads them,
    on up to ``Baseline.threads`` threads and at most two buckets' worth ahead: while a bucket is
    on the wire (and far hosts pass on and patch the one before), the next ones are being
    compared. ``close`` stops that (the caller's, whatever happened)."""

    def __init__(
        self,
        baseline: Baseline,
        layout: DeltaLayout,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        sums: list[int] | None,
    ) -> None:
        self._baseline, self._layout, self._plan, self._tensors = baseline, layout, plan, tensors
        self._sums = sums
        # The first and last bucket each blob is packed into.
        self._buckets: dict[int, tuple[int, int]] = {}
        for number, bucket in enumerate(layout.plan.buckets):
            for seg in bucket.segments:
                if seg.tensor in layout.blobs:
                    first, _ = self._buckets.get(seg.tensor, (number, number))
                    self._buckets[seg.tensor] = (first, number)
        self._made: dict[int, torch.Tensor] = {}  # blobs made, kept until past their last bucket
        # The blobs with work to do (not encoded by the scan), in the order the packer reads.
        self._order = [
            index
            for index, blob in sorted(layout.blobs.items())
            if blob.dense
            or (plan.tensors[blob.tensor].name, blob.first_span) not in baseline._encoded
        ]
        self._next = 0  # the next of ``_order`` to encode ahead
        self._ahead: dict[int, Future[tuple[torch.Tensor, int | None]]] = {}
        self._ahead_bytes = 0
        self._taken: set[int] = set()  # encoded here before their turn ahead came
        self._budget = 2 * max((bucket.nbytes for bucket in layout.plan.buckets), default=0)
        self._pool = (
            ThreadPoolExecutor(baseline.threads, thread_name_prefix="weight-sync-encode")
            if baseline.threads > 1 and len(self._order) > 1
            else None
        )
        # One flattened tensor cached for each of the two readers (a non-contiguous one is
        # copied to flatten it: once, as blobs of a tensor come one after another).
        self._flat_here = _Flat(tensors)
        self._flat_ahead = _Flat(tensors)

    def __len__(self) -> int:
        return len(self._layout.plan.tensors)

    def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        whole = self._layout.whole.get(index)
        if whole is not None:
            return self._tensors[whole]
        made = self._made.get(index)
        if made is not None:
            return made
        first, _ = self._buckets[index]
        for done in [i for i in self._made if self._buckets[i][1] < first]:
            del self._made[done]
        self._fill()
        future = self._ahead.pop(index, None)
        if future is None:  # not ahead (encoded by the scan, no threads, out of order): here
            self._taken.add(index)
            data, crc = self._encode(index, self._flat_here.of(self._layout.blobs[index].tensor))
        else:
            data, crc = future.result()
            self._ahead_bytes -= self._layout.plan.tensors[index].nbytes
            self._fill()
        if crc is not None and self._sums is not None:
            self._sums.append(crc)
        self._made[index] = data
        return data

    def close(self) -> None:
        """Stop encoding ahead: what has not started never will, and what has is waited for."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _fill(self) -> None:
        """Encode ahead until two buckets' worth are on the way."""
        while (
            self._pool is not None
            and self._next < len(self._order)
            and self._ahead_bytes < self._budget
        ):
            index = self._order[self._next]
            self._next += 1
            if index in self._taken:
                continue
            self._ahead[index] = self._pool.submit(
                self._encode, index, self._flat_ahead.of(self._layout.blobs[index].tensor)
            )
            self._ahead_bytes += self._layout.plan.tensors[index].nbytes

    def _encode(self, index: int, flat: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """Blob ``index`` of the tensor ``flat`` (flattened), as ``Baseline.encode`` makes it."""
        blob = self._layout.blobs[index]
        meta = self._plan.tensors[blob.tensor]
        return self._baseline.encode(blob, meta, flat, self._sums is not None)


class _Flat:
    """A tensor of ``tensors`` flattened, the last one asked for kept."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = tensors
        self._kept: tuple[int, torch.Tensor] | None = None

    def of(self, index: int) -> torch.Tensor:
        if self._kept is None or self._kept[0] != index:
            self._kept = (index, self._tensors[index].reshape(-1))
        return self._kept[1]
