"""The push into SGLang engines: check, pause, send bucket by bucket, commit, resume.

SGLang receives with its own code (``update_weights_from_distributed``), so its engines do not
run our receiver and this is not ``weight_sync.send.pusher``'s two-phase push. What SGLang lets
us keep, we keep:

* **Checked before any byte moves** (``checkpoint.check_push``): every name must be one the
  engine loaded at start, with its shape; a refused push changes nothing anywhere.
* **Bounded**: every call to an engine and every broadcast draws on the push's deadline
  (``push_timeout_s``, less a reserve to release the engines after a failure); a dead or frozen
  engine, or one that answers ``success: false``, is a ``ServerError`` naming it, in bound. The
  group is then aborted on our side, which over Gloo ends the engines' own waits in it at once
  (their sockets to us close); over NCCL it cannot (see ``_recover``).
* **Versioned**: engines answer ``"none (past N)"`` (SGLang's ``weight_version`` label, which
  every output's ``meta_info`` carries; ``N`` the version being pushed) from before the first
  byte moves until the push committed, then the version. A push that failed after bytes moved
  leaves them so: SGLang loads each bucket as it arrives, so they may hold half-new weights,
  and say so. The next push must then carry at least every tensor the failed one sent (else it
  is refused, nothing sent), so that no engine claims a version over a mix. The label is the
  engines' only memory of what they were pushed: a pusher reads it (``/model_info``) when it
  forms its group and takes versions past it (``weight_sync.wire.versions``), so a new trainer or a
  repair never reuses a version an engine served.
* **Paused and flushed**: generation is paused around the push (``pause_mode``: ``"retract"``
  puts running requests back in the queue, recomputed with the new weights on resume;
  ``"abort"`` ends them; SGLang's ``"in_place"``, which keeps them with their KV cache, would
  refuse the flush) and the radix cache flushed before the new version is announced: its
  entries were computed with the old weights. A cache that cannot be flushed fails the push.

Per push: one call per engine per round (pause, begin, end, flush, label, resume) and one per
engine per bucket (SGLang receives one bucket per call). Packing bucket k+1 overlaps the
transfer of bucket k.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from typing_extensions import Self

from weight_sync.adapters.sglang.buckets import Bucket, pack, plan_buckets
from weight_sync.adapters.sglang.checkpoint import Checkpoint, check_push
from weight_sync.adapters.sglang.client import Engine
from weight_sync.adapters.sglang.group import connect_nccl, open_trainer_group
from weight_sync.config import SyncConfig
from weight_sync.control.deadline import Deadline
from weight_sync.control.futures import in_thread
from weight_sync.control.http import collect_answers, reason
from weight_sync.errors import PlanMismatchError, ServerError, WeightSyncError
from weight_sync.result import PushResult
from weight_sync.send.sharded import ShardedSource
from weight_sync.transport.devices import push_device, sized_for
from weight_sync.transport.rendezvous import bind_listener, listen_address
from weight_sync.transport.torch_group import TorchGroup, TorchWork
from weight_sync.wire.blame import blame_servers
from weight_sync.wire.mapping import Transform
from weight_sync.wire.metadata import BackendName, dtype_name
from weight_sync.wire.state_dict import Rename, StateDict, check_state_dict, wire_dtype
from weight_sync.wire.versions import (
    NO_VERSION,
    check_version,
    choose_version,
    label_past,
    label_version,
    unlabelled,
)

__all__ = ["NO_VERSION", "PauseMode", "SGLangPusher"]

logger = logging.getLogger(__name__)

PauseMode = Literal["retract", "abort"]
_QUICK_S = 10.0  # bound on each call made to recover after a failure
_WHO = "SGLang engine(s)"  # how messages name the engines


class SGLangPusher:
    """Pushes a trainer's weights into SGLang engines (see the module doc); ``engines`` are
    ``Engine``s (``HTTPEngine``, ``ActorEngine``). ``SGLangServers`` and ``SGLangUpdater`` are
    this with the engines made from URLs or Ray actors.

    The group forms at the first push, over every tensor-parallel rank of every engine, and is
    kept; it is formed again after a push that failed other than by a refusal.

    ``senders`` (a push from every rank of a sharded trainer, as ``WeightUpdater`` and
    ``VLLMServers`` take one) is refused: SGLang's update routes load whole tensors from one
    source."""

    def __init__(
        self,
        engines: Sequence[Engine],
        config: SyncConfig | None = None,
        *,
        pause_mode: PauseMode = "retract",
        senders: dist.ProcessGroup | None = None,
    ) -> None:
        if senders is not None:
            raise ValueError(
                "SGLang engines cannot take a push from many senders: their update routes load "
                "whole tensors from one source, not blocks from every trainer rank. Push from one "
                "rank: gather the shards there (a ShardedSource, or each DTensor's full_tensor())"
            )
        if config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig, got {type(config).__name__}")
        if pause_mode not in ("retract", "abort"):
            raise ValueError(
                f"pause_mode must be 'retract' or 'abort', got {pause_mode!r} (SGLang's "
                "'in_place' keeps running requests, whose KV cache then refuses the flush a "
                "push needs)"
            )
        self.config = config or SyncConfig()
        if self.config.delta:
            raise ValueError(
                "SGLang engines load what they receive and keep no baseline: "
                "delta pushes need weight_sync's own receivers; set delta=False"
            )
        if not engines:
            raise ValueError("no engines: give at least one SGLang engine to push to")
        names = [engine.name for engine in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"an engine is listed twice: {names}")
        self.engines = list(engines)
        self.pause_mode = pause_mode
        self._group: TorchGroup | None = None
        self._connected = False  # NCCL: our communicator exists
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
        return [label_version(label) for label in labels]

    def push(
        self,
        state_dict: StateDict,
        *,
        rename: Rename | None = None,
        transform: Transform | None = None,
        version: int | None = None,
    ) -> PushResult:
        """Push ``state_dict`` (names as the engines' checkpoint has them, or mapped there by
        ``transform`` then ``rename``) to every engine; when it returns, every engine serves
        ``result.version``, its cache flushed, and generates again.

        ``version``: the version to label the push with (an RL loop's step), past every version
        an engine was ever pushed, else refused (``ValueError``) with nothing sent; by default
        the count goes on past them.

        Raises ``TypeError``/``ValueError`` for a bad state dict, and ``PlanMismatchError`` for
        one the engines cannot load, before anything is sent or paused; otherwise a
        ``WeightSyncError`` within ``push_timeout_s`` -- ``ServerError`` naming the engines that
        failed where that is known -- after which the engines still reachable say ``"none (past
        N)"`` (if any byte moved) and generate again, until a push repairs them."""
        started = time.monotonic()
        check_version(version)
        if isinstance(state_dict, ShardedSource):
            raise TypeError(
                "SGLang engines take whole tensors: gather a ShardedSource's "
                "tensors (full_tensor()) and push them as a state dict"
            )
        entries = check_state_dict(state_dict, self.config, rename, transform)
        with self._lock:
            if self._closed:
                raise WeightSyncError("this SGLang pusher is closed; create a new one")
            named = [
                *zip(entries.names, range(len(entries.names))),
                *((tied.name, tied.tensor) for tied in entries.tied),
            ]
            if not named:
                return PushResult.nothing(self._version or 0)
            bound = self.config.push_timeout_s
            deadline = Deadline(bound - _reserve(bound), "push", started)
            sent = self._check(named, entries.tensors, deadline)
            if not sent:  # only a tied head, which the engines tie themselves
                return PushResult.nothing(self._version or 0)
            sources = [entries.tensors[index] for _, index in sent]
            cast = self.config.cast_dtype
            sized = sized_for(self.config, push_device(sources))
            buckets = plan_buckets(
                [
                    (name, wire_dtype(t.dtype, cast), tuple(t.shape))
                    for (name, _), t in zip(sent, sources, strict=True)
                ],
                sized.sized_bucket_bytes,
            )
            names = {name for name, _ in sent}
            return self._push(buckets, sources, names, deadline, started, version)

    def close(self) -> None:
        """Leave the group on every engine (they keep serving their weights). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._leave_group()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one push --------------------------------------------------------------------------------

    def _check(
        self, named: list[tuple[str, int]], tensors: list[torch.Tensor], deadline: Deadline
    ) -> list[tuple[str, int]]:
        """What to send, checked against every engine's checkpoint; raises PlanMismatchError."""
        if self._checkpoints is None:  # one by one: a trainer-side error stays what it is
            self._checkpoints = [
                e.checkpoint(deadline.left(self.config.rpc_timeout_s)) for e in self.engines
            ]
        cast = self.config.cast_dtype
        pushed = [
            (name, tuple(tensors[index].shape), dtype_name(wire_dtype(tensors[index].dtype, cast)))
            for name, index in named
        ]
        problems: dict[int, list[str]] = {}
        keep: set[int] | None = None
        for slot, checkpoint in enumerate(self._checkpoints):
            kept, wrong = check_push(checkpoint, pushed)
            if wrong:
                problems[slot] = [f"{self.engines[slot].name}: {why}" for why in wrong]
            keep = set(kept) if keep is None else keep & set(kept)
        missing = sorted(self._must_cover - {name for name, _ in named})
        if missing:
            problems.setdefault(0, []).append(
                f"a push failed part-way after sending {len(missing)} tensor(s) this one lacks "
                f"({', '.join(missing[:5])}): push them all, so that no engine claims a version "
                "over a mix"
            )
        if problems:
            raise PlanMismatchError(problems)
        assert keep is not None
        return [named[index] for index in sorted(keep)]

    def _push(
        self,
        buckets: list[Bucket],
        sources: list[torch.Tensor],
        names: set[str],
        deadline: Deadline,
        started: float,
        named: int | None,
    ) -> PushResult:
        phases: dict[str, float] = {}
        mark = time.monotonic()

        def lap(phase: str) -> None:
            nonlocal mark
            now = time.monotonic()
            phases[phase] = now - mark
            mark = now

        paused = moved = False
        version = 0
        try:
            paused = True  # before the calls: an engine that paused must resume, whoever failed
            self._fan("pause_generation", {"mode": self.pause_mode}, deadline)
            group = self._ensure_group(sources, deadline)  # may move _next_version up
            version = choose_version(named, self._next_version, "engines")
            lap("group")
            self._fan("begin_weight_update", {}, deadline)
            moved = True  # from the label on: the engines may no longer hold what they say
            self._next_version = version + 1  # spent, whatever happens: an engine may hold it
            self._label(unlabelled(version), deadline)
            self._transfer(group, buckets, sources, deadline)
            lap("transfer")
            self._fan("end_weight_update", {}, deadline)
            self._fan("flush_cache", None, deadline)
            self._label(str(version), deadline)
            lap("commit")
        except BaseException as exc:
            blamed = self._recover(exc, paused, version if moved else None, names)
            if blamed is exc:
                raise
            raise blamed from exc
        self._version, self._must_cover = version, set()
        try:
            self._fan(
                "continue_generation", {"torch_empty_cache": False}, Deadline(_QUICK_S, "resume")
            )
        except ServerError as exc:
            raise ServerError(
                f"version {version} was committed on every engine, but resuming "
                f"generation failed: {exc}; call continue_generation on them",
                exc.servers,
            ) from exc
        seconds = time.monotonic() - started
        phases["total"] = seconds
        nbytes = sum(bucket.nbytes for bucket in buckets)
        logger.info(
            "pushed version %d to %d SGLang engine(s): %d tensors, %.1f MB in %d buckets, %.3fs",
            version,
            len(self.engines),
            len(sources),
            nbytes / 1e6,
            len(buckets),
            seconds,
        )
        return PushResult(
            version, nbytes, len(buckets), seconds, len(sources), False, phases, nbytes
        )

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
            body = {
                **bucket.request(),
                "group_name": self._group_name,
                "load_format": "flattened_bucket",
                "flush_cache": False,
            }
            timeout_s = deadline.left(self.config.collective_timeout_s)
            calls = {
                engine.name: in_thread(
                    partial(engine.call, "update_weights_from_distributed", body, timeout_s),
                    "weight-sync-sglang",
                )
                for engine in self.engines
            }
            if not self._connected:  # NCCL: the engines create their communicator in this call
                self._connect(group, calls, deadline)
            in_flight = group.broadcast(data, src=0, timeout_s=timeout_s), calls
        if in_flight is not None:
            self._finish(*in_flight, deadline)

    def _finish(self, work: TorchWork, calls: dict[str, Future[Any]], deadline: Deadline) -> None:
        """Wait for one bucket: an engine that failed is named at once, even while the
        broadcast still waits (for it, perhaps)."""
        # bounded by the collective's timeout
        sending = in_thread(work.wait, "weight-sync-broadcast", exit_waits=True)
        collect_answers(
            calls,
            deadline.left(self.config.collective_timeout_s) + 1.0,
            "update_weights_from_distributed",
            who=_WHO,
            also=sending,
        )

    def _connect(
        self, group: TorchGroup, calls: dict[str, Future[Any]], deadline: Deadline
    ) -> None:
        """Create our NCCL communicator while the engines create theirs, in their first receive
        (lazily, under the same store key), bounded: torch bounds nothing of
        ``ncclCommInitRank``, and posting the first broadcast without a communicator would run
        it under the group's lock with no bound at all (see ``transport.nccl.connect``)."""
        connecting = in_thread(
            lambda: connect_nccl(group), "weight-sync-nccl-init", exit_waits=True
        )
        collect_answers(
            calls,
            deadline.left(self.config.rendezvous_timeout_s),
            "creating the NCCL communicator",
            who=_WHO,
            also=connecting,
            until_also=True,
        )
        self._connected = True

    def _ensure_group(self, sources: list[torch.Tensor], deadline: Deadline) -> TorchGroup:
        backend, device = self._backend_for(sources)
        if self._group is not None and backend == self._backend:
            return self._group
        self._leave_group()
        answers = self._fan("server_info", None, deadline)
        ranks = []
        for engine in self.engines:
            info = answers[engine.name] or {}
            for field, what in (
                ("dp_size", "data-parallel replicas"),
                ("pp_size", "pipeline stages"),
            ):
                if int(info.get(field, 1) or 1) != 1:
                    raise ValueError(
                        f"SGLang engine {engine.name} runs {what} ({field} > 1), whose ranks "
                        "SGLang cannot place in a weight-update group; start one engine per "
                        "replica, tensor-parallel only"
                    )
            ranks.append(int(info.get("tp_size", 1) or 1))
        # Versions never repeat, across trainers and repairs too: past what any engine was ever
        # pushed, as its label says -- read from /model_info, where SGLang keeps it (0.5.23's
        # /server_info has no weight_version).
        labels = self._fan("model_info", None, deadline)
        for engine in self.engines:
            past = label_past(str((labels[engine.name] or {}).get("weight_version")))
            self._next_version = max(self._next_version, past + 1)
        # A trainer that died mid-push left a session open: SGLang refuses to begin another.
        self._quietly("end_weight_update", {}, _QUICK_S)
        config = self.config
        address = listen_address(config.master_addr, config.interface)
        listener = bind_listener(address)
        name = f"weight_sync_{secrets.token_hex(6)}"
        timeout_s = deadline.left(config.rendezvous_timeout_s)
        calls: dict[str, Future[Any]] = {}
        offset = 1
        for engine, size in zip(self.engines, ranks, strict=True):
            body = {
                "master_address": address,
                "master_port": listener.getsockname()[1],
                "rank_offset": offset,
                "world_size": 1 + sum(ranks),
                "group_name": name,
                "backend": backend,
            }
            calls[engine.name] = in_thread(
                partial(engine.call, "init_weights_update_group", body, timeout_s)
            )
            offset += size
        ours = in_thread(
            lambda: open_trainer_group(
                listener,
                address,
                1 + sum(ranks),
                name,
                backend,
                device,
                timeout_s,
                config.collective_timeout_s,
            )
        )
        try:
            collect_answers(calls, timeout_s + 1.0, "init_weights_update_group", who=_WHO)
            group = ours.result(timeout=max(deadline.remaining(), 0.1))
        except BaseException:
            ours.add_done_callback(lambda done: done.exception() or done.result().abort())
            self._quietly("destroy_weights_update_group", {"group_name": name}, _QUICK_S)
            raise
        self._group, self._group_name, self._backend = group, name, backend
        self._connected = backend == "gloo"  # Gloo connected in the constructor; NCCL lazily
        logger.info(
            "SGLang group %s formed: the trainer and %d engine rank(s), %s",
            name,
            sum(ranks),
            backend,
        )
        return group

    def _backend_for(self, sources: list[torch.Tensor]) -> tuple[BackendName, torch.device | None]:
        on_gpu = any(tensor.is_cuda for tensor in sources)
        backend = (
            self.config.backend if self.config.backend != "auto" else ("nccl" if on_gpu else "gloo")
        )
        if backend == "nccl":
            device = next((t.device for t in sources if t.is_cuda), None)
            if device is None:
                raise ValueError(
                    "backend='nccl' sends from a CUDA device, but every tensor "
                    "of this push is on the CPU; use backend='gloo' or 'auto'"
                )
            return "nccl", device
        return "gloo", None

    # -- failure -------------------------------------------------------------------------------

    def _recover(
        self, error: BaseException, paused: bool, moved: int | None, names: set[str]
    ) -> BaseException:
        """After a failed push: abort our end of the group, then release every engine (see
        ``release``), within what the push kept of its bound. ``moved``: the version being
        pushed, once bytes may have moved (None before). Returns the error to raise: a
        ``ServerError`` naming the engines that could not be reached (dead) or whose calls
        failed.

        NCCL: an engine's receive is a kernel our abort cannot cancel (SGLang waits for it only
        on its stream), so an engine whose transfer was cut stays wedged until its group's
        30-minute timeout; it is not resumed, and the error says to restart it."""
        failed = dict(error.servers) if isinstance(error, ServerError) else {}
        group_name, nccl = self._group_name, self._backend == "nccl"
        self._drop_group(abort=True)
        if moved is not None:
            self._must_cover |= names
        budget = _reserve(self.config.push_timeout_s)
        wedged = nccl and moved is not None
        unreachable: dict[str, str] = {}
        futures = {
            engine.name: in_thread(
                partial(
                    release,
                    engine,
                    group_name,
                    past=moved,
                    resume=paused and not wedged,
                    timeout_s=budget / 4,
                )
            )
            for engine in self.engines
        }
        end = time.monotonic() + budget
        for name, future in futures.items():
            try:
                future.result(timeout=max(end - time.monotonic(), 0.01))
            except Exception as exc:
                unreachable[name] = reason(name, exc)
                logger.warning("after a failed push (%s), SGLang engine %s: %s", error, name, exc)
        if wedged:
            return WeightSyncError(
                f"{error} [over NCCL, the engines' receives cannot be cancelled: restart the "
                f"SGLang engines of this push (they are labelled {unlabelled(moved or 0)!r} and "
                "were not resumed)]"
            )
        return blame_servers(error, failed, unreachable, "SGLang engine(s)")

    def _drop_group(self, abort: bool) -> None:
        group, self._group, self._backend = self._group, None, None
        self._checkpoints = None  # read again with the next group: an engine may have restarted
        if group is not None:
            group.abort("the push failed") if abort else group.close()

    def _leave_group(self) -> None:
        """Close our end of the group and have every engine leave it (quietly, bounded)."""
        if self._group is not None:
            self._drop_group(abort=False)
            self._quietly(
                "destroy_weights_update_group", {"group_name": self._group_name}, _QUICK_S
            )

    # -- calls to every engine -------------------------------------------------------------------

    def _fan(self, route: str, body: dict[str, Any] | None, deadline: Deadline) -> dict[str, Any]:
        """``route`` on every engine at once, bounded by ``rpc_timeout_s`` and the deadline.
        Every call is let finish (within the bound) before a failure is raised: each is a step
        an engine takes alone (the bytes go through ``_transfer``), and one still in flight when
        another engine refused at once would land after the steps that follow, in no order (an
        engine actor serves calls on several threads) -- a pause after the release's resume, a
        session opened after it ended, a resume after the next push's pause."""
        timeout_s = deadline.left(self.config.rpc_timeout_s)
        calls = {
            engine.name: in_thread(
                partial(engine.call, route, body, timeout_s), "weight-sync-sglang"
            )
            for engine in self.engines
        }
        return collect_answers(calls, timeout_s + 1.0, route, who=_WHO, settle=True)

    def _label(self, label: str, deadline: Deadline) -> None:
        self._fan(
            "update_weight_version", {"new_version": label, "abort_all_requests": False}, deadline
        )

    def _quietly(self, route: str, body: dict[str, Any], timeout_s: float) -> None:
        """``route`` on every engine, bounded; failures (expected: nothing to end) only logged.
        Settled as every ``_fan``: CI saw one engine's refusal ("no session to end") come at
        once while another's ``end_weight_update`` was still in flight, which then landed after
        the push's ``begin_weight_update`` and ended its session."""
        try:
            self._fan(route, body, Deadline(timeout_s, route))
        except WeightSyncError as exc:
            logger.debug("%s: %s", route, exc)


