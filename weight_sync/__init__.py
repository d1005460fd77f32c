"""weight_sync: push a trainer's fresh weights to its inference workers, fast and bounded.

updater = WeightUpdater(workers, SyncConfig())
result = updater.push(model.state_dict())
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weight_sync.config import SyncConfig
from weight_sync.errors import (
    ChecksumMismatchError,
    PlanMismatchError,
    SenderFailedError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
    WorkerFailedError,
)
from weight_sync.result import PushResult
from weight_sync.wire.metadata import SyncStatus

if TYPE_CHECKING:
    from weight_sync.actors import WeightSyncWorker, WeightUpdater, remote_worker
    from weight_sync.launch.job_sync import JobSync

# Imported when first used: the Ray glue (the data plane, the protocol and their tests run where
# Ray is not installed: a GPU machine, a torchrun job), and the launched job's API.
_LAZY = {
    "WeightSyncWorker": "weight_sync.actors",
    "WeightUpdater": "weight_sync.actors",
    "remote_worker": "weight_sync.actors",
    "JobSync": "weight_sync.launch.job_sync",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'weight_sync' has no attribute {name!r}")


__all__ = [
    "ChecksumMismatchError",
    "JobSync",
    "PlanMismatchError",
    "PushResult",
    "SenderFailedError",
    "SyncConfig",
    "SyncStatus",
    "SyncTimeoutError",
    "TransportError",
    "WeightSyncError",
    "WeightSyncWorker",
    "WeightUpdater",
    "WorkerFailedError",
    "remote_worker",
]
__version__ = "0.1.0"
