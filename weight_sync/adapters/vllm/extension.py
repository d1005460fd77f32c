"""The worker half of the vLLM adapter: runs inside each of vLLM's worker processes.

Pass ``worker_extension_cls="weight_sync.adapters.vllm.WeightSyncExtension"`` when building the
engine; vLLM appends this class to its worker's bases, and the engine-side member
(``VLLMEngine``) reaches it through ``collective_rpc``. A push, from one sender or from every
rank of a sharded trainer (``RayLanes``), takes two steps on each worker: the check of the
push's layout against the engine's model before any byte moves, then every lane received and
loaded into the model as it completes, in one reload (``member.LaneMember``,
``reload.Streamed``).

Every method answers with a ``WorkerReply`` in JSON and never raises: vLLM turns a worker's
exception into a plain ``RuntimeError`` (and, with several workers, loses the others' answers),
so errors travel as data and the engine side raises them again as weight_sync's own types.
Only strings, numbers and lists of them cross ``collective_rpc``: nothing is unpickled that the
trainer's validated messages did not say.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from weight_sync.adapters.vllm.member import LaneMember
from weight_sync.adapters.vllm.reload import ReloadTarget
from weight_sync.receive.receiver import Receiver
from weight_sync.wire.metadata import LanePush, SyncStatus, WorkerReply

EXTENSION = "weight_sync.adapters.vllm.WeightSyncExtension"


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner``,
    ``self.vllm_config``, ``self.rank``)."""

    def weight_sync_info(self) -> str:
        return self._weight_sync_reply(
            lambda: self._weight_sync_state()[0].info().model_dump_json()
        )

    def weight_sync_leave(self) -> str:
        """Let go of every lane (the engine shuts down). What they landed stays this worker's."""
        member = self.__dict__.get("_weight_sync_lane_member")
        return self._weight_sync_reply(member.close if member is not None else lambda: None)

    def weight_sync_status(self) -> str:
        return self._weight_sync_reply(lambda: None)

    def weight_sync_lanes_check(self, call_json: str) -> str:
        """Rank 0's call (``LanePush``, as JSON), its check alone (``LaneMember.check``): this
        worker's problems with the push, as a JSON list (empty: it takes all of it)."""
        member = self._weight_sync_lanes()
        return self._weight_sync_reply(
            lambda: json.dumps(member.check(self._weight_sync_call(call_json)))
        )

    def weight_sync_lanes_push(self, call_json: str) -> str:
        """Rank 0's call (``LanePush``, as JSON: ``LaneMember.push``); the version held."""
        member = self._weight_sync_lanes()
        return self._weight_sync_reply(lambda: str(member.push(self._weight_sync_call(call_json))))

    def weight_sync_lanes_leave(self, endpoints: list[list[Any]]) -> str:
        """The senders at ``endpoints`` left: let go of their lanes, unless other senders' took
        their place. What they landed stays this worker's status (its one-sender receiver is
        the record every lane writes: ``Lanes.record``)."""
        member = self.__dict__.get("_weight_sync_lane_member")

        def leave() -> None:
            if member is not None:
                member.leave(endpoints)

        return self._weight_sync_reply(leave)

    # -- internals -----------------------------------------------------------------------------

    def _weight_sync_call(self, call_json: str) -> LanePush:
        """Rank 0's call as this worker takes it: as member ``slot`` plus its rank within the
        engine (the engine's workers are consecutive members)."""
        call = LanePush.parse(call_json)
        return call.model_copy(update={"slot": call.slot + int(getattr(self, "rank", 0))})

    def _weight_sync_reply(self, step: Callable[[], Any]) -> str:
        reply, _ = WorkerReply.of(step, self._weight_sync_status)
        return reply.model_dump_json()

    def _weight_sync_status(self) -> SyncStatus:
        """The one-sender receiver's status (every push's record, from one sender or many),
        with its lanes' push in flight, if any (``Lanes.status``)."""
        return self._weight_sync_lanes().member.status()

    def _weight_sync_lanes(self) -> LaneMember:
        member = self.__dict__.get("_weight_sync_lane_member")
        if member is None:
            receiver, target = self._weight_sync_state()
            member = self.__dict__["_weight_sync_lane_member"] = LaneMember(target, receiver)
        return member

    def _weight_sync_state(self) -> tuple[Receiver, ReloadTarget]:
        state = self.__dict__.get("_weight_sync")
        if state is None:
            runner: Any = self.model_runner  # type: ignore[attr-defined]
            target = ReloadTarget(runner.get_model, self.vllm_config, runner)  # type: ignore[attr-defined]
            # vLLM's worker knows its device (``Worker.device``); a thread's current one may not be it.
            device = getattr(self, "device", None)
            receiver = Receiver(device if isinstance(device, torch.device) else None)
            state = self.__dict__["_weight_sync"] = (receiver, target)
        return state
