"""weight_sync as a backend of vLLM's own weight-transfer API.

vLLM 0.32 lets a package register a weight-transfer engine; its own are NCCL, CUDA IPC and NIXL
only, with no CPU path, no timeouts and no way back from a failure part-way. With this backend a
user of vLLM's API gets weight_sync's push instead -- Gloo or NCCL, the check before any byte
moves, versions that never repeat, two-phase commit, bounded waits -- without calling
``WeightUpdater``::

    # inference: the backend registers itself in every vLLM process (a vLLM plugin)
    llm = LLM(model, weight_transfer_config={"backend": "weight_sync"})      # e.g. a Ray actor

    # trainer
    from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from weight_sync.adapters.vllm.backend import StateDictSource, WeightSyncTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(rank=0, world_size=1 + vllm_workers, config=SyncConfig()),
        client=RayVLLMWeightSyncClient(llm_actors), source=StateDictSource(model),
    )
    engine.send_weights()          # after every optimizer step; returns the PushResult

The push is the same protocol as ``WeightUpdater``'s (``weight_sync.send.pusher``) over a control
plane over a store, ``weight_sync.control.store.ClientPlane``: vLLM's client carries each round to every engine at once
(``init_weight_transfer_engine`` forms the group, ``start_weight_update`` prepares,
``update_weights`` receives, ``finish_weight_update`` commits or cancels, labelling the outputs
with the version), and since vLLM's client returns nothing, each worker answers through a small
store the trainer listens on (loopback unless ``SyncConfig`` names an address). Every vLLM worker
process is a member of its own: an engine with tensor parallelism 2 is two members.

What stays the caller's, as with vLLM's own engines: pausing generation and clearing the prefix
cache around a push (``pause_generation(clear_cache=True)`` / ``resume_generation`` on an
``AsyncLLM``; ``reset_prefix_cache()`` on an ``LLM``), and replacing an engine that died (vLLM's
client keeps calling every engine, so a dead one fails every push until it is replaced).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    materialize_full_tensor,
)
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from weight_sync.adapters.vllm.lanes import LaneMember, StoreLaneMember
from weight_sync.adapters.vllm.reload import ReloadTarget
from weight_sync.adapters.vllm.servers import release_server
from weight_sync.config import SyncConfig
from weight_sync.control.store import ClientPlane, StoreMember
from weight_sync.errors import first_line
from weight_sync.receive.receiver import Loader, Receiver
from weight_sync.result import PushResult
from weight_sync.send.pusher import Pusher
from weight_sync.transport.rendezvous import open_store

logger = logging.getLogger(__name__)

BACKEND = "weight_sync"
_WATCHDOG_KEY = "weight_sync/watchdog"  # never set: checking it only proves the store answers


def register() -> None:
    """Register the backend with vLLM (both sides). Idempotent; vLLM calls it in each of its
    processes through the ``vllm.general_plugins`` entry point, and importing this module
    calls it too."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, WeightSyncTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, WeightSyncTrainerEngine)


# -- the worker side: inside each vLLM worker process ----------------------------------------------


@dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):
    """Where the trainer's control store listens, and which group formation this is."""

    address: str
    port: int
    epoch: int
    timeout_s: float
    max_metadata_bytes: int
    # The worker's own server (``vllm serve``), where the trainer drives it over HTTP: if the
    # trainer dies, the worker's watchdog releases that server (see ``_Watchdog``).
    server_url: str | None = None
    # Every sender's store, where a sharded trainer pushes from each rank (``VLLMServers`` with
    # ``senders``): ``address``/``port`` are then rank 0's.
    lanes: list[list[Any]] | None = None


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    version: int
    push: int = 0  # with lanes: the push's number, and how long its lanes may take
    wait_s: float = 0.0


class WeightSyncTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    """One vLLM worker as a member of weight_sync pushes (see the module doc)."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._target = target = ReloadTarget(lambda: self.model, vllm_config)
        # vLLM's device for this worker, never a thread's; vLLM keeps a layer's tensors until the
        # layer is complete, so they must not be views into buffers a later bucket overwrites.
        self._member = StoreMember(
            Receiver(device), target.check, lambda: Loader(target.load, target.reload, keeps=True)
        )
        self._watchdog: _Watchdog | None = None
        self._lanes: StoreLaneMember | None = None  # pushed to by every rank of a sharded trainer
        self._session = False  # vLLM's update session is open (none of its steps raises here)

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        """Register with the trainer's control store, answer its probe, and join the group it
        then describes. Given its server's URL, watch the trainer from now until shutdown."""
        self._stop_watchdog()
        if init_info.server_url:  # from before the join: a trainer may die while it waits
            self._watchdog = _Watchdog(
                init_info.address,
                init_info.port,
                init_info.server_url,
                self._holds_version,
                lambda: self._session,
                releases=not dist.is_initialized() or dist.get_rank() == 0,
            )
        self._close_lanes()
        if init_info.lanes:
            lanes = init_info.lanes

            def follow() -> None:
                self._lanes = StoreLaneMember(
                    init_info.address,
                    init_info.port,
                    init_info.epoch,
                    lanes,
                    init_info.timeout_s,
                    LaneMember(self._target, self._member.receiver),
                    init_info.server_url or "",
                )

            _answered(follow, "join")
            return
        join = partial(
            self._member.init,
            init_info.address,
            init_info.port,
            init_info.epoch,
            init_info.timeout_s,
            init_info.max_metadata_bytes,
        )
        _answered(join, "join")

    def start_weight_update(self) -> None:
        _answered(self._lanes.check if self._lanes is not None else self._member.start, "check")
        self._session = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default synchronizes an accelerator, which a CPU worker does not have.
        self.receive_weights(self.parse_update_info(update_info))
        device = self._member.receiver.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        info, lanes = update_info, self._lanes
        if lanes is not None:
            _answered(partial(lanes.receive, info.push, info.version, info.wait_s), "receive")
        else:
            _answered(partial(self._member.receive, info.version), "receive")

    def finish_weight_update(self) -> None:
        self._session = False
        if self._lanes is not None:  # the lanes committed in update_weights: nothing is left
            return
        version = self._member.pushing
        gone = self._watchdog is not None and self._watchdog.fired.is_set()
        if not gone and _answered(self._member.finish, "commit"):
            return
        # The trainer died mid-push (a worker's watchdog released the server, which calls this)
        # or its verdict could not be read: none will come, and vLLM keeps its update session
        # open -- refusing every later trainer -- unless this returns. The push is dropped here.
        self._member.pushing = None
        if version is not None:
            _answered(partial(self._member.receiver.cancel, version), "drop")

    def shutdown(self) -> None:
        self._stop_watchdog()
        self._close_lanes()
        self._member.shutdown()

    def _holds_version(self) -> bool:
        """Whether the server's label names what this worker holds, for its watchdog. Over
        lanes the worker commits within ``update_weights``, before the trainer labels the
        version (``finish_weight_update``): while the update session is open, the label is
        not its own."""
        if self._lanes is not None:
            return self._lanes.member.held is not None and not self._session
        return self._member.receiver.version is not None

    def _close_lanes(self) -> None:
        lanes, self._lanes = self._lanes, None
        if lanes is not None:
            lanes.close()

    def _stop_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()


def _answered(step: Callable[[], object], what: str) -> bool:
    """Run one weight-transfer step (a join, a check, a receive, a commit) whose outcome the
    trainer reads in its store, never raising into vLLM. A server of several workers runs each
    step as one ``collective_rpc`` of its multiprocess executor, which reads the workers'
    replies in order and raises at the first failed one, leaving the others queued, where the
    server's next calls take them for their own; and a raise in ``update_weights`` ends vLLM's
    update session on that worker alone. An error the step did not answer leaves the trainer
    waiting until its deadline. Returns whether the step ran to its end."""
    try:
        step()
    except Exception as exc:
        logger.error("%s failed in this worker (answered in the trainer's store): %s", what, exc)
        return False
    return True


