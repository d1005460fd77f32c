"""The engine half of the vLLM adapter: the sync-group member a ``WeightUpdater`` talks to.

``VLLMEngine`` owns one vLLM engine -- the offline ``vllm.LLM`` or the asynchronous
``AsyncLLM`` -- usually as a Ray actor (``RemoteVLLMEngine``, or your own actor class inheriting
from it). It forwards each step of a push to the engine's workers (``WeightSyncExtension``)
through ``collective_rpc``, every call bounded by what the push has left, and around the push
does what vLLM needs of a weight update:

* **Generation is paused** from the moment every worker accepted the push until it committed
  (``AsyncLLM.pause_generation``, ``pause_mode`` deciding what happens to requests in flight),
  and the KV and prefix caches are cleared: their entries were computed with the old weights,
  and a prompt sharing a cached prefix would otherwise be answered partly by them. A cache that
  cannot be cleared fails the push. The offline ``LLM`` generates only inside ``generate``,
  which never overlaps a push here (see below), so it needs no pause.
* **vLLM labels its outputs with the committed version** (``update_weight_version``): every
  ``CompletionOutput.weight_versions`` span says which push produced those tokens, ``"none"``
  while the engine holds no committed version (a push under way or failed part-way).
* **Errors keep their types**: a worker's ``TransportError`` or ``WeightSyncError`` is raised
  here as such (vLLM alone would turn it into a plain ``RuntimeError``).

The class is an asyncio Ray actor: an ``AsyncLLM`` runs on the actor's event loop, and every
call to an offline ``LLM`` (which is not thread-safe) runs on one thread of its own, one at a
time, so a push waits for a ``generate`` in flight and holds the next one. ``weights_version``
answers at once, even during a push.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Literal

import ray

from weight_sync.adapters.vllm.extension import EXTENSION
from weight_sync.errors import SyncTimeoutError, WeightSyncError
from weight_sync.wire.metadata import (
    LanePush,
    MemberInfo,
    SyncStatus,
    WorkerReply,
)
from weight_sync.wire.versions import NO_VERSION

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
_DEFAULT_TIMEOUT_S = 300.0  # a call made without one (the updater always passes one)
_MARGIN_S = 1.0  # an engine's own bound ends this much before its caller's


class VLLMEngine:
    """One vLLM engine as a member of a ``WeightUpdater``'s pushes.

    ``engine_kwargs`` build the engine (``worker_extension_cls`` is filled in): an offline
    ``vllm.LLM``, or with ``async_engine=True`` an ``AsyncLLM``. Or pass a built ``engine``
    whose ``worker_extension_cls`` is ``EXTENSION``. ``pause_mode`` says what a push does to
    an ``AsyncLLM``'s requests in flight: ``"keep"`` (the default) freezes them and, since
    their KV entries are dropped with the caches, recomputes them with the new weights on resume
    (their outputs then span two versions, as ``weight_versions`` shows); ``"wait"`` lets them
    finish with the old weights first (the push's prepare waits for them); ``"abort"`` ends
    them.
    """

    def __init__(
        self,
        engine: Any = None,
        *,
        async_engine: bool = False,
        pause_mode: PauseMode = "keep",
        **engine_kwargs: Any,
    ) -> None:
        if engine is None:
            engine_kwargs.setdefault("worker_extension_cls", EXTENSION)
            engine = _build(async_engine, engine_kwargs)
        elif engine_kwargs or async_engine:
            raise TypeError("pass either a built engine or the arguments to build one, not both")
        if pause_mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause_mode must be 'abort', 'wait' or 'keep', not {pause_mode!r}")
        self.engine = engine
        self._driver: _Driver = (
            _AsyncDriver(engine, pause_mode)
            if inspect.iscoroutinefunction(engine.collective_rpc)
            else _SyncDriver(engine)
        )
        self._version: int | None = None  # what every worker committed; None if they differ
        self._label = "default"  # vLLM's own, until the first push
        self._paused = False

    # -- what users call ---------------------------------------------------------------------

    def weights_version(self) -> int | None:
        """The version every worker of the engine committed (``None`` before the first push, while
        a push is under way, and after a failed one). Answers at once, also during a push."""
        return self._version

    async def sync_status(self) -> SyncStatus:
        """The engine's status: its first worker's, unless another one disagrees (then that one's,
        so that a dirty or lagging worker is never hidden). Waits for a push in flight."""
        return _merge_status(await self._statuses())

    async def generate(
        self, prompts: Any, sampling_params: Any = None
    ) -> tuple[list[Any], int | None]:
        """Generate (``LLM.generate``'s prompts; ``SamplingParams``, or a dict of their fields so
        that the caller need not import vLLM) and return the ``RequestOutput``s with the weight
        version that produced all of them, read from vLLM's own ``weight_versions`` labels:
        ``None`` if any output's tokens came from weights that are no committed version, or from
        two versions (a push landed mid-request)."""
        if isinstance(sampling_params, dict):
            sampling_params = importlib.import_module("vllm").SamplingParams(**sampling_params)
        outputs = await self._driver.generate(prompts, sampling_params)
        return outputs, _version_of(outputs)

    async def shutdown(self) -> None:
        """Leave the sync group and stop the engine (its processes and shared memory)."""
        try:
            await self._call("weight_sync_leave", 30.0)
        except WeightSyncError as exc:
            logger.warning("leaving the sync group on shutdown: %s", exc)
        await self._driver.shutdown()

    # -- protocol, called by WeightUpdater (``weight_sync.actors.lanes.RayLanes``) -------------

    async def _weight_sync_info(self, timeout_s: float | None = None) -> MemberInfo:
        infos = [
            MemberInfo.model_validate_json(i)
            for i in await self._call("weight_sync_info", timeout_s)
        ]
        versions = {info.version for info in infos}
        hosts = {info.host for info in infos}
        return infos[0].model_copy(
            update={
                "has_default_group": any(info.has_default_group for info in infos),
                "cuda": all(info.cuda for info in infos),
                "gpus": tuple(gpu for info in infos for gpu in info.gpus),
                "version": versions.pop() if len(versions) == 1 else None,
                "highest_version": max(info.highest_version for info in infos),
                "concurrent": False,
                "ranks": len(infos),
                "host": hosts.pop()
                if len(hosts) == 1
                else None,  # all its workers share a ring, or none
            }
        )

    async def _weight_sync_lanes_push(
        self, call_json: str, timeout_s: float | None = None
    ) -> int | None:
        """Rank 0's call (``LanePush``, as JSON) on every worker of the engine, each as member
        ``slot`` plus its rank: first the check alone (the engine's own loader on meta tensors
        of the whole tensors); where every worker takes the push, generation pauses, then every
        lane is received and loaded (``LaneMember.push``), and the caches are cleared before
        generation resumes. Where a worker refused it, the push is still called on every
        worker, each refusing every lane as it opens (nothing moves; the senders learn why),
        and generation never paused."""
        wait_s = LanePush.parse(call_json).wait_s
        bound = wait_s + 2 * _MARGIN_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        answers = await self._call("weight_sync_lanes_check", bound, call_json)
        taken = not any(json.loads(problems) for problems in answers)
        if taken:
            self._version = None  # whatever the staging, no version is claimed while receiving
            if not self._paused:
                await self._driver.pause()
                self._paused = True
        try:
            left_s = max(deadline - time.monotonic(), 2 * _MARGIN_S)
            await self._call("weight_sync_lanes_push", left_s, call_json)
        finally:
            if taken:
                await self._settle()
        return self._version

    async def _weight_sync_lanes_leave(
        self, endpoints: list[list[Any]], timeout_s: float | None = None
    ) -> None:
        """The senders at ``endpoints`` left (``RayLanes.close``): every worker lets go of
        their lanes, unless lanes from other senders took their place."""
        await self._call("weight_sync_lanes_leave", timeout_s, endpoints)

    # -- internals ---------------------------------------------------------------------------

    async def _call(self, method: str, timeout_s: float | None, *args: Any) -> list[Any]:
        """``method`` on every worker of the engine, bounded by ``timeout_s`` (less a margin, so
        that a timeout here reaches the caller as an error, before the caller stops waiting);
        one result per worker, or the first worker error raised as its own type."""
        given = _DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        timeout_s = max(given - _MARGIN_S, given / 2, 0.001)
        try:
            raw = await self._driver.rpc(method, args, timeout_s)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise SyncTimeoutError(
                f"the vLLM engine's workers did not finish {method} within {timeout_s:.1f}s; check "
                "the engine's logs, or raise push_timeout_s"
            ) from exc
        except WeightSyncError:
            raise
        except Exception as exc:  # the engine itself failed (e.g. its core process died)
            raise WeightSyncError(f"the vLLM engine failed during {method}: {exc!r}") from exc
        if not raw:
            raise WeightSyncError(f"collective_rpc({method!r}) reached no vLLM worker")
        replies = [WorkerReply.model_validate_json(r) for r in raw]
        await self._track([r.status for r in replies])
        return [reply.unwrap() for reply in replies]

    async def _statuses(self) -> list[SyncStatus]:
        raw = await self._driver.rpc("weight_sync_status", (), _DEFAULT_TIMEOUT_S)
        return [WorkerReply.model_validate_json(r).status for r in raw]

    async def _track(self, statuses: list[SyncStatus]) -> None:
        """Follow the workers' version (the engine holds one only if all of them hold the same),
        and label vLLM's outputs with it."""
        versions = {s.version for s in statuses}
        dirty = any(s.dirty for s in statuses)
        self._version = versions.pop() if len(versions) == 1 and not dirty else None
        label = NO_VERSION if self._version is None else str(self._version)
        if label != self._label and not (self._label == "default" and self._version is None):
            await self._driver.label(label)
            self._label = label

    async def _settle(self) -> None:
        """After the weights may have changed: clear the caches, then resume generation. A cache
        that cannot be cleared leaves the engine claiming no version, and fails the push."""
        try:
            if not await self._driver.reset_prefix_cache():
                self._version = None
                await self._driver.label(NO_VERSION)
                self._label = NO_VERSION
                raise WeightSyncError(
                    "the vLLM engine could not clear its prefix cache after new weights landed "
                    "(requests still hold KV blocks); it claims no version until the next push"
                )
        finally:
            await self._resume()

    async def _resume(self) -> None:
        if self._paused:
            self._paused = False
            await self._driver.resume()


class _Driver:
    """What ``VLLMEngine`` needs of an engine, awaitable whatever the engine's kind."""

    async def rpc(self, method: str, args: tuple, timeout_s: float) -> list[Any]:
        raise NotImplementedError

    async def pause(self) -> None:
        raise NotImplementedError

    async def resume(self) -> None:
        raise NotImplementedError

    async def reset_prefix_cache(self) -> bool:
        raise NotImplementedError

    async def label(self, version: str) -> None:
        raise NotImplementedError

    async def generate(self, prompts: Any, sampling_params: Any) -> list[Any]:
        raise NotImplementedError

    async def shutdown(self) -> None:
        raise NotImplementedError


class _SyncDriver(_Driver):
    """The offline ``vllm.LLM``: every call on one thread of its own, one at a time."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="vllm-engine")

    async def _run(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, partial(function, *args, **kwargs))

    async def rpc(self, method: str, args: tuple, timeout_s: float) -> list[Any]:
        call = self._run(self._llm.collective_rpc, method, timeout=timeout_s, args=args)
        return await asyncio.wait_for(call, timeout_s)  # the engine core may never answer

    async def pause(self) -> None:
        pass  # generation only runs inside generate(), on the same thread as the push

    async def resume(self) -> None:
        pass

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._run(self._llm.reset_prefix_cache, reset_running_requests=True))

    async def label(self, version: str) -> None:
        await self._run(self._llm.update_weight_version, version)

    async def generate(self, prompts: Any, sampling_params: Any) -> list[Any]:
        return list(await self._run(self._llm.generate, prompts, sampling_params, use_tqdm=False))

    async def shutdown(self) -> None:
        await self._run(self._llm.llm_engine.engine_core.shutdown)
        self._thread.shutdown(wait=False)


class _AsyncDriver(_Driver):
    """``AsyncLLM``, on the actor's event loop."""

    def __init__(self, engine: Any, pause_mode: PauseMode) -> None:
        self._engine = engine
        self._pause_mode = pause_mode
        self._requests = 0

    async def rpc(self, method: str, args: tuple, timeout_s: float) -> list[Any]:
        call = self._engine.collective_rpc(method, timeout=timeout_s, args=args)
        return await asyncio.wait_for(call, timeout_s)  # the engine core may never answer

    async def pause(self) -> None:
        await self._engine.pause_generation(mode=self._pause_mode, clear_cache=True)

    async def resume(self) -> None:
        await self._engine.resume_generation()

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._engine.reset_prefix_cache(reset_running_requests=True))

    async def label(self, version: str) -> None:
        await self._engine.update_weight_version(version)

    async def generate(self, prompts: Any, sampling_params: Any) -> list[Any]:
        if sampling_params is None:
            sampling_params = importlib.import_module("vllm").SamplingParams()
        batch = prompts if isinstance(prompts, list) else [prompts]
        params = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(batch)
        )
        return list(
            await asyncio.gather(*(self._one(p, s) for p, s in zip(batch, params, strict=True)))
        )

    async def _one(self, prompt: Any, sampling_params: Any) -> Any:
        self._requests += 1
        final = None
        async for output in self._engine.generate(
            prompt, sampling_params, f"ws-{id(self)}-{self._requests}"
        ):
            final = output
        return final

    async def shutdown(self) -> None:
        self._engine.shutdown()


def _build(async_engine: bool, engine_kwargs: dict[str, Any]) -> Any:
    if not async_engine:
        return importlib.import_module("vllm").LLM(**engine_kwargs)
    args = importlib.import_module("vllm.engine.arg_utils").AsyncEngineArgs(**engine_kwargs)
    return importlib.import_module("vllm.v1.engine.async_llm").AsyncLLM.from_engine_args(args)


def _merge_status(statuses: list[SyncStatus]) -> SyncStatus:
    first = statuses[0]
    return next(
        (s for s in statuses if (s.version, s.dirty) != (first.version, first.dirty)), first
    )


def _version_of(outputs: list[Any]) -> int | None:
    """The one committed version every output's tokens were labelled with by vLLM, else None."""
    labels = {
        span.version
        for output in outputs
        for completion in output.outputs
        for span in (completion.weight_versions or ())
    }
    if len(labels) != 1:
        return None
    label = labels.pop()
    return int(label) if label.isdigit() else None


RemoteVLLMEngine = ray.remote(VLLMEngine)
"""``VLLMEngine`` as a Ray actor class: ``RemoteVLLMEngine.options(num_cpus=0).remote(model=...)``."""
