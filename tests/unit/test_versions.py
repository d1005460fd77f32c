"""The version rules (weight_sync.wire.versions), as tables: labels read and written, a named
version checked and chosen, a member's refusal of a version it was sent, and the version a
member holds across the lanes of several senders."""

from __future__ import annotations

import pytest

from weight_sync.wire.versions import (
    NO_VERSION,
    agreed_version,
    check_version,
    choose_version,
    held_across_lanes,
    label_past,
    label_version,
    past_sent,
    proposed_version,
    unlabelled,
)


@pytest.mark.parametrize(("label", "version", "past"), [
    ("7", 7, 7),
    ("none", None, 0),
    ("none (past 7)", None, 7),         # a push of 7 under way, or failed part-way
    ("default", None, 0),               # SGLang's own label, before any push
    ("None", None, 0),                  # no label at all, as str() makes it
    ("step-3", None, 0),                # someone else's label: not ours to read
    ("none (past x)", None, 0),
])  # fmt: skip
def test_labels_say_the_version_held_and_the_highest_pushed(
    label: str, version: int | None, past: int
) -> None:
    assert label_version(label) == version and label_past(label) == past


@pytest.mark.parametrize("past", [0, 1, 12345])
def test_an_unlabelled_engine_keeps_what_it_was_pushed_in_its_label(past: int) -> None:
    label = unlabelled(past)
    assert label.startswith(NO_VERSION) and label_version(label) is None
    assert label_past(label) == past
    assert (label == NO_VERSION) == (past == 0)


@pytest.mark.parametrize(("named", "lowest", "chosen"), [
    (None, 1, 1), (None, 8, 8), (8, 8, 8), (100, 8, 100),
])  # fmt: skip
def test_a_push_takes_the_named_version_or_the_lowest_free_one(
    named: int | None, lowest: int, chosen: int
) -> None:
    assert choose_version(named, lowest) == chosen


@pytest.mark.parametrize(("named", "lowest", "proposed"), [
    (0, 4, 4),  # none given: its lowest free one
    (9, 4, 9),  # given one past it
    (2, 4, 4),  # given a stale one: raised past it, so the senders call the push off
])  # fmt: skip
def test_a_sender_proposes_the_version_it_was_given_unless_it_is_stale(
    named: int, lowest: int, proposed: int
) -> None:
    assert proposed_version(named, lowest) == proposed
    assert (agreed_version([proposed], [named])[1] is None) == (named in (0, proposed))


@pytest.mark.parametrize(("proposed", "named", "version", "why"), [
    ([3, 5], [0, 0], 5, None),  # none given: past every sender's
    ([7, 7], [7, 7], 7, None),  # all given one, past every sender's
    ([7, 3], [7, 0], 7, "named versions [0, 7]"),  # given to one sender only
    ([5, 5], [2, 2], 5, "version 2 is not past what these workers were already pushed (up to 4)"),
    ([8, 9], [8, 9], 9, "named versions [8, 9]"),  # given two
])  # fmt: skip
def test_many_senders_take_the_highest_proposal_and_one_version_if_given_one(
    proposed: list[int], named: list[int], version: int, why: str | None
) -> None:
    got, said = agreed_version(proposed, named)
    assert got == version
    assert (said is None) if why is None else (said is not None and why in said), said


@pytest.mark.parametrize(("named", "lowest"), [(7, 8), (1, 8), (3, 4)])
def test_a_named_version_not_past_what_was_pushed_is_refused_saying_what_is_free(
    named: int, lowest: int
) -> None:
    with pytest.raises(ValueError, match=f"version {named} is not past .* of at least {lowest}"):
        choose_version(named, lowest, "engines")


@pytest.mark.parametrize(("bad", "error"), [
    (0, ValueError), (-3, ValueError), (True, TypeError), (2.0, TypeError), ("4", TypeError),
])  # fmt: skip
def test_a_version_that_cannot_be_one_is_a_caller_error(bad: object, error: type) -> None:
    with pytest.raises(error, match="version must be"):
        check_version(bad)
    check_version(None)
    check_version(1)


@pytest.mark.parametrize(
    ("versions", "held"),
    [([3, 3, 3], 3), ([3, None, 3], None), ([3, 2], None), ([None, None], None), ([], None)],
)
def test_a_member_holds_a_version_only_when_every_lane_does(versions, held) -> None:
    assert held_across_lanes(versions) == held


@pytest.mark.parametrize(
    ("version", "sent", "refused"), [(5, 4, False), (5, 5, True), (1, 9, True)]
)
def test_a_member_refuses_a_version_it_was_sent(version: int, sent: int, refused: bool) -> None:
    problems = past_sent(version, sent)
    assert bool(problems) == refused
    if refused:
        assert f"version={sent + 1} or higher" in problems[0]