class _Watchdog:
    """Releases this worker's server if the trainer dies while it holds it.

    A trainer driving ``vllm serve`` over HTTP pauses the server around each push; if it dies
    then, nobody would resume it, and the server would stop serving for good. So from the
    group's formation until shutdown, a daemon thread checks the trainer's control store over a
    connection of its own (every ``interval_s``; a dead trainer's store refuses at once) and,
    when it stops answering, asks the server -- over HTTP, from its own thread, never waiting:
    the engine may be busy with this very worker -- to label its outputs ``"none"`` unless this
    worker holds a committed version, to end the update session the trainer left open (see
    ``finish_weight_update``) if one is, and to resume if paused (``servers.release_server``).
    Every worker watches (each must know the trainer died); only the server's first worker
    (``releases``) asks, as each of those calls reaches every worker of the server, and vLLM
    raises at a second end of one session."""

    def __init__(
        self,
        address: str,
        port: int,
        url: str,
        holds_version: Callable[[], bool],
        session_open: Callable[[], bool],
        *,
        releases: bool,
        interval_s: float = 1.0,
    ) -> None:
        self._stopped = threading.Event()
        self.fired = threading.Event()  # the trainer was found dead
        release = (holds_version, session_open) if releases else None
        self._thread = threading.Thread(
            target=self._watch,
            args=(address, port, url, release, interval_s),
            name="weight-sync-watchdog",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(
        self,
        address: str,
        port: int,
        url: str,
        release: tuple[Callable[[], bool], Callable[[], bool]] | None,
        interval_s: float,
    ) -> None:
        try:
            store = open_store(address, port, 1, max(5 * interval_s, 5.0), None)
            while not self._stopped.wait(interval_s):
                store.check([_WATCHDOG_KEY])
        except Exception as exc:  # the trainer's store is gone: it died, or closed it
            if self._stopped.is_set():
                return
            self.fired.set()
            logger.warning(
                "the trainer's store at %s:%s stopped answering (%s)%s",
                address,
                port,
                first_line(exc),
                f": releasing {url}" if release is not None else "",
            )
            if release is not None:
                holds_version, session_open = release
                release_server(url, holds_version=holds_version(), session_open=session_open())


# -- the trainer side ------------------------------------------------------------------------------


class StateDictSource(WeightSource):
    """A ``WeightSource`` over ``module.state_dict()``: tied names included, which vLLM's
    ``ModuleSource`` (``named_parameters``) leaves out. An engine that post-processes each
    module alone needs them: vLLM on CPU keeps a packed copy of a tied LM head, which reloading
    the embedding does not refresh (weight_sync refuses such a push before any byte moves). A
    tied name travels as metadata only."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(name, t.dtype, tuple(t.shape))
            for name, t in self._module.state_dict().items()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._module.state_dict().items():
            yield name, materialize_full_tensor(tensor)


@dataclass
class WeightSyncTrainerInitInfo(TrainerInitInfo):
    """``world_size``: this trainer plus every vLLM worker process that receives (engines x
    their tensor-parallel size). ``config``: how pushes run (timeouts, buckets, staging, ...)."""

    backend: ClassVar[str] = BACKEND

    world_size: int
    config: SyncConfig = field(default_factory=SyncConfig)

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(
                f"world_size counts the trainer and at least one vLLM worker, got {self.world_size}"
            )
        if not isinstance(self.config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig, got {type(self.config).__name__}")


class WeightSyncTrainerEngine(TrainerWeightTransferEngine[WeightSyncTrainerInitInfo]):
    """The trainer's end: a ``Pusher`` over a ``ClientPlane``. Only rank 0 sends; other trainer
    ranks only iterate the source (which may gather shards with them)."""

    init_info_cls = WeightSyncTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        config: SyncConfig | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.plane = ClientPlane(client, workers, config or SyncConfig()) if is_sender else None
        self.pusher = Pusher(self.plane, config) if self.plane is not None else None

    @classmethod
    def trainer_init(
        cls,
        init_info: WeightSyncTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> WeightSyncTrainerEngine:
        """Ready to push; the group forms with the first push (when the weights' device, and so
        the backend, is known)."""
        return cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            config=init_info.config,
            workers=init_info.world_size - 1,
        )

    # vLLM's base returns None; ours also hands the sending rank its PushResult (a caller that
    # ignores it loses nothing), and takes the weights here as well as at init.
    def send_weights(  # type: ignore[override]
        self, weights: Iterable[tuple[str, torch.Tensor]] | None = None
    ) -> PushResult | None:
        """Push ``weights`` (default: the source given at init) to every vLLM worker; returns the
        ``PushResult`` on the sending rank."""
        pairs = weights if weights is not None else self.source
        if pairs is None:
            raise ValueError("no weights: pass a WeightSource at trainer_init, or weights here")
        if self.pusher is None:
            for _ in pairs:  # this rank only takes part in the source's gathers
                pass
            return None
        return self.pusher.push(list(pairs))

    def shutdown(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
        if self.plane is not None:
            self.plane.close()


register()
