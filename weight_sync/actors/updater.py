"""``WeightUpdater``: the trainer's end. One ``push`` = plan, prepare, broadcast, commit.

Control plane, per push and per worker: one ``prepare`` call carrying the version and the plan
(or the hash of a plan the worker already holds), one ``receive`` call that runs alongside the
broadcast, one ``commit``. The number of Ray calls never depends on the number of tensors.

Failure: every wait draws on the push's deadline. When something fails, the trainer leaves the
group first (so members blocked on it fail at once), waits a bounded time for every worker's
call to end, and then knows each worker's fate (see ``calls.Outcomes``): workers that died or
never answered are dropped, the rest leave the group, and the next push forms a new one.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.actor import ActorHandle

from weight_sync.actors.calls import Outcomes, collect
from weight_sync.actors.worker import SYNC_GROUP
from weight_sync.config import SyncConfig
from weight_sync.deadline import Deadline
from weight_sync.errors import (
    ChecksumMismatchError,
    PlanMismatchError,
    TransportError,
    WeightSyncError,
)
from weight_sync.mapping import Transform
from weight_sync.metadata import (
    TRAINER_RANK,
    BackendName,
    GroupSpec,
    MemberInfo,
    ModeName,
    PrepareReply,
    PrepareRequest,
    ReceiveReport,
    SyncPlan,
)
from weight_sync.metrics import PushMetrics
from weight_sync.sender import (
    Entries,
    PushPlanner,
    Rename,
    Sender,
    StateDict,
    check_state_dict,
    nonfinite_error,
)
from weight_sync.sharded import ShardedSource
from weight_sync.transport import TorchGroup, address_of_interface, bind_listener

logger = logging.getLogger(__name__)

# After a failure, how long past its own timeout a worker's call may take to report (Ray's own
# latency on a loaded node); a worker silent beyond that is taken for frozen.
_GRACE_S = 5.0


@dataclass(frozen=True)
class PushResult:
    """What one push moved. ``version`` is now committed on every worker."""

    version: int
    nbytes: int  # bytes of the tensors pushed (alignment padding on the wire not counted)
    buckets: int
    seconds: float
    tensors: int = 0  # names delivered, tied ones included
    partial: bool = False
    # Seconds per phase: group (probe + join, when a group was formed), prepare, transfer,
    # commit, total.
    phases: Mapping[str, float] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Payload gigabytes per second, as seen by the trainer."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class _Member:
    handle: ActorHandle
    known_plan: str | None = None  # digest of the plan this worker has cached
    concurrent: bool = False  # made with remote_worker: has weight_sync's concurrency groups


class WeightUpdater:
    """Pushes named tensors from this process (rank 0) to ``workers`` (``WeightSyncWorker`` actors).

    The group is formed lazily on the first push and reused. A failed push tears it down,
    drops the workers that died or froze, and the next push forms a new group over the rest.
    ``push`` calls from several threads are serialised.
    """

    def __init__(self, workers: Sequence[ActorHandle], config: SyncConfig | None = None) -> None:
        if config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig, got {type(config).__name__}")
        self._members = [_Member(handle) for handle in _check_handles(workers, [])]
        self._config = config or SyncConfig()
        self._group: TorchGroup | None = None
        self._planner: PushPlanner | None = None  # made with the first group (needs its device)
        self._version = 0  # last version committed on every worker
        self._next_version = 1  # never reused: spent once any worker may have committed it
        self._lock = threading.Lock()
        self._closed = False
        self._id = secrets.token_hex(4)
        self._metrics = PushMetrics(self._id) if self._config.metrics and ray.is_initialized() else None

    @property
    def workers(self) -> tuple[ActorHandle, ...]:
        """The workers pushes go to: those given, minus any dropped after dying or freezing."""
        return tuple(member.handle for member in self._members)

    @property
    def config(self) -> SyncConfig:
        return self._config

    @property
    def group(self) -> TorchGroup | None:
        """The sync group (this process is rank 0), or None until a push forms it."""
        return self._group

    @property
    def version(self) -> int:
        """The last version committed by a push (0 before the first)."""
        return self._version

    def add_workers(self, workers: Sequence[ActorHandle]) -> None:
        """Add workers (e.g. replacements for dropped ones). The current group is left; the next
        push forms one over everybody and sends the newcomers the full weights."""
        with self._lock:
            self._check_open()
            added = _check_handles(workers, self.workers)
            self._teardown()
            self._members.extend(_Member(handle) for handle in added)
            logger.info("added %d worker(s); %d in all", len(added), len(self._members))

    def push(
        self,
        state_dict: StateDict | ShardedSource,
        *,
        rename: Rename | None = None,
        transform: Transform | None = None,
        partial: bool = False,
    ) -> PushResult:
        """Send every tensor to every worker; returns once all of them hold it and commit.

        ``transform`` (see ``weight_sync.mapping``: fuse, rename, drop) and then ``rename``
        (``None`` drops a tensor) map the trainer's names to the workers'. Tied weights (names
        sharing one tensor's bytes) travel once. ``partial=True`` sends only the tensors given
        (adapters, what changed): workers accept a subset of their model, but only on top of a
        committed version, and keep reporting the last full push as ``full_version``. A
        ``ShardedSource`` (see ``weight_sync.sharded``) is gathered bucket by bucket with the
        other trainer ranks, which call ``serve()`` meanwhile.

        Raises ``TypeError``/``ValueError`` for a bad state dict (nothing sent anywhere), and a
        ``WeightSyncError`` within ``push_timeout_s`` for failures while running:
        ``PlanMismatchError`` when workers refuse the push (nothing changed anywhere);
        ``WorkerFailedError`` naming the workers that died, froze or raised (the dead and frozen
        are dropped from ``workers``); ``SyncTimeoutError``/``TransportError`` when nobody in
        particular is to blame.
        """
        if not isinstance(state_dict, ShardedSource):
            entries = check_state_dict(state_dict, self._config, rename, transform)
            return self._push(entries, entries.tensors, partial)
        source, version = state_dict, None
        if not source.is_sender:
            raise ValueError("this rank does not send: call serve() on its ShardedSource")
        try:
            if transform is not None:
                raise ValueError("transform needs whole tensors and cannot run on a sharded "
                                 "source; rename (names only) can")  # fmt: skip
            entries = check_state_dict(source.items(), self._config, rename, sharded=True)
            cast = self._config.cast_dtype
            if self._config.check_finite and not source.all_finite(cast):
                raise nonfinite_error(cast)
            result = self._push(entries, source.gathering(entries.tensors), partial)
            version = result.version
            return result
        finally:
            source.finish(version)

    def _push(
        self, entries: Entries, tensors: Sequence[torch.Tensor], partial: bool
    ) -> PushResult:
        with self._lock:
            self._check_open()
            if not entries.count:
                logger.info("empty state dict: nothing to push (version stays %d)", self._version)
                return PushResult(self._version, 0, 0, 0.0)
            if not self._members:
                raise WeightSyncError(
                    "no workers left: all were dropped after failures; add replacements with "
                    "add_workers()"
                )
            clock = _PhaseClock()
            deadline = Deadline(self._config.push_timeout_s, "push")
            broadcasting = False
            try:
                group = self._ensure_group(entries.tensors, deadline)  # may move _next_version up
                plan = self._plan(group, entries)
                version = self._next_version
                clock.lap("group")
                self._prepare(version, plan, partial, deadline)
                clock.lap("prepare")
                broadcasting = True
                self._transfer(group, version, plan, tensors, deadline)
                clock.lap("transfer")
                self._next_version = version + 1
                timeout_s = deadline.left(self._config.rpc_timeout_s)
                self._settle(
                    [m.handle._weight_sync_commit.remote(version, timeout_s=timeout_s)
                     for m in self._members], "commit", timeout_s,
                )  # fmt: skip
                clock.lap("commit")
            except BaseException as exc:
                if self._metrics is not None:
                    self._metrics.failed(exc)
                # Refused before any collective (by the workers, or a plan too large): the group
                # is intact and is kept.
                refused = not broadcasting and isinstance(exc, PlanMismatchError | ValueError)
                if self._group is not None and not refused:
                    self._teardown(deadline)
                raise
            self._version = version
            result = PushResult(
                version, plan.payload_bytes, len(plan.buckets), clock.total(), entries.count,
                partial, clock.phases,
            )  # fmt: skip
            if self._metrics is not None:
                self._metrics.pushed(version, result.nbytes, result.buckets, clock.phases, result.gbps)
            logger.info(
                "pushed version %d%s: %d tensors, %.1f MB in %d buckets, %.3fs (%.2f GB/s; %s)",
                version, " (partial)" if partial else "", result.tensors, result.nbytes / 1e6,
                result.buckets, result.seconds, result.gbps,
                ", ".join(f"{phase} {seconds:.3f}s" for phase, seconds in clock.phases.items()),
            )  # fmt: skip
            return result

    def close(self) -> None:
        """Leave the group on every worker and here. Idempotent; the workers keep their weights."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._teardown()

    def __enter__(self) -> WeightUpdater:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the steps of a push -------------------------------------------------------------------

    def _plan(self, group: TorchGroup, entries: Entries) -> SyncPlan:
        if self._planner is None:
            self._planner = PushPlanner(self._config, group.device)
        plan = self._planner.plan(entries)
        if len(plan.wire) > self._config.max_metadata_bytes:
            raise ValueError(
                f"the plan's metadata is {len(plan.wire)} bytes, over max_metadata_bytes="
                f"{self._config.max_metadata_bytes}; raise it in SyncConfig or push fewer tensors"
            )
        return plan

    def _prepare(self, version: int, plan: SyncPlan, partial: bool, deadline: Deadline) -> None:
        """Every worker checks the push; any refusal raises before a byte is broadcast."""
        request = PrepareRequest(
            version=version, plan_digest=plan.digest, staging=self._config.staging,
            checksum=self._config.checksum, partial=partial,
        )  # fmt: skip
        replies = self._prepare_round(request, plan, self._members, deadline)
        lacking = [m for m, reply in zip(self._members, replies, strict=True) if reply.need_plan]
        if lacking:  # a worker lost its cached plan (e.g. was restarted): send it in full
            for member in lacking:
                member.known_plan = None
            again = iter(self._prepare_round(request, plan, lacking, deadline))
            replies = [next(again) if reply.need_plan else reply for reply in replies]
        problems = {i: reply.problems or ("refused",) for i, reply in enumerate(replies)
                    if not reply.accepted}  # fmt: skip
        if problems:
            self._cancel(version, [m for m, r in zip(self._members, replies, strict=True) if r.accepted],
                         deadline)  # fmt: skip
            raise PlanMismatchError(problems)
        for member in self._members:
            member.known_plan = plan.digest

    def _prepare_round(
        self, request: PrepareRequest, plan: SyncPlan, members: list[_Member], deadline: Deadline
    ) -> list[PrepareReply]:
        by_hash = request.model_dump_json()
        with_plan: str | None = None  # serialised only if some worker lacks the plan
        timeout_s = deadline.left(self._config.rpc_timeout_s)
        refs: list[ray.ObjectRef] = []
        for member in members:
            message = by_hash
            if member.known_plan != plan.digest:
                if with_plan is None:
                    with_plan = request.model_copy(update={"plan": plan}).model_dump_json()
                message = with_plan
            refs.append(member.handle._weight_sync_prepare.remote(message, timeout_s=timeout_s))
        return self._settle(refs, "prepare", timeout_s)

    def _cancel(self, version: int, members: list[_Member], deadline: Deadline) -> None:
        """Tell workers that accepted a push refused elsewhere to drop it (an engine that paused
        its generation for the push resumes). Bounded; a worker that cannot act on it drops the
        push at its next prepare anyway."""
        wait_s = min(_GRACE_S, deadline.remaining())
        refs = [m.handle._weight_sync_cancel.remote(version, timeout_s=wait_s) for m in members]
        outcomes = collect(refs, wait_s)
        if not outcomes.ok:
            logger.warning("cancelling a refused push: %s", outcomes.error("cancel", wait_s))

    def _transfer(
        self,
        group: TorchGroup,
        version: int,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        deadline: Deadline,
    ) -> None:
        timeout_s = deadline.remaining()
        receiving = [self._receive_call(member, version, timeout_s) for member in self._members]
        try:
            sent = Sender(group).send(plan, tensors, deadline, self._config.checksum)
        except WeightSyncError as exc:
            raise self._after_failure(receiving, "receive", deadline) or exc from exc
        outcomes = collect(receiving, deadline.remaining())
        if not outcomes.ok:
            raise self._after_failure(receiving, "receive", deadline) or outcomes.error(
                "receive", deadline.seconds
            )
        if sent is not None:
            _check_checksums(outcomes.results, sent)

    def _receive_call(self, member: _Member, version: int, timeout_s: float) -> ray.ObjectRef:
        method: Any = member.handle._weight_sync_receive
        if member.concurrent and self._config.staging == "atomic":
            method = method.options(concurrency_group=SYNC_GROUP)  # beside the actor's serving
        return method.remote(version, timeout_s=timeout_s)

    # -- failures ------------------------------------------------------------------------------

    def _settle(self, refs: Sequence[ray.ObjectRef], what: str, timeout_s: float) -> list:
        """Every worker's answer, or (dropping the dead and frozen) the error naming who failed."""
        outcomes = collect(refs, timeout_s)
        if not outcomes.ok:
            raise self._blame(outcomes, what, timeout_s)
        return outcomes.results

    def _after_failure(
        self, refs: list[ray.ObjectRef], what: str, deadline: Deadline
    ) -> WeightSyncError | None:
        """A collective failed: leave it, then give every worker's call time to end.

        Members waiting on this process fail as soon as it leaves; members waiting on a frozen
        peer fail at their collective timeout. Whoever is still silent after that is frozen.
        """
        self._close_group()
        wait_s = min(self._config.collective_timeout_s + _GRACE_S, deadline.remaining())
        return self._blame_late(refs, what, wait_s)

    def _blame_late(
        self,
        refs: Sequence[ray.ObjectRef],
        what: str,
        wait_s: float,
        timeout_s: float | None = None,
    ) -> WeightSyncError | None:
        """After a failure here: wait ``wait_s`` for the workers' calls, then the error naming
        (and dropping) who failed, or None if every call succeeded after all. ``timeout_s`` is
        the bound the error quotes, when the workers had longer than ``wait_s``."""
        outcomes = collect(refs, wait_s)
        quoted = wait_s if timeout_s is None else timeout_s
        return None if outcomes.ok else self._blame(outcomes, what, quoted)

    def _blame(self, outcomes: Outcomes, what: str, timeout_s: float) -> WeightSyncError:
        dropped = outcomes.unreachable
        if dropped:
            gone = {id(self._members[index]) for index in dropped}
            self._members = [member for member in self._members if id(member) not in gone]
            logger.warning(
                "dropped worker(s) %s (dead or not answering); %d left", dropped, len(self._members)
            )
        return outcomes.error(what, timeout_s, dropped)

    # -- the group -----------------------------------------------------------------------------

    def _ensure_group(self, tensors: list[torch.Tensor], deadline: Deadline) -> TorchGroup:
        if self._group is not None:
            return self._group
        config = self._config
        probe_s = deadline.left(config.rpc_timeout_s)
        infos: list[MemberInfo] = self._settle(
            [m.handle._weight_sync_info.remote(timeout_s=probe_s) for m in self._members], "probe",
            probe_s,
        )  # fmt: skip
        for member, info in zip(self._members, infos, strict=True):
            member.concurrent = info.concurrent
            member.known_plan = None
        # Versions never go backwards or repeat, even across a trainer restart: a worker may
        # have been sent a version it never committed, and that version is spent too.
        held = [info.version for info in infos if info.version is not None]
        self._version = max([self._version, *held])
        sent = max(info.highest_version for info in infos)
        self._next_version = max(self._next_version, self._version + 1, sent + 1)
        backend = _choose_backend(config, tensors, infos)
        mode = _choose_mode(config, infos)
        address = (
            config.master_addr if config.interface is None else address_of_interface(config.interface)
        )
        listener = bind_listener(address)
        group_id = secrets.token_hex(8)
        rendezvous_s = deadline.left(config.rendezvous_timeout_s)
        # A member may bring several ranks (an engine with tensor parallelism: every one of its
        # workers receives the broadcast); it is given the first, and numbers the rest on.
        firsts = list(itertools.accumulate((info.ranks for info in infos), initial=1))
        specs = [
            GroupSpec(
                group_id=group_id, address=address, port=listener.getsockname()[1],
                world_size=firsts[-1], rank=rank, backend=backend, mode=mode,
                rendezvous_timeout_s=rendezvous_s,
                collective_timeout_s=config.collective_timeout_s,
            )  # fmt: skip
            for rank in [TRAINER_RANK, *firsts[:-1]]
        ]
        join_s = deadline.left(config.rpc_timeout_s)
        joining = [
            m.handle._weight_sync_join.remote(spec.model_dump_json(), config.max_metadata_bytes,
                                              timeout_s=join_s)
            for m, spec in zip(self._members, specs[1:], strict=True)
        ]  # fmt: skip
        try:
            group = TorchGroup.join(specs[TRAINER_RANK], listener)
        except WeightSyncError as exc:
            listener.close()
            # The members that joined fail at their own rendezvous timeout, about now.
            failure = self._blame_late(
                joining, "join", min(_GRACE_S, deadline.remaining()), rendezvous_s
            )
            self._leave_workers(deadline)
            raise failure or exc from exc
        except BaseException:
            listener.close()
            self._leave_workers(deadline)
            raise
        try:
            self._settle(joining, "join", deadline.left(config.rpc_timeout_s))
        except BaseException:
            group.close()
            self._leave_workers(deadline)
            raise
        self._group = group
        return group

    def _check_open(self) -> None:
        if self._closed:
            raise WeightSyncError("this WeightUpdater is closed; create a new one")

    def _close_group(self) -> None:
        group, self._group = self._group, None
        self._planner = None  # planned for that group's device
        if group is not None:
            group.close()

    def _teardown(self, deadline: Deadline | None = None) -> None:
        self._close_group()
        self._leave_workers(deadline)

    def _leave_workers(self, deadline: Deadline | None = None) -> None:
        """Ask every worker to leave, waiting at most what is left of ``deadline``: the request is
        sent either way, and a worker that cannot act on it is left to its own timeouts."""
        wait_s = min(_GRACE_S, self._config.rpc_timeout_s)
        if deadline is not None:
            wait_s = min(wait_s, deadline.remaining())
        refs = [m.handle._weight_sync_leave.remote(timeout_s=wait_s) for m in self._members]
        outcomes = collect(refs, wait_s)
        if not outcomes.ok:
            logger.warning(
                "some workers did not leave the sync group cleanly: %s",
                outcomes.error("leave", wait_s),
            )


class _PhaseClock:
    """Seconds per phase of one push, and the total."""

    def __init__(self) -> None:
        self._start = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self._last
        self._last = now

    def total(self) -> float:
        self.phases["total"] = self._last - self._start
        return self.phases["total"]


def _check_handles(
    workers: Sequence[ActorHandle], present: Sequence[ActorHandle]
) -> list[ActorHandle]:
    if isinstance(workers, ActorHandle) or not isinstance(workers, Sequence):
        raise TypeError("workers must be a list of WeightSyncWorker actor handles")
    if not workers and not present:
        raise ValueError("workers must name at least one WeightSyncWorker actor")
    seen = {handle._actor_id for handle in present}
    for index, worker in enumerate(workers):
        if not isinstance(worker, ActorHandle):
            raise TypeError(f"workers[{index}] is a {type(worker).__name__}, not a Ray actor handle")
        if worker._actor_id in seen:
            raise ValueError(f"workers[{index}] is already a worker of this updater")
        seen.add(worker._actor_id)
    return list(workers)


def _check_checksums(reports: list[ReceiveReport], sent: list[int]) -> None:
    bad = [index for index, report in enumerate(reports) if report.checksums != tuple(sent)]
    if bad:
        raise ChecksumMismatchError(
            f"worker(s) {bad} received bytes whose CRC32 differs from what was sent; nothing "
            "was committed. Check the network path and the workers' memory", bad,
        )  # fmt: skip


def _choose_backend(
    config: SyncConfig, tensors: list[torch.Tensor], infos: list[MemberInfo]
) -> BackendName:
    if config.backend != "auto":
        return config.backend
    on_cuda = any(t.is_cuda for t in tensors)
    everyone_has_gpu = torch.cuda.is_available() and all(info.cuda for info in infos)
    return "nccl" if on_cuda and everyone_has_gpu else "gloo"


def _choose_mode(config: SyncConfig, infos: list[MemberInfo]) -> ModeName:
    here = dist.is_available() and dist.is_initialized()
    # 'world' makes each member's process group the default one: that needs one rank per
    # process, which a member bringing several ranks (an engine's workers) cannot promise.
    anyone = here or any(info.has_default_group or info.ranks > 1 for info in infos)
    if config.group_mode == "auto":
        return "standalone" if anyone else "world"
    if config.group_mode == "world" and anyone:
        raise TransportError(
            "group_mode='world' but a member already has a torch.distributed default group (or "
            "brings several ranks, as a tensor-parallel engine does); use group_mode="
            "'standalone' or 'auto'"
        )
    return config.group_mode
