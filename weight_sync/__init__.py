"""weight_sync: push a trainer's fresh weights to its inference workers, fast and bounded.

    updater = WeightUpdater(workers, SyncConfig())
    result = updater.push(model.state_dict())
"""

from weight_sync.actors import PushResult, WeightSyncWorker, WeightUpdater
from weight_sync.config import SyncConfig
from weight_sync.errors import (
    PlanMismatchError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
    WorkerFailedError,
)

__all__ = [
    "PlanMismatchError",
    "PushResult",
    "SyncConfig",
    "SyncTimeoutError",
    "TransportError",
    "WeightSyncError",
    "WeightUpdater",
    "WeightSyncWorker",
    "WorkerFailedError",
]
__version__ = "0.1.0"
