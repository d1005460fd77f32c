"""A member's check of a push from many senders before any byte moves (``receive.member``), as a
table: the layout sent or held, what its weights say of it, the version against every version
the member was sent -- the one check a Ray worker and a vLLM worker both make."""

from __future__ import annotations

import pytest
import torch

from weight_sync.receive.member import Member, addresses
from weight_sync.receive.receiver import Receiver
from weight_sync.wire.lane_rules import layout_of

LAYOUT = layout_of([("w", torch.zeros(4, 2)), ("b", torch.zeros(3))], range(2))
OTHER = layout_of([("w", torch.zeros(4, 2))], range(2))


@pytest.mark.parametrize(
    ("held", "sent_json", "digest", "limit", "sent_before", "version", "found", "want"),
    [
        (None, True, LAYOUT.digest, 10_000, 0, 1, [], []),  # sent, taken, kept
        (LAYOUT, False, LAYOUT.digest, 10_000, 0, 1, [], []),  # held: not sent again
        (None, False, LAYOUT.digest, 10_000, 0, 1, [], ["does not hold the push's layout"]),
        (OTHER, False, LAYOUT.digest, 10_000, 0, 1, [], ["does not hold the push's layout"]),
        (None, True, OTHER.digest, 10_000, 0, 1, [], ["does not hold the push's layout"]),
        (None, True, LAYOUT.digest, 10, 0, 1, [], ["exceeds max_metadata_bytes"]),
        (None, True, LAYOUT.digest, 10_000, 4, 4, [], ["version 4 is not past 4"]),
        (None, True, LAYOUT.digest, 10_000, 4, 5, [], []),
        (None, True, LAYOUT.digest, 10_000, 4, 3, ["no 'b'"], ["no 'b'", "not past 4"]),
    ],
    ids=["sent", "held", "neither", "another-held", "another-sent", "too-big", "sent-already",
         "past-sent", "weights-and-version"],
)  # fmt: skip
def test_a_push_is_checked_once_against_layout_weights_and_versions(
    held: object,
    sent_json: bool,
    digest: str,
    limit: int,
    sent_before: int,
    version: int,
    found: list[str],
    want: list[str],
) -> None:
    record = Receiver()
    record.saw(sent_before)  # by one sender's pushes or many: the record is the member's
    member = Member(record)
    member.layout = held  # type: ignore[assignment]
    seen: list[object] = []

    def problems(layout: object) -> list[str]:
        seen.append(layout)
        return found

    got = member.check(LAYOUT.wire if sent_json else None, digest, version, limit, problems)
    assert len(got) == len(want) and all(w in g for g, w in zip(got, want, strict=True)), got
    # A layout it could not take is neither asked about nor kept.
    taken = not any("layout" in w or "max_metadata" in w for w in want)
    assert seen == ([LAYOUT] if taken else [])
    assert member.holds(LAYOUT.digest) == (taken or held is LAYOUT)


def test_lanes_are_named_by_their_senders_stores_however_they_arrive() -> None:
    """Ray and JSON hand the endpoints back as lists: the same senders all the same."""
    assert addresses([["10.0.0.1", "29500"], ("10.0.0.2", 29501)]) == [
        ("10.0.0.1", 29500),
        ("10.0.0.2", 29501),
    ]
    assert Member(Receiver()).lanes_from([("10.0.0.1", 29500)]) is None  # it follows none
