"""Dense or delta, push by push (weight_sync.delta.choice): a pure rule, fed the cost of each
push, tested as sequences of pushes."""

from __future__ import annotations

import dataclasses

import pytest

from weight_sync.delta.choice import FIRST_RETRY, RETRY, DeltaChoice

MB = 1_000_000


def run(choice: DeltaChoice, far: bool, seconds: dict[bool, float], pushes: int) -> list[bool]:
    """Push ``pushes`` times, each costing ``seconds[delta]`` for 100 MB; the ways taken."""
    ways = []
    for _ in range(pushes):
        chosen = choice.choose(far)
        choice.record(chosen, seconds[chosen.delta], 100 * MB)
        ways.append(chosen.delta)
    return ways


@pytest.mark.parametrize(
    ("mode", "far", "seconds", "expected"),
    [
        # Off: always dense.
        (False, True, {False: 4.0, True: 0.5}, [False] * 5),
        # Always: a delta every push (the workers may still ask for dense bytes).
        ("always", False, {False: 0.3, True: 0.4}, [True] * 5),
        # Every member on the trainer's host: dense, never timed.
        (True, False, {False: 0.3, True: 0.1}, [False] * 5),
        # Across a slow link: dense once (no base yet), a delta timed, then deltas.
        (True, True, {False: 4.0, True: 0.6}, [False, True] + [True] * RETRY),
        # Across a fast link, where the scan costs more than the bytes: back to dense.
        (True, True, {False: 0.2, True: 0.45}, [False, True] + [False] * RETRY),
        # Close: the slower way is timed again soon (a first timing is its worst).
        (True, True, {False: 0.3, True: 0.35}, [False, True, False, False, True, False]),
    ],
)  # fmt: skip
def test_the_way_each_push_goes(mode: bool | str, far: bool, seconds: dict[bool, float],
                                expected: list[bool]) -> None:  # fmt: skip
    assert run(DeltaChoice(mode), far, seconds, len(expected)) == expected  # type: ignore[arg-type]


def test_a_clearly_slower_way_is_timed_again_every_retry_pushes() -> None:
    choice = DeltaChoice(True)
    ways = run(choice, True, {False: 0.2, True: 0.5}, 2 + 2 * (RETRY + 1))
    # After the two first pushes: RETRY dense pushes, one delta, RETRY dense, one delta.
    assert ways[2:] == ([False] * RETRY + [True]) * 2
    # The density fell: the next timed delta wins, and the pushes after it stay deltas.
    later = run(choice, True, {False: 0.2, True: 0.05}, RETRY + 4)
    assert later == [False] * RETRY + [True] * 4


def test_a_close_verdict_is_checked_ever_less_often() -> None:
    choice = DeltaChoice(True)
    intervals = [FIRST_RETRY, 2 * FIRST_RETRY, 4 * FIRST_RETRY, RETRY, RETRY]
    assert intervals[2] < RETRY <= 2 * intervals[2]
    ways = run(choice, True, {False: 0.3, True: 0.35}, 2 + sum(n + 1 for n in intervals))
    assert ways[2:] == [way for n in intervals for way in [False] * n + [True]]


def test_a_faster_delta_is_checked_ever_less_often_too() -> None:
    choice = DeltaChoice(True)
    intervals = [FIRST_RETRY, 2 * FIRST_RETRY, 4 * FIRST_RETRY, RETRY]
    ways = run(choice, True, {False: 0.35, True: 0.3}, 2 + sum(n + 1 for n in intervals))
    assert ways[2:] == [way for n in intervals for way in [True] * n + [False]]


def test_a_clear_verdict_turned_close_is_checked_soon_again() -> None:
    choice = DeltaChoice(True)
    run(choice, True, {False: 1.0, True: 0.3}, 2)  # clear: checked after RETRY
    ways = run(choice, True, {False: 0.4, True: 0.3}, RETRY + 1 + FIRST_RETRY + 1)
    assert ways == [True] * RETRY + [False] + [True] * FIRST_RETRY + [False]


def test_a_retry_that_went_dense_for_want_of_a_base_is_tried_again() -> None:
    """The retried delta went dense (a worker lacked the base): no delta was timed, so the next
    push retries it."""
    choice = DeltaChoice(True)
    run(choice, True, {False: 0.3, True: 0.35}, 2 + FIRST_RETRY)
    retry = choice.choose(True)
    assert retry.delta and "again" in retry.reason
    choice.record(dataclasses.replace(retry, delta=False), 0.3, 100 * MB)  # as it went
    assert choice.choose(True).delta


def test_an_unlucky_first_timing_is_undone_two_pushes_later() -> None:
    """The first delta push of a run is the slowest (fresh buffers, bigger early updates): timed
    a little slower than dense once, it is tried again two pushes later, wins, and stays."""
    choice = DeltaChoice(True)
    run(choice, True, {False: 0.4, True: 0.5}, 2)
    ways = run(choice, True, {False: 0.4, True: 0.3}, 9)
    assert ways == [False, False, True, True, True, False, True, True, True]


def test_reasons_say_what_was_measured() -> None:
    choice = DeltaChoice(True)
    run(choice, True, {False: 4.0, True: 0.5}, 2)
    assert choice.choose(True).reason == "delta was 8.0x faster when last timed"
    assert "trainer's host" in choice.choose(False).reason
    choice.forget()
    assert choice.choose(True).reason == "timing a dense push"
