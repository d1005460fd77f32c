"""vLLM: a worker extension that receives pushes, and the engine-side member that drives it.

vLLM runs the model in worker processes it starts itself, and lets users add methods to those
workers with ``worker_extension_cls`` (called through ``LLM.collective_rpc``). So the adapter
has two halves:

* ``WeightSyncExtension`` -- pass ``worker_extension_cls="weight_sync.adapters.vllm.
  WeightSyncExtension"``. In the worker process it joins the sync group, receives buckets and
  hands each bucket's tensors to the engine's own ``model.load_weights`` (which knows the
  engine's stacked q/k/v and gate/up layouts, so the trainer pushes its own names).
* ``VLLMEngine`` -- the member the ``WeightUpdater`` talks to, usually the Ray actor that owns
  the ``LLM`` (``RemoteVLLMEngine``, or your own engine actor inheriting from it). It forwards
  each step of a push to the worker through ``collective_rpc`` and, around it, pauses
  generation, then clears the prefix cache (its KV entries were computed by the old weights)
  and resumes.

Only plain strings and ints cross ``collective_rpc``: the same JSON messages as every other
member, so nothing is unpickled that the updater did not validate.

Tensor (and pipeline) parallel engines: every vLLM worker of the engine joins the sync group as
a rank of its own (the engine tells the updater how many ranks it takes) and receives every
bucket; the engine's ``load_weights`` on each worker keeps its shard of each full tensor, as it
does when loading a checkpoint. vLLM is not installed where this library is tested:
``tests/ray/test_vllm_contract.py`` runs the adapter against a host that calls it the way vLLM
does (see the README for what has and has not been run for real).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

import ray
import torch

from weight_sync.errors import WeightSyncError
from weight_sync.metadata import MemberInfo, PrepareReply, ReceiveReport, SyncStatus
from weight_sync.receiver import Receiver

EXTENSION = "weight_sync.adapters.vllm.WeightSyncExtension"


class WeightSyncExtension:
    """Mixed into vLLM's worker class: ``self.model_runner.model`` is the engine's model."""

    def weight_sync_info(self) -> str:
        return self._weight_sync_receiver().info().model_dump_json()

    def weight_sync_join(self, spec_json: str, max_metadata_bytes: int) -> None:
        """Join as the engine's first rank plus this worker's rank within the engine."""
        local_rank = int(getattr(self, "rank", 0))  # vLLM's worker: its rank in the engine
        self._weight_sync_receiver().join_json(spec_json, max_metadata_bytes, local_rank)

    def weight_sync_prepare(self, request_json: str) -> str:
        # The engine's load_weights decides what it can load: no up-front name check here.
        return self._weight_sync_receiver().prepare(request_json, lambda: None).model_dump_json()

    def weight_sync_receive(self, version: int) -> str:
        report = self._weight_sync_receiver().receive(version, self._weight_sync_load)
        return report.model_dump_json()

    def weight_sync_commit(self, version: int) -> None:
        self._weight_sync_receiver().commit(version, self._weight_sync_load)

    def weight_sync_leave(self) -> None:
        self._weight_sync_receiver().leave()

    def weight_sync_status(self) -> str:
        return self._weight_sync_receiver().status().model_dump_json()

    def _weight_sync_load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        model: Any = self.model_runner.model  # type: ignore[attr-defined]
        model.load_weights(weights=list(weights))

    def _weight_sync_receiver(self) -> Receiver:
        receiver = self.__dict__.get("_weight_sync_state")
        if receiver is None:
            receiver = self.__dict__["_weight_sync_state"] = Receiver()
        return receiver


class VLLMEngine:
    """The sync-group member for one vLLM engine; the ``WeightUpdater`` is given its handle.

    ``engine_kwargs`` build ``vllm.LLM`` (``worker_extension_cls`` is filled in), or pass a
    built ``engine`` whose ``worker_extension_cls`` is ``EXTENSION``. Override
    ``pause_generation``/``resume_generation`` for an engine that generates concurrently with
    this actor's calls (an async engine); with the offline ``LLM`` in a Ray actor, calls run one
    at a time, so a push already waits for the generation in flight and holds the next one.
    """

    def __init__(self, engine: Any = None, **engine_kwargs: Any) -> None:
        if engine is None:
            engine_kwargs.setdefault("worker_extension_cls", EXTENSION)
            engine = importlib.import_module("vllm").LLM(**engine_kwargs)
        elif engine_kwargs:
            raise TypeError("pass either a built engine or the arguments to build one, not both")
        self.llm = engine
        self._paused = False

    # -- hooks -----------------------------------------------------------------------------

    def pause_generation(self) -> None:
        """Stop starting new generation until ``resume_generation``. Default: the engine's own
        ``pause_generation`` if it has a synchronous one, else nothing (see the class doc)."""
        _call_if_present(self.llm, "pause_generation")

    def resume_generation(self) -> None:
        _call_if_present(self.llm, "resume_generation")

    def weights_version(self) -> int | None:
        return self.sync_status().version

    def generate(self, *args: Any, **kwargs: Any) -> tuple[Any, int | None]:
        """``LLM.generate`` and the weight version that produced its outputs (calls run one at a
        time, so no push commits in between)."""
        return self.llm.generate(*args, **kwargs), self.weights_version()

    def sync_status(self) -> SyncStatus:
        """The engine's status: its first worker's, unless another one disagrees (then that
        one's, so a dirty or lagging worker is never hidden)."""
        statuses = [SyncStatus.model_validate_json(s) for s in self._rpc("weight_sync_status")]
        first = statuses[0]
        return next((s for s in statuses if (s.version, s.dirty) != (first.version, first.dirty)), first)

    # -- protocol, called by WeightUpdater ---------------------------------------------------

    def _weight_sync_info(self) -> MemberInfo:
        infos = [MemberInfo.model_validate_json(i) for i in self._rpc("weight_sync_info")]
        versions = {info.version for info in infos}
        return infos[0].model_copy(update={
            "has_default_group": any(info.has_default_group for info in infos),
            "cuda": all(info.cuda for info in infos),
            "version": versions.pop() if len(versions) == 1 else None,
            "highest_version": max(info.highest_version for info in infos),
            "concurrent": False, "ranks": len(infos),
        })  # fmt: skip

    def _weight_sync_join(self, spec_json: str, max_metadata_bytes: int) -> None:
        self._rpc("weight_sync_join", spec_json, max_metadata_bytes)

    def _weight_sync_prepare(self, request_json: str) -> PrepareReply:
        replies = [PrepareReply.model_validate_json(r)
                   for r in self._rpc("weight_sync_prepare", request_json)]  # fmt: skip
        return PrepareReply(
            accepted=all(reply.accepted for reply in replies),
            need_plan=any(reply.need_plan for reply in replies),
            problems=tuple(dict.fromkeys(p for reply in replies for p in reply.problems)),
        )

    def _weight_sync_receive(self, version: int) -> ReceiveReport:
        self._pause()
        try:
            reports = [ReceiveReport.model_validate_json(r)
                       for r in self._rpc("weight_sync_receive", version)]  # fmt: skip
        except BaseException:
            self._refresh_and_resume()  # streaming: weights may be part-new; stale KV must go
            raise
        # Any worker's damaged bytes must reach the trainer's checksum comparison.
        first = reports[0]
        return next((r for r in reports if r.checksums != first.checksums), first)

    def _weight_sync_commit(self, version: int) -> None:
        try:
            self._rpc("weight_sync_commit", version)
        finally:
            self._refresh_and_resume()

    def _weight_sync_leave(self) -> None:
        try:
            self._rpc("weight_sync_leave")
        finally:
            if self._paused:
                self._refresh_and_resume()

    # -- internals ---------------------------------------------------------------------------

    def _pause(self) -> None:
        if not self._paused:
            self.pause_generation()
            self._paused = True

    def _refresh_and_resume(self) -> None:
        self.llm.reset_prefix_cache()
        if self._paused:
            self._paused = False
            self.resume_generation()

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every worker of the engine; one result per worker."""
        results = list(self.llm.collective_rpc(method, args=args))
        if not results:
            raise WeightSyncError(f"collective_rpc({method!r}) reached no vLLM worker")
        return results


RemoteVLLMEngine = ray.remote(VLLMEngine)
"""``VLLMEngine`` as a Ray actor class: ``RemoteVLLMEngine.options(num_gpus=1).remote(model=...)``."""


def _call_if_present(engine: Any, name: str) -> None:
    method: Callable[[], Any] | None = getattr(engine, name, None)
    if method is None:
        return
    result = method()
    if hasattr(result, "__await__"):
        close = getattr(result, "close", None)
        if close is not None:
            close()  # never awaited: don't leave a warning behind
        raise TypeError(
            f"the engine's {name}() is async; override VLLMEngine.{name} to run it on the "
            "engine's event loop"
        )
