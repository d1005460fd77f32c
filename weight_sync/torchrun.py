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
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import Self

from weight_sync.config import SyncConfig
from weight_sync.deadline import Deadline
from weight_sync.devices import CPU, module_device
from weight_sync.errors import PlanMismatchError, TransportError, WeightSyncError, first_line
from weight_sync.protocol import Pusher
from weight_sync.receiver import Loader, Receiver, expecting
from weight_sync.result import PushResult
from weight_sync.send.checks import StateDict
from weight_sync.send.sharded import control_device
from weight_sync.store_plane import MAX_REPLY_CHARS, PREFIX, ClientPlane, StoreMember
from weight_sync.transport.rendezvous import open_store

__all__ = ["JobSync", "LaunchEnv", "launch_env"]

logger = logging.getLogger(__name__)

_COMMAND = "cmd/"  # + sequence number: the n-th step rank 0 asked of every rank
_CLOSE = "close"
_ENDPOINT_BYTES = 256  # rank 0's store address, as JSON, in one fixed-size broadcast
_LONGEST_WAIT_S = 86400.0  # one store wait; a longer push_timeout_s waits again
_LINGER_S = 1.0  # rank 0 keeps its store this long after posting close


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

    Made on every rank at once (it broadcasts rank 0's address over the default group). If the
    process has no default group yet, one is made from the launcher's variables (Gloo,
    ``init_method``: ``env://`` by default, which needs ``MASTER_ADDR``/``MASTER_PORT``: torchrun
    sets them, mpirun users export them with ``-x``; or a ``file://`` path every rank shares).
    """

    def __init__(self, config: SyncConfig | None = None, *, init_method: str | None = None) -> None:
        if config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig, got {type(config).__name__}")
        config = config or SyncConfig()
        if "same_host" in config.model_fields_set and config.same_host != "group":
            raise ValueError(
                "JobSync pushes over the job's own new_group, every rank a member: "
                f"same_host={config.same_host!r} would take some ranks out of it; leave it unset"
            )
        self.config = config.model_copy(update={"group_mode": "job", "same_host": "group"})
        self._pusher: Pusher | None = None
        self._plane: ClientPlane | None = None
        self._commands: _Commands | None = None
        self._member: StoreMember | None = None
        self._store: Any = None  # the trainer's store: rank 0 posts commands, the others read
        self._next = 0  # the next command's number
        self._pushes = 0  # rank 0: pushes begun
        self._closed = False
        self._device = CPU  # where this rank's model lives: set by each receive
        self.last_result: PushResult | None = None
        self._owns_world = _ensure_world(config, init_method)
        try:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            if self.world_size < 2:
                raise ValueError("a job of one rank has nobody to push to: launch 2 or more ranks")
            if self.rank == 0:
                self._commands = _Commands()
                self._plane = ClientPlane(self._commands, self.world_size - 1, self.config)
                self._commands.plane = self._plane
                self._pusher = Pusher(self._plane, self.config)
            # Every rank at once: where rank 0's store listens.
            address, port = _share_endpoint(self._plane.address if self._plane else None)
            if self.rank != 0:
                store = open_store(address, port, 1, self.config.rendezvous_timeout_s, None)
                self._store = dist.PrefixStore(PREFIX, store)
                self._member = StoreMember(
                    Receiver(lambda: self._device), expecting(lambda: None), lambda: Loader(_refuse)
                )
        except BaseException:
            self.close()
            raise

    # -- every rank ----------------------------------------------------------------------------

    def update(
        self, model: torch.nn.Module, timeout_s: float | None = None, version: int | None = None
    ) -> int:
        """One push: rank 0 sends ``model.state_dict()``, every other rank receives into its
        ``model`` (same names, shapes, dtypes). Returns the version now held, on every rank.
        ``version`` (read on rank 0 only): as ``WeightUpdater.push`` -- an RL loop's step, past
        every version a rank holds or was sent, or refused before anything is sent."""
        if self.rank == 0:
            return self.push(model.state_dict(), version=version).version
        return self.receive(model, timeout_s=timeout_s)

    @property
    def version(self) -> int | None:
        """The version this rank holds (rank 0: the last one every rank committed); None before
        the first push, while this rank's weights are part-way through one, and once closed."""
        if self._pusher is not None:
            return self._pusher.version or None
        return self._member.receiver.version if self._member is not None else None

    def close(self) -> None:
        """Leave. On rank 0 the other ranks' next ``receive`` raises; the default group is
        destroyed only if ``JobSync`` made it. Idempotent."""
        self._closed = True
        pusher, plane, self._pusher, self._plane = self._pusher, self._plane, None, None
        try:
            if pusher is not None:
                pusher.close()
            if self._commands is not None:
                self._commands.post(_CLOSE, {})
        except Exception as exc:  # leaving must not fail over a peer already gone
            logger.warning("closing the job's sync: %s", exc)
        finally:
            if plane is not None:
                # The store lingers a moment: ranks polling read the close, not its absence.
                timer = threading.Timer(_LINGER_S, plane.close)
                timer.daemon = True
                timer.start()
            if self._member is not None:
                self._member.shutdown()
                self._member, self._store = None, None
            if self._owns_world and dist.is_initialized():
                self._owns_world = False
                dist.destroy_process_group()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- rank 0 --------------------------------------------------------------------------------

    def push(self, state_dict: StateDict, **options: Any) -> PushResult:
        """Rank 0: send ``state_dict`` to every other rank (``options``: those of
        ``WeightUpdater.push``); the others call ``receive`` meanwhile.

        Every push is framed by a ``begin`` and an ``end`` command, whatever happens in between
        (a refusal, a state dict refused here before anything was sent, a failure part-way): a
        receiving rank's ``receive`` ends with the push, and skips what is left of one it gave
        up on."""
        if self._closed:
            raise WeightSyncError("this JobSync is closed; make a new one on every rank")
        if self._pusher is None or self._commands is None:
            raise ValueError(f"rank {self.rank} receives: only rank 0 pushes (call receive)")
        self._pushes += 1
        frame = {"push": self._pushes}
        self._commands.post("begin", frame)
        try:
            self.last_result = self._pusher.push(state_dict, **options)
        except BaseException as exc:
            self._commands.post("end", {**frame, "error": first_line(exc)})
            raise
        self._commands.post("end", {**frame, "version": self.last_result.version})
        return self.last_result

    # -- every other rank ----------------------------------------------------------------------

    def receive(
        self,
        model: torch.nn.Module | None = None,
        *,
        load_weights: Any = None,
        timeout_s: float | None = None,
    ) -> int:
        """Take one push from rank 0 into ``model`` (its state dict: checked against the push
        before any byte moves, written in place), or hand it to ``load_weights`` (an iterable of
        ``(name, tensor)`` per bucket, tensors valid during the call; accepts any names).

        Waits at most ``timeout_s`` (default ``push_timeout_s``) for rank 0 to begin the push,
        and as long again, between steps, for it to end (a step under way is bounded by the
        group's own timeouts). Returns the version committed; raises a ``WeightSyncError`` when
        the push did not commit here (this rank then reports no version, unless the push was
        refused before any byte moved)."""
        if self._closed:
            raise WeightSyncError("this JobSync is closed; make a new one on every rank")
        if self._member is None:
            raise ValueError("rank 0 pushes: call push (or update) there")
        if (model is None) == (load_weights is None):
            raise ValueError("pass a model, or a load_weights callable, not both")
        self._member.retarget(*_target(model, load_weights))
        self._device = module_device(model) if model is not None else CPU
        wait_s = timeout_s if timeout_s is not None else self.config.push_timeout_s
        deadline = Deadline(wait_s, "waiting for rank 0's push")
        began = False
        committed: int | None = None
        failure: WeightSyncError | None = None
        while True:
            op, arg = self._command(deadline, failure)
            if op == _CLOSE:
                raise WeightSyncError("rank 0 closed its JobSync: no more pushes will come")
            if not began:  # steps left of a push this rank gave up on are skipped
                if op == "begin":
                    began, deadline = True, Deadline(wait_s, "rank 0's push")
                continue
            if op == "end":
                return self._ended(arg, committed, failure)
            try:
                committed = self._step(op, arg) or committed
            except Exception as exc:  # answered to rank 0 already; its verdict follows
                failure = (
                    exc
                    if isinstance(exc, WeightSyncError)
                    else TransportError(f"rank {self.rank}: {op} failed: {first_line(exc)}")
                )

    def _step(self, op: str, arg: dict[str, Any]) -> int | None:
        """Run one step of rank 0's push; returns the version when it committed here."""
        assert self._member is not None
        if op == "init":
            self._member.init(**arg, slot=self.rank)
        elif op == "start":
            self._member.start()
        elif op == "update":
            self._member.receive(int(arg["version"]))
        elif op == "finish":
            version = self._member.pushing
            if self._member.finish():
                return version
        elif op == "shutdown":
            self._member.shutdown()
        return None

    def _ended(
        self, arg: dict[str, Any], committed: int | None, failure: WeightSyncError | None
    ) -> int:
        """The push is over on rank 0: ``arg`` says how it ended there."""
        assert self._member is not None
        member = self._member
        if member.pushing is not None:  # no verdict reached this rank: drop what it prepared
            member.receiver.cancel(member.pushing)
            member.pushing = None
        if committed is not None:  # this rank holds it, whatever failed elsewhere afterwards
            return committed
        if member.prepared is not None and not member.prepared.accepted:
            raise PlanMismatchError({self.rank - 1: member.prepared.problems})
        if failure is not None:
            raise failure
        raise WeightSyncError(
            f"rank 0's push was called off ({arg.get('error', 'see its error')}); nothing "
            "committed here"
        )

    def _command(
        self, deadline: Deadline, failure: WeightSyncError | None
    ) -> tuple[str, dict[str, Any]]:
        """The next step rank 0 asks for, waiting within ``deadline``.

        One blocking ``TCPStore.wait`` rather than a poll: the store answers the moment rank 0
        posts the key (about 0.2 ms on a loaded 2-core VM; a poll's pause was 2-50 ms per step
        of every push), and a dead rank 0 closes the connection, which ends the wait at once.
        It is not sliced: each wait that times out makes c10d log two warnings, so only the
        last one, at the deadline, may."""
        key = f"{_COMMAND}{self._next}"
        while True:
            wait = datetime.timedelta(seconds=deadline.left(_LONGEST_WAIT_S))  # raises once spent
            try:
                self._store.wait([key], wait)
                raw = self._store.get(key).decode()
                break
            except dist.DistStoreError:
                continue  # timed out: the next ``left`` raises if the deadline is spent
            except RuntimeError as exc:  # DistNetworkError: the store's process is gone
                if failure is not None:
                    raise failure from None  # what this rank saw first: rank 0 left mid-push
                raise TransportError(
                    f"rank 0's store stopped answering ({first_line(exc)}); rank 0 died or left "
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


def _share_endpoint(endpoint: tuple[str, int] | None) -> tuple[str, int]:
    """Rank 0's store address, broadcast over the default group (no pickle: JSON in a byte
    tensor of fixed size). Rank 0 calls it with its endpoint; the others with None."""
    buffer = torch.zeros(_ENDPOINT_BYTES, dtype=torch.uint8, device=control_device(None))
    if endpoint is not None:
        raw = json.dumps(list(endpoint)).encode()
        buffer[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(buffer, src=0)
    address, port = json.loads(bytes(buffer.cpu().tolist()).rstrip(b"\0").decode())
    return str(address), int(port)


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
