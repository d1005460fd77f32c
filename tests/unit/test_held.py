"""What a sender knows each member holds of its plans or layouts (``send.roster.Held``), as a
table: a step is a call, the expected value what ``lacking`` says of every member after it."""

from __future__ import annotations

from typing import Any

import pytest

from weight_sync.send.roster import Held

# (members, size, steps, lacking "a" after each step: one bool per member)
STEPS = [
    (2, 4, [("learnt", "a")], [[False, False]]),
    (2, 4, [("learnt", "a", [1])], [[True, False]]),
    (2, 1, [("learnt", "a"), ("learnt", "b")], [[False, False], [True, True]]),
    (2, 2, [("learnt", "a"), ("learnt", "b"), ("learnt", "a"), ("learnt", "c")],
     [[False, False], [False, False], [False, False], [False, False]]),
    (2, 2, [("learnt", "a"), ("learnt", "b"), ("learnt", "c")],
     [[False, False], [False, False], [True, True]]),
    (2, 4, [("learnt", "a"), ("forgot", 0, "a")], [[False, False], [True, False]]),
    (2, 4, [("learnt", "a"), ("forgot", 1, "b")], [[False, False], [False, False]]),
    (2, 4, [("learnt", "a"), ("learnt", "b"), ("forgot", 1)], [[False, False]] * 2 + [[False, True]]),
    (3, 4, [("learnt", "a", [2]), ("drop", [0])], [[True, True, False], [True, False]]),
    (2, 4, [("learnt", "a"), ("reset",)], [[False, False], [True, True]]),
    (2, 4, [("learnt", "a"), ("reset", 3)], [[False, False], [True, True, True]]),
]  # fmt: skip


@pytest.mark.parametrize(("members", "size", "steps", "lacking"), STEPS)
def test_a_plan_goes_in_full_to_the_members_that_lack_it(
    members: int, size: int, steps: list[tuple[Any, ...]], lacking: list[list[bool]]
) -> None:
    """Learnt by those that took it, the oldest falling out past the member's cache size (a
    digest used again counts as the latest); forgotten by one that asked for it, or all of a
    member's after a refusal; the gone dropped in order; a probe forgets everything."""
    held = Held(members, size)
    for (call, *args), want in zip(steps, lacking, strict=True):
        getattr(held, call)(*args)
        assert held.lacking("a") == want
        assert held.all_hold("a") == (not any(want))
