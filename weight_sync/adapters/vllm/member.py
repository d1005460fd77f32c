"""The vLLM worker's end of pushes, however they are driven: ``LaneMember`` follows every
sender's lane at once and loads each tensor as soon as it is whole, in one reload; a
``StoreLaneMember`` is one driven through vLLM's weight-transfer API (``lanes.ClientLanes``,
inside the weight_sync backend), which takes a slot in rank 0's store and answers there. Each
worker of a ``VLLMEngine`` on Ray runs a ``LaneMember`` for ``RayLanes`` (``extension.py``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from weight_sync.adapters.vllm.reload import ReloadTarget, Streamed
from weight_sync.control.keys import read_bounded
from weight_sync.control.lane_store import VERDICTS, Checks
from weight_sync.errors import WeightSyncError, first_line
from weight_sync.receive.assembly import Assembly
from weight_sync.receive.checks import check_layout
from weight_sync.receive.member import Member
from weight_sync.receive.receiver import Receiver
from weight_sync.transport.rendezvous import open_store
from weight_sync.wire.blocks import BlockLayout
from weight_sync.wire.metadata import LaneCheck, LanePush

logger = logging.getLogger(__name__)

# In rank 0's store, beside the verdicts and the checks (``control.lane_store``):
CHECK = "check"  # a LaneCheck (JSON): the push the workers check now
LANDED = "landed/"  # + push/slot: how a push ended at a worker (JSON {"version"} or {"error"})
SLOTS = "slots/"  # + epoch: the counter each worker takes its slot from
# + epoch/slot: a worker's word as it joins (JSON): the highest version it was ever sent, and
# its server's URL (where rank 0 tells the lanes which workers a server that died took along)
SENT = "sent/"
CHECK_BYTES = 256


class LaneMember:
    """One vLLM worker's end of pushes from one sender or from every rank of a sharded trainer,
    however they are driven (through vLLM's weight-transfer API by ``ClientLanes``:
    ``StoreLaneMember``; over Ray by ``RayLanes``, through ``VLLMEngine``): the push's layout
    checked against the engine, every sender's lane followed at once, each tensor loaded as
    soon as it is whole, in one reload. ``single``: the record of what the worker holds, kept
    across the trainers it follows (``receive.member.Member``)."""

    def __init__(self, target: ReloadTarget, single: Receiver) -> None:
        self._target = target
        self.member = Member(single)
        # The last layout's problems, by its digest and whether this worker held a version: a
        # push over Ray is checked twice (``check``, then ``push``), and each check builds and
        # hashes a plan of every tensor.
        self._found: tuple[tuple[str, bool], list[str]] | None = None

    @property
    def held(self) -> int | None:
        """The version every lane committed and the engine loaded here (None without lanes)."""
        return self.member.record.version if self.member.lanes is not None else None

    @property
    def sent(self) -> int:
        """The highest version this worker was ever sent, by one sender or many."""
        return self.member.record.highest_version

    def connect(self, endpoints: Sequence[Sequence[Any]], slot: int, timeout_s: float) -> None:
        """Follow the lanes of the senders whose stores are at ``endpoints``, as member
        ``slot`` of each (dialled again only when either changed)."""
        self.member.follow(endpoints, slot, timeout_s)

    def leave(self, endpoints: Sequence[Sequence[Any]]) -> None:
        """The senders at ``endpoints`` left: let go of their lanes, unless lanes from other
        senders took their place."""
        self.member.leave(endpoints)

    def holds(self, digest: str) -> bool:
        return self.member.holds(digest)

    def check(self, call: LanePush) -> list[str]:
        """Rank 0's ``call``, its check alone (``Member.checked``, the senders' lanes followed
        first): what of the push this engine cannot take -- asked before ``push``, so that the
        engine pauses generation only for a push every worker takes."""
        lanes = self.member.follow_call(call)
        return self.member.checked(lanes.checks, call.check, self._problems, self._name(call.slot))

    def push(self, call: LanePush) -> int | None:
        """Rank 0's ``call`` in one step (over Ray, through ``VLLMEngine``): this worker's
        check and every lane at once (``Member.take``: refused on every lane where the check
        found problems), each tensor loaded as soon as every lane brought its blocks, in one
        reload (``Streamed``). Returns the version held."""
        name, senders = self._name(call.slot), len(call.endpoints)
        stream = Streamed(self._target, self.member.record.device, senders)
        take = self.member.take
        return self._streamed(
            stream,
            lambda: take(call, self._problems, lambda layout: self._into(layout, stream), name),
            name,
        )

    def answer(self, checks: Checks, slot: int, check: LaneCheck) -> None:
        """Answer ``check`` in rank 0's store as member ``slot`` (``Member.answer``): what of
        the push this engine cannot take -- told to by ``vllm serve``'s
        ``start_weight_update`` (``StoreLaneMember``)."""
        self.member.answer(checks, slot, check, self._problems, self._name(slot))

    def receive(self, push: int, version: int, wait_s: float, name: str) -> int:
        """Take push ``push`` (of ``version``) on every lane at once, each tensor loaded as
        soon as every lane brought its blocks, in one reload; the version held here, else
        raises (and this worker holds none where bytes reached the engine). ``name`` names
        this worker in errors."""
        layout = self.member.layout
        assert layout is not None, "connect and check first"
        stream = Streamed(self._target, self.member.record.device, layout.senders)
        assembly = self._into(layout, stream)
        held = self._streamed(
            stream, lambda: self.member.receive(assembly, push, version, wait_s, name), name
        )
        assert held == version, (held, version)
        return held

    def _problems(self, layout: BlockLayout) -> list[str]:
        replicas = self._target.data_parallel_size
        if replicas > 1:  # slots are counted per engine core; its replicas' workers would clash
            why = f"a data-parallel engine (data_parallel_size={replicas}) cannot take a push"
            return [f"{why} from many senders yet: start one server or engine per replica"]
        held = self.member.record.version
        key = (layout.digest, held is None)
        if self._found is None or self._found[0] != key:
            # vLLM's loader takes whole checkpoint tensors: the layout's, whole.
            self._found = key, check_layout(layout, self._target.check, held)
        return list(self._found[1])

    @staticmethod
    def _into(layout: BlockLayout, stream: Streamed) -> Assembly:
        # The reload may hold a layer's tensors until the layer is complete (``keeps``).
        return Assembly(layout, None, stream.load, keeps=True)

    def _streamed(self, stream: Streamed, take: Callable[[], int | None], name: str) -> int | None:
        """``take`` the push into ``stream``, then finish its reload; where the push fails, the
        reload is left as a failed push leaves it. Where the lanes committed but the reload
        failed, this worker holds no version either."""
        try:
            held = take()
        except BaseException:
            stream.abort()
            raise
        try:
            stream.close()
        except Exception as exc:
            why = f"{name} received every lane but its engine did not load them: {first_line(exc)}"
            lanes = self.member.lanes
            assert lanes is not None, "the lanes just committed"
            lanes.lost(why)
            raise WeightSyncError(why) from exc
        return held

    @staticmethod
    def _name(slot: int) -> str:
        return f"vLLM worker {slot - 1}"

    def close(self) -> None:
        self.member.close()


class StoreLaneMember:
    """A ``LaneMember`` driven by ``ClientLanes`` (vLLM's weight-transfer API, inside the
    weight_sync backend): it takes a slot in rank 0's
    store (``address``, ``port``), says there the highest version this worker was sent and its
    server (``server_url``), follows every sender's lane (``lanes``: their stores), and answers
    each check in that store."""

    def __init__(
        self,
        address: str,
        port: int,
        epoch: int,
        lanes: Sequence[Sequence[Any]],
        timeout_s: float,
        member: LaneMember,
        server_url: str = "",
    ) -> None:
        self._store = dist.PrefixStore(VERDICTS, open_store(address, port, 1, timeout_s, None))
        self._checks = Checks(self._store)
        self.slot = int(self._store.add(f"{SLOTS}{epoch}", 1))
        joined = {"sent": member.sent, "server": server_url}
        self._store.set(f"{SENT}{epoch}/{self.slot}", json.dumps(joined))
        member.connect(lanes, self.slot, timeout_s)
        self.member = member

    # Neither step raises: each answers in rank 0's store (why: backend._answered).

    def check(self) -> None:
        """``start_weight_update``: answer rank 0 with what of the push this engine cannot
        take (empty: all of it; a check that failed is one problem). A request it cannot read
        goes unanswered: rank 0 stops waiting at its store's timeout."""
        try:
            check = LaneCheck.model_validate_json(read_bounded(self._store, CHECK, CHECK_BYTES))
        except Exception as exc:
            logger.error("%s cannot read the push to check: %s", self.name, exc)
            return
        self.member.answer(self._checks, self.slot, check)

    def receive(self, push: int, version: int, wait_s: float) -> None:
        """``update_weights``: see ``LaneMember.receive``; how it ended, in rank 0's store."""
        try:
            outcome: dict[str, Any] = {
                "version": self.member.receive(push, version, wait_s, self.name)
            }
        except Exception as exc:
            logger.warning("push %d: %s", push, exc)
            outcome = {"error": first_line(exc)}
        self._store.set(f"{LANDED}{push}/{self.slot}", json.dumps(outcome))

    @property
    def name(self) -> str:
        return f"vLLM worker {self.slot - 1}"

    def close(self) -> None:
        self.member.close()
