"""Who is blamed, and who dropped, for a set of workers' outcomes (pure: no Ray calls made)."""

import pytest

from weight_sync import SyncTimeoutError, TransportError, WorkerFailedError
from weight_sync.control.plane import Outcomes


def outcomes(n: int, **fields) -> Outcomes:
    return Outcomes(results=[None] * n, **fields)


@pytest.mark.parametrize(
    ("fields", "error", "blamed", "unreachable"),
    [
        # a dead worker is blamed and dropped; the others lost the broadcast because of it
        ({"died": {1: "actor died"}, "collateral": [0, 2]}, WorkerFailedError, [1], [1]),
        # a frozen worker: silent while the others answered
        ({"late": [2], "collateral": [0, 1]}, WorkerFailedError, [2], [2]),
        # a worker that raised is blamed but kept: it still answers
        ({"raised": {0: "ValueError: x"}}, WorkerFailedError, [0], []),
        # nobody answered: nobody can be blamed (the trainer or the timeout is suspect)
        ({"late": [0, 1, 2]}, SyncTimeoutError, None, []),
        # everyone lost the collective and nobody is at fault: the group itself failed
        ({"collateral": [0, 1, 2]}, TransportError, None, []),
        # dead and silent at once: both dropped
        ({"died": {0: "actor died"}, "late": [2]}, WorkerFailedError, [0, 2], [0, 2]),
    ],
)
def test_blame_table(
    fields: dict, error: type, blamed: list[int] | None, unreachable: list[int]
) -> None:
    result = outcomes(3, **fields)
    assert not result.ok
    assert result.unreachable == unreachable
    raised = result.error("receive", 5.0, dropped=unreachable)
    assert type(raised) is error
    if blamed is not None:
        assert isinstance(raised, WorkerFailedError)
        assert raised.workers == blamed and raised.dropped == unreachable
        for index in blamed:
            assert f"worker {index}:" in str(raised)


def test_all_answered_is_ok() -> None:
    assert outcomes(2).ok


@pytest.mark.parametrize(
    ("fields", "late", "collateral"),
    [
        # worker 0 relays to 1 and 2; it died joining: its followers, still dialling, are excused
        ({"died": {0: "actor died"}, "late": [1, 2]}, [], [1, 2]),
        # its relay lost the formation to someone else: the same
        ({"collateral": [0], "late": [2]}, [], [0, 2]),
        # its relay joined: a follower still silent is late, and dropped
        ({"late": [2]}, [2], []),
        # worker 3 relays nobody: its lateness is its own
        ({"raised": {0: "TransportError: x"}, "late": [3]}, [3], []),
    ],
)  # fmt: skip
def test_followers_of_a_relay_that_failed_to_join_are_not_blamed_for_it(
    fields: dict, late: list[int], collateral: list[int]
) -> None:
    from weight_sync.send.formation import _excuse_followers

    got = outcomes(4, **fields)
    _excuse_followers(got, {1: 0, 2: 0})
    assert (got.late, got.collateral) == (late, collateral)
