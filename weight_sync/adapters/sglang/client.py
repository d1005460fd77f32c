"""How the trainer reaches one SGLang engine: the narrow seam between the push and the engine.

SGLang's weight-update surface is the same few calls whether the engine is an HTTP server
(``python -m sglang.launch_server``, its routes) or an ``sglang.Engine`` in a Ray actor (its
methods, and its tokenizer manager's for the three the offline engine does not expose). So an
``Engine`` is one method, ``call(route, body, timeout_s)``, named by the HTTP route and taking
its JSON body, plus the checkpoint the engine was started from (for the check before a push):

* ``HTTPEngine`` -- a server, over the standard library's HTTP client (``weight_sync.control.http``);
* ``ActorEngine`` (``engine.py``) -- an ``SGLangEngine`` Ray actor.

Every call is bounded by ``timeout_s`` and raises ``ServerError`` naming the engine when it
fails, times out, or SGLang answers ``success: false``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from weight_sync.adapters.sglang.checkpoint import Checkpoint, read_checkpoint
from weight_sync.control.http import call
from weight_sync.errors import ServerError

# The HTTP endpoints the push uses, and whether each is a read (GET). The Ray actor serves the same.
ENDPOINTS: dict[str, bool] = {
    "server_info": True,
    "model_info": True,
    "pause_generation": False,
    "continue_generation": False,
    "update_weight_version": False,
    "init_weights_update_group": False,
    "destroy_weights_update_group": False,
    "begin_weight_update": False,
    "update_weights_from_distributed": False,
    "end_weight_update": False,
    "flush_cache": False,
}


class Engine(Protocol):
    """One SGLang engine as the push drives it (see the module doc)."""

    @property
    def name(self) -> str:
        """How errors name it: the server's URL, or the actor's."""
        ...

    def call(self, route: str, body: dict[str, Any] | None, timeout_s: float) -> Any: ...

    def checkpoint(self, timeout_s: float) -> Checkpoint: ...


class HTTPEngine:
    """An SGLang server at ``url``. ``checkpoint``: a folder holding the checkpoint the server
    was started from, where the trainer cannot read the server's own ``model_path``."""

    def __init__(self, url: str, checkpoint: str | Path | None = None) -> None:
        self.url = url
        self._checkpoint = checkpoint

    @property
    def name(self) -> str:
        return self.url

    def call(self, route: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        assert route in ENDPOINTS, route
        if route == "flush_cache":  # answers text, with 400 when requests still hold the cache
            return call(self.url, route, None, timeout_s=timeout_s, method="POST", text=True)
        answer = call(
            self.url, route, body, timeout_s=timeout_s, method="GET" if ENDPOINTS[route] else "POST"
        )
        return checked(self.url, route, answer)

    def checkpoint(self, timeout_s: float) -> Checkpoint:
        folder = self._checkpoint
        if folder is None:
            folder = (self.call("model_info", None, timeout_s) or {}).get("model_path")
        if folder is None or not Path(folder).is_dir():
            raise ValueError(
                f"the SGLang server {self.url} serves {folder!r}, which this trainer cannot read: "
                "pass checkpoint= a folder holding the same checkpoint (its *.safetensors and "
                "config.json), so that a push can be checked before any byte moves"
            )
        return read_checkpoint(folder)


def checked(name: str, route: str, answer: Any) -> Any:
    """``answer`` unless SGLang said ``success: false``: then ``ServerError`` with its message."""
    if isinstance(answer, dict) and answer.get("success") is False:
        message = str(answer.get("message", ""))[:500]
        raise ServerError(
            f"SGLang engine {name}: {route} failed: {message}", {name: f"{route}: {message}"}
        )
    return answer
