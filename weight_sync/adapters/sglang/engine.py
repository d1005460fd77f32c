"""SGLang engines as Ray actors: ``SGLangEngine`` owns an offline ``sglang.Engine``, and
``SGLangUpdater`` pushes to a list of them from the trainer.

The actor serves the endpoints the push uses (``client.ENDPOINTS``) from the engine's methods --
``init_weights_update_group``, ``begin_weight_update``, ``update_weights_from_distributed``,
``end_weight_update``, ``destroy_weights_update_group``, ``flush_cache`` -- and, for
``update_weight_version``, which the offline engine does not expose, from its tokenizer manager,
as SGLang's HTTP server does. The engine is not thread-safe (each method runs its own event
loop to completion), so the actor runs one engine call at a time: a ``generate`` never runs
inside one of a push's calls, but may run between two of them (between buckets) -- with the
engine labelled ``"none"``, which its outputs then carry, so a rollout from weights half-way
through a push is told apart. The two pause routes are answered without pausing: a pause a
dead trainer left behind would hold every later ``generate``, and a push's call waits for a
``generate`` in flight (give the push's calls time for the longest one: ``rpc_timeout_s``,
``collective_timeout_s``).

SGLang need not be importable where the trainer runs. Its pins and vLLM's differ (``openai``,
``compressed-tensors``, ``numba``, ``xgrammar``), so the two often live in separate virtual
environments: ``start_engine(python=...)`` starts the actor with SGLang's interpreter, which must
have the same Ray and this package installed. When SGLang's scheduler process fails, SGLang
kills its whole process tree, the actor's process included: the trainer then sees the actor
die, a ``ServerError`` naming it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from weight_sync.adapters.sglang.checkpoint import Checkpoint, read_checkpoint
from weight_sync.adapters.sglang.client import ENDPOINTS, checked
from weight_sync.adapters.sglang.pusher import PauseMode, SGLangPusher
from weight_sync.config import SyncConfig
from weight_sync.errors import ServerError
from weight_sync.wire.versions import label_version

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["ActorEngine", "RemoteSGLangEngine", "SGLangEngine", "SGLangUpdater", "start_engine"]

logger = logging.getLogger(__name__)

# What the engine's own methods take; the rest of ``ENDPOINTS`` is answered below.
_METHODS = frozenset(
    {
        "init_weights_update_group",
        "destroy_weights_update_group",
        "begin_weight_update",
        "update_weights_from_distributed",
        "end_weight_update",
    }
)


class SGLangEngine:
    """One ``sglang.Engine`` (``engine_kwargs``: ``model_path``, ``device``, ``dtype``, ...),
    usually as a Ray actor (``RemoteSGLangEngine``)."""

    def __init__(self, **engine_kwargs: Any) -> None:
        import sglang

        if "model_path" not in engine_kwargs:
            raise TypeError("SGLangEngine needs model_path= (a checkpoint folder)")
        self._model_path = str(engine_kwargs["model_path"])
        self._lock = threading.Lock()
        self.engine = sglang.Engine(**engine_kwargs)

    def sglang_call(self, route: str, body: dict[str, Any] | None) -> Any:
        """One route of the push (see the module doc), as SGLang's HTTP server answers it."""
        if route not in ENDPOINTS:
            raise ValueError(f"not a route of the push: {route!r}")
        with self._lock:
            return self._serve(route, body or {})

    def checkpoint_json(self) -> str:
        """The checkpoint this engine was started from (read on its own node)."""
        return read_checkpoint(self._model_path).to_json()

    def generate(
        self, input_ids: list[list[int]], sampling_params: dict[str, Any], **options: Any
    ) -> list[dict[str, Any]]:
        """``Engine.generate`` on token ids; each output's ``meta_info["weight_version"]`` says
        which push produced it (``"none"``: weights that are no committed version)."""
        with self._lock:
            outputs = self.engine.generate(
                input_ids=input_ids, sampling_params=sampling_params, **options
            )
        return outputs if isinstance(outputs, list) else [outputs]

    def weights_version(self) -> int | None:
        """The committed version this engine serves (None: none, or a push under way). Answers
        at once, also during a push: the label lives in this process (the tokenizer manager)."""
        return label_version(str(self.engine.get_model_info().get("weight_version")))

    def shutdown(self) -> None:
        """Stop the engine and its processes."""
        with self._lock:
            self.engine.shutdown()

    def _serve(self, route: str, body: dict[str, Any]) -> Any:
        engine = self.engine
        if route in ("pause_generation", "continue_generation"):
            return {"success": True, "message": "one call at a time: nothing to pause"}
        if route == "server_info":
            return engine.get_server_info()
        if route == "model_info":
            return engine.get_model_info()
        if route == "flush_cache":
            done = engine.flush_cache()
            return {
                "success": bool(getattr(done, "success", done)),
                "message": str(getattr(done, "message", "")),
            }
        if route == "update_weight_version":
            from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

            request = UpdateWeightVersionReqInput(**body)
            engine.loop.run_until_complete(engine.tokenizer_manager.update_weight_version(request))
            return {"success": True, "message": f"labelled {request.new_version}"}
        assert route in _METHODS, route
        answer = getattr(engine, route)(**body)
        if isinstance(answer, tuple):  # (success, message)
            return {"success": bool(answer[0]), "message": str(answer[1])}
        return answer


