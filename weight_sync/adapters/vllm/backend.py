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

The push is the same protocol as ``WeightUpdater``'s (``weight_sync.protocol``) over a control
plane of its own, ``ClientPlane``: vLLM's client carries each round to every engine at once
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
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
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

from weight_sync.adapters.vllm.extension import WorkerReply
from weight_sync.adapters.vllm.reload import ReloadTarget
from weight_sync.config import SyncConfig
from weight_sync.control import Fate, first_line, is_collateral, then
from weight_sync.errors import WeightSyncError
from weight_sync.metadata import (
    GroupSpec,
    MemberInfo,
    PrepareReply,
    PrepareRequest,
    PushReply,
    ReceiveReport,
    SyncPlan,
)
from weight_sync.protocol import Pusher
from weight_sync.receiver import Loader, Receiver
from weight_sync.result import PushResult
from weight_sync.transport.rendezvous import address_of_interface, bind_listener, open_store

logger = logging.getLogger(__name__)

BACKEND = "weight_sync"
_PREFIX = "weight_sync/control/"
_POLL_S = 0.005
_COMMIT, _CANCEL = "commit", "cancel"
_MAX_REPLY_CHARS = 1 << 20


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


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    version: int


class WeightSyncTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    """One vLLM worker as a member of weight_sync pushes (see the module doc)."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._receiver = Receiver(device)  # vLLM's device for this worker, never a thread's
        self._target = ReloadTarget(lambda: self.model, vllm_config)
        self._store: Any = None
        self._slot = 0
        self._epoch = 0
        self._pushing: int | None = None  # the version this worker prepared

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        """Register with the trainer's control store, answer its probe, and join the group it
        then describes."""
        self.shutdown()
        from torch.distributed import PrefixStore

        store = open_store(init_info.address, init_info.port, 1, init_info.timeout_s, None)
        self._store = PrefixStore(_PREFIX, store)
        self._epoch = init_info.epoch
        self._slot = int(self._store.add(f"{self._epoch}/slots", 1))
        self._answer(
            f"info/{self._epoch}/{self._slot}", lambda: self._receiver.info().model_dump_json()
        )
        spec_json = self._read(f"spec/{self._epoch}/{self._slot}", init_info.max_metadata_bytes)
        self._receiver.join_json(spec_json, init_info.max_metadata_bytes)

    def start_weight_update(self) -> None:
        """Check the push the trainer announced (fetching its plan from the store if this worker
        does not hold it)."""
        request_json = self._read(f"prepare/{self._epoch}", _MAX_REPLY_CHARS)
        request = PrepareRequest.model_validate_json(request_json)
        self._pushing = request.version

        def prepare() -> str:
            reply = self._receiver.prepare(request_json, self._target.check)
            if reply.need_plan:
                plan_json = self._read(f"plan/{request.plan_digest}", self._receiver_limit())
                whole = request.model_copy(update={"plan": SyncPlan.model_validate_json(plan_json)})
                reply = self._receiver.prepare(whole.model_dump_json(), self._target.check)
            return reply.model_dump_json()

        self._answer(f"prepared/{request.version}/{self._slot}", prepare)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default synchronizes an accelerator, which a CPU worker does not have.
        self.receive_weights(self.parse_update_info(update_info))
        if self._receiver.device.type == "cuda":
            torch.cuda.synchronize(self._receiver.device)

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        version = update_info.version
        self._answer(f"received/{version}/{self._slot}",
                     lambda: self._receiver.receive(version, self._loader()).model_dump_json())  # fmt: skip

    def finish_weight_update(self) -> None:
        """Commit the push, or drop it: the trainer's verdict, once every worker received it."""
        version, self._pushing = self._pushing, None
        if version is None:
            return
        verdict = self._read(f"verdict/{version}", 16)
        if verdict == _COMMIT:
            # Never raises: vLLM would keep its update session open, refusing every later one.
            # A failed commit reaches the trainer through the store.
            self._answer(f"committed/{version}/{self._slot}",
                         lambda: self._receiver.commit(version, self._loader()), reraise=False)  # fmt: skip
        else:
            self._receiver.cancel(version)

    def shutdown(self) -> None:
        self._receiver.leave()
        self._store = None

    # -- internals -----------------------------------------------------------------------------

    def _loader(self) -> Loader:
        return Loader(self._target.load, self._target.reload, keeps=True)

    def _receiver_limit(self) -> int:
        return self._receiver._max_metadata_bytes or _MAX_REPLY_CHARS

    def _read(self, key: str, limit: int) -> str:
        value = self._store.get(key).decode()
        if len(value) > limit:
            raise WeightSyncError(f"control message {key!r} of {len(value)} bytes exceeds {limit}")
        return value

    def _answer(self, key: str, step: Callable[[], Any], reraise: bool = True) -> None:
        """Run ``step`` and write its result or its error to ``key`` for the trainer; an error
        is raised again here too (``reraise``), so that vLLM ends the update session."""
        try:
            value, error = step(), None
        except Exception as exc:
            value, error = None, exc
        reply = WorkerReply(
            value=value, error=type(error).__name__ if error else None,
            message=str(error)[:2000] if error else "", status=self._receiver.status(),
        )  # fmt: skip
        self._store.set(key, reply.model_dump_json())
        if error is not None and reraise:
            raise error


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

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True, config: SyncConfig | None = None,
                 workers: int = 1) -> None:  # fmt: skip
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
        return cls(client=client, source=source, is_sender=init_info.is_sender,
                   config=init_info.config, workers=init_info.world_size - 1)  # fmt: skip

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


