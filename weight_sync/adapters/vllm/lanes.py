"""Pushes into vLLM engines driven through vLLM's weight-transfer API, from one trainer process
or from every rank of a sharded trainer.

``ClientLanes`` is what ``VLLMServers(urls)`` runs over ``vllm serve``'s HTTP routes, and
``VLLMServers(urls, senders=group)`` for a trainer sharded over K ranks (FSDP2, DTensor); it
is also what vLLM's own trainer-side API runs with weight_sync as its backend
(``backend.WeightSyncTrainerEngine``, over ``RayVLLMWeightSyncClient`` or
``HTTPVLLMWeightSyncClient``). Made on every trainer rank, each pushing its own shards over a
lane of its own (an ordinary push over the store plane, ``send.senders``) while every vLLM
worker process of every engine follows all K lanes at once. One trainer process is the K = 1
case (``OneRank``), the same protocol, pushing its whole state dict (or a ``ShardedSource`` it
gathers)::

    # on every rank of the trainers' torch.distributed group
    urls = ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    servers = VLLMServers(urls, senders=dist.group.WORLD)
    for step in range(steps):
        ...  # train
        servers.push(model.state_dict())      # this rank's shards; every rank at once

vLLM's weight-transfer API carries it, one call per engine per step (an HTTP call to each
``vllm serve``), made by rank 0 only:

* ``init_weight_transfer_engine`` hands each worker every sender's store address (the
  ``lanes`` of ``WeightSyncInitInfo``); the worker takes a slot in rank 0's store and dials
  them all (``StoreLaneMember``, inside the weight_sync backend);
* ``start_weight_update`` is the check before any byte moves: rank 0 puts the push's layout in
  its store, and each worker runs the engine's own ``load_weights`` on meta tensors of the whole
  tensors (``ReloadTarget.check``) and answers there; a refusal anywhere calls the push off on
  every sender;
* ``update_weights`` runs every lane at once in the worker; the blocks are put together into
  whole tensors (vLLM's loader stacks and shards whole checkpoint tensors itself, tensor
  parallelism included), each loaded as soon as it is whole, in one layerwise reload
  (``reload.Streamed``): a push that fails part-way leaves the worker holding no version;
* ``finish_weight_update`` labels the outputs with the version; or, after a failure, the
  servers are labelled ``"none"`` and resumed, as ``VLLMServers`` does.

Pausing, resetting the prefix cache and resuming are the front's (``Around``): rank 0 makes
``vllm serve``'s (``servers.py``); vLLM's own API leaves them to its caller. The workers join as
the first push begins, and again after a push that failed once the engines were called or when
a server reports other than the version last committed: a server restarted at the same URL
rejoins, sent every tensor. The worker's half is ``member.py``'s.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import torch.distributed as dist

from weight_sync.adapters.vllm.member import CHECK, LANDED, SENT
from weight_sync.config import SyncConfig
from weight_sync.control.deadline import Deadline
from weight_sync.control.futures import in_thread
from weight_sync.control.keys import delete, take, wait_all
from weight_sync.control.lane_store import Checks
from weight_sync.errors import (
    PlanMismatchError,
    ServerError,
    WeightSyncError,
    WorkerFailedError,
    first_line,
)
from weight_sync.result import PushResult
from weight_sync.send.collectives import OneRank
from weight_sync.send.senders import Senders, nothing_moves
from weight_sync.send.sharded import ShardedSource
from weight_sync.wire.blame import Outcomes, blame_servers
from weight_sync.wire.blocks import BlockLayout
from weight_sync.wire.metadata import LaneCheck
from weight_sync.wire.state_dict import StateDict

logger = logging.getLogger(__name__)


class Client(Protocol):
    """The weight-transfer calls of vLLM's ``VLLMWeightSyncClient``, each reaching every engine
    at once: ``servers.ServersClient`` over ``vllm serve``, or vLLM's own clients
    (``backend.OwnClient``). ``failures``: the engines whose calls failed, by name, until the
    caller clears it."""

    failures: dict[str, str]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(
        self, update_info: dict[str, Any], lost: Callable[[str, str], None] | None = None
    ) -> None:
        """``lost(name, why)``: told at once of each engine that stopped answering mid-call."""

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    def shutdown_weight_transfer_engine(self) -> None: ...


class Around(Protocol):
    """What rank 0 does around each push into the engines: ``vllm serve``'s pause, prefix cache
    reset, resume and release (``servers.ServersAround``), or nothing where vLLM's API leaves them to
    its caller (``backend.LeftToCaller``). ``names``: the engines, as errors name them."""

    names: list[str]

    def count(self, timeout_s: float) -> int:
        """Every engine's worker processes: the members of a push."""

    def relabelled(self, committed: int, timeout_s: float) -> bool:
        """Whether an engine no longer reports version ``committed`` (it restarted, or another
        trainer pushed to it): its workers must join again."""

    def pause(self, timeout_s: float) -> None: ...

    def loaded(self, timeout_s: float) -> None:
        """Every engine committed and was labelled: what it must do before serving again."""

    def resume(self, quiet: bool) -> None: ...

    def release(self, error: BaseException) -> dict[str, str]:
        """After a failed push: every engine reachable claims no version and serves again.
        Returns those that could not be reached, with why."""


