"""Pure pieces of the shared-memory path: the ranks in each part, how big the slots are, and the
spec a ring member is sent (who takes which route: tests/unit/test_routes.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from weight_sync.wire.metadata import GroupSpec
from weight_sync.send.formation import first_ranks
from weight_sync.transport import shm


@pytest.mark.parametrize(
    ("ranks", "local", "firsts"),
    [
        ([1, 1, 1], [False, False, False], [1, 2, 3]),  # everyone on the group
        ([1, 1, 1], [True, False, True], [1, 1, 2]),  # ranks count within each part
        ([2, 1, 3, 1], [False, False, True, True], [1, 3, 1, 4]),  # TP engines take several
        ([1, 2, 1, 1], ["group", "cuda_ipc", "shm", "cuda_ipc"], [1, 1, 1, 3]),  # three parts
        ([], [], []),
    ],
)  # fmt: skip
def test_ranks_within_each_part(ranks: list[int], local: list, firsts: list[int]) -> None:
    assert first_ranks(ranks, local) == firsts


@pytest.mark.parametrize(
    ("bucket", "alignment", "slot"),
    [(32 << 20, 4096, 8 << 20), (4096, 4096, 4096), (4096, 64, 1024), (1, 64, 64),
     ((1 << 20) + 1, 4096, (1 << 18) + 4096)],
)  # fmt: skip
def test_slots_hold_a_bucket_between_them(bucket: int, alignment: int, slot: int) -> None:
    assert shm.slot_bytes_for(bucket, alignment) == slot
    assert slot * shm.SLOTS >= bucket and slot % alignment == 0


def spec(**fields: object) -> GroupSpec:
    base = dict(
        group_id="ab" * 8,
        address="127.0.0.1",
        port=1234,
        world_size=3,
        rank=1,
        backend="gloo",
        mode="standalone",
        rendezvous_timeout_s=5,
        collective_timeout_s=5,
    )
    return GroupSpec(**{**base, **fields})  # type: ignore[arg-type]


def test_a_ring_spec_has_no_port_and_a_group_spec_needs_one() -> None:
    ring = spec(transport="shm", address=shm.socket_name("ab" * 8), port=0)
    assert GroupSpec.model_validate_json(ring.model_dump_json()) == ring
    with pytest.raises(ValidationError, match="needs a port"):
        spec(port=0)
    with pytest.raises(ValidationError, match="has none"):
        spec(transport="shm", port=1234)
