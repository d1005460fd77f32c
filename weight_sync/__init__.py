"""weight_sync: push a trainer's fresh weights to its inference workers, fast and bounded.

    updater = WeightUpdater(workers, SyncConfig())
    result = updater.push(model.state_dict())
"""

from weight_sync.actors import PushResult, WeightSyncWorker, WeightUpdater, remote_worker
from weight_sync.config import SyncConfig
from weight_sync.errors import (
    ChecksumMismatchError,
    PlanMismatchError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
    WorkerFailedError,
)
from weight_sync.metadata import SyncStatus

__all__ = [
    "ChecksumMismatchError",
    "PlanMismatchError",
    "PushResult",
    "SyncConfig",
    "SyncStatus",
    "SyncTimeoutError",
    "TransportError",
    "WeightSyncError",
    "WeightUpdater",
    "WeightSyncWorker",
    "WorkerFailedError",
    "remote_worker",
]
__version__ = "0.1.0"
