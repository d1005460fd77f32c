"""Pure planning: named tensor metadata + bucket size -> where every byte travels.

The plan is a deterministic function of its inputs and is sent to receivers whole, so both sides
agree on bucket boundaries without re-deriving them. Rules:

* tensors keep their order (state-dict order keeps related tensors in the same bucket);
* each tensor starts at an ``alignment``-aligned offset, so the receiver can view it in place;
* a tensor that fits in one bucket is never split -- if it does not fit in what is left of the
  current bucket, a new bucket starts;
* a tensor larger than a bucket fills what is left of the current bucket and spills over as many
  buckets as it needs, split on element boundaries;
* tensors with no bytes get no segment; the receiver materialises them without any transfer;
* a tensor flagged ``direct`` gets a bucket of its own, broadcast from its own storage (the
  caller flags large contiguous tensors already on the transport's device). The packed bucket
  being filled stays open across it.
* ``tied`` names (sharing a tensor's bytes) get no segments: they arrive as their tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

from weight_sync.wire.metadata import BucketMeta, Segment, SyncPlan, TensorMeta, Tied

# 'auto' direct threshold for host buffers: measured best on Gloo (docs/performance, "What the
# defaults come from").
HOST_DIRECT_MIN_BYTES = 1 << 20


def align_up(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def direct_threshold(
    setting: int | str | None, device_type: str, bucket_bytes: int, collective: bool = True
) -> int | None:
    """The smallest tensor sent from its own storage (None: none is) for buffers on a device of
    ``device_type``, given ``SyncConfig.direct_min_bytes`` (an explicit value wins).
    ``collective``: whether any member takes the push through a collective (the group, or a
    relay fed by it) rather than only through the rings (shared memory, CUDA IPC).

    'auto' on the host is 1 MiB: a host copy costs about what the bytes cost on the wire, so
    skipping it pays from small sizes. On a GPU with a collective, packing is a device copy at
    memory speed (a 32 MiB bucket in some 20 us on an H100) while every collective costs a
    launch and its latency (tens of us on NVLink): a tensor smaller than a bucket would add a
    collective to save less than it costs. From ``bucket_bytes`` up it would fill a bucket of
    its own anyway, so sending it alone adds no collective and saves the copy. On a GPU with
    rings only (the colocated deployment) 1 MiB again: there a packed byte is copied four times
    (packed, into a slot, out of it, unpacked) and a direct one twice (into a slot, out of it
    straight into the worker's tensor), while a tensor sent alone costs the ring's messages of
    a chunk or two, some tens of us (``benchmarks/ring_chunks.py``) -- what a fifth of a MiB
    costs to copy on an H100.
    """
    if setting != "auto":
        return None if setting is None else int(setting)
    if device_type == "cuda" and collective:
        return bucket_bytes
    return HOST_DIRECT_MIN_BYTES


def make_plan(
    tensors: Sequence[TensorMeta],
    bucket_bytes: int,
    alignment: int,
    direct: Sequence[bool] = (),
    tied: Sequence[Tied] = (),
) -> SyncPlan:
    if bucket_bytes < alignment:
        raise ValueError(f"bucket_bytes ({bucket_bytes}) must be >= alignment ({alignment})")
    if direct and len(direct) != len(tensors):
        raise ValueError(f"direct has {len(direct)} flags for {len(tensors)} tensors")
    buckets: list[BucketMeta] = []
    segments: list[Segment] = []
    used = 0

    def close_bucket() -> None:
        nonlocal segments, used
        if segments:
            buckets.append(BucketMeta.model_construct(nbytes=used, segments=tuple(segments)))
        segments, used = [], 0

    for index, meta in enumerate(tensors):
        remaining, tensor_offset = meta.nbytes, 0
        if remaining and direct and direct[index]:
            whole = Segment.model_construct(
                tensor=index, tensor_offset=0, bucket_offset=0, nbytes=remaining
            )
            buckets.append(
                BucketMeta.model_construct(nbytes=remaining, segments=(whole,), direct=True)
            )
            continue
        if remaining and remaining <= bucket_bytes < align_up(used, alignment) + remaining:
            close_bucket()  # fits in a bucket of its own, but not in what is left of this one
        while remaining:
            start = align_up(used, alignment)
            room = bucket_bytes - start
            chunk = min(remaining, room - room % meta.itemsize)
            if chunk <= 0:
                close_bucket()
                continue
            segments.append(
                Segment.model_construct(
                    tensor=index, tensor_offset=tensor_offset, bucket_offset=start, nbytes=chunk
                )
            )
            used = start + chunk
            tensor_offset += chunk
            remaining -= chunk
    close_bucket()
    # The pieces are built unvalidated (they are ours, and per-field validation of thousands of
    # segments is slow); SyncPlan's own validator still checks the whole geometry.
    return SyncPlan(
        alignment=alignment, tensors=tuple(tensors), buckets=tuple(buckets), tied=tuple(tied)
    )
