"""vLLM: a worker extension that receives pushes, and the engine-side member that drives it.

* ``WeightSyncExtension`` (``extension.py``) -- pass ``worker_extension_cls=EXTENSION``. Inside
  each of vLLM's worker processes it follows the senders' lanes (``member.py``), checks a push
  against the engine's model before any byte moves, and reloads it through vLLM's layerwise
  reload (``reload.py``).
* ``VLLMEngine`` / ``RemoteVLLMEngine`` (``engine.py``) -- the member a ``WeightUpdater`` is
  given: it owns the ``LLM`` or ``AsyncLLM``, forwards each step of a push to the workers,
  pauses generation and clears the caches around it, and labels vLLM's outputs with the
  committed version.
* ``VLLMServers`` (``servers.py``) -- pushes into running ``vllm serve`` processes over HTTP,
  from a trainer with neither Ray nor vLLM, one process or every rank of a sharded trainer
  (``senders``), each rank sending its own shards (``lanes.py``); ``ServerProcess``
  (``process.py``) starts one locally.
* weight_sync as a backend of vLLM's own weight-transfer API (``backend.py``, registered as a
  vLLM plugin): the same lanes, through vLLM's clients.

Nothing here imports vLLM until it is used, so this package imports where vLLM is absent.
"""

from weight_sync.adapters.vllm.engine import NO_VERSION, RemoteVLLMEngine, VLLMEngine
from weight_sync.adapters.vllm.extension import EXTENSION, WeightSyncExtension
from weight_sync.adapters.vllm.process import ServerProcess
from weight_sync.adapters.vllm.servers import VLLMServers

__all__ = [
    "EXTENSION",
    "NO_VERSION",
    "RemoteVLLMEngine",
    "ServerProcess",
    "VLLMEngine",
    "VLLMServers",
    "WeightSyncExtension",
]