class ClientPlane:
    """``ControlPlane`` over a vLLM weight-sync client (see the module doc). Members are the
    vLLM worker processes, in the order they registered."""

    def __init__(self, client: VLLMWeightSyncClient, workers: int, config: SyncConfig) -> None:
        from torch.distributed import PrefixStore

        self._client = client
        self._workers = workers
        self._timeout_s = config.rendezvous_timeout_s
        self._max_metadata_bytes = config.max_metadata_bytes
        address = (
            config.master_addr
            if config.interface is None
            else address_of_interface(config.interface)
        )
        listener = bind_listener(address)
        self._address, self._port = address, listener.getsockname()[1]
        self._mailbox = _Mailbox(
            PrefixStore(_PREFIX, open_store(address, self._port, 1, self._timeout_s, listener))
        )
        self._epoch = 0
        self._plans: set[str] = set()  # digests whose plan is in the store
        self._joining: Future[Any] | None = None
        self._pushing: int | None = None  # prepared, neither committed nor cancelled

    def __len__(self) -> int:
        return self._workers

    def probe(self, timeout_s: float) -> list[Future[MemberInfo]]:
        self._epoch += 1
        info = {"address": self._address, "port": self._port, "epoch": self._epoch,
                "timeout_s": self._timeout_s, "max_metadata_bytes": self._max_metadata_bytes}  # fmt: skip
        self._joining = _in_thread(lambda: self._client.init_weight_transfer_engine(info))
        return self._round("info", self._epoch, self._joining, MemberInfo)

    def join(
        self, specs: Sequence[GroupSpec], max_metadata_bytes: int, timeout_s: float
    ) -> list[Future[None]]:
        assert self._joining is not None, "probe first"
        for slot, spec in enumerate(specs, start=1):
            self._mailbox.post(f"spec/{self._epoch}/{slot}", spec.model_dump_json())
        return [self._joining] * self._workers  # the init call returns once all have joined

    def prepare(
        self,
        request: PrepareRequest,
        plan: SyncPlan,
        members: Sequence[int],
        send_plan: Sequence[bool],
        timeout_s: float,
    ) -> list[Future[PrepareReply]]:
        # Workers fetch the plan from the store when they lack it, so none asks for it.
        assert list(members) == list(range(self._workers)), "every worker prepares at once"
        if plan.digest not in self._plans:
            self._mailbox.post(f"plan/{plan.digest}", plan.wire)
            self._plans.add(plan.digest)
        self._mailbox.post(f"prepare/{self._epoch}", request.model_dump_json())
        self._pushing = request.version
        call = _in_thread(self._client.start_weight_update)
        return self._round("prepared", request.version, call, PrepareReply)

    def cancel(self, version: int, members: Sequence[int], timeout_s: float) -> list[Future[None]]:
        return [_in_thread(self._end_session)] * len(members)

    def push(self, request: PrepareRequest, timeout_s: float) -> list[Future[PushReply]]:
        raise AssertionError("vLLM's workers never offer one-call pushes (MemberInfo.one_call)")

    def receive(self, version: int, atomic: bool, timeout_s: float) -> list[Future[ReceiveReport]]:
        call = _in_thread(lambda: self._client.update_weights({"version": version}))
        return self._round("received", version, call, ReceiveReport)

    def commit(self, version: int, timeout_s: float) -> list[Future[None]]:
        self._pushing = None
        self._mailbox.post(f"verdict/{version}", _COMMIT)
        call = _in_thread(lambda: self._client.finish_weight_update(str(version)))
        return self._round("committed", version, call, None)

    def leave(self, timeout_s: float) -> list[Future[None]]:
        """End any update session still open (vLLM refuses to release an engine inside one),
        then release the engines from the group."""
        shutdown = getattr(self._client, "shutdown_weight_transfer_engine", lambda: None)

        def leave() -> None:
            try:
                self._end_session()
            except Exception as exc:  # a worker whose update already failed has no session
                logger.debug("ending the update session: %s", exc)
            shutdown()

        return [_in_thread(leave)] * self._workers

    def drop(self, members: Sequence[int]) -> None:
        logger.warning(
            "vLLM worker(s) %s failed; vLLM's client still calls every engine, so pushes fail "
            "until they are replaced", list(members),
        )  # fmt: skip

    def fate(self, error: BaseException) -> tuple[Fate, str]:
        return ("collateral" if is_collateral(error) else "raised"), first_line(error)

    def close(self) -> None:
        self._mailbox.close()

    def _end_session(self) -> None:
        """``finish_weight_update`` with a verdict to drop the push in flight, if any."""
        version, self._pushing = self._pushing, None
        if version is not None:
            self._mailbox.post(f"verdict/{version}", _CANCEL)
            self._client.finish_weight_update()

    def _round(
        self, step: str, key: int, call: Future[Any], kind: type | None
    ) -> list[Future[Any]]:
        """One future per worker: its answer under ``step/key/slot``, or the client call's error
        if that call fails before the worker answered."""
        answers = [
            self._mailbox.expect(f"{step}/{key}/{slot}") for slot in range(1, self._workers + 1)
        ]

        def failed(done: Future[Any]) -> None:
            if done.exception() is not None:
                for answer in answers:
                    _settle(answer, error=done.exception())

        call.add_done_callback(failed)
        return [then(answer, lambda raw: _parse(raw, kind)) for answer in answers]


