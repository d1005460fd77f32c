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

The push is the same protocol as ``WeightUpdater``'s and ``VLLMServers``': one sender's lane
(``lanes.ClientLanes`` over ``OneRank``), which vLLM's client carries to every engine at once --
``init_weight_transfer_engine`` has each worker join (as the first push begins),
``start_weight_update`` has it check the push against its model, ``update_weights`` takes the
lane, each tensor loaded as soon as it is whole, and ``finish_weight_update`` labels the outputs
with the version. Since vLLM's client returns nothing, each worker answers through a small store
the trainer listens on (loopback unless ``SyncConfig`` names an address). Every vLLM worker
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

from weight_sync.adapters.vllm.lanes import ClientLanes
from weight_sync.adapters.vllm.member import LaneMember, StoreLaneMember
from weight_sync.adapters.vllm.reload import ReloadTarget
from weight_sync.adapters.vllm.servers import release_server
from weight_sync.config import SyncConfig
from weight_sync.errors import WeightSyncError, first_line
from weight_sync.receive.receiver import Receiver
from weight_sync.result import PushResult
from weight_sync.send.collectives import OneRank
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
    """Where the trainer's stores listen, and which join this is."""

    address: str  # rank 0's store: the worker's slot, its answers, the verdicts
    port: int
    epoch: int  # the join's number (a worker's slot is counted per join)
    timeout_s: float
    # Every sender's store (one, or each rank's of a sharded trainer): the lanes to follow.
    lanes: list[list[Any]]
    # The worker's own server (``vllm serve``), where the trainer drives it over HTTP: if the
    # trainer dies, the worker's watchdog releases that server (see ``_Watchdog``).
    server_url: str | None = None


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    version: int
    push: int  # the push's number, and how long its lanes may take
    wait_s: float


class WeightSyncTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    """One vLLM worker as a member of weight_sync pushes (see the module doc)."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._target = ReloadTarget(lambda: self.model, vllm_config)
        # What this worker holds, whichever trainer pushed it: kept across joins. vLLM's device
        # for this worker, never a thread's.
        self._record = Receiver(device)
        self._watchdog: _Watchdog | None = None
        self._lanes: StoreLaneMember | None = None  # the lanes of the trainer that joined last
        self._session = False  # vLLM's update session is open (none of its steps raises here)

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        """Take a slot in the trainer's store and follow its senders' lanes (leaving those of a
        trainer joined before). Given its server's URL, watch the trainer from now until
        shutdown."""
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

        def follow() -> None:
            self._lanes = StoreLaneMember(
                init_info.address,
                init_info.port,
                init_info.epoch,
                init_info.lanes,
                init_info.timeout_s,
                LaneMember(self._target, self._record),
                init_info.server_url or "",
            )

        _answered(follow, "join")

    def start_weight_update(self) -> None:
        _answered(self._joined().check, "check")
        self._session = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default synchronizes an accelerator, which a CPU worker does not have.
        self.receive_weights(self.parse_update_info(update_info))
        if self._record.device.type == "cuda":
            torch.cuda.synchronize(self._record.device)

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        info = update_info
        _answered(lambda: self._joined().receive(info.push, info.version, info.wait_s), "receive")

    def finish_weight_update(self) -> None:
        # The lanes committed in update_weights: nothing is left but vLLM's own label.
        self._session = False

    def shutdown(self) -> None:
        self._stop_watchdog()
        self._close_lanes()

    def _joined(self) -> StoreLaneMember:
        if self._lanes is None:
            raise WeightSyncError("no trainer joined this worker (init_weight_transfer_engine)")
        return self._lanes

    def _holds_version(self) -> bool:
        """Whether the server's label names what this worker holds, for its watchdog. The
        worker commits within ``update_weights``, before the trainer labels the version
        (``finish_weight_update``): while the update session is open, the label is not its
        own."""
        return self._record.version is not None and not self._session

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


class OwnClient:
    """One of vLLM's own clients (``VLLMWeightSyncClient``: Ray handles, HTTP to one server) as
    ``lanes.ClientLanes`` calls it. Each of its calls reaches every engine and says nothing of
    which one failed: the workers' answers come through the trainer's store."""

    def __init__(self, client: VLLMWeightSyncClient) -> None:
        self._client = client
        self.failures: dict[str, str] = {}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self._client.start_weight_update()

    def update_weights(
        self, update_info: dict[str, Any], lost: Callable[[str, str], None] | None = None
    ) -> None:
        self._client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._client.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        shutdown = getattr(self._client, "shutdown_weight_transfer_engine", None)
        if shutdown is not None:  # not every client can release the engines
            shutdown()


class LeftToCaller:
    """Around a push through vLLM's own clients, nothing: pausing, the prefix cache and the
    version label after a failure are its caller's, as with vLLM's own engines. Its engines'
    workers are ``workers`` in all, as the caller counted them."""

    def __init__(self, workers: int) -> None:
        self._workers = workers
        self.names = ["the vLLM engines"]

    def count(self, timeout_s: float) -> int:
        return self._workers

    def relabelled(self, committed: int, timeout_s: float) -> bool:
        return False  # the caller replaces an engine, and the trainer engine with it

    def pause(self, timeout_s: float) -> None:
        pass

    def loaded(self, timeout_s: float) -> None:
        pass

    def resume(self, quiet: bool) -> None:
        pass

    def release(self, error: BaseException) -> dict[str, str]:
        return {}


class WeightSyncTrainerEngine(TrainerWeightTransferEngine[WeightSyncTrainerInitInfo]):
    """The trainer's end: one sender's lane (``lanes.ClientLanes`` over ``OneRank``), its
    engines' workers joining as the first push begins. Only rank 0 sends; other trainer ranks
    only iterate the source (which may gather shards with them)."""

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
        self.lanes: ClientLanes | None = None
        if is_sender:
            around = LeftToCaller(workers)
            self.lanes = ClientLanes(OwnClient(client), around, config, OneRank(), BACKEND)

    @classmethod
    def trainer_init(
        cls,
        init_info: WeightSyncTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> WeightSyncTrainerEngine:
        """Ready to push; the engines' workers join as the first push begins."""
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
        if self.lanes is None:
            for _ in pairs:  # this rank only takes part in the source's gathers
                pass
            return None
        return self.lanes.push(list(pairs), {})

    def shutdown(self) -> None:
        if self.lanes is not None:
            self.lanes.close()


register()