RemoteSGLangEngine = ray.remote(SGLangEngine)


def start_engine(
    *,
    python: str | None = None,
    env: Mapping[str, str] | None = None,
    options: Mapping[str, Any] | None = None,
    **engine_kwargs: Any,
) -> Any:
    """An ``SGLangEngine`` actor over ``sglang.Engine(**engine_kwargs)``. ``python``: SGLang's
    interpreter, from a virtual environment with SGLang, this Ray and weight_sync (Ray's
    ``py_executable``), where the caller's has no SGLang; ``env``: variables for the engine (on
    CPU: ``SGLANG_USE_CPU_ENGINE="1"``); ``options``: more actor options (resources,
    scheduling). The actor takes no CPU of its own (SGLang's processes use the machine) and a few
    threads, so that a version query is answered while a push's call waits for the engine."""
    runtime: dict[str, Any] = {"env_vars": dict(env or {})}
    if python is not None:
        runtime["py_executable"] = python
    settings = {"num_cpus": 0, "max_concurrency": 4, "runtime_env": runtime, **(options or {})}
    return RemoteSGLangEngine.options(**settings).remote(**engine_kwargs)


class ActorEngine:
    """An ``SGLangEngine`` actor as the push reaches it (``client.Engine``)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._name = f"actor {actor._actor_id.hex()[:12]}"

    @property
    def name(self) -> str:
        return self._name

    def call(self, route: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        return checked(
            self._name,
            route,
            self._get(self.actor.sglang_call.remote(route, body), timeout_s, route),
        )

    def checkpoint(self, timeout_s: float) -> Checkpoint:
        raw = self._get(self.actor.checkpoint_json.remote(), timeout_s, "checkpoint")
        return Checkpoint.from_json(raw)

    def _get(self, ref: Any, timeout_s: float, what: str) -> Any:
        try:
            return ray.get(ref, timeout=timeout_s)
        except GetTimeoutError as exc:
            error: Exception = exc
            reason = f"{what}: no answer within {timeout_s:.1f}s"
        except RayActorError as exc:
            error, reason = exc, f"{what}: the actor died ({type(exc).__name__})"
        except RayTaskError as exc:
            error, reason = exc, f"{what}: {type(exc.cause).__name__}: {exc.cause}"
        message = f"SGLang engine {self._name} failed: {reason}"
        raise ServerError(message, {self._name: reason}) from error


class SGLangUpdater(SGLangPusher):
    """Pushes from this process (the trainer) to ``engines``, ``SGLangEngine`` actors: the
    ``WeightUpdater`` of SGLang engines, with its ``push``/``close``/``version``. SGLang
    receives with its own code, so its engines cannot join a ``WeightUpdater``'s protocol."""

    def __init__(
        self,
        engines: list[Any],
        config: SyncConfig | None = None,
        *,
        pause_mode: PauseMode = "retract",
        senders: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(engines, list | tuple) or not all(
            isinstance(engine, ray.actor.ActorHandle) for engine in engines
        ):
            raise TypeError("engines must be a list of SGLangEngine actor handles")
        self.actors = list(engines)
        super().__init__(
            [ActorEngine(actor) for actor in engines],
            config,
            pause_mode=pause_mode,
            senders=senders,
        )
