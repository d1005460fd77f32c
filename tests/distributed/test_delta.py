"""Delta pushes on spawned ranks over the shared-memory ring, through the real ``delta.send`` and
``Receiver``: a model of ~10M elements (blobs of every kind, the direct path, a tied name),
streamed and staged, with checksums, in one section and in several. (The Ray-level guarantees
-- lineage, fallback, faults -- are in tests/ray.)"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import RankContext, run_ranks
from weight_sync import SyncConfig
from weight_sync.wire.checksums import state_dict_digests
from weight_sync.delta.baseline import Baseline
from weight_sync.wire.metadata import PrepareRequest, SyncPlan
from weight_sync.receive.receiver import Receiver, expecting
from weight_sync.send import wire as transfer
from weight_sync.wire.state_dict import Entries
from weight_sync.send.sender import PushPlanner
from weight_sync.transport import shm

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not shm.available(), reason="the ring needs Linux (memfd, fd passing)"),
]
BUCKET = 1 << 20
CONFIG = SyncConfig(
    bucket_bytes=BUCKET, direct_min_bytes=4 << 20, cast_dtype="bfloat16", checksum=True
)
BASES = [None, *(f"{'5e' * 8}:{version}" for version in (1, 2, 3))]  # what each push makes


def model(seed: int) -> dict[str, torch.Tensor]:
    """~10M fp32 elements, with tensors on the direct path and a tied name."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "embed": torch.randn(3000, 1024, generator=gen),  # 12 MB in bf16: direct
        "w1": torch.randn(2048, 2048, generator=gen),
        "w2": torch.randn(2048, 1024, generator=gen),
        "bias": torch.randn(1000, generator=gen),
        "w3": torch.randn(512, 1024, generator=gen),
    }
    tensors["head"] = tensors["embed"]
    return tensors


def step(tensors: dict[str, torch.Tensor], seed: int) -> None:
    """An update that changes about 2% of the values as bf16 holds them."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name != "head":
            tensor.mul_(1 + 0.0001 * torch.randn(tensor.shape, generator=gen))


def request(
    plan: SyncPlan, version: int, staging: str, built_on: str | None, new_base: str, sections: int
) -> str:
    delta = built_on is not None
    return PrepareRequest(
        version=version, plan_digest=plan.digest, plan=plan, staging=staging, checksum=True,
        built_on=built_on, new_base=new_base, delta=delta, delta_bucket_bytes=BUCKET,
        delta_sections=sections if delta else 1,
    ).model_dump_json()  # fmt: skip


def delta_rank(ctx: RankContext, sections: int) -> dict:
    """Rank 0 pushes dense, then two deltas in ``sections``; rank 1 streams them in place, rank 2
    stages them. Each returns, per push, its checksums (and the workers their weights'
    digests)."""
    tensors = model(seed=5)
    entries = Entries(list(tensors), list(tensors.values()))
    plan = PushPlanner(CONFIG, torch.device("cpu")).plan(entries)
    if ctx.rank == 0:
        baseline = Baseline()
        ring = shm.ShmWriter(ctx.group_id, ctx.world_size - 1, shm.slot_bytes_for(BUCKET), 30)
        ctx.ports()
        ring.accept(30)
        out: dict = {"sums": [], "wire": [], "digests": []}
        try:
            for version in (1, 2, 3):
                if version > 1:
                    step(tensors, seed=version)
                baseline.begin()
                sent = transfer.send_with_baseline(ring, plan, entries.tensors, baseline, delta=version > 1,
                                     bucket_bytes=BUCKET, sections_asked=sections,
                                     with_checksums=True)  # fmt: skip
                baseline.finish(plan, version, partial=False)
                out["sums"].append(sent.checksums)
                out["wire"].append(sent.wire_bytes)
                as_held = {n: t.to(torch.bfloat16) for n, t in tensors.items()}
                out["digests"].append(state_dict_digests(as_held))
        finally:
            ring.close()
        return out
    ctx.ports()
    metas = plan.metas()
    held = {name: torch.zeros(meta.shape, dtype=meta.torch_dtype) for name, meta in metas.items()}
    held["head"] = held["embed"]
    receiver = Receiver()
    receiver.join(ctx.shm_spec(), max_metadata_bytes=1 << 24)
    staging = "stream" if ctx.rank == 1 else "atomic"
    out = {"sums": [], "digests": []}
    try:
        for version in (1, 2, 3):
            asked = request(plan, version, staging, BASES[version - 1], BASES[version], sections)
            reply = receiver.prepare(asked, expecting(lambda: None), lambda: held)
            assert reply.accepted and reply.in_place, reply
            report = receiver.receive(version, lambda items: None, held)
            receiver.commit(version, lambda items: None, held)
            assert receiver.version == version and receiver.delta_base == BASES[version]
            out["sums"].append(list(report.checksums or ()))
            out["digests"].append(state_dict_digests(held))
    finally:
        receiver.leave()
    return out


@pytest.mark.parametrize("sections", [1, 4])
def test_deltas_stream_and_stage_bit_for_bit_with_checksums(sections: int) -> None:
    trainer, streamed, staged = run_ranks(delta_rank, 3, sections, timeout_s=150)
    dense, *deltas = trainer["wire"]
    assert all(wire < dense / 10 for wire in deltas), trainer["wire"]
    for worker in (streamed, staged):
        assert worker["digests"] == trainer["digests"]  # bit for bit after every push
        assert worker["sums"] == trainer["sums"]  # checksums cover the patched weights
