"""SGLang: pushes into engines that receive with SGLang's own weight-update API.

* ``SGLangPusher`` (``pusher.py``) -- the push: check against the engine's checkpoint
  (``checkpoint.py``), pause, buckets laid out as SGLang cuts them (``buckets.py``) broadcast
  over the group SGLang joins (``group.py``), commit, resume; every call bounded.
* ``SGLangServers`` (``servers.py``) -- over HTTP to ``python -m sglang.launch_server``
  processes, from a trainer with neither Ray nor SGLang; ``SGLangServer`` (``process.py``)
  starts one locally.
* ``SGLangUpdater`` / ``SGLangEngine`` / ``start_engine`` (``engine.py``) -- Ray actors owning
  an offline ``sglang.Engine``, and the updater that pushes to them.

``client.py`` is the seam between them: an engine is reached by route name, over HTTP or Ray.
Nothing here imports SGLang (it runs in the engines' processes, often another virtual
environment), and Ray only once the actor classes are used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weight_sync.adapters.sglang.process import SGLangServer, local_servers
from weight_sync.adapters.sglang.pusher import NO_VERSION, SGLangPusher
from weight_sync.adapters.sglang.servers import SGLangServers, release_servers
from weight_sync.errors import ServerError

if TYPE_CHECKING:
    from weight_sync.adapters.sglang.engine import SGLangEngine, SGLangUpdater, start_engine

_LAZY = frozenset({"SGLangEngine", "SGLangUpdater", "start_engine", "RemoteSGLangEngine"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from weight_sync.adapters.sglang import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'weight_sync.adapters.sglang' has no attribute {name!r}")


__all__ = [
    "NO_VERSION",
    "SGLangEngine",
    "SGLangPusher",
    "SGLangServer",
    "SGLangServers",
    "SGLangUpdater",
    "ServerError",
    "local_servers",
    "release_servers",
    "start_engine",
]
