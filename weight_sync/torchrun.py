"""The ranks of one launched job -- ``torchrun``, ``mpirun``, ``mp.spawn`` -- as a sync group, no Ray.

The textbook shape: N processes started by a launcher, rank 0 training, ranks 1..N-1 serving,
rank 0 broadcasting fresh weights to the others over a group made with ``new_group`` beside the
job's default group. Every rank makes a ``JobSync`` at the same point (a collective), then calls
``update(model)`` once per push::

    sync = JobSync(SyncConfig())          # reads the launcher's environment if need be
    for step in range(steps):
        if sync.rank == 0:
            train_step(model)
        version = sync.update(model)      # rank 0 pushes model.state_dict(), the others receive
    sync.close()

It is the same push as ``WeightUpdater``'s -- ``weight_sync.protocol`` over the store-backed plane
of ``weight_sync.store_plane`` -- so the checks before any byte moves, versions that never repeat,
two-phase commit, bounded waits and typed errors are the same: rank 0's ``push`` raises what
``WeightUpdater.push`` raises, and every other rank's ``receive`` raises a ``WeightSyncError`` when
the push did not commit there (``PlanMismatchError`` when this rank refused it).

The control plane: rank 0 listens on a store of its own (``SyncConfig.master_addr`` or
``interface``: loopback unless named, so a job across nodes must name rank 0's address) and tells
the ranks where with one broadcast over the default group; each step of a push is then a command
in that store, which every rank reads in order and answers. Bytes travel over the dedicated group
(``group_mode='job'``: ``new_group`` over the default group, Gloo; an NCCL push stands alone, see
``transport.torch_group``). Ranks are the job's ranks: rank r of the job is rank r of the group.

Several senders (``JobSync(senders=K)``: ranks ``0..K-1`` a sharded trainer, every one pushing
its own shards; see docs/many-senders.md): each sender is the above on a lane of its own -- its
store, its ``Pusher``, a standalone group with the receiving ranks -- and each receiving rank
runs one ``Receiver`` per lane, on a thread each, placing the lanes' blocks in its model
(``receive.assembly``). Around the lanes, every rank agrees before any byte moves (a gather of
fixed-size rows over a Gloo group of the job: each sender's checks, version and layout digest;
the layout itself to receiving ranks that lack it; their refusals), and after them rank 0 judges
the senders' reports in its store; a receiving rank holds a version only once every lane
committed it there.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from pydantic import ValidationError
from typing_extensions import Self

from weight_sync.blocks import BlockLayout
from weight_sync.config import SyncConfig
from weight_sync.deadline import Deadline
from weight_sync.devices import CPU, module_device
from weight_sync.errors import (
    PlanMismatchError,
    SenderFailedError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
    first_line,
)
from weight_sync.protocol import Pusher
from weight_sync.receive.assembly import Assembly, agreed
from weight_sync.receiver import Loader, Receiver, expecting
from weight_sync.result import PushResult
from weight_sync.send.checks import StateDict, check_state_dict
from weight_sync.send.lanes import lane_of, layout_of
from weight_sync.send.sharded import control_device
from weight_sync.store_plane import MAX_REPLY_CHARS, PREFIX, ClientPlane, StoreMember
from weight_sync.transport.rendezvous import open_store
from weight_sync.versions import check_version

__all__ = ["JobSync", "LaunchEnv", "launch_env"]

logger = logging.getLogger(__name__)

_COMMAND = "cmd/"  # + sequence number: the n-th step rank 0 asked of every rank
_CLOSE = "close"
_ENDPOINT_BYTES = 256  # rank 0's store address, as JSON, in one fixed-size broadcast
_LONGEST_WAIT_S = 86400.0  # one store wait; a longer push_timeout_s waits again
_LINGER_S = 1.0  # rank 0 keeps its store this long after posting close
_LANES = "lanes/"  # + push/rank: how each sender's lane ended; + push/verdict: rank 0's verdict


@dataclass(frozen=True)
class LaunchEnv:
    """Who this process is in a launched job, as its launcher says."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "torchrun" or "mpirun"


