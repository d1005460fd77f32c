"""Who is blamed, and who dropped, for a set of workers' outcomes (pure: no Ray calls made)."""

import pytest

from weight_sync import SyncTimeoutError, TransportError, WorkerFailedError
from weight_sync.control import Outcomes


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
def test_blame_table(fields: dict, error: type, blamed: list[int] | None, unreachable: list[int]) -> None:
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