class ClientLanes:
    """This trainer rank's end of pushes into the vLLM engines that ``client`` calls (see the
    module doc), ``around`` what rank 0 does around each push; ``owner`` names the front in
    what it tells a caller to change (``VLLMServers``, which checks the arguments first).

    Made on every rank of ``group`` (the trainers' torch.distributed group) at once: a
    collective. Its ranks ``0..n-1`` are the senders; the DTensors pushed must lie on meshes of
    them (docs/many-senders.md). ``OneRank()``: a trainer of one process, the K = 1 case.
    Rank 0 makes every call on the engines."""

    def __init__(
        self,
        client: Client,
        around: Around,
        config: SyncConfig | None,
        group: dist.ProcessGroup | OneRank,
        owner: str,
    ) -> None:
        self._client, self._around = client, around
        # The engines' workers are counted, and join, as the first push begins (``_renew``):
        # making this touches no engine.
        engines = len(around.names)
        self._lanes = Senders(config, group, lambda _: engines, owner, deaths=True)
        self.config = self._lanes.config
        self.rank, self.senders = self._lanes.rank, self._lanes.senders
        self._checks = Checks(self._lanes.store)  # rank 0's: each push's check, in its store
        self._paused = False
        self._session = False  # the servers' update session was opened (start_weight_update)
        self._committed = 0
        self._closed = False
        self._epoch = 0  # how many times the workers joined (their slots are counted per join)
        # No worker joined yet, or the last push failed once the servers were called: the next
        # push has every worker join anew (``_renew``).
        self._stale = True
        self._slots_of: dict[str, list[int]] = {}  # rank 0: each server's workers, by slot
        self._gone: dict[str, str] = {}  # rank 0: the servers lost in the push under way
        logger.info("sender %d of %d, to %d vLLM engine(s)", self.rank, self.senders, engines)

    @property
    def version(self) -> int:
        """The last version every lane committed on every worker (0: none yet)."""
        return self._committed

    def push(self, state_dict: StateDict | object, options: Mapping[str, Any]) -> PushResult:
        """Push this rank's shards of ``state_dict`` while every other trainer rank pushes its
        own -- or, the one sender, its whole state dict or a ``ShardedSource`` it gathers --;
        returns once every server serves the version, its prefix cache reset, resumed.
        ``options``: ``rename``, ``transform`` and ``version`` as ``VLLMServers.push`` (the
        same on every rank; any other is refused, ``lane_rules.share_of``).

        Raises, on every rank and before any byte moves: ``TypeError``/``ValueError`` for a
        state dict some rank refused, ``PlanMismatchError`` where a server's engine cannot load
        it (the servers keep their weights and versions, and are resumed). After, on every rank
        too: ``SenderFailedError`` naming the trainer ranks whose lanes did not land, or
        ``ServerError`` where servers failed (named on rank 0) -- the servers then report no
        version and serve again, until a push repairs them."""
        if self._closed:
            raise WeightSyncError("these VLLMServers are closed; create new ones on every rank")
        pushed: int | None = None
        try:
            result = self._push(state_dict, options)
            pushed = result.version
        except WeightSyncError as exc:  # a runtime failure, on every rank (not a refusal, and
            if not isinstance(exc, PlanMismatchError):  # not a caller's mistake): the
                self._stale = True  # workers join anew at the next push
            raise
        finally:
            if isinstance(state_dict, ShardedSource):  # the other ranks stop serving its gathers
                state_dict.finish(pushed)
        return result

    def _push(self, state_dict: StateDict | object, options: Mapping[str, Any]) -> PushResult:
        self._renew()
        started = time.monotonic()  # after the joins, bounded by their own rendezvous
        try:
            share, chosen = self._lanes.agree(
                state_dict,
                options,
                lambda layout, v: self._check(layout, v, started),
                gathered=True,
            )
        except BaseException:
            self._end_session()  # rank 0, where its check paused the servers
            raise
        if (empty := nothing_moves(share, self._committed)) is not None:
            self._end_session()
            return empty
        update: Future[None] | None = None
        if self.rank == 0:
            info = {
                "version": chosen,
                "push": self._lanes.pushes,
                "wait_s": self._lanes.wait_s(started),
            }
            lost = functools.partial(self._lost, self._lanes.pushes)
            update = in_thread(lambda: self._client.update_weights(info, lost))
        try:
            result = self._lanes.push(share, chosen, started)
        except BaseException as exc:
            if update is None:
                raise
            named = self._failed(update, exc, started)
            if named is exc:
                raise
            raise named from exc

        def landed() -> None:  # rank 0, which made the servers' calls
            assert update is not None
            self._landed(update, result.version, started)

        self._lanes.conclude(
            landed,
            lambda: ServerError(
                "every lane committed, but servers did not load the push (see rank 0's error)",
                {},
            ),
        )
        self._committed = result.version
        return result

    def close(self) -> None:
        """Leave: the servers' workers stop following the lanes (they keep serving their
        weights), and this rank's store closes. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.rank == 0 and self._epoch:
            try:
                self._client.shutdown_weight_transfer_engine()
            except ServerError as exc:
                logger.warning("leaving the servers: %s", exc)
        self._lanes.close()

    def _renew(self) -> None:
        """Every rank at once, as a push begins: where no worker joined yet, the last push
        failed once the servers were called, or -- rank 0 asks them -- a server reports other
        than the version last committed (it restarted, or its worker released it after a
        trainer died), the lanes renew (``Senders.renew``): rank 0 counts every server's
        workers and has each join anew (``_join``), a restarted server's sent every tensor.
        One small all-reduce otherwise."""
        self._stale = self._stale or (self.rank == 0 and self._relabelled())
        if self._lanes.renew(self._stale, self._count):
            self._lanes.out.pusher.spent(self._lanes.from_rank_0(self._join))
        self._stale = False

    def _relabelled(self) -> bool:
        """Rank 0: whether an engine does not report the version last committed (or did not
        answer: the count that follows names it)."""
        return bool(self._committed) and self._around.relabelled(
            self._committed, self.config.rpc_timeout_s
        )

    def _count(self, config: SyncConfig) -> int:
        """Rank 0, as the lanes renew: every engine's worker processes."""
        return self._around.count(config.rpc_timeout_s)

    def _join(self) -> int:
        """Rank 0: every worker follows the lanes from now, as the slot it takes in this join;
        returns the highest version any was sent. Learns each worker's server (``_slots_of``)."""
        self._epoch += 1
        self._slots_of = {}
        address, port = self._lanes.endpoints[0]
        self._client.init_weight_transfer_engine(
            {
                "address": address,
                "port": port,
                "epoch": self._epoch,
                "timeout_s": self.config.rendezvous_timeout_s,
                "lanes": [list(endpoint) for endpoint in self._lanes.endpoints],
            }
        )
        deadline = Deadline(self.config.rendezvous_timeout_s, "the vLLM workers' joining")
        keys = self._worker_keys(f"{SENT}{self._epoch}/")
        found = wait_all(self._lanes.store, keys, deadline)
        delete(self._lanes.store, list(found))  # read once
        words = [json.loads(found[key]) if key in found else None for key in keys]
        joined = self._every_worker(words, "joining", deadline)
        for slot, word in enumerate(joined, start=1):
            self._slots_of.setdefault(str(word["server"]), []).append(slot)
        logger.info("%d vLLM worker(s) joined", len(joined))
        return max(int(word["sent"]) for word in joined)

    # -- rank 0: the HTTP calls around the lanes ---------------------------------------------------

    def _lost(self, push: int, url: str, why: str) -> None:
        """Rank 0, from the thread of ``url``'s update call: the server stopped answering
        mid-push, its process gone or stuck -- its workers are told gone to every lane at once
        (``Senders.gone``), which would otherwise wait for their answers until their bounds."""
        self._gone[url] = why
        slots = self._slots_of.get(url, [])
        self._lanes.gone(push, slots, f"its server {url} stopped answering mid-push ({why})")

    def _check(self, layout: BlockLayout, version: int, started: float) -> dict[int, list[str]]:
        """Pause the servers and have every worker check the layout and ``version``
        (``start_weight_update``). Returns each refusing worker's problems, after ending the
        update session and resuming; raises ``ServerError`` (nothing sent) where a server did
        not answer."""
        if not layout.blocks:  # an empty push: nothing to check, nothing will move
            return {}
        deadline = Deadline(self.config.push_timeout_s, "the workers' layout checks", started)
        rpc_s = deadline.left(self.config.rpc_timeout_s)
        self._client.failures.clear()
        self._gone = {}
        try:
            self._paused = True  # some servers may be paused even if one fails to
            self._around.pause(rpc_s)
            self._checks.post_layout(layout)
            check = LaneCheck(
                push=self._lanes.pushes,
                version=version,
                digest=layout.digest,
                max_metadata_bytes=self.config.max_metadata_bytes,
            )
            self._lanes.store.set(CHECK, check.model_dump_json())
            self._session = True
            self._client.start_weight_update()
            words = self._checks.answers(self._lanes.pushes, self._lanes.members, deadline)
            answers = self._every_worker(words, "layout check", deadline)
        except Exception as exc:  # a store error too: rank 0 must still give the word
            self._end_session()
            named = exc.servers if isinstance(exc, ServerError) else self._client.failures
            raise ServerError(
                f"a server did not check the push ({first_line(exc)}); nothing was sent",
                dict(named) or {name: first_line(exc) for name in self._around.names},
            ) from exc
        problems = {member: list(found) for member, found in enumerate(answers) if found}
        if problems:
            self._end_session()
        return problems

    def _landed(self, update: Future[None], version: int, started: float) -> None:
        """Every lane committed: once every server's update call returned, label the outputs,
        reset the prefix caches, resume."""
        try:
            self._wait(update, started)
            self._loaded_everywhere()
            self._session = False
            self._client.finish_weight_update(str(version))
            self._around.loaded(self.config.rpc_timeout_s)
        except BaseException as exc:
            self._finish_quietly()  # the session is open unless its finish ran
            self._around.release(exc)
            self._paused = False
            if isinstance(exc, ServerError):
                raise
            raise ServerError(
                f"the lanes committed, but a server did not load them ({first_line(exc)})",
                dict(self._client.failures)
                or {name: first_line(exc) for name in self._around.names},
            ) from exc
        self._around.resume(quiet=False)
        self._paused = False

    def _loaded_everywhere(self) -> None:
        """Every worker's word on the push (``StoreLaneMember.receive``, which never raises):
        ``ServerError`` naming those that did not load it, by ``wire.blame``'s rules."""
        keys = self._worker_keys(f"{LANDED}{self._lanes.pushes}/")
        found = take(self._lanes.store, keys)
        outcomes = load_outcomes([json.loads(found[key]) if key in found else {} for key in keys])
        if outcomes.ok:
            return
        error = outcomes.error(
            "the lanes committed, but loading them into the engines", self.config.push_timeout_s
        )
        assert isinstance(error, WorkerFailedError), error  # only raised outcomes: blamed
        failed = {f"vLLM worker {worker}": why for worker, why in outcomes.raised.items()}
        raise ServerError(str(error), failed, error.workers)

    def _worker_keys(self, prefix: str) -> list[str]:
        """Each vLLM worker's key under ``prefix``, in order (a worker writes under its slot,
        counted from 1)."""
        return [f"{prefix}{slot}" for slot in range(1, self._lanes.members + 1)]

    def _every_worker(self, words: list[Any], what: str, deadline: Deadline) -> list[Any]:
        """``words``, every vLLM worker's answer in order, where none is missing (None); else
        the error ``wire.blame`` says for ``what`` (``SyncTimeoutError`` when none answered;
        else the silent ones blamed)."""
        outcomes = Outcomes(
            words, late=[worker for worker, word in enumerate(words) if word is None]
        )
        if not outcomes.ok:
            raise outcomes.error(f"the vLLM workers' {what}", deadline.seconds)
        return words

    def _failed(self, update: Future[None], error: BaseException, started: float) -> BaseException:
        """Rank 0, the push failed: the servers claim no version and serve again. Returns the
        error to raise: the push's, or a ``ServerError`` naming the servers to blame -- those
        that stopped answering mid-push, else those unreachable after it, else those whose
        calls failed (``wire.blame.blame_servers``)."""
        try:
            self._wait(update, started)
        except BaseException as exc:
            logger.info("push %d: the servers' update failed too: %s", self._lanes.pushes, exc)
        failed = dict(self._client.failures)  # the push's, not the release's
        self._finish_quietly()
        unreachable = self._around.release(error)
        self._paused = False
        if self._gone:
            named = "; ".join(f"{url}: {why}" for url, why in self._gone.items())
            return ServerError(
                f"server(s) stopped answering mid-push, their workers gone: {named}",
                dict(self._gone),
            )
        return blame_servers(error, failed, unreachable, "server(s)")

    def _end_session(self) -> None:
        """Before any byte moved: end the update session (if one is open) and resume."""
        if not self._paused:
            return
        self._finish_quietly()
        self._around.resume(quiet=True)
        self._paused = False

    def _finish_quietly(self) -> None:
        """End the servers' update sessions with no version, if they were opened (vLLM raises
        at the end of one that is not, and on a server of several workers a raise leaves
        replies queued: see ``backend._answered``)."""
        if not self._session:
            return
        self._session = False
        try:
            self._client.finish_weight_update()
        except ServerError as exc:
            logger.debug("no update session to end: %s", exc)

    def _wait(self, update: Future[None], started: float) -> None:
        deadline = Deadline(self.config.push_timeout_s + 5, "the servers' update calls", started)
        update.result(timeout=deadline.remaining())


def load_outcomes(words: Sequence[Mapping[str, Any]]) -> Outcomes:
    """How a push ended at each vLLM worker, from its word in rank 0's store (``{"version"}``,
    or ``{"error"}``; empty where it gave none): one that did not load the push answered and
    lives, so it is blamed and kept -- ``wire.blame``'s rule for a call that raised."""
    return Outcomes(
        list(words),
        raised={
            worker: str(word.get("error", "gave no word on the push"))
            for worker, word in enumerate(words)
            if "version" not in word
        },
    )