def launch_env(environ: Mapping[str, str]) -> LaunchEnv | None:
    """Read the launcher's variables: torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) or
    Open MPI's (``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``); None where neither is
    set (``mp.spawn`` sets none: its processes make their default group themselves)."""
    for launcher, prefix in (("torchrun", ""), ("mpirun", "OMPI_COMM_WORLD_")):
        rank, size = (
            environ.get(f"{prefix}RANK"),
            environ.get(f"{prefix}SIZE" if prefix else "WORLD_SIZE"),
        )
        if rank is None and size is None:
            continue
        try:
            parsed = LaunchEnv(
                int(rank or ""),
                int(size or ""),
                int(environ.get(f"{prefix}LOCAL_RANK", "0")),
                launcher,
            )
        except ValueError:
            raise ValueError(
                f"{launcher}'s variables {prefix or ''}RANK={rank!r} and "
                f"{prefix + 'SIZE' if prefix else 'WORLD_SIZE'}={size!r} must both be integers"
            ) from None
        if not 0 <= parsed.rank < parsed.world_size:
            raise ValueError(f"rank {parsed.rank} is outside a world of {parsed.world_size}")
        return parsed
    return None


class JobSync:
    """This rank's end of the job's pushes; see the module doc.

    Made on every rank at once (it shares the senders' addresses over the default group). If
    the process has no default group yet, one is made from the launcher's variables (Gloo,
    ``init_method``: ``env://`` by default, which needs ``MASTER_ADDR``/``MASTER_PORT``: torchrun
    sets them, mpirun users export them with ``-x``; or a ``file://`` path every rank shares).

    ``senders``: how many ranks send, ranks ``0..senders-1``. One (the default): rank 0 pushes
    its state dict whole. More: the ranks of a sharded trainer (FSDP2, tensor parallel), each
    pushing the blocks of its own shards at once over a lane of its own; see the module doc.
    """

    def __init__(
        self,
        config: SyncConfig | None = None,
        *,
        senders: int = 1,
        init_method: str | None = None,
    ) -> None:
        if config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig, got {type(config).__name__}")
        if not isinstance(senders, int) or isinstance(senders, bool) or senders < 1:
            raise ValueError(f"senders must be an int >= 1 (the trainer's ranks), got {senders!r}")
        config = config or SyncConfig()
        if "same_host" in config.model_fields_set and config.same_host != "group":
            raise ValueError(
                "JobSync pushes over the job's own groups, every receiving rank a member: "
                f"same_host={config.same_host!r} would take some ranks out of them; leave it unset"
            )
        # One sender: new_group over the job's world, unless the config asks for a group of its
        # own rendezvous ("standalone": members on one host then take the push from one of them,
        # see SyncConfig.relay). Several: a group per lane, each standalone (new_group is
        # collective over the world, and the lanes form at once).
        mode = "job" if senders == 1 else "standalone"
        if "group_mode" in config.model_fields_set and config.group_mode != mode:
            if config.group_mode != "standalone":
                raise ValueError(
                    f"JobSync pushes over a group made with new_group ('job') or of its own "
                    f"('standalone'), not group_mode={config.group_mode!r}"
                    + (" (several senders need 'standalone')" if senders > 1 else "")
                )
            mode = "standalone"
        self.config = config.model_copy(update={"group_mode": mode, "same_host": "group"})
        self.senders = senders
        self._out: _Outbound | None = None
        self._lanes: list[_Inbound] = []
        self._control: dist.ProcessGroup | None = None  # several senders: every rank, Gloo
        self._verdicts: Any = None  # several senders: rank 0's store, where they report
        self._pushes = 0  # pushes begun (every rank, with several senders)
        self._layout: BlockLayout | None = None  # a receiving rank's, with several senders
        self._committed = 0  # a sender's, with several: the last push every lane committed
        self._held: int | None = None  # a receiver's, with several: what every lane committed
        self._closed = False
        self._device = CPU  # where this rank's model lives: set by each receive
        self.last_result: PushResult | None = None
        self._owns_world = _ensure_world(config, init_method)
        try:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            if self.world_size <= senders:
                raise ValueError(
                    f"a job of {self.world_size} ranks, {senders} of them sending, has nobody to "
                    "push to: launch more ranks, or name fewer senders"
                )
            if self.rank < senders:
                self._out = _Outbound(self.config, self.world_size - senders)
            endpoints = _share_endpoints(self._out.address if self._out else None, senders)
            if self.rank >= senders:
                self._lanes = [
                    _Inbound(
                        self.config, address, port, self.rank - senders + 1, lambda: self._device
                    )
                    for address, port in endpoints
                ]
            if senders > 1:
                self._control = dist.new_group(backend="gloo", timeout=_timeout(self.config))
                if self.rank < senders:
                    store = open_store(*endpoints[0], 1, self.config.rendezvous_timeout_s, None)
                else:
                    store = self._lanes[0].raw_store
                self._verdicts = dist.PrefixStore(_LANES, store)
        except BaseException:
            self.close()
            raise

    # -- every rank ----------------------------------------------------------------------------

    @property
    def is_sender(self) -> bool:
        return self.rank < self.senders

    def update(
        self, model: torch.nn.Module, timeout_s: float | None = None, version: int | None = None
    ) -> int:
        """One push: the senders send ``model.state_dict()`` (with several senders, each its
        own shards of it), every other rank receives into its ``model`` (same names, shapes,
        dtypes: whole tensors). Returns the version now held, on every rank. ``version`` (read
        on the senders only): as ``WeightUpdater.push`` -- an RL loop's step, past every
        version a rank holds or was sent, or refused before anything is sent."""
        if self.is_sender:
            return self.push(model.state_dict(), version=version).version
        return self.receive(model, timeout_s=timeout_s)

    @property
    def version(self) -> int | None:
        """The version this rank holds (a sender: the last one every rank committed); None
        before the first push, while this rank's weights are part-way through one, and once
        closed."""
        if self._out is not None:
            return (self._out.pusher.version if self.senders == 1 else self._committed) or None
        if self.senders == 1:
            return self._lanes[0].member.receiver.version if self._lanes else None
        return self._held if self._lanes else None

    def close(self) -> None:
        """Leave. On a sender the other ranks' next ``receive`` raises; the default group is
        destroyed only if ``JobSync`` made it. Idempotent."""
        self._closed = True
        out, self._out = self._out, None
        if out is not None:
            out.close()
        for lane in self._lanes:
            lane.member.shutdown()
        self._lanes, self._verdicts = [], None
        if self._owns_world and dist.is_initialized():
            self._owns_world = False
            dist.destroy_process_group()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the senders ---------------------------------------------------------------------------

    def push(self, state_dict: StateDict, **options: Any) -> PushResult:
        """A sender: send ``state_dict`` to every receiving rank (``options``: those of
        ``WeightUpdater.push``); the others call ``receive`` meanwhile. With several senders,
        every sender calls it at once with its own shards of the same state dict, and each
        returns once every lane committed (``SenderFailedError`` naming the senders that did
        not, when one failed or died).

        Every push is framed by a ``begin`` and an ``end`` command, whatever happens in between
        (a refusal, a state dict refused here before anything was sent, a failure part-way): a
        receiving rank's ``receive`` ends with the push, and skips what is left of one it gave
        up on."""
        if self._closed:
            raise WeightSyncError("this JobSync is closed; make a new one on every rank")
        if self._out is None:
            raise ValueError(
                f"rank {self.rank} receives: only ranks 0..{self.senders - 1} push (call receive)"
            )
        if self.senders == 1:
            self.last_result = self._out.push(state_dict, options)
            return self.last_result
        started = time.monotonic()
        self._pushes += 1
        lane, version = self._agree_as_sender(state_dict, options)
        if not lane:  # the layout gives this rank no block: its lane stays idle
            result = PushResult(version, 0, 0, 0.0)
        else:
            try:
                result = self._out.push(lane, {"version": version})
            except Exception as exc:
                try:
                    self._report({"error": first_line(exc)}, started)
                except WeightSyncError as verdict:  # this rank's own error says more
                    logger.debug("push %d failed: %s", self._pushes, verdict)
                raise
        landed = {"nbytes": result.nbytes, "buckets": result.buckets, "wire": result.wire_bytes}
        self.last_result = self._report(landed, started, result)
        return self.last_result

    # -- every other rank ----------------------------------------------------------------------

    def receive(
        self,
        model: torch.nn.Module | None = None,
        *,
        load_weights: Any = None,
        timeout_s: float | None = None,
    ) -> int:
        """Take one push into ``model`` (its state dict: checked against the push before any
        byte moves, written in place), or hand it to ``load_weights`` (an iterable of ``(name,
        tensor)`` per bucket, tensors valid during the call; accepts any names).

        Waits at most ``timeout_s`` (default ``push_timeout_s``) for the push to begin, and as
        long again, between steps, for it to end (a step under way is bounded by the group's
        own timeouts). Returns the version committed; raises a ``WeightSyncError`` when the
        push did not commit here (this rank then reports no version, unless the push was
        refused before any byte moved). With several senders, it holds a version only once
        every sender's lane committed it here (``SenderFailedError`` naming the senders whose
        lanes did not)."""
        if self._closed:
            raise WeightSyncError("this JobSync is closed; make a new one on every rank")
        if not self._lanes:
            raise ValueError("the senders push: call push (or update) there")
        if (model is None) == (load_weights is None):
            raise ValueError("pass a model, or a load_weights callable, not both")
        self._device = module_device(model) if model is not None else CPU
        wait_s = timeout_s if timeout_s is not None else self.config.push_timeout_s
        if self.senders == 1:
            self._lanes[0].member.retarget(*_target(model, load_weights))
            return self._lanes[0].receive(wait_s)
        self._pushes += 1
        assembly = self._agree_as_receiver(model, load_weights)
        # Only the senders the layout gives blocks to push; the others' lanes stay idle.
        active = {s: lane for s, lane in enumerate(self._lanes) if assembly.layout.sent_by(s)}
        for sender, lane in active.items():
            lane.member.retarget(
                assembly.check(sender),
                functools.partial(_loader, assembly, sender),
                functools.partial(assembly.destinations, sender),
            )
        self._held = None  # from the first byte: the lanes land apart
        with ThreadPoolExecutor(len(active), thread_name_prefix="weight-sync-lane") as pool:
            calls = {s: pool.submit(lane.receive, wait_s) for s, lane in active.items()}
            outcomes = {s: _outcome(call) for s, call in calls.items()}
        failed = {s: error for s, (_, error) in outcomes.items() if error is not None}
        for sender, error in failed.items():
            if sender and self._lanes[sender].sender_gone:  # tell rank 0 now, not at its deadline
                self._report_for(sender, error)
        if failed:
            assembly.forget()
            if len(failed) == len(outcomes) and len({str(e) for e in failed.values()}) == 1:
                raise next(iter(failed.values()))  # the same on every lane: refused, called off
            raise SenderFailedError(
                f"rank {self.rank} holds no version: the lanes of trainer ranks {sorted(failed)} "
                "did not commit here -- "
                + "; ".join(f"rank {s}: {first_line(e)}" for s, e in failed.items()),
                sorted(failed),
            )
        versions = [version for version, _ in outcomes.values()]
        self._held = agreed(versions)
        if self._held is None:
            raise SenderFailedError(f"the lanes committed different versions: {versions}")
        return self._held

    # -- several senders: agreeing before any byte moves, reporting after ------------------------

    def _agree_as_sender(
        self, state_dict: StateDict, options: Mapping[str, Any]
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Every rank at once, before any lane moves a byte: the senders' layouts are one, each
        sender's share passes its checks, the version is past every sender's, and every
        receiving rank can take the layout. Any failure raises on every rank, nothing sent."""
        assert self._out is not None
        error: Exception | None = None
        lane: dict[str, torch.Tensor] = {}
        layout: BlockLayout | None = None
        named = options.get("version")
        try:
            unknown = set(options) - {"version"}
            if unknown:
                raise ValueError(
                    f"a push from many senders takes no {sorted(unknown)} yet: it sends the "
                    "blocks of every tensor as named in the state dict"
                )
            check_version(named)
            entries = list(state_dict.items() if isinstance(state_dict, Mapping) else state_dict)
            layout = layout_of(entries, range(self.senders))
            if len(layout.wire) > self.config.max_metadata_bytes:
                raise ValueError(
                    f"the push's layout ({len(layout.blocks)} blocks) is over max_metadata_bytes="
                    f"{self.config.max_metadata_bytes}; raise it in SyncConfig on every rank"
                )
            lane = lane_of(entries, layout, self.rank)
            check_state_dict(lane, self.config)
        except (TypeError, ValueError) as exc:
            error, named = exc, None
        proposal = max(named or 0, self._out.pusher.next_version)
        digest = bytes.fromhex(layout.digest) if layout is not None else bytes(32)
        rows = self._gather([int(error is not None), proposal, named or 0], digest)
        reason = _called_off(rows[: self.senders])
        if reason is None and layout is not None and self._lacks_layout(rows):
            self._send_layout(layout if self.rank == 0 else None)
        refusals = self._gather_refusals([])
        if error is not None:
            raise error
        if reason is not None:
            raise ValueError(f"{reason}; nothing was sent")
        if refusals:
            raise PlanMismatchError(
                {r - self.senders: ["refused the push's layout (see that rank)"] for r in refusals}
            )
        return lane, max(row[1] for row in rows[: self.senders])

    def _agree_as_receiver(self, model: torch.nn.Module | None, load_weights: Any) -> Assembly:
        """A receiving rank's half of ``_agree_as_sender``: the layout (from rank 0, when this
        rank lacks it), checked against its model."""
        held = bytes.fromhex(self._layout.digest) if self._layout else bytes(32)
        rows = self._gather([0, 0, 0], held)
        reason = _called_off(rows[: self.senders])
        problems: list[str] = []
        assembly = None
        if reason is None:
            try:
                if self._lacks_layout(rows):
                    self._layout = self._send_layout(None)
                assert self._layout is not None
                target = model.state_dict(keep_vars=True) if model is not None else None
                assembly = Assembly(self._layout, target, load_weights if target is None else None)
                problems = assembly.problems()
            except WeightSyncError as exc:  # a layout this rank cannot read: refused here
                problems = [str(exc)]
        refusals = self._gather_refusals(problems)
        if reason is not None:
            raise WeightSyncError(f"the senders called the push off ({reason}); nothing changed")
        if problems:
            raise PlanMismatchError({self.rank - self.senders: problems})
        if refusals:
            raise WeightSyncError(
                f"ranks {refusals} refused the push before any byte moved; nothing changed here"
            )
        assert assembly is not None
        return assembly

    def _lacks_layout(self, rows: list[tuple[int, ...]]) -> bool:
        """Whether a receiving rank holds another layout than the senders' (then rank 0 sends
        it): the same answer on every rank, from the same rows."""
        return any(row[3:] != rows[0][3:] for row in rows[self.senders :])

    def _gather(self, values: list[int], digest: bytes) -> list[tuple[int, ...]]:
        """Every rank's ``values`` and layout digest, on every rank (fixed size: no pickle)."""
        mine = torch.tensor(values + list(struct.unpack("<4q", digest)), dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._collective(lambda: dist.all_gather(rows, mine, group=self._control))
        return [tuple(row.tolist()) for row in rows]

    def _gather_refusals(self, problems: list[str]) -> list[int]:
        """The receiving ranks that refused the layout (this one, if ``problems``)."""
        rows = self._gather([int(bool(problems)), 0, 0], bytes(32))
        return [r for r, row in enumerate(rows) if row[0] and r >= self.senders]

    def _send_layout(self, layout: BlockLayout | None) -> BlockLayout | None:
        """Rank 0's layout to every rank, as JSON (no pickle). Rank 0 refused a layout over its
        ``max_metadata_bytes`` before the push began; every rank takes both broadcasts before
        checking the size against its own (a rank leaving between them would hang the rest)."""
        raw = layout.wire.encode() if layout is not None else b""
        size = torch.tensor([len(raw)], dtype=torch.int64)
        self._collective(lambda: dist.broadcast(size, src=0, group=self._control))
        buffer = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else None
        if buffer is None:
            buffer = torch.empty(int(size), dtype=torch.uint8)
        self._collective(lambda: dist.broadcast(buffer, src=0, group=self._control))
        if layout is not None:
            return layout
        if int(size) > self.config.max_metadata_bytes:
            raise WeightSyncError(
                f"the push's layout is {int(size)} bytes, over max_metadata_bytes="
                f"{self.config.max_metadata_bytes} here; raise it in SyncConfig on every rank"
            )
        try:
            return BlockLayout.model_validate_json(bytes(buffer.tolist()))
        except ValidationError as exc:
            raise WeightSyncError(
                f"rank 0 sent a malformed layout: {exc.errors()[0]['msg']}"
            ) from exc

    def _collective(self, run: Callable[[], object]) -> None:
        try:
            run()
        except RuntimeError as exc:  # Gloo: a rank of the job died or left
            raise TransportError(
                f"rank {self.rank}: a rank of the job left before the push began "
                f"({first_line(exc)}); nothing was sent"
            ) from exc

    def _report(
        self, outcome: dict[str, Any], started: float, result: PushResult | None = None
    ) -> PushResult:
        """Every sender tells rank 0 how its lane ended; rank 0 says whether all committed.
        Returns the push's result (every lane's bytes), or raises ``SenderFailedError``."""
        store, push = self._verdicts, self._pushes
        deadline = Deadline(self.config.push_timeout_s, "the senders' reports", started)
        store.set(f"{push}/{self.rank}", json.dumps(outcome))
        if self.rank == 0:
            keys = [f"{push}/{rank}" for rank in range(self.senders)]
            try:
                store.wait(keys, datetime.timedelta(seconds=deadline.left(_LONGEST_WAIT_S)))
            except dist.DistStoreError:
                pass
            reports = {
                rank: json.loads(store.get(key)) if store.check([key]) else None
                for rank, key in enumerate(keys)
            }
            verdict = _verdict(reports)
            store.set(f"{push}/verdict", json.dumps(verdict))
        else:
            verdict = self._wait_verdict(f"{push}/verdict", deadline)
        if "failed" in verdict:
            raise SenderFailedError(verdict["failed"], verdict["senders"])
        assert result is not None
        self._committed = result.version
        return dataclasses.replace(
            result,
            nbytes=verdict["nbytes"],
            buckets=verdict["buckets"],
            wire_bytes=verdict["wire"],
            seconds=time.monotonic() - started,
        )

    def _report_for(self, sender: int, error: BaseException) -> None:
        """A receiving rank saw ``sender``'s store close mid-push: its process is gone, and it
        will never report. Said for it (unless it reported first), so that rank 0's verdict
        comes now rather than at the push's deadline."""
        why = f"its process is gone (its store closed on rank {self.rank}: {first_line(error)})"
        try:
            self._verdicts.compare_set(f"{self._pushes}/{sender}", "", json.dumps({"error": why}))
        except RuntimeError as exc:  # rank 0 is gone too: nobody to tell
            logger.debug("cannot report sender %d's death: %s", sender, exc)

    def _wait_verdict(self, key: str, deadline: Deadline) -> dict[str, Any]:
        try:
            self._verdicts.wait([key], datetime.timedelta(seconds=deadline.left(_LONGEST_WAIT_S)))
        except dist.DistStoreError as exc:
            raise SyncTimeoutError(
                f"rank 0 gave no verdict on push {self._pushes} in time"
            ) from exc
        except RuntimeError as exc:
            raise SenderFailedError(
                f"rank 0 died or left before its verdict ({first_line(exc)}); no receiving rank "
                "claims the push",
                [0],
            ) from exc
        return dict(json.loads(self._verdicts.get(key)))


class _Outbound:
    """A sender's lane: its commands in a store of its own, which its receiving ranks read,
    and the ``Pusher`` of its pushes."""

    def __init__(self, config: SyncConfig, receivers: int) -> None:
        self.commands = _Commands()
        self.plane = ClientPlane(self.commands, receivers, config)
        self.commands.plane = self.plane
        self.pusher = Pusher(self.plane, config)
        self._pushes = 0

    @property
    def address(self) -> tuple[str, int]:
        return self.plane.address

    def push(self, state_dict: StateDict, options: Mapping[str, Any]) -> PushResult:
        self._pushes += 1
        frame = {"push": self._pushes}
        self.commands.post("begin", frame)
        try:
            result = self.pusher.push(state_dict, **options)
        except BaseException as exc:
            self.commands.post("end", {**frame, "error": first_line(exc)})
            raise
        self.commands.post("end", {**frame, "version": result.version})
        return result

    def close(self) -> None:
        try:
            self.pusher.close()
            self.commands.post(_CLOSE, {})
        except Exception as exc:  # leaving must not fail over a peer already gone
            logger.warning("closing the job's sync: %s", exc)
        finally:
            # The store lingers a moment: ranks polling read the close, not its absence.
            timer = threading.Timer(_LINGER_S, self.plane.close)
            timer.daemon = True
            timer.start()


class _Inbound:
    """A receiving rank's lane from one sender: that sender's commands, read in order, and the
    ``Receiver`` that takes its pushes."""

    def __init__(
        self,
        config: SyncConfig,
        address: str,
        port: int,
        slot: int,
        device: Callable[[], torch.device],
    ) -> None:
        self.slot = slot
        self.raw_store = open_store(address, port, 1, config.rendezvous_timeout_s, None)
        self.store = dist.PrefixStore(PREFIX, self.raw_store)
        self.sender_gone = False  # its store closed: the sender's process died or left
        self.member = StoreMember(
            Receiver(device), expecting(lambda: None), lambda: Loader(_refuse)
        )
        self._next = 0  # the next command's number

    def receive(self, wait_s: float) -> int:
        """Take one push of this lane; see ``JobSync.receive``."""
        deadline = Deadline(wait_s, "waiting for the sender's push")
        began = False
        committed: int | None = None
        failure: WeightSyncError | None = None
        while True:
            op, arg = self._command(deadline, failure)
            if op == _CLOSE:
                raise WeightSyncError("the sender closed its JobSync: no more pushes will come")
            if not began:  # steps left of a push this rank gave up on are skipped
                if op == "begin":
                    began, deadline = True, Deadline(wait_s, "the sender's push")
                continue
            if op == "end":
                return self._ended(arg, committed, failure)
            try:
                committed = self._step(op, arg) or committed
            except Exception as exc:  # answered to the sender already; its verdict follows
                failure = (
                    exc
                    if isinstance(exc, WeightSyncError)
                    else TransportError(f"member {self.slot}: {op} failed: {first_line(exc)}")
                )

    def _step(self, op: str, arg: dict[str, Any]) -> int | None:
        """Run one step of the sender's push; returns the version when it committed here."""
        member = self.member
        if op == "init":
            member.init(**arg, slot=self.slot)
        elif op == "start":
            member.start()
        elif op == "update":
            member.receive(int(arg["version"]))
        elif op == "finish":
            version = member.pushing
            if member.finish():
                return version
        elif op == "shutdown":
            member.shutdown()
        return None

    def _ended(
        self, arg: dict[str, Any], committed: int | None, failure: WeightSyncError | None
    ) -> int:
        """The push is over on the sender: ``arg`` says how it ended there."""
        member = self.member
        if member.pushing is not None:  # no verdict reached this rank: drop what it prepared
            member.receiver.cancel(member.pushing)
            member.pushing = None
        if committed is not None:  # this rank holds it, whatever failed elsewhere afterwards
            return committed
        if member.prepared is not None and not member.prepared.accepted:
            raise PlanMismatchError({self.slot - 1: member.prepared.problems})
        if failure is not None:
            raise failure
        raise WeightSyncError(
            f"the sender's push was called off ({arg.get('error', 'see its error')}); nothing "
            "committed here"
        )

    def _command(
        self, deadline: Deadline, failure: WeightSyncError | None
    ) -> tuple[str, dict[str, Any]]:
        """The next step the sender asks for, waiting within ``deadline``.

        One blocking ``TCPStore.wait`` rather than a poll: the store answers the moment the
        sender posts the key (about 0.2 ms on a loaded 2-core VM; a poll's pause was 2-50 ms per
        step of every push), and a dead sender closes the connection, which ends the wait at
        once. It is not sliced: each wait that times out makes c10d log two warnings, so only
        the last one, at the deadline, may."""
        key = f"{_COMMAND}{self._next}"
        while True:
            wait = datetime.timedelta(seconds=deadline.left(_LONGEST_WAIT_S))  # raises once spent
            try:
                self.store.wait([key], wait)
                raw = self.store.get(key).decode()
                break
            except dist.DistStoreError:
                continue  # timed out: the next ``left`` raises if the deadline is spent
            except RuntimeError as exc:  # DistNetworkError: the store's process is gone
                self.sender_gone = True
                if failure is not None:
                    raise failure from None  # what this rank saw first: the sender left mid-push
                raise TransportError(
                    f"the sender's store stopped answering ({first_line(exc)}); it died or left "
                    "-- check it"
                ) from exc
        self._next += 1
        if len(raw) > MAX_REPLY_CHARS:
            raise WeightSyncError(f"a command of {len(raw)} bytes exceeds {MAX_REPLY_CHARS}")
        command = json.loads(raw)
        return str(command["op"]), dict(command["arg"])


class _Commands:
    """Rank 0's ``Client``: each call of a push becomes the next command in its store, which every
    other rank reads in order; their answers come back through ``ClientPlane``'s mailbox. Posted
    through the plane itself, so that commands and the protocol's messages keep one order; the
    plane calls a client from several threads, hence the lock."""

    def __init__(self) -> None:
        self.plane: ClientPlane | None = None  # the plane this client serves: set once it exists
        self._next = 0
        self._lock = threading.Lock()

    def post(self, op: str, arg: dict[str, Any]) -> None:
        assert self.plane is not None, "the plane comes first"
        with self._lock:
            self.plane.post(f"{_COMMAND}{self._next}", json.dumps({"op": op, "arg": arg}))
            self._next += 1

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post(
            "init",
            {
                k: init_info[k]
                for k in ("address", "port", "epoch", "timeout_s", "max_metadata_bytes")
            },
        )

    def start_weight_update(self) -> None:
        self.post("start", {})

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.post("update", {"version": int(update_info["version"])})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.post("finish", {})

    def shutdown_weight_transfer_engine(self) -> None:
        self.post("shutdown", {})


def _ensure_world(config: SyncConfig, init_method: str | None) -> bool:
    """Make the default group from the launcher's variables unless there is one; returns
    whether it was made here."""
    if dist.is_initialized():
        return False
    env = launch_env(os.environ)
    if env is None:
        raise ValueError(
            "no torch.distributed default group and no launcher variables (RANK/WORLD_SIZE from "
            "torchrun, OMPI_COMM_WORLD_RANK/_SIZE from mpirun): launch with one of those, or call "
            "init_process_group first (as mp.spawn's processes do)"
        )
    if init_method is None and not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        raise ValueError(
            f"{env.launcher} gave no MASTER_ADDR/MASTER_PORT: export them to every rank "
            "(mpirun -x MASTER_ADDR=... -x MASTER_PORT=...) or pass init_method='file:///shared/path'"
        )
    dist.init_process_group(
        "gloo",
        init_method=init_method or "env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=config.rendezvous_timeout_s),
    )
    return True


def _share_endpoints(endpoint: tuple[str, int] | None, senders: int) -> list[tuple[str, int]]:
    """The senders' store addresses, on every rank: each rank gives its own (a sender) or None,
    all gathered over the default group (no pickle: JSON in byte tensors of fixed size)."""
    device = control_device(None)
    mine = torch.zeros(_ENDPOINT_BYTES, dtype=torch.uint8, device=device)
    if endpoint is not None:
        raw = json.dumps(list(endpoint)).encode()
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    endpoints = []
    for row in rows[:senders]:
        address, port = json.loads(bytes(row.cpu().tolist()).rstrip(b"\0").decode())
        endpoints.append((str(address), int(port)))
    return endpoints


def _timeout(config: SyncConfig) -> datetime.timedelta:
    return datetime.timedelta(seconds=config.push_timeout_s)


def _called_off(senders: list[tuple[int, ...]]) -> str | None:
    """Why a push from many senders is called off before any byte moves, from every sender's
    row of ``JobSync._gather`` (refused, proposed version, named version, layout digest): the
    same answer on every rank. None: it goes ahead."""
    refused = [rank for rank, row in enumerate(senders) if row[0]]
    if refused:
        return f"trainer rank(s) {refused} refused their shards (see their errors)"
    if len({row[3:] for row in senders}) > 1:
        return (
            "the trainer ranks' state dicts differ (names, dtypes, shapes or placements): every "
            "sender must push the same model's state_dict()"
        )
    version, named = max(row[1] for row in senders), {row[2] for row in senders}
    if len(named) > 1 or named - {0, version}:
        return (
            f"the senders named versions {sorted(named)}; they must all name one version, past "
            f"every sender's ({version})"
        )
    return None


def _loader(assembly: Assembly, sender: int) -> Loader:
    return Loader(assembly.loader(sender))


def _outcome(call: Future[int]) -> tuple[int | None, BaseException | None]:
    try:
        return call.result(), None
    except Exception as exc:
        return None, exc


def _verdict(reports: Mapping[int, dict[str, Any] | None]) -> dict[str, Any]:
    """Rank 0's verdict on a push from many senders, from every sender's report (None: it
    sent none in time -- it died or hung)."""
    failed = {
        rank: "sent no report: it died or hung -- check it" if report is None else report["error"]
        for rank, report in reports.items()
        if report is None or "error" in report
    }
    if failed:
        return {
            "failed": "no receiving rank claims the push: trainer ranks "
            f"{sorted(failed)} did not land their lanes -- "
            + "; ".join(f"rank {rank}: {why}" for rank, why in failed.items()),
            "senders": sorted(failed),
        }
    landed = [report for report in reports.values() if report is not None]
    return {key: sum(report[key] for report in landed) for key in ("nbytes", "buckets", "wire")}


def _target(model: torch.nn.Module | None, load_weights: Any) -> tuple[Any, Any, Any]:
    """(check, loader, destinations) for a push into ``model``, or through ``load_weights``."""
    if model is None:
        return expecting(lambda: None), lambda: Loader(load_weights), lambda: None
    destinations = model.state_dict(keep_vars=True)

    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                destinations[name].copy_(tensor)

    return expecting(lambda: destinations), lambda: Loader(load), lambda: destinations


def _refuse(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    raise AssertionError("receive() sets the target before any push")