class _Mailbox:
    """The trainer's end of the control store: it posts messages, and gets futures for the keys
    workers will answer under, resolved by one thread that polls for them (a store's blocking
    ``wait`` would hold up every other use of it). One lock guards every use of the store."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._pending: dict[str, Future[str]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None

    def post(self, key: str, value: str) -> None:
        with self._lock:
            self._store.set(key, value)

    def expect(self, key: str) -> Future[str]:
        future: Future[str] = Future()
        with self._lock:
            self._pending[key] = future
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._poll, name="weight-sync-replies", daemon=True
                )
                self._thread.start()
        return future

    def close(self) -> None:
        """Stop polling and drop the store (the trainer's listening socket goes with it)."""
        with self._lock:
            self._closed, self._store = True, None
            for future in self._pending.values():
                _settle(future, error=WeightSyncError("the weight-transfer engine was shut down"))
            self._pending.clear()

    def _poll(self) -> None:
        while True:
            arrived = []
            with self._lock:
                if self._closed:
                    return
                for key, future in list(self._pending.items()):
                    if future.done():  # failed with its client call
                        del self._pending[key]
                    elif self._store.check([key]):
                        arrived.append((future, self._store.get(key).decode()))
                        self._store.delete_key(key)
                        del self._pending[key]
            for future, value in arrived:
                _settle(future, result=value)
            time.sleep(_POLL_S)


def _parse(raw: str, kind: type | None) -> Any:
    if len(raw) > _MAX_REPLY_CHARS:
        raise WeightSyncError(f"a worker's reply of {len(raw)} bytes exceeds {_MAX_REPLY_CHARS}")
    value = WorkerReply.model_validate_json(raw).unwrap()
    return kind.model_validate_json(value) if kind is not None and value is not None else None  # type: ignore[attr-defined]


def _settle(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass  # settled already (by the other of the worker's answer and the client call)


def _in_thread(call: Callable[[], Any]) -> Future[Any]:
    """Run a blocking client call on a thread of its own: a stuck engine may never return, and
    must not hold up anything else (the push's deadline bounds the wait for it)."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            _settle(future, result=call())
        except BaseException as exc:
            _settle(future, error=exc)

    threading.Thread(target=run, name="weight-sync-client", daemon=True).start()
    return future


register()
