"""``WeightUpdater``: the trainer's end. One ``push`` = plan, prepare, broadcast, commit.

Control plane, per push and per worker: one ``prepare`` call carrying the version and the plan
(or the hash of a plan the worker already holds), one ``receive`` call that runs alongside the
broadcast, one ``commit``. The number of Ray calls never depends on the number of tensors.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import ray
import torch
import torch.distributed as dist
from ray.actor import ActorHandle

from weight_sync.actors.calls import gather
from weight_sync.config import SyncConfig
from weight_sync.errors import PlanMismatchError, TransportError, WeightSyncError
from weight_sync.metadata import (
    TRAINER_RANK,
    BackendName,
    GroupSpec,
    MemberInfo,
    ModeName,
    PrepareReply,
    PrepareRequest,
    SyncPlan,
)
from weight_sync.sender import PushPlanner, Sender, StateDict, check_state_dict
from weight_sync.transport import TorchGroup, bind_listener

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushResult:
    """What one push moved. ``version`` is now committed on every worker."""

    version: int
    nbytes: int  # bytes of the tensors pushed (alignment padding on the wire not counted)
    buckets: int
    seconds: float
    tensors: int = 0

    @property
    def gbps(self) -> float:
        """Payload gigabytes per second, as seen by the trainer."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WeightUpdater:
    """Pushes named tensors from this process (rank 0) to ``workers`` (``WeightSyncWorker`` actors).

    The group is formed lazily on the first push and reused; a failed push tears it down and the
    next push forms a new one. ``push`` calls from several threads are serialised.
    """

    def __init__(self, workers: Sequence[ActorHandle], config: SyncConfig | None = None) -> None:
        if isinstance(workers, ActorHandle) or not isinstance(workers, Sequence):
            raise TypeError("workers must be a list of WeightSyncWorker actor handles")
        if not workers:
            raise ValueError("workers must name at least one WeightSyncWorker actor")
        for index, worker in enumerate(workers):
            if not isinstance(worker, ActorHandle):
                raise TypeError(f"workers[{index}] is a {type(worker).__name__}, not a Ray actor handle")
        if config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig, got {type(config).__name__}")
        self._workers = list(workers)
        self._config = config or SyncConfig()
        self._group: TorchGroup | None = None
        self._planner: PushPlanner | None = None  # made with the first group (needs its device)
        self._known_plans: list[str | None] = [None] * len(self._workers)
        self._version = 0  # last version committed on every worker
        self._next_version = 1  # never reused: spent once any worker may have committed it
        self._lock = threading.Lock()
        self._closed = False

    @property
    def workers(self) -> tuple[ActorHandle, ...]:
        return tuple(self._workers)

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

    def push(self, state_dict: StateDict) -> PushResult:
        """Send every tensor to every worker; returns once all of them hold it and commit.

        Raises ``TypeError``/``ValueError`` for a bad state dict (nothing sent), and a
        ``WeightSyncError`` for failures while running: ``PlanMismatchError`` when workers
        refuse the push (nothing changed anywhere), ``WorkerFailedError``/``SyncTimeoutError``/
        ``TransportError`` when a push fails part-way (those workers stay dirty until a full push).
        """
        names, tensors = check_state_dict(state_dict, self._config)
        with self._lock:
            if self._closed:
                raise WeightSyncError("this WeightUpdater is closed; create a new one")
            if not names:
                logger.info("empty state dict: nothing to push (version stays %d)", self._version)
                return PushResult(self._version, 0, 0, 0.0)
            start = time.perf_counter()
            group = self._ensure_group(tensors)
            if self._planner is None:
                self._planner = PushPlanner(self._config, group.device)
            plan = self._planner.plan(names, tensors)
            version = self._next_version
            try:
                self._prepare(version, plan)
                self._transfer(group, version, plan, tensors)
                self._next_version = version + 1
                gather(
                    [w._weight_sync_commit.remote(version) for w in self._workers],
                    "commit", self._config.rpc_timeout_s,
                )  # fmt: skip
            except PlanMismatchError:
                raise  # refused before any collective: the group is intact
            except BaseException:
                self._teardown()
                raise
            self._version = version
            result = PushResult(
                version, plan.payload_bytes, len(plan.buckets), time.perf_counter() - start,
                len(plan.tensors),
            )  # fmt: skip
            logger.info(
                "pushed version %d: %d tensors, %.1f MB in %d buckets, %.3fs (%.2f GB/s)",
                version, result.tensors, result.nbytes / 1e6, result.buckets, result.seconds,
                result.gbps,
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

    def _prepare(self, version: int, plan: SyncPlan) -> None:
        """Every worker checks the push; any refusal raises before a byte is broadcast."""
        replies = self._prepare_round(version, plan, resend=set())
        missing = {i for i, reply in enumerate(replies) if reply.need_plan}
        if missing:  # a worker lost its cached plan (e.g. was restarted): send it in full
            again = self._prepare_round(version, plan, resend=missing)
            replies = [again[i] if i in missing else reply for i, reply in enumerate(replies)]
        problems = {i: reply.problems or ("refused",) for i, reply in enumerate(replies)
                    if not reply.accepted}  # fmt: skip
        if problems:
            raise PlanMismatchError(problems)
        self._known_plans = [plan.digest] * len(self._workers)

    def _prepare_round(self, version: int, plan: SyncPlan, resend: set[int]) -> list[PrepareReply]:
        by_hash = PrepareRequest(version=version, plan_digest=plan.digest).model_dump_json()
        with_plan: str | None = None  # serialised only if some worker lacks the plan
        refs: list[ray.ObjectRef] = []
        for index, worker in enumerate(self._workers):
            request = by_hash
            if self._known_plans[index] != plan.digest or index in resend:
                if with_plan is None:
                    with_plan = PrepareRequest(
                        version=version, plan_digest=plan.digest, plan=plan
                    ).model_dump_json()
                request = with_plan
            refs.append(worker._weight_sync_prepare.remote(request))
        return gather(refs, "prepare", self._config.rpc_timeout_s)

    def _transfer(
        self, group: TorchGroup, version: int, plan: SyncPlan, tensors: list[torch.Tensor]
    ) -> None:
        receiving = [w._weight_sync_receive.remote(version) for w in self._workers]
        try:
            Sender(group).send(plan, tensors)
        except WeightSyncError as exc:
            # Leave first: members blocked on our next bucket then fail at once instead of
            # waiting out collective_timeout_s, and the workers' own errors say who failed.
            self._close_group()
            try:
                gather(receiving, "receive", self._config.rpc_timeout_s)
            except WeightSyncError as worker_exc:
                raise worker_exc from exc
            raise
        gather(receiving, "receive", self._config.push_timeout_s)

    # -- the group -----------------------------------------------------------------------------

    def _ensure_group(self, tensors: list[torch.Tensor]) -> TorchGroup:
        if self._group is not None:
            return self._group
        config = self._config
        infos: list[MemberInfo] = gather(
            [w._weight_sync_info.remote() for w in self._workers], "probe", config.rpc_timeout_s
        )
        # Versions never go backwards, even across a trainer restart.
        held = [info.version for info in infos if info.version is not None]
        self._version = max([self._version, *held])
        self._next_version = max(self._next_version, self._version + 1)
        backend = _choose_backend(config, tensors, infos)
        mode = _choose_mode(config, infos)
        listener = bind_listener(config.master_addr)
        group_id = secrets.token_hex(8)
        specs = [
            GroupSpec(
                group_id=group_id, address=config.master_addr, port=listener.getsockname()[1],
                world_size=len(self._workers) + 1, rank=rank, backend=backend, mode=mode,
                rendezvous_timeout_s=config.rendezvous_timeout_s,
                collective_timeout_s=config.collective_timeout_s,
            )  # fmt: skip
            for rank in range(len(self._workers) + 1)
        ]
        joining = [
            worker._weight_sync_join.remote(spec.model_dump_json(), config.max_metadata_bytes)
            for worker, spec in zip(self._workers, specs[1:], strict=True)
        ]
        try:
            group = TorchGroup.join(specs[TRAINER_RANK], listener)
        except BaseException:
            listener.close()
            self._leave_workers()
            raise
        try:
            gather(joining, "join", config.rendezvous_timeout_s + config.rpc_timeout_s)
        except BaseException:
            group.close()
            self._leave_workers()
            raise
        self._group = group
        self._known_plans = [None] * len(self._workers)
        return group

    def _close_group(self) -> None:
        group, self._group = self._group, None
        self._planner = None  # planned for that group's device
        if group is not None:
            group.close()

    def _teardown(self) -> None:
        self._close_group()
        self._leave_workers()

    def _leave_workers(self) -> None:
        """Ask every worker to leave; a worker that cannot answer in time is left to its timeouts."""
        refs = [w._weight_sync_leave.remote() for w in self._workers]
        try:
            gather(refs, "leave", min(10.0, self._config.rpc_timeout_s))
        except WeightSyncError as exc:
            logger.warning("some workers did not leave the sync group cleanly: %s", exc)


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
    anyone = here or any(info.has_default_group for info in infos)
    if config.group_mode == "auto":
        return "standalone" if anyone else "world"
    if config.group_mode == "world" and anyone:
        raise TransportError(
            "group_mode='world' but a member already has a torch.distributed default group; "
            "use group_mode='standalone' or 'auto'"
        )
    return config.group_mode
