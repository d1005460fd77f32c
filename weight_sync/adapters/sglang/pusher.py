"""The push into SGLang engines: check, pause, send bucket by bucket, commit, resume.

SGLang receives with its own code (``update_weights_from_distributed``), so its engines do not
run our receiver and this is not ``weight_sync.protocol``'s two-phase push. What SGLang lets
us keep, we keep:

* **Checked before any byte moves** (``checkpoint.check_push``): every name must be one the
  engine loaded at start, with its shape; a refused push changes nothing anywhere.
* **Bounded**: every call to an engine and every broadcast draws on the push's deadline
  (``push_timeout_s``); a dead or frozen engine, or one that answers ``success: false``, is a
  ``ServerError`` naming it, in bound. The group is then aborted on our side, which ends the
  engines' own waits in it at once (their sockets to us close).
* **Versioned**: engines answer ``"none"`` (SGLang's ``weight_version`` label, which every
  output's ``meta_info`` carries) from before the first byte moves until the push committed,
  then the version. A push that failed after bytes moved leaves them ``"none"``: SGLang loads
  each bucket as it arrives, so they may hold half-new weights, and say so. The next push must
  then carry at least every tensor the failed one sent (else it is refused, nothing sent), so
  that no engine claims a version over a mix.
* **Paused and flushed**: generation is paused around the push (``pause_mode``: ``"retract"``
  puts running requests back in the queue, recomputed with the new weights on resume;
  ``"abort"`` ends them; ``"in_place"`` freezes them with their old KV cache) and the radix
  cache flushed before the new version is announced: its entries were computed with the old
  weights. A cache that cannot be flushed fails the push.

Per push: one call per engine per round (pause, begin, end, flush, label, resume) and one per
engine per bucket (SGLang receives one bucket per call). Packing bucket k+1 overlaps the
transfer of bucket k.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any, Literal

import torch
from typing_extensions import Self

from weight_sync.adapters.sglang.buckets import Bucket, pack, plan_buckets
from weight_sync.adapters.sglang.checkpoint import Checkpoint, check_push
from weight_sync.adapters.sglang.client import Engine
from weight_sync.adapters.sglang.group import open_trainer_group
from weight_sync.config import SyncConfig
from weight_sync.control import in_thread
from weight_sync.deadline import Deadline
from weight_sync.entries import Rename, StateDict, check_state_dict, wire_dtype
from weight_sync.errors import PlanMismatchError, WeightSyncError
from weight_sync.http import ServerError
from weight_sync.mapping import Transform
from weight_sync.metadata import BackendName
from weight_sync.result import PushResult
from weight_sync.sharded import ShardedSource
from weight_sync.transport.rendezvous import address_of_interface, bind_listener
from weight_sync.transport.torch_group import TorchGroup, TorchWork

__all__ = ["NO_VERSION", "PauseMode", "SGLangPusher"]

logger = logging.getLogger(__name__)

PauseMode = Literal["retract", "abort", "in_place"]
NO_VERSION = "none"  # the label of an engine that holds no committed version
_UNLABELLED = frozenset({NO_VERSION, "default"})  # "default": SGLang's own, before any push
_QUICK_S = 10.0  # bound on each call made to recover after a failure


class SGLangPusher:
    """Pushes a trainer's weights into SGLang engines (see the module doc); ``engines`` are
    ``Engine``s (``HTTPEngine``, ``ActorEngine``). ``SGLangServers`` and ``SGLangUpdater`` are
    this with the engines made from URLs or Ray actors.

    The group forms at the first push, over every tensor-parallel rank of every engine, and is
    kept; it is formed again after a push that failed other than by a refusal."""

    def __init__(
        self,
        engines: Sequence[Engine],
        config: SyncConfig | None = None,
        *,
        pause_mode: PauseMode = "retract",
    ) -> None:
        if config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig, got {type(config).__name__}")
        if pause_mode not in ("retract", "abort", "in_place"):
            raise ValueError(
                f"pause_mode must be 'retract', 'abort' or 'in_place', got {pause_mode!r}"
            )
        self.config = config or SyncConfig()
        if self.config.delta:
            raise ValueError("SGLang engines load what they receive and keep no baseline: "
                             "delta pushes need weight_sync's own receivers; set delta=False")  # fmt: skip
        if not engines:
            raise ValueError("no engines: give at least one SGLang engine to push to")
        names = [engine.name for engine in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"an engine is listed twice: {names}")
        self.engines = list(engines)
        self.pause_mode = pause_mode
        self._by_name = dict(zip(names, self.engines, strict=True))
        self._group: TorchGroup | None = None
        self._group_name = ""
        self._backend: BackendName | None = None
        self._checkpoints: list[Checkpoint] | None = None
        self._version: int | None = None
        self._next_version = 1
        self._must_cover: set[str] = set()  # sent by a push that failed part-way
        self._lock = threading.Lock()
        self._closed = False

    @property
    def version(self) -> int | None:
        """The last version committed on every engine by this pusher (None before the first)."""
        return self._version

    def versions(self) -> list[int | None]:
        """Each engine's version as it labels its outputs: None where it holds none (no push
        yet, or one failed part-way). ``ServerError`` names the engines that did not answer."""
        answers = self._fan("model_info", None, Deadline(self.config.rpc_timeout_s, "versions"))
        labels = [str((answers[e.name] or {}).get("weight_version")) for e in self.engines]
        return [as_version(label) for label in labels]

    def push(
        self,
        state_dict: StateDict,
        *,
        rename: Rename | None = None,
        transform: Transform | None = None,
    ) -> PushResult:
        """Push ``state_dict`` (names as the engines' checkpoint has them, or mapped there by
        ``transform`` then ``rename``) to every engine; when it returns, every engine serves
        ``result.version``, its cache flushed, and generates again.

        Raises ``TypeError``/``ValueError`` for a bad state dict, and ``PlanMismatchError`` for
        one the engines cannot load, before anything is sent or paused; otherwise a
        ``WeightSyncError`` within ``push_timeout_s`` -- ``ServerError`` naming the engines that
        failed where that is known -- after which the engines still reachable say ``"none"``
        (if any byte moved) and generate again, until a push repairs them."""
        started = time.monotonic()
        if isinstance(state_dict, ShardedSource):
            raise TypeError("SGLang engines take whole tensors: gather a ShardedSource's "
                            "tensors (full_tensor()) and push them as a state dict")  # fmt: skip
        entries = check_state_dict(state_dict, self.config, rename, transform)
        with self._lock:
            if self._closed:
                raise WeightSyncError("this SGLang pusher is closed; create a new one")
            named = [*zip(entries.names, range(len(entries.names))),
                     *((tied.name, tied.tensor) for tied in entries.tied)]  # fmt: skip
            if not named:
                return PushResult(self._version or 0, 0, 0, 0.0)
            bound = self.config.push_timeout_s
            deadline = Deadline(bound - min(bound / 4, 3 * _QUICK_S), "push", started)
            sent = self._check(named, entries.tensors, deadline)
            sources = [entries.tensors[index] for _, index in sent]
            cast = self.config.cast_dtype
            buckets = plan_buckets(
                [(name, wire_dtype(t.dtype, cast), tuple(t.shape))
                 for (name, _), t in zip(sent, sources, strict=True)],
                self.config.bucket_bytes,
            )  # fmt: skip
            return self._push(buckets, sources, {name for name, _ in sent}, deadline, started)

    def close(self) -> None:
        """Leave the group on every engine (they keep serving their weights). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._group is not None:
                self._drop_group(abort=False)
                self._quietly("destroy_weights_update_group", {"group_name": self._group_name})

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one push --------------------------------------------------------------------------------

    def _check(
        self, named: list[tuple[str, int]], tensors: list[torch.Tensor], deadline: Deadline
    ) -> list[tuple[str, int]]:
        """What to send, checked against every engine's checkpoint; raises PlanMismatchError."""
        if self._checkpoints is None:
            timeout_s = deadline.left(self.config.rpc_timeout_s)
            answers = _settle({e.name: in_thread(partial(e.checkpoint, timeout_s))
                               for e in self.engines}, timeout_s + 1.0, "reading checkpoints")  # fmt: skip
            self._checkpoints = [answers[e.name] for e in self.engines]
        shapes = [(name, tuple(tensors[index].shape)) for name, index in named]
        problems: dict[int, list[str]] = {}
        keep: list[int] | None = None
        for slot, checkpoint in enumerate(self._checkpoints):
            kept, wrong = check_push(checkpoint, shapes)
            if wrong:
                problems[slot] = wrong
            keep = kept if keep is None else [index for index in keep if index in set(kept)]
        missing = sorted(self._must_cover - {name for name, _ in named})
        if missing:
            why = (f"a push failed part-way after sending {len(missing)} tensor(s) this one "
                   f"lacks ({', '.join(missing[:5])}...): push them all, so that no engine "
                   "claims a version over a mix")  # fmt: skip
            for slot in range(len(self.engines)):
                problems.setdefault(slot, []).append(why)
        if problems:
            raise PlanMismatchError(problems)
        assert keep is not None
        return [named[index] for index in keep]

    def _push(
        self,
        buckets: list[Bucket],
        sources: list[torch.Tensor],
        names: set[str],
        deadline: Deadline,
        started: float,
    ) -> PushResult:
        phases: dict[str, float] = {}
        mark = time.monotonic()

        def lap(phase: str) -> None:
            nonlocal mark
            now = time.monotonic()
            phases[phase] = now - mark
            mark = now

        paused = moved = False
        try:
            self._fan("pause_generation", {"mode": self.pause_mode}, deadline)
            paused = True
            group = self._ensure_group(sources, deadline)
            lap("group")
            self._fan("begin_weight_update", {}, deadline)
            moved = True  # from the label on: the engines may no longer hold what they say
            self._label(NO_VERSION, deadline)
            self._transfer(group, buckets, sources, deadline)
            lap("transfer")
            self._fan("end_weight_update", {}, deadline)
            self._fan("flush_cache", None, deadline)
            version = self._next_version
            self._label(str(version), deadline)
            lap("commit")
        except BaseException as exc:
            blamed = self._recover(exc, paused, moved, names)
            if blamed is exc:
                raise
            raise blamed from exc
        self._next_version += 1
        self._version, self._must_cover = version, set()
        self._fan("continue_generation", {"torch_empty_cache": False}, Deadline(_QUICK_S, "resume"))
        seconds = time.monotonic() - started
        phases["total"] = seconds
        nbytes = sum(bucket.nbytes for bucket in buckets)
        logger.info("pushed version %d to %d SGLang engine(s): %d tensors, %.1f MB in %d "
                    "buckets, %.3fs", version, len(self.engines), len(sources), nbytes / 1e6,
                    len(buckets), seconds)  # fmt: skip
        return PushResult(version, nbytes, len(buckets), seconds, len(sources), False, phases,
                          nbytes)  # fmt: skip

    def _transfer(
        self,
        group: TorchGroup,
        buckets: list[Bucket],
        sources: list[torch.Tensor],
        deadline: Deadline,
    ) -> None:
        """Each bucket: every engine asked to receive it, then broadcast; packing the next
        bucket overlaps both. Two buffers of the largest bucket, for this push only."""
        size = max(bucket.nbytes for bucket in buckets)
        buffers = [torch.empty(size, dtype=torch.uint8, device=group.device) for _ in range(2)]
        in_flight: tuple[TorchWork, dict[str, Future[Any]]] | None = None
        for index, bucket in enumerate(buckets):
            data = pack(bucket, sources, buffers[index % 2])
            if in_flight is not None:
                self._finish(*in_flight, deadline)
            body = {**bucket.request(), "group_name": self._group_name,
                    "load_format": "flattened_bucket", "flush_cache": False}  # fmt: skip
            timeout_s = deadline.left(self.config.collective_timeout_s)
            calls = {engine.name: in_thread(partial(engine.call, "update_weights_from_distributed",
                                                    body, timeout_s), "weight-sync-sglang")
                     for engine in self.engines}  # fmt: skip
            in_flight = group.broadcast(data, src=0, timeout_s=timeout_s), calls
        if in_flight is not None:
            self._finish(*in_flight, deadline)

    def _finish(self, work: TorchWork, calls: dict[str, Future[Any]], deadline: Deadline) -> None:
        """Wait for one bucket: an engine that failed is named at once, even while the
        broadcast still waits (for it, perhaps)."""
        sending = in_thread(work.wait, "weight-sync-broadcast")  # bounded by the collective's
        _settle(calls, deadline.left(self.config.collective_timeout_s) + 1.0,
                "update_weights_from_distributed", sending)  # fmt: skip

    def _ensure_group(self, sources: list[torch.Tensor], deadline: Deadline) -> TorchGroup:
        backend, device = self._backend_for(sources)
        if self._group is not None and backend == self._backend:
            return self._group
        if self._group is not None:
            self._drop_group(abort=False)
            self._quietly("destroy_weights_update_group", {"group_name": self._group_name})
        answers = self._fan("server_info", None, deadline)
        ranks = []
        for engine in self.engines:
            info = answers[engine.name] or {}
            if int(info.get("dp_size", 1) or 1) != 1:
                raise ValueError(f"SGLang engine {engine.name} runs data-parallel replicas "
                                 "(dp_size > 1), which SGLang cannot update from a broadcast; "
                                 "start one engine per replica")  # fmt: skip
            ranks.append(int(info.get("tp_size", 1) or 1))
        # A trainer that died mid-push left a session open: SGLang refuses to begin another.
        self._quietly("end_weight_update", {})
        config = self.config
        address = (
            config.master_addr
            if config.interface is None
            else address_of_interface(config.interface)
        )
        listener = bind_listener(address)
        name = f"weight_sync_{secrets.token_hex(6)}"
        timeout_s = deadline.left(config.rendezvous_timeout_s)
        calls: dict[str, Future[Any]] = {}
        offset = 1
        for engine, size in zip(self.engines, ranks, strict=True):
            body = {"master_address": address, "master_port": listener.getsockname()[1],
                    "rank_offset": offset, "world_size": 1 + sum(ranks), "group_name": name,
                    "backend": backend}  # fmt: skip
            calls[engine.name] = in_thread(
                partial(engine.call, "init_weights_update_group", body, timeout_s)
            )
            offset += size
        ours = in_thread(lambda: open_trainer_group(
            listener, address, 1 + sum(ranks), name, backend, device, timeout_s,
            config.collective_timeout_s,
        ))  # fmt: skip
        try:
            _settle(calls, timeout_s + 1.0, "init_weights_update_group")
            group = ours.result(timeout=max(deadline.remaining(), 0.1))
        except BaseException:
            ours.add_done_callback(lambda done: done.exception() or done.result().abort())
            self._quietly("destroy_weights_update_group", {"group_name": name})
            raise
        self._group, self._group_name, self._backend = group, name, backend
        logger.info("SGLang group %s formed: the trainer and %d engine rank(s), %s",
                    name, sum(ranks), backend)  # fmt: skip
        return group

    def _backend_for(self, sources: list[torch.Tensor]) -> tuple[BackendName, torch.device | None]:
        on_gpu = any(tensor.is_cuda for tensor in sources)
        backend = self.config.backend if self.config.backend != "auto" else (
            "nccl" if on_gpu else "gloo"
        )  # fmt: skip
        if backend == "nccl":
            device = next((t.device for t in sources if t.is_cuda), None)
            if device is None:
                raise ValueError("backend='nccl' sends from a CUDA device, but every tensor "
                                 "of this push is on the CPU; use backend='gloo' or 'auto'")  # fmt: skip
            return "nccl", device
        return "gloo", None

    # -- failure -------------------------------------------------------------------------------

    def _recover(
        self, error: BaseException, paused: bool, moved: bool, names: set[str]
    ) -> BaseException:
        """After a failed push: abort our end of the group (the engines' waits in it end), then
        on every engine, each call bounded: end the update session, say ``"none"`` if bytes
        may have moved, leave the group, resume. Returns the error to raise: a ``ServerError``
        naming the engines that could not be reached (dead) or whose calls failed."""
        failed = dict(error.servers) if isinstance(error, ServerError) else {}
        group_name = self._group_name
        self._drop_group(abort=True)
        if moved:
            self._must_cover |= names

        def recover(engine: Engine) -> None:
            for route, body in (("end_weight_update", {}),
                                ("destroy_weights_update_group", {"group_name": group_name})):  # fmt: skip
                try:
                    engine.call(route, body, _QUICK_S)
                except ServerError as exc:  # none open, or already gone: expected here
                    logger.debug("recovering %s: %s", engine.name, exc)
            if moved:
                engine.call("update_weight_version",
                            {"new_version": NO_VERSION, "abort_all_requests": False}, _QUICK_S)  # fmt: skip
            if paused:
                engine.call("continue_generation", {"torch_empty_cache": False}, _QUICK_S)

        unreachable: dict[str, str] = {}
        futures = {engine.name: in_thread(partial(recover, engine)) for engine in self.engines}
        for name, future in futures.items():
            try:
                future.result(timeout=5 * _QUICK_S)
            except Exception as exc:
                unreachable[name] = str(exc.servers.get(name, exc)) if isinstance(
                    exc, ServerError) else f"{type(exc).__name__}: {exc}"  # fmt: skip
                logger.warning("after a failed push (%s), SGLang engine %s: %s", error, name, exc)
        if not isinstance(error, WeightSyncError):
            return error
        blamed, what = (unreachable, "unreachable") if unreachable else (failed, "failed")
        if not blamed or (isinstance(error, ServerError) and set(blamed) <= set(error.servers)):
            return error
        detail = "; ".join(f"{name}: {reason}" for name, reason in blamed.items())
        return ServerError(f"{error} [{what} SGLang engine(s): {detail}]", blamed)

    def _drop_group(self, abort: bool) -> None:
        group, self._group, self._backend = self._group, None, None
        self._checkpoints = None  # read again with the next group: an engine may have restarted
        if group is not None:
            group.abort("the push failed") if abort else group.close()

    # -- calls to every engine -------------------------------------------------------------------

    def _fan(self, route: str, body: dict[str, Any] | None, deadline: Deadline) -> dict[str, Any]:
        """``route`` on every engine at once, bounded by ``rpc_timeout_s`` and the deadline."""
        timeout_s = deadline.left(self.config.rpc_timeout_s)
        calls = {engine.name: in_thread(partial(engine.call, route, body, timeout_s),
                                        "weight-sync-sglang")
                 for engine in self.engines}  # fmt: skip
        return _settle(calls, timeout_s + 1.0, route)

    def _label(self, label: str, deadline: Deadline) -> None:
        self._fan("update_weight_version", {"new_version": label, "abort_all_requests": False},
                  deadline)  # fmt: skip

    def _quietly(self, route: str, body: dict[str, Any]) -> None:
        """``route`` on every engine, bounded; failures (expected: nothing to end) only logged."""
        try:
            self._fan(route, body, Deadline(_QUICK_S, route))
        except WeightSyncError as exc:
            logger.debug("%s: %s", route, exc)