def release(
    engine: Engine,
    group_name: str | None,
    *,
    past: int | None,
    resume: bool,
    timeout_s: float,
) -> None:
    """Free one engine after a push that failed, or whose trainer died: leave the group first
    (an engine rank still waiting in it on a peer ends its wait when that peer's sockets close;
    meanwhile its update call holds the lock the calls below need), end the update session
    (SGLang refuses the next one until then), say ``"none (past N)"`` if bytes of version
    ``past`` may have moved (SGLang loads bucket by bucket; None: they did not), and resume
    generation. Leaving and ending may fail (nothing to leave or end); labelling and resuming
    raise ``ServerError``."""
    steps: list[tuple[str, dict[str, Any]]] = [("end_weight_update", {})]
    if group_name is not None:
        steps.insert(0, ("destroy_weights_update_group", {"group_name": group_name}))
    for route, body in steps:
        try:
            engine.call(route, body, timeout_s)
        except ServerError as exc:
            logger.debug("releasing %s, %s: %s", engine.name, route, exc)
    if past is not None:
        engine.call(
            "update_weight_version",
            {"new_version": unlabelled(past), "abort_all_requests": False},
            timeout_s,
        )
    if resume:
        engine.call("continue_generation", {"torch_empty_cache": False}, timeout_s)


def _reserve(push_timeout_s: float) -> float:
    """What a push keeps of its bound to release the engines after a failure."""
    return min(push_timeout_s / 4, 30.0)
