"""The push protocol, the same for every control plane: plan, prepare, transfer, commit.

A ``Pusher`` lives in the trainer process (rank 0 of the sync group). It reaches its members
through a ``ControlPlane`` (``weight_sync.control.plane``: Ray actors, or a client over a store) and
moves bytes over a ``Transport`` (the broadcast group, and a shared-memory ring for the members
on its own host); it never sees either one's machinery. Per push and per member, the long way:
one ``prepare`` carrying the version and the plan (or the hash of a plan the member already
holds), one ``receive`` that runs alongside the broadcast, one ``commit``. In the steady state
(every member holds the plan and offers it) the three are one call, ``push``: the members agree
by votes over the group itself -- on their verdicts before any byte moves, and after the last
byte that every one of them has received -- instead of answering the trainer in between (see
``_push_in_one_call``). The number of calls never depends on the number of tensors.

Failure: every wait draws on the push's deadline. When something fails, the trainer leaves the
group first (so members blocked on it fail at once), waits a bounded time for every member's
call to end, and then knows each member's fate (see ``wire.blame.Outcomes``): members that died or
never answered are dropped, the rest leave the group, and the next push forms a new one.

A push reads downhill from here into ``weight_sync.send``: the state dict is checked
(``wire.state_dict``) and planned (``send.sender.PushPlanner``); the group is formed when there is
none (``send.formation``, gathering the members' replies through ``send.roster``); ``send.wire``
says what this push puts on the wire -- dense, or a delta against the trainer's baseline -- and
sends it through the ``send.sender``. None of those modules imports this one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from weight_sync.config import SyncConfig
from weight_sync.control.deadline import Deadline
from weight_sync.control.plane import ControlPlane, collect
from weight_sync.errors import ChecksumMismatchError, PlanMismatchError, WeightSyncError
from weight_sync.result import PushResult
from weight_sync.send.formation import form_group
from weight_sync.send.roster import GRACE_S, Roster
from weight_sync.send.routes import Route
from weight_sync.send.sender import PushPlanner, Sender
from weight_sync.send.sharded import ShardedSource
from weight_sync.send.wire import Decision, Sent, Wire, as_dense
from weight_sync.transport import Transport, cuda_ipc
from weight_sync.transport.devices import push_device, sized_for
from weight_sync.wire.mapping import Transform
from weight_sync.wire.metadata import (
    VOTE_AGREED,
    MemberInfo,
    PrepareReply,
    PrepareRequest,
    ReceiveReport,
    SyncPlan,
)
from weight_sync.wire.state_dict import (
    Entries,
    Rename,
    StateDict,
    check_state_dict,
    nonfinite_error,
)
from weight_sync.wire.versions import check_version, choose_version

__all__ = ["PushObserver", "PushResult", "Pusher"]

logger = logging.getLogger(__name__)


def _teardown_reserve(push_timeout_s: float) -> float:
    """What a push keeps of its bound for leaving the group after a failure (asking every member
    to leave, without waiting long for any): 2 s, or a tenth of a short bound."""
    return min(2.0, push_timeout_s / 10)


class PushObserver(Protocol):
    """Told of every push (e.g. ``weight_sync.actors.metrics.PushMetrics``)."""

    def pushed(
        self, version: int, nbytes: int, buckets: int, phases: Mapping[str, float], gbps: float
    ) -> None: ...

    def failed(self, error: BaseException) -> None: ...


class Pusher:
    """Pushes named tensors from this process (rank 0) to the members of ``plane``.

    The group is formed lazily on the first push and reused. A failed push tears it down,
    drops the members that died or froze, and the next push forms a new group over the rest.
    ``push`` calls from several threads are serialised.
    """

    def __init__(
        self,
        plane: ControlPlane,
        config: SyncConfig | None = None,
        observer: PushObserver | None = None,
        first_version: int = 1,
        wrap: Callable[[Transport], Transport] | None = None,
    ) -> None:
        """``first_version``: the lowest version this pusher may use (a caller that replaces its
        pusher passes the old one's ``next_version``: versions never repeat, even where every
        member restarted and remembers none). ``wrap``: what each group formed is used through
        (a lane of several senders over one group: ``transport.rounds.SendLane``)."""
        if config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig, got {type(config).__name__}")
        self._plane = plane
        self._config = config or SyncConfig()
        # With every "auto" size settled for the current group's device (see _ensure_group).
        self._sized = self._config.sized_for("cpu")
        # The members, what plans each holds and which base each is: see weight_sync.send.roster.
        self._roster = Roster(plane, self._config.rpc_timeout_s)
        self._observer = observer
        self._group: Transport | None = None
        self._wrap = wrap
        self._planner: PushPlanner | None = None  # made with the first group (needs its device)
        self._sender: Sender | None = None  # of the current group: keeps its staging buffers
        self._routes: list[
            Route
        ] = []  # per member of the current group (see weight_sync.send.routes)
        self._ipc_refused = False  # a CUDA ring failed to open here: colocated members take shm
        # Dense or delta, push by push (with SyncConfig.delta: against its copy of what the
        # members hold): see weight_sync.send.wire.
        self._wire = Wire(self._config)
        # Every member of the current group commits in its receive call when asked (see
        # PrepareRequest.commit_on_receipt): learnt by the probe.
        self._on_receipt = False
        self._version = 0  # last version committed on every member
        self._next_version = first_version  # never reused: spent once a member may hold it
        self._lock = threading.Lock()
        self._closed = False

    @property
    def config(self) -> SyncConfig:
        return self._config

    @property
    def group(self) -> Transport | None:
        """The sync group (this process is rank 0): a ``TorchGroup``, the shared-memory ring of
        this host's members, or a ``Fanout`` of both; None until a push forms it."""
        return self._group

    @property
    def routes(self) -> list[Route]:
        """How each member receives through the current group: ``"group"`` (the broadcast
        group), ``"shm"`` (the host ring) or ``"cuda_ipc"`` (the CUDA ring on the trainer's GPU);
        see ``weight_sync.send.routes``. Empty while no group is formed."""
        return list(self._routes) if self._group is not None else []

    @property
    def version(self) -> int:
        """The last version committed by a push (0 before the first)."""
        return self._version

    @property
    def next_version(self) -> int:
        """The version the next push will take, at the lowest (every lower one is spent)."""
        return self._next_version

    def spent(self, version: int) -> None:
        """Every version up to ``version`` was spent elsewhere (another trainer sent it to these
        members): the next push goes past it."""
        self._next_version = max(self._next_version, version + 1)

    def push(
        self,
        state_dict: StateDict | Entries | ShardedSource,
        *,
        rename: Rename | None = None,
        transform: Transform | None = None,
        partial: bool = False,
        version: int | None = None,
    ) -> PushResult:
        """Send every tensor to every worker; returns once all of them hold it and commit.

        ``transform`` (see ``weight_sync.wire.mapping``: fuse, rename, drop) and then ``rename``
        (``None`` drops a tensor) map the trainer's names to the workers'. Tied weights (names
        sharing one tensor's bytes) travel once. ``partial=True`` sends only the tensors given
        (adapters, what changed): workers accept a subset of their model, but only on top of a
        committed version, and keep reporting the last full push as ``full_version``. A
        ``ShardedSource`` (see ``weight_sync.send.sharded``) is gathered bucket by bucket with the
        other trainer ranks, which call ``serve()`` meanwhile.

        ``version``: the version to label this push with (an RL loop's global step, say), which
        must be past every version any worker holds or was ever sent, and past this pusher's
        own (``next_version``); without it the count goes on from there (docs/guarantees.md,
        "Versions"). One that is not past them is refused with a ``ValueError`` before any byte
        moves.

        Raises ``TypeError``/``ValueError`` for a bad state dict (nothing sent anywhere), and a
        ``WeightSyncError`` within ``push_timeout_s`` for failures while running:
        ``PlanMismatchError`` when workers refuse the push (nothing changed anywhere);
        ``WorkerFailedError`` naming the workers that died, froze or raised (the dead and frozen
        are dropped from ``workers``); ``SyncTimeoutError``/``TransportError`` when nobody in
        particular is to blame.
        """
        started = time.monotonic()  # the bound runs from the call: checks and the lock count
        check_version(version)
        if isinstance(state_dict, Entries):  # checked already (a lane's: ``lane_rules.share_of``)
            assert rename is None and transform is None, "checked entries are mapped already"
            return self._push(state_dict, state_dict.tensors, partial, False, started, version)
        if not isinstance(state_dict, ShardedSource):
            entries = check_state_dict(state_dict, self._config, rename, transform)
            return self._push(entries, entries.tensors, partial, False, started, version)
        source, pushed = state_dict, None
        if not source.is_sender:
            raise ValueError("this rank does not send: call serve() on its ShardedSource")
        try:
            if transform is not None:
                raise ValueError(
                    "transform needs whole tensors and cannot run on a sharded "
                    "source; rename (names only) can"
                )
            entries = check_state_dict(source.items(), self._config, rename, sharded=True)
            cast = self._config.cast_dtype
            if self._config.check_finite and not source.all_finite(cast):
                raise nonfinite_error(cast)
            gathering = source.gathering(entries.tensors)
            result = self._push(entries, gathering, partial, True, started, version)
            pushed = result.version
            return result
        finally:
            source.finish(pushed)

    def close(self) -> None:
        """Leave the group on every member and here. Idempotent; the members keep their weights."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._teardown()

    def regroup(self) -> None:
        """Leave the group now; the next push forms a new one over the members (they changed:
        a lane's members rejoined over a new one group)."""
        with self._lock:
            self._close_group()

    # -- one push ------------------------------------------------------------------------------

    def _push(
        self,
        entries: Entries,
        tensors: Sequence[torch.Tensor],
        partial: bool,
        sharded: bool,
        started: float,
        named: int | None = None,
    ) -> PushResult:
        with self._lock:
            self._check_open()
            if not entries.count:
                return PushResult.nothing(self._version)
            if not len(self._plane):
                raise WeightSyncError(
                    "no workers left: all were dropped after failures; add replacements "
                    "(WeightUpdater.add_workers)"
                )
            clock = _PhaseClock()
            # Every wait draws on ``deadline``; the teardown after a failure on what is left of
            # ``bound``, so that the error is raised within push_timeout_s of the call.
            bound = self._config.push_timeout_s
            deadline = Deadline(bound - _teardown_reserve(bound), "push", started)
            broadcasting = False
            try:
                group = self._ensure_group(entries.tensors, deadline)  # may move _next_version up
                plan = self._plan(group, entries)
                version = choose_version(named, self._next_version)
                clock.lap("group")
                decision = self._wire.decide(version, sharded, self._roster.bases)
                request = self._request(version, partial, plan, decision)
                done = None
                if request.commit_on_receipt and self._roster.plans.all_hold(plan.digest):
                    done = self._push_in_one_call(group, request, plan, tensors, deadline)
                    clock.lap("push")
                    if done is not None:
                        clock.carve("push", "scan", done[0].wire.scan_s)
                if done is None:  # the long way: a round of prepare calls first
                    request, in_place = self._prepare(request, plan, deadline)
                    clock.lap("prepare")
                    broadcasting = True
                    sent, _ = self._transfer(group, request, plan, tensors, deadline)
                    clock.lap("transfer")
                    clock.carve("transfer", "scan", sent.wire.scan_s)
                else:
                    sent, in_place = done
                if not request.commit_on_receipt:
                    timeout_s = deadline.left(self._config.rpc_timeout_s)
                    self._roster.replies(
                        self._plane.commit(version, timeout_s), "commit", timeout_s
                    )
                    clock.lap("commit")
                self._roster.bases = self._wire.bases_after(self._roster.bases, request, in_place)
            except BaseException as exc:
                if self._observer is not None:
                    self._observer.failed(exc)
                # Refused before any byte moved (by the members, or a plan too large): the group
                # is intact and is kept.
                refused = isinstance(exc, PlanMismatchError) or (
                    not broadcasting and isinstance(exc, ValueError)
                )
                if self._group is not None and not refused:
                    self._teardown(Deadline(bound, "push", started))
                raise
            self._version = version
            reason = self._wire.sent(decision, request, sent.seconds, plan.payload_bytes)
            result = PushResult(
                version,
                plan.payload_bytes,
                len(plan.buckets),
                clock.total(),
                entries.count,
                partial,
                clock.phases,
                sent.wire.wire_bytes,
                request.delta,
                sent.wire.density,
                reason,
            )
            if self._observer is not None:
                self._observer.pushed(
                    version, result.nbytes, result.buckets, clock.phases, result.gbps
                )
            logger.info(
                "pushed version %d%s%s: %d tensors, %.1f MB (%.1f MB on the wire) in %d buckets, "
                "%.3fs (%.2f GB/s; %s)",
                version,
                " (partial)" if partial else "",
                " (delta)" if request.delta else "",
                result.tensors,
                result.nbytes / 1e6,
                result.wire_bytes / 1e6,
                result.buckets,
                result.seconds,
                result.gbps,
                ", ".join(f"{phase} {seconds:.3f}s" for phase, seconds in clock.phases.items()),
            )
            return result

    def _plan(self, group: Transport, entries: Entries) -> SyncPlan:
        if self._planner is None:
            # Members only on the rings (the colocated deployment) take smaller tensors alone.
            collective = any(route in ("group", "relay") for route in self._routes)
            self._planner = PushPlanner(self._sized, group.device, collective)
        plan = self._planner.plan(entries)
        if len(plan.wire) > self._config.max_metadata_bytes:
            raise ValueError(
                f"the plan's metadata is {len(plan.wire)} bytes, over max_metadata_bytes="
                f"{self._config.max_metadata_bytes}; raise it in SyncConfig or push fewer tensors"
            )
        return plan

    def _request(
        self, version: int, partial: bool, plan: SyncPlan, decision: Decision
    ) -> PrepareRequest:
        config = self._config
        # The trainer compares checksums before anyone commits: they keep the commit round.
        on_receipt = self._on_receipt and not config.checksum
        return PrepareRequest(
            version=version,
            plan_digest=plan.digest,
            staging=config.staging,
            checksum=config.checksum,
            partial=partial,
            commit_on_receipt=on_receipt,
            **decision.request_fields(self._sized.sized_bucket_bytes),
        )

    def _prepare(
        self, request: PrepareRequest, plan: SyncPlan, deadline: Deadline
    ) -> tuple[PrepareRequest, list[bool]]:
        """Every member checks the push; any refusal raises before a byte is broadcast. A delta
        that some member cannot take goes dense for all (the broadcast costs what its largest
        stream costs). Returns the request that went through, and which members write every
        tensor in place."""
        replies = self._prepare_all(request, plan, deadline)
        dense = [i for i, reply in enumerate(replies) if reply.need_dense]
        if dense:
            logger.info("worker(s) %s do not hold the trainer's base: this push goes dense", dense)
            request = as_dense(request)
            replies = self._prepare_all(request, plan, deadline)
        problems = {
            i: reply.problems or ("refused",)
            for i, reply in enumerate(replies)
            if not reply.accepted
        }
        if problems:
            accepted = [i for i, reply in enumerate(replies) if reply.accepted]
            self._roster.cancel(request.version, accepted, deadline)
            raise PlanMismatchError(problems)
        self._roster.plans.learnt(plan.digest)
        return request, [reply.in_place for reply in replies]

    def _prepare_all(
        self, request: PrepareRequest, plan: SyncPlan, deadline: Deadline
    ) -> list[PrepareReply]:
        """Every member's reply, sending the plan in full to those that do not hold it."""
        everyone = range(len(self._plane))
        replies = self._prepare_round(request, plan, everyone, deadline)
        lacking = [i for i, reply in enumerate(replies) if reply.need_plan]
        if lacking:  # a member lost its cached plan (e.g. was restarted): send it in full
            for index in lacking:
                self._roster.plans.forgot(index, plan.digest)
            again = iter(self._prepare_round(request, plan, lacking, deadline))
            replies = [next(again) if reply.need_plan else reply for reply in replies]
        return replies

    def _prepare_round(
        self, request: PrepareRequest, plan: SyncPlan, members: Sequence[int], deadline: Deadline
    ) -> list[PrepareReply]:
        timeout_s = deadline.left(self._config.rpc_timeout_s)
        send_plan = self._roster.plans.lacking(plan.digest, members)
        calls = self._plane.prepare(request, plan, list(members), send_plan, timeout_s)
        return self._roster.replies(calls, "prepare", timeout_s)

    def _push_in_one_call(
        self,
        group: Transport,
        request: PrepareRequest,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        deadline: Deadline,
    ) -> tuple[_Transferred, list[bool]] | None:
        """The steady state, where every member holds the plan and commits on receipt: one call
        per member (``Receiver.push``). Before any byte moves, the members vote over the group
        on their verdicts, and the trainer with them: a refusal anywhere stops the push
        everywhere, as a prepare round would, and raises ``PlanMismatchError``. Returns what
        ``_transfer`` does, and which members write every tensor in place; None when a member
        turned out to need the plan or dense bytes (the push then goes the long way)."""
        calls = self._plane.push(request, deadline.remaining())
        try:
            verdict = group.vote(VOTE_AGREED, deadline.left(self._config.collective_timeout_s))
        except WeightSyncError as exc:
            raise self._after_failure(calls, "push", deadline) or exc from exc
        if verdict != VOTE_AGREED:
            timeout_s = deadline.left(self._config.rpc_timeout_s)
            replies = [reply.prepared for reply in self._roster.replies(calls, "push", timeout_s)]
            for index, reply in enumerate(replies):
                if reply.need_plan:
                    self._roster.plans.forgot(index, plan.digest)
            if any(reply.need_plan or reply.need_dense for reply in replies):
                return None
            raise PlanMismatchError(
                {
                    index: reply.problems or ("refused",)
                    for index, reply in enumerate(replies)
                    if not reply.accepted
                }
            )
        sent, replies = self._transfer(group, request, plan, tensors, deadline, calls)
        self._roster.plans.learnt(plan.digest)
        return sent, [reply.prepared.in_place for reply in replies]

    def _transfer(
        self,
        group: Transport,
        request: PrepareRequest,
        plan: SyncPlan,
        tensors: Sequence[torch.Tensor],
        deadline: Deadline,
        calls: list[Future[Any]] | None = None,
    ) -> tuple[_Transferred, list[Any]]:
        """Broadcast the push while every member receives it (in ``calls``, a push in one call;
        else in a round of receive calls started here); returns what was sent and the seconds
        until every member had it (what a dense and a delta push are compared by), and every
        member's answer."""
        config = self._config
        # Spent from here on, whatever happens: members may commit it as soon as they all have it.
        self._next_version = request.version + 1
        what, receiving = "push", calls
        if receiving is None:
            what = "receive"
            receiving = self._plane.receive(
                request.version, config.staging == "atomic", deadline.remaining()
            )
        started = time.perf_counter()
        try:
            if self._sender is None:
                self._sender = Sender(group)
            sent = self._wire.send(
                self._sender, request, plan, tensors, deadline, self._sized.sized_bucket_bytes
            )
            if request.commit_on_receipt:  # completes once every member has received
                group.vote(VOTE_AGREED, deadline.left(self._config.collective_timeout_s))
        except WeightSyncError as exc:
            raise self._after_failure(receiving, what, deadline) or exc from exc
        outcomes = collect(self._plane, receiving, deadline.remaining())
        if not outcomes.ok:
            raise self._after_failure(receiving, what, deadline) or outcomes.error(
                what, deadline.seconds
            )
        if sent.checksums is not None:
            _check_checksums(outcomes.results, sent.checksums)
        return _Transferred(sent, time.perf_counter() - started), outcomes.results

    # -- failures ------------------------------------------------------------------------------

    def _after_failure(
        self, calls: Sequence[Future[Any]], what: str, deadline: Deadline
    ) -> WeightSyncError | None:
        """A collective failed: leave it, then give every member's call time to end.

        Members waiting on this process fail as soon as it leaves; members waiting on a frozen
        peer fail at their collective timeout. Whoever is still silent after that is frozen.
        """
        self._close_group()
        wait_s = min(self._config.collective_timeout_s + GRACE_S, deadline.remaining())
        return self._roster.blame_late(calls, what, wait_s)

    # -- the group -----------------------------------------------------------------------------

    def _ensure_group(self, tensors: list[torch.Tensor], deadline: Deadline) -> Transport:
        """The current group, or a new one formed over the members (see ``weight_sync.send.formation``)
        after a probe that tells this updater what they hold."""
        if self._group is not None:
            return self._group
        probe_s = deadline.left(self._config.rpc_timeout_s)
        infos: list[MemberInfo] = self._roster.replies(self._plane.probe(probe_s), "probe", probe_s)
        self._probed(infos)
        device = push_device(tensors)
        # Sizes are settled once per group: a plan (and the members' buffers) stays put while
        # the group does, however the free memory moves.
        self._sized = sized_for(self._config, device)
        try:
            formed = form_group(
                self._roster,
                self._sized,
                infos,
                device,
                deadline,
                ipc_refused=self._ipc_refused,
            )
        except cuda_ipc.IpcUnavailableError as exc:
            # Remembered for this updater's life: IPC is a property of the deployment.
            logger.warning(
                "CUDA IPC refused (%s): workers on the trainer's GPU take the host ring instead",
                exc,
            )
            self._ipc_refused = True
            return self._ensure_group(tensors, deadline)
        self._routes = formed.routes
        self._group = self._wrap(formed.group) if self._wrap is not None else formed.group
        self._wire.reached(formed.far)
        return self._group

    def _probed(self, infos: list[MemberInfo]) -> None:
        """Take in the members' answers to a probe: what they hold, how they commit, and which
        versions they have seen."""
        self._roster.probed(infos)
        # Committing in the receive call applies an atomic push's staged bytes there: not for a
        # member that receives those beside its own methods (see actors.worker).
        self._on_receipt = all(
            info.one_call and not (info.concurrent and self._config.staging == "atomic")
            for info in infos
        )
        # Versions never go backwards or repeat, even across a trainer restart: a member may
        # have been sent a version it never committed, and that version is spent too.
        held = [info.version for info in infos if info.version is not None]
        self._version = max([self._version, *held])
        sent = max(info.highest_version for info in infos)
        self._next_version = max(self._next_version, self._version + 1, sent + 1)

    def _check_open(self) -> None:
        if self._closed:
            raise WeightSyncError("this updater is closed; create a new one")

    def _close_group(self) -> None:
        group, self._group = self._group, None
        self._planner = self._sender = None  # planned for that group's device
        if group is not None:
            group.close()

    def _teardown(self, deadline: Deadline | None = None) -> None:
        self._close_group()
        self._roster.leave(deadline)


@dataclass(frozen=True)
class _Transferred:
    """What a push's transfer put on the wire, and the seconds until every member had it."""

    wire: Sent
    seconds: float


class _PhaseClock:
    """Seconds per phase of one push, and the total."""

    def __init__(self) -> None:
        self._start = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self._last
        self._last = now

    def carve(self, phase: str, part: str, seconds: float) -> None:
        """Count ``seconds`` of the lap ``phase`` as a phase ``part`` of their own, listed
        before it."""
        if seconds > 0:
            rest = self.phases.pop(phase) - seconds
            self.phases[part] = seconds
            self.phases[phase] = rest

    def total(self) -> float:
        self.phases["total"] = self._last - self._start
        return self.phases["total"]


def _check_checksums(reports: list[ReceiveReport], sent: list[int]) -> None:
    bad = [index for index, report in enumerate(reports) if report.checksums != tuple(sent)]
    if bad:
        raise ChecksumMismatchError(
            f"worker(s) {bad} received bytes whose checksum differs from what was sent; nothing "
            "was committed. Check the network path and the workers' memory",
            bad,
        )
