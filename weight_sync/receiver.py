"""Worker side: validate the plan, receive, unpack, apply, report -- and the version state machine.

A worker's version moves only on commit. The moment the first byte of a push may reach the
model, the worker stops claiming any version ("dirty") until a full push commits, so it never
reports a version whose weights it does not fully hold.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch
from pydantic import ValidationError

from weight_sync.errors import WeightSyncError
from weight_sync.metadata import (
    TRAINER_RANK,
    GroupSpec,
    PrepareReply,
    PrepareRequest,
    ReceiveReport,
    SyncPlan,
    TensorMeta,
)
from weight_sync.packing import NamedTensors, Unpacker, bucket_buffers, can_land_in, staging_slots
from weight_sync.transport import TorchGroup, Transport, Work

logger = logging.getLogger(__name__)

Apply = Callable[[NamedTensors], None]
_PLAN_CACHE_SIZE = 8


def check_plan(plan: SyncPlan, expected: Mapping[str, TensorMeta] | None) -> list[str]:
    """What in ``plan`` this worker cannot load; empty when it can load all of it.

    ``expected`` is the worker's target (name -> meta); ``None`` accepts any plan (a custom
    ``load_weights`` decides for itself). With a target, the key sets must match exactly: a push
    that covered only part of the model would leave it mixing two versions.
    """
    if expected is None:
        return []
    problems = []
    sent = {meta.name: meta for meta in plan.tensors}
    for name, meta in sent.items():
        want = expected.get(name)
        if want is None:
            problems.append(f"unknown tensor {name!r}")
        elif (want.dtype, want.shape) != (meta.dtype, meta.shape):
            problems.append(
                f"{name!r}: sent {meta.dtype}{list(meta.shape)}, "
                f"model has {want.dtype}{list(want.shape)}"
            )
    problems.extend(f"missing tensor {name!r}" for name in expected if name not in sent)
    return problems


class Receiver:
    """One worker's end of the sync protocol."""

    def __init__(self) -> None:
        self.version: int | None = None  # committed version; None before the first / when dirty
        self.dirty = False
        self._transport: Transport | None = None
        self._max_metadata_bytes = 0
        self._plans: OrderedDict[str, SyncPlan] = OrderedDict()
        self._prepared: tuple[int, SyncPlan] | None = None
        self._received: int | None = None

    # -- membership --------------------------------------------------------------------------

    @property
    def transport(self) -> Transport | None:
        """The group this worker is in, if any."""
        return self._transport

    def join(self, spec: GroupSpec, max_metadata_bytes: int) -> None:
        self.leave()
        self._max_metadata_bytes = max_metadata_bytes
        self._transport = TorchGroup.join(spec)

    def leave(self) -> None:
        transport, self._transport = self._transport, None
        self._prepared = None
        if transport is not None:
            transport.close()

    # -- one push ----------------------------------------------------------------------------

    def prepare(
        self, request_json: str, expected: Callable[[], Mapping[str, TensorMeta] | None]
    ) -> PrepareReply:
        """Validate a push before any collective runs. Changes nothing the model can see."""
        self._prepared = None
        if len(request_json) > self._max_metadata_bytes:
            return _refuse(f"metadata of {len(request_json)} bytes exceeds max_metadata_bytes="
                           f"{self._max_metadata_bytes}")
        try:
            request = PrepareRequest.model_validate_json(request_json)
        except ValidationError as exc:
            return _refuse(f"malformed metadata ({exc.error_count()} errors): {exc.errors()[0]['msg']}")
        plan = request.plan or self._plans.get(request.plan_digest)
        if plan is None:
            return PrepareReply(accepted=False, need_plan=True)
        if plan.digest != request.plan_digest:
            return _refuse("plan does not match its digest")
        if self._transport is None:
            return _refuse("this worker is not in a sync group")
        try:
            problems = check_plan(plan, expected())
        except Exception as exc:  # a user's hook: report it instead of crashing the actor call
            problems = [f"cannot list this worker's expected weights: {exc!r}"]
        if problems:
            return _refuse(*problems)
        self._plans[plan.digest] = plan
        self._plans.move_to_end(plan.digest)
        while len(self._plans) > _PLAN_CACHE_SIZE:
            self._plans.popitem(last=False)
        self._prepared = (request.version, plan)
        return PrepareReply(accepted=True)

    def receive(
        self,
        version: int,
        apply: Apply,
        destinations: Mapping[str, torch.Tensor] | None = None,
    ) -> ReceiveReport:
        """Take part in the broadcast of a prepared push, applying each bucket as it lands.

        Tensors named in ``destinations`` that fit (``can_land_in``) are written there in place;
        the others go through ``apply``.
        """
        prepared, self._prepared = self._prepared, None
        transport = self._transport
        if prepared is None or prepared[0] != version or transport is None:
            self.leave()  # our peers are about to broadcast: leaving makes them fail fast
            raise WeightSyncError(f"receive({version}) without a matching prepare on this worker")
        plan = prepared[1]
        start = time.perf_counter()
        self.version, self.dirty, self._received = None, True, None
        try:
            landing = {} if destinations is None else {
                index: destinations[meta.name]
                for index, meta in enumerate(plan.tensors)
                if meta.name in destinations
                and can_land_in(destinations[meta.name], meta, transport.device)
            }  # fmt: skip
            _stream(transport, plan, apply, landing)
        except BaseException:
            self.leave()
            raise
        self._received = version
        return ReceiveReport(
            version=version, nbytes=plan.nbytes, buckets=len(plan.buckets),
            seconds=time.perf_counter() - start,
        )  # fmt: skip

    def commit(self, version: int) -> None:
        if self._received != version:
            raise WeightSyncError(
                f"commit({version}) but this worker holds {self._received} fully; it stays dirty"
            )
        self.version, self.dirty, self._received = version, False, None


def _stream(
    transport: Transport, plan: SyncPlan, apply: Apply, landing: Mapping[int, torch.Tensor]
) -> None:
    """Receive bucket k+1 while applying bucket k."""
    unpacker = Unpacker(plan, landing)
    empties = unpacker.empty_tensors(transport.device)
    if empties:
        apply(empties)
    if not plan.buckets:
        return
    buffers = bucket_buffers(plan, transport.device)
    slots = staging_slots(plan)

    def start(index: int) -> tuple[torch.Tensor, Work]:
        slot = slots[index]
        if slot is None:
            data = unpacker.direct_target(index, transport.device)
        else:
            data = buffers[slot][: plan.buckets[index].nbytes]
        return data, transport.broadcast(data, src=TRAINER_RANK)

    data, pending = start(0)
    for index in range(len(plan.buckets)):
        pending.wait()
        current = data
        if index + 1 < len(plan.buckets):
            data, pending = start(index + 1)
        ready = unpacker.unpack(index, current)
        if ready:
            apply(ready)
    if transport.device.type == "cuda":
        torch.cuda.current_stream(transport.device).synchronize()


def _refuse(*problems: str) -> PrepareReply:
    return PrepareReply(accepted=False, problems=problems)
