import pickle

import pytest

import weight_sync
from weight_sync import (
    PlanMismatchError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
    WorkerFailedError,
)


@pytest.mark.parametrize(
    "error",
    [
        PlanMismatchError({0: ["unknown tensor 'x'"], 3: ["missing tensor 'y'"] * 7}),
        WorkerFailedError("receive failed on 1 worker(s)", [2]),
        WorkerFailedError("receive failed on 2 worker(s)", [2, 5], dropped=[5]),
        SyncTimeoutError("join: worker(s) [1] did not answer"),
        TransportError("a broadcast failed"),
    ],
)
def test_errors_pickle_across_processes(error: WeightSyncError) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert isinstance(again, WeightSyncError)
    assert getattr(again, "problems", None) == getattr(error, "problems", None)
    assert getattr(again, "workers", None) == getattr(error, "workers", None)
    assert getattr(again, "dropped", None) == getattr(error, "dropped", None)


def test_plan_mismatch_message_names_workers_and_truncates() -> None:
    message = str(PlanMismatchError({3: [f"missing tensor 'w{i}'" for i in range(7)]}))
    assert "worker 3:" in message and "(+2 more)" in message and "nothing changed" in message


def test_timeout_is_also_a_builtin_timeout() -> None:
    assert issubclass(SyncTimeoutError, TimeoutError)
    assert set(weight_sync.__all__) >= {
        "WeightSyncError",
        "PlanMismatchError",
        "SyncTimeoutError",
        "WorkerFailedError",
        "TransportError",
    }