def _settle(
    calls: Mapping[str, Future[Any]], timeout_s: float, what: str, also: Future[Any] | None = None
) -> dict[str, Any]:
    """The answers of ``calls`` (by engine name) once all are in -- and ``also``, the trainer's
    own part, done -- within ``timeout_s``. ``ServerError`` names every engine whose call failed
    as soon as one has (before ``also``'s error: an engine that failed is the better lead), or
    that had not answered in time."""
    end = time.monotonic() + timeout_s
    while True:
        failed = {name: _reason(name, future) for name, future in calls.items()
                  if future.done() and future.exception() is not None}  # fmt: skip
        if failed:
            detail = "; ".join(f"{name}: {reason}" for name, reason in failed.items())
            raise ServerError(f"{what} failed on {len(failed)} SGLang engine(s): {detail}", failed)
        if also is not None and also.done() and also.exception() is not None:
            raise also.exception()  # type: ignore[misc]
        late = [name for name, future in calls.items() if not future.done()]
        if not late and (also is None or also.done()):
            return {name: future.result() for name, future in calls.items()}
        if time.monotonic() >= end:
            if not late:  # only ours is late: its own bound raises first, this is a backstop
                raise WeightSyncError(f"{what}: the trainer's broadcast outlived its bound")
            raise ServerError(
                f"{what}: SGLang engine(s) {late} did not answer within {timeout_s:.1f}s",
                dict.fromkeys(late, f"no answer to {what} within {timeout_s:.1f}s"),
            )
        time.sleep(0.005)


def _reason(name: str, future: Future[Any]) -> str:
    error = future.exception()
    if isinstance(error, ServerError) and name in error.servers:
        return error.servers[name]
    return f"{type(error).__name__}: {error}"


def as_version(label: str) -> int | None:
    if label in _UNLABELLED:
        return None
    try:
        return int(label)
    except ValueError:
        return None  # labelled by someone else: not a version of ours
