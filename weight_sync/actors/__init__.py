"""The Ray glue: control-plane calls between the trainer's updater and the workers.

Knows Ray and the wire types; the sockets and collectives stay behind ``weight_sync.transport``.
"""

from weight_sync.actors.updater import WeightUpdater
from weight_sync.actors.worker import WeightSyncWorker, remote_worker
from weight_sync.result import PushResult

__all__ = ["PushResult", "WeightSyncWorker", "WeightUpdater", "remote_worker"]
