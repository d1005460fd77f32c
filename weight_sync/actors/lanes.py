"""``RayLanes``: every rank of a sharded trainer pushing its own shards to Ray workers.

The trainer actors of one sharded trainer (FSDP2 over their own torch.distributed group) each
make a ``WeightUpdater(workers, senders=group)`` over the same workers (this class underneath),
and each calls ``push(model.state_dict())`` at the same point. Each sender pushes the blocks of
its own shards over a lane of its own (an ordinary push over the store plane: see
``send.senders``), and every worker runs one receive per lane at once, writing each block where
it belongs (``WeightSyncWorker``'s ``_weight_sync_lanes_*``; a ``VLLMEngine`` forwards them to
its vLLM workers, each a member of its own, which load whole tensors once every lane
committed). Around the lanes, as in a
launched job (``weight_sync.launch.job_sync``):

* when they form, rank 0 asks every worker how many members it brings and the highest version
  it was ever sent: the senders' versions go past it;
* before any byte moves, the senders agree over a Gloo group of their own (each one's checks,
  version and layout); then each sender's lane opens (``send.senders.Opening``) and rank 0
  makes the push's one Ray call on every worker, carrying each lane's push in one step where it
  is one (the steady state: the worker then reads nothing of that sender's store). The worker
  checks the layout and version against its model (the layout read in rank 0's store by a
  worker that lacks it) and takes every lane at once -- refusing on every lane where it
  cannot take the push, so every sender raises the refusal and nothing moves anywhere;
* each sender reports how its lane ended in rank 0's store, and rank 0 judges.

The Ray glue stays thin: what a lane is and the verdict are ``send.senders``' and
``control.lane_store``', the agreement's rules ``wire.lane_rules``'.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.actor import ActorHandle

from weight_sync.actors.members import RayMembers
from weight_sync.actors.metrics import push_metrics
from weight_sync.actors.worker import SYNC_GROUP
from weight_sync.config import SyncConfig
from weight_sync.control.deadline import Deadline
from weight_sync.control.lane_store import NO_ONE_GROUP, Checks
from weight_sync.control.plane import collect
from weight_sync.control.store import Answers
from weight_sync.errors import (
    PlanMismatchError,
    WeightSyncError,
    WorkerFailedError,
    first_line,
)
from weight_sync.result import PushResult
from weight_sync.send.collectives import OneRank, gather_bytes
from weight_sync.send.roster import GRACE_S
from weight_sync.send.routes import Route, members_nccl_problem
from weight_sync.send.senders import Senders, nothing_moves
from weight_sync.send.sharded import ShardedSource
from weight_sync.transport.base import Transport
from weight_sync.transport.devices import current_gpu, gpu_uuid
from weight_sync.wire.blocks import BlockLayout
from weight_sync.wire.lane_rules import Share
from weight_sync.wire.metadata import NO_LANE, GroupSpec, LaneCheck, LanePush, MemberInfo
from weight_sync.wire.state_dict import StateDict

logger = logging.getLogger(__name__)


class RayLanes:
    """This trainer rank's end of pushes from every rank of a sharded trainer to ``workers``
    (``WeightSyncWorker`` or ``VLLMEngine`` actors; the same list on every rank): what
    ``WeightUpdater(workers, senders=group)`` runs.

    Made on every rank of ``group`` (the trainers' torch.distributed group) at once: a
    collective. Its ranks ``0..n-1`` are the senders; the DTensors pushed must
    lie on meshes of them (see docs/many-senders.md). ``OneRank()``: a trainer of one process,
    no torch.distributed -- the K = 1 case, the same protocol.

    ``one_group``: every lane's buckets go over one group of the senders and the workers, point
    to point, each worker taking them in rounds (``transport.rounds``), rather than over a Gloo
    group per lane -- the design for NCCL (``SyncConfig(backend="nccl")``, which several
    senders need; the push's one sender runs its lane on the backend it names). It
    takes ``WeightSyncWorker`` actors (not yet ``VLLMEngine``s). A push that fails may leave
    that group aborted, or a worker without it (restarted): the push after it forms the group
    again first, every worker rejoining."""

    def __init__(
        self,
        workers: Sequence[ActorHandle],
        config: SyncConfig | None = None,
        *,
        group: dist.ProcessGroup | OneRank | None = None,
        one_group: bool = False,
    ) -> None:
        if one_group:
            _check_joinable(workers)
        # The workers, and how a worker's failed call ended; rank 0 drops the dead and frozen.
        self._plane = RayMembers(workers)
        self._alike = list(workers)  # the workers as every rank holds them (see ``_renew``)
        self._over_one_group = one_group
        # NCCL members must each hold a GPU of their own: asked of the workers in ``_probe``.
        self._one_nccl_group = (
            one_group and isinstance(config, SyncConfig) and config.backend == "nccl"
        )
        self._slots: list[int] = []  # rank 0: each worker's first member slot (1-based)
        self._one_call: list[bool] = []  # rank 0: which workers take a push in one call
        self._concurrent: list[bool] = []  # rank 0: which serve their methods beside a push
        self._sent = 0  # rank 0: the highest version any worker was ever sent
        # Rank 0 asks the workers what they bring (``_probe``) as the first push begins, as after
        # any change (``_renew``), so that making this touches no worker -- a frozen one is named
        # and dropped by that push, as one it freezes in. Over one group it asks them now: the
        # group forms with them.
        counted = self._probe if one_group else lambda _: len(self._alike)
        self._lanes = Senders(
            config,
            group,
            lambda given: counted(given.rpc_timeout_s),
            "WeightUpdater",
            self._invite if one_group else None,
            call=self._call_workers,
        )
        try:
            self._lanes.out.pusher.spent(self._lanes.from_rank_0(lambda: self._sent))
        except BaseException:
            self._lanes.close()
            raise
        self.config = self._lanes.config
        self.rank, self.senders = self._lanes.rank, self._lanes.senders
        self._checks = Checks(self._lanes.store)  # rank 0's: each layout, for who lacks it
        self._agreed: tuple[BlockLayout, int, float] | None = None  # the push under way
        self._calls: list[Future[Any]] = []  # rank 0: each worker's call of the push under way
        self._committed = 0
        self._closed = False
        self._lock = threading.Lock()
        self._observer = push_metrics(self.config)
        # The last push failed, or workers were dropped (rank 0) or added -- or none was made
        # yet: the next push renews the lanes (``Senders.renew``), rank 0 counting the workers'
        # members again.
        self._failed, self._changed = False, not one_group

    @property
    def version(self) -> int:
        """The last version every lane committed on every worker (0: none yet)."""
        return self._committed

    @property
    def workers(self) -> tuple[ActorHandle, ...]:
        """The workers pushes go to: those given and added, less any dropped after dying or
        freezing -- by rank 0 at once, by the others as the next push begins."""
        return self._plane.handles

    def add_workers(self, workers: Sequence[ActorHandle]) -> None:
        """Add ``workers`` (the same on every rank; what counts is rank 0's): the next push
        renews the lanes over every worker (``Senders.renew``), and sends the newcomers every
        lane in full."""
        if self._over_one_group:
            _check_joinable(workers)
        self._plane.add(workers)
        self._alike.extend(workers)
        self._changed = True
        logger.info("added %d worker(s); %d in all", len(workers), len(self._plane))

    @property
    def group(self) -> Transport | None:
        """This rank's lane's group, None until a push forms it."""
        return self._lanes.out.pusher.group

    @property
    def routes(self) -> list[Route]:
        """How each worker takes this rank's lane (``Pusher.routes``)."""
        return self._lanes.out.pusher.routes

    def push(self, state_dict: StateDict | object, options: Mapping[str, Any]) -> PushResult:
        """Push this rank's shards of ``state_dict`` while every other trainer rank pushes its
        own; returns once every worker holds every lane (``PushResult`` of the whole push).
        ``options``: ``rename``, ``version`` and ``partial`` as ``WeightUpdater.push`` (the same
        on every rank; any other is refused, ``lane_rules.share_of``).

        Raises, on every rank: ``TypeError``/``ValueError`` for a state dict some rank refused
        (nothing sent), ``PlanMismatchError`` where workers refused the layout (nothing sent),
        ``SenderFailedError`` naming the trainer ranks whose lanes did not land, and
        ``WorkerFailedError`` where workers' receives failed (named on rank 0)."""
        with self._lock:  # pushes from several threads of a rank, one after the other
            if self._closed:
                raise WeightSyncError("this WeightUpdater is closed")
            pushed: int | None = None
            try:
                result = self._push(state_dict, options)
                pushed = result.version
            except BaseException as exc:
                if self._observer is not None:
                    self._observer.failed(exc)
                if isinstance(exc, PlanMismatchError):  # nothing moved: the group is whole,
                    self._failed = any(  # unless a worker lost it (restarted): then it forms
                        problem.startswith(NO_ONE_GROUP)  # again first
                        for problems in exc.problems.values()
                        for problem in problems
                    )
                elif isinstance(exc, WeightSyncError):  # a runtime failure, on every rank (a
                    self._failed = True  # caller's error is not)
                raise
            finally:  # the other ranks stop serving (its lane's push did, where it had one)
                if isinstance(state_dict, ShardedSource):
                    state_dict.finish(pushed)
        if self._observer is not None and result.buckets:
            phases, gbps = result.phases, result.gbps
            self._observer.pushed(result.version, result.nbytes, result.buckets, phases, gbps)
        return result

    def _push(self, state_dict: StateDict | object, options: Mapping[str, Any]) -> PushResult:
        self._renew()
        self._failed = self._changed = False
        started = time.monotonic()  # after the renewal, bounded by its own rendezvous
        self._calls = []
        share, chosen = self._lanes.agree(state_dict, options, None, gathered=True)
        if (empty := nothing_moves(share, self._committed)) is not None:
            return empty
        assert share.layout is not None, "an agreed push has a layout"
        self._agreed = share.layout, chosen, started
        try:
            return self._send(share, chosen, started)
        except BaseException:  # once agreed, whatever failed may have left the group aborted
            self._failed = True  # (a refusal did not: ``push`` says)
            raise

    def _send(self, share: Share, chosen: int, started: float) -> PushResult:
        try:
            result = self._lanes.push(share, chosen, started)  # rank 0 calls the workers there
        except WeightSyncError as exc:
            if self.rank != 0:
                raise
            failed, dropped, died = self._blame_workers(self._calls, exc, started)
            if failed is not None and died:  # who died, as rank 0's calls on them saw it
                raise failed from exc
            if isinstance(exc, WorkerFailedError):  # the lanes' cause, by worker index as one
                exc.workers = sorted({self._worker_of(member) for member in exc.workers})
                exc.dropped = dropped  # sender's error names them: what ``workers`` lost
            raise
        self._lanes.conclude(
            lambda: self._blame_workers(self._calls, None, started),
            lambda: WorkerFailedError(
                "every lane committed, but workers did not hold the push (see rank 0's error)",
                [],
            ),
        )
        self._committed = result.version
        return result

    def close(self) -> None:
        """Leave: the workers' lanes from this rank end; rank 0 has the workers let go of
        the lanes from every sender (and of the one group), within ``rpc_timeout_s``.
        Idempotent; never raises over a worker gone."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._lanes.close()
        if self.rank == 0:
            self._release_workers()

    def _renew(self) -> None:
        """Every rank at once, as a push begins: the lanes renewed where any rank needs it
        (``Senders.renew``), rank 0 counting the workers' members again (``_recount``); then
        every rank drops the workers rank 0 dropped, so that ``workers`` reads alike on every
        rank -- which holds while every rank made the same ``add_workers`` calls."""
        if not self._lanes.renew(self._failed or self._changed, self._recount):
            return
        control = self._lanes.control
        mine = len(self._alike).to_bytes(8, "little")
        held = [int.from_bytes(raw, "little") for raw in gather_bytes(mine, 8, control)]
        if len(set(held)) > 1:
            raise ValueError(
                f"the trainer ranks hold {held} workers (by rank): call add_workers on every "
                "rank, with the same workers"
            )
        live = {worker._actor_id for worker in self._plane.handles}
        mask = bytes(int(worker._actor_id in live) for worker in self._alike)
        kept = control.broadcast(mask, len(mask))
        if self.rank != 0:
            self._plane.drop([index for index, keep in enumerate(kept) if not keep])
        self._alike = list(self._plane.handles)

    def _recount(self, config: SyncConfig) -> int:
        """Rank 0, as the lanes renew: the workers' members counted again (``_probe``), every
        version any worker was sent spent here."""
        members = self._probe(config.rpc_timeout_s)
        self._lanes.out.pusher.spent(self._sent)
        return members

    def _probe(self, timeout_s: float) -> int:
        """Rank 0: ask every worker how many members it brings (a vLLM engine with tensor
        parallelism 2 brings two, taking consecutive slots) and the highest version it was ever
        sent; returns the members in all."""
        calls = [worker._weight_sync_info.remote(timeout_s) for worker in self.workers]
        infos: list[MemberInfo] = self._answers(calls, "the probe of the workers", timeout_s)
        ranks = [info.ranks for info in infos]
        if self._over_one_group and any(count != 1 for count in ranks):
            raise ValueError(
                f"one_group takes workers of one member each; these bring {ranks} members: "
                "leave one_group unset"
            )
        problem = members_nccl_problem(infos, _current_gpu()) if self._one_nccl_group else None
        if problem is not None:  # else they would fail in the rendezvous, at its bound
            raise ValueError(
                f"one_group over NCCL cannot take these workers: {problem}; give each worker a "
                "GPU of its own, or leave SyncConfig.backend unset (Gloo)"
            )
        self._slots = [1 + sum(ranks[:index]) for index in range(len(ranks))]
        self._one_call = [info.one_call for info in infos]
        self._concurrent = [info.concurrent for info in infos]
        self._sent = max(info.highest_version for info in infos)
        return sum(ranks)

    def _release_workers(self) -> None:
        """Rank 0: every worker lets go of the lanes from these senders, unless lanes from
        other senders took their place."""
        calls = [
            worker._weight_sync_lanes_leave.remote(self._lanes.endpoints, self.config.rpc_timeout_s)
            for worker in self.workers
            if hasattr(worker, "_weight_sync_lanes_leave")
        ]
        try:
            ray.get(calls, timeout=self.config.rpc_timeout_s)
        except Exception as exc:  # leaving must not fail over a worker already gone
            logger.warning("workers did not let go of the lanes: %s", first_line(exc))

    def _invite(
        self, specs: list[GroupSpec], endpoints: list[tuple[str, int]]
    ) -> Callable[[], None]:
        """Rank 0: every worker joins the one group as the rank its spec names (one member
        each: see ``_probe``), its lanes from the senders at ``endpoints`` to take their buckets
        over it; returns what waits for their joins once the senders' formed."""
        calls = [
            worker._weight_sync_lanes_join.remote(spec.model_dump_json(), endpoints, slot)
            for spec, slot, worker in zip(specs, self._slots, self.workers, strict=True)
        ]

        def joined() -> None:  # they formed with the senders: their answers are on the way
            self._answers(calls, "joining the one group", specs[0].rendezvous_timeout_s)

        return joined

    def _call_workers(self, firsts: list[str | None]) -> Answers:
        """Rank 0, once every sender's lane opened (``send.senders.Opening``): the push's one
        call on every worker, saying how each lane opens (``firsts``). Each worker checks the
        layout and version against its model -- the layout read in rank 0's store, posted there
        once, by a worker that lacks it -- and takes every lane, refusing on every lane where it
        cannot take the push (``Member.take``). Where this rank's lane is the push's only one,
        opened in the call, a worker that takes a push in one call (``MemberInfo.one_call``)
        answers that lane in its call's result, as one sender's workers do -- no reply through
        the store, no wait for the poller that reads it: returns those calls, by slot. A call
        that finds its worker dead tells every lane at once (``Senders.gone``): their waits
        for its answers end then, not at their bounds."""
        assert self._agreed is not None, "the senders agreed on the push"
        layout, version, started = self._agreed
        self._checks.post_layout(layout)
        over = {"one_group": True} if self._over_one_group else {}  # no VLLMEngine's kwarg
        check = LaneCheck(
            push=self._lanes.pushes,
            version=version,
            digest=layout.digest,
            max_metadata_bytes=self.config.max_metadata_bytes,
        )
        call = LanePush(
            endpoints=self._lanes.endpoints,
            slot=1,
            check=check,
            wait_s=self._lanes.wait_s(started),
            firsts=firsts,
        )
        alone = firsts[0] not in (None, NO_LANE) and all(f == NO_LANE for f in firsts[1:])
        answer = [alone and one_call for one_call in self._one_call]
        # A staged push of one lane is received beside a concurrent worker's own methods, as
        # one sender's is, and applied in their turn (``_weight_sync_lanes_push``'s ``beside``);
        # a push of several lanes holds the actor for the whole push, which keeps the lanes'
        # applies in one turn.
        beside = self.config.staging == "atomic" and sum(f != NO_LANE for f in firsts) == 1
        self._calls = []
        ends = [*self._slots[1:], self._lanes.members + 1]
        for slot, end, asked, concurrent, worker in zip(
            self._slots, ends, answer, self._concurrent, self.workers, strict=True
        ):
            method: Any = worker._weight_sync_lanes_push
            kwargs = dict(over)
            if beside and concurrent:
                method, kwargs["beside"] = method.options(concurrency_group=SYNC_GROUP), True
            made = call.model_copy(update={"slot": slot, "answer": asked}).model_dump_json()
            self._calls.append(method.remote(made, **kwargs).future())
            told = functools.partial(self._told_dead, check.push, range(slot, end))
            self._calls[-1].add_done_callback(told)
        return {
            slot: made
            for slot, asked, made in zip(self._slots, answer, self._calls, strict=True)
            if asked
        }

    def _told_dead(self, push: int, slots: range, call: Future[Any]) -> None:
        """Rank 0: where ``call`` found its worker dead, its members (``slots``) are told gone
        to every lane of push ``push``."""
        if (error := call.exception()) is not None:
            fate, why = self._plane.fate(error)
            if fate == "died":
                self._lanes.gone(push, list(slots), why)

    def _blame_workers(
        self, calls: Sequence[Future[Any]], error: Exception | None, started: float
    ) -> tuple[WeightSyncError | None, list[int], bool]:
        """Rank 0: how every worker's receive ended, as one sender judges its members
        (``wire.blame.Outcomes``), dropping those that died, or froze while others answered.
        Without ``error`` (every lane committed) it waits within what the push has left and
        raises ``WorkerFailedError`` naming those that died or raised. After the lanes'
        ``error`` their members had their bounds already: a worker that rank 0's lane named dead
        or silent (``WorkerFailedError.dropped``) is not waited for, the others a grace of
        ``roster.GRACE_S``; returns the error naming the workers (None: every call returned),
        the workers dropped, and whether any died."""
        if not calls:
            return None, [], False
        deadline = Deadline(self.config.push_timeout_s + 5, "the workers' receives", started)
        wait_s, quoted = deadline.remaining(), deadline.seconds
        if error is not None:
            named = set()
            if isinstance(error, WorkerFailedError):
                named = {self._worker_of(member) for member in error.dropped}
            others = [call for index, call in enumerate(calls) if index not in named]
            wait(others, timeout=min(GRACE_S, wait_s))
            wait_s, quoted = 0.0, self.config.collective_timeout_s + GRACE_S
        outcomes = collect(self._plane, calls, wait_s)
        if outcomes.ok:
            return None, [], False
        dropped = outcomes.unreachable
        self._drop(dropped)
        failed = outcomes.error("the workers' receives", quoted, dropped)
        if error is None:
            raise failed
        return failed, dropped, bool(outcomes.died)

    def _worker_of(self, member: int) -> int:
        """Rank 0: the worker whose members include ``member`` (0-based, as lanes name them)."""
        return max(index for index, slot in enumerate(self._slots) if slot <= member + 1)

    def _drop(self, dropped: Sequence[int]) -> None:
        """Rank 0: give up on the workers ``dropped`` (indices): the next push renews the lanes
        over the rest."""
        if not dropped:
            return
        self._plane.drop(dropped)
        self._changed = True
        logger.warning(
            "dropped worker(s) %s (dead or not answering); %d left", list(dropped), len(self._plane)
        )

    def _answers(self, calls: Sequence[Any], what: str, timeout_s: float) -> list[Any]:
        """Rank 0: every worker's answer to ``calls`` (one each), within ``timeout_s``; else
        the error naming who failed and how, by the rules every push's members are blamed by
        (``wire.blame.Outcomes``): a worker dead or silent, one that raised."""
        outcomes = collect(self._plane, [call.future() for call in calls], timeout_s)
        if not outcomes.ok:
            self._drop(outcomes.unreachable)
            raise outcomes.error(what, timeout_s, outcomes.unreachable)
        return outcomes.results


def _check_joinable(workers: Sequence[ActorHandle]) -> None:
    if not all(hasattr(worker, "_weight_sync_lanes_join") for worker in workers):
        raise ValueError(
            "one_group takes WeightSyncWorker actors: a VLLMEngine's workers cannot join "
            "one group yet; leave one_group unset (Gloo lanes)"
        )


def _current_gpu() -> str | None:
    """The UUID of the GPU this rank sends from over NCCL (its current one), if it has one."""
    if not torch.cuda.is_available():
        return None
    return gpu_uuid(current_gpu())
