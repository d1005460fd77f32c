"""Actors shared by the Ray tests: a trainer that owns a WeightUpdater, and workers."""

from __future__ import annotations

import copy
import datetime
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import ray
import torch
import torch.distributed as dist

from tests.ray.pool import start_over
from tests.zoo import BufferModel, zoo
from weight_sync import PushResult, SyncConfig, WeightSyncWorker, WeightUpdater, remote_worker
from weight_sync.errors import WeightSyncError
from weight_sync.send.collectives import OneRank
from weight_sync.send.sharded import ShardedSource, push_sharded
from weight_sync.transport.rendezvous import bind_listener, open_store
from weight_sync.wire.checksums import state_dict_digests
from weight_sync.wire.mapping import fuse
from weight_sync.wire.metadata import TensorMeta

BIG = 300_000  # 1.2 MB tensors: split across the tests' 256 KiB buckets


class Renewable(WeightSyncWorker):
    """A worker the tests may reuse (tests/ray/pool.py): ``renew(**init)`` starts it over in
    this process as ``__init__(**init)`` would in a new actor, its group let go of first."""

    def renew(self, **init: Any) -> None:
        self._weight_sync_member().close()
        start_over(self, **init)


@ray.remote(num_cpus=0)
class ZooWorker(Renewable):
    """Default load_weights into self.model, whose buffers hold every dtype."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self.model = BufferModel(zoo(seed, big=BIG))


@ray.remote(num_cpus=0)
class RecordingWorker(Renewable):
    """A custom load_weights (as an inference engine would have), no self.model."""

    def __init__(self) -> None:
        super().__init__()
        self.received: dict[str, torch.Tensor] = {}
        self.calls = 0

    def load_weights(self, weights) -> None:
        self.calls += 1
        self.received.update((name, tensor.clone()) for name, tensor in weights)

    def load_calls(self) -> int:
        return self.calls

    def received_digests(self) -> dict[str, str]:
        return state_dict_digests(self.received)


@ray.remote(num_cpus=0)
class FlakyWorker(ZooWorker.__ray_actor_class__):  # type: ignore[name-defined]
    """A ZooWorker whose load_weights can be told to fail half-way through the next push."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.fail_after: int | None = None

    def fail_next_push(self, after_calls: int) -> None:
        self.fail_after = after_calls

    def fail_destinations(self) -> None:
        """``weight_sync_destinations`` raises once, the next time it is asked: a user's hook
        that fails as a push begins (a worker asks its hooks once a push, in its check)."""
        self.destinations_fail = True

    def weight_sync_destinations(self) -> Any:
        if self.__dict__.pop("destinations_fail", False):
            raise RuntimeError("injected weight_sync_destinations failure")
        return super().weight_sync_destinations()

    def fail_next_commit(self) -> None:
        """The next commit of its lane raises once every worker has received: in a step of
        its own, or at the end of a push in one step (after a push: it follows a lane)."""
        receivers = _receivers(self)
        assert receivers, "push once first: the worker follows no lane yet"
        commits = [receiver.commit for receiver in receivers]

        def failing(*args: Any, **kwargs: Any) -> None:
            for receiver, commit in zip(receivers, commits, strict=True):
                receiver.commit = commit  # type: ignore[method-assign]
            raise RuntimeError("injected commit failure")

        for receiver in receivers:
            receiver.commit = failing  # type: ignore[method-assign]

    def load_weights(self, weights) -> None:
        if self.fail_after is not None:
            if self.fail_after == 0:
                self.fail_after = None
                raise RuntimeError("injected load_weights failure")
            self.fail_after -= 1
        super().load_weights(weights)


def _receivers(worker: Any) -> list[Any]:
    """Every receiver a push lands through on ``worker``: each of its lanes' (one a sender),
    once it follows any."""
    member = worker._weight_sync_member()
    lanes = member.lanes.inbound if member.lanes is not None else []
    return [lane.member.receiver for lane in lanes]


class _Tampered:
    """Wraps a worker's real transport: flips one received byte (damage on the wire), or makes
    every bucket arrive ``delay_s`` late (a slow link)."""

    def __init__(self, inner: Any, flip: bool, delay_s: float) -> None:
        self._inner, self._flip, self._delay_s = inner, flip, delay_s
        self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> Any:
        work, outer = self._inner.broadcast(tensor, src, timeout_s), self

        class Tampered:
            def wait(self) -> None:
                work.wait()
                time.sleep(outer._delay_s)
                if outer._flip and tensor.numel():
                    outer._flip = False
                    tensor[tensor.numel() // 2] ^= 0x10

            def after(self) -> None:  # on the CPU, ordering is waiting
                self.wait()

        return Tampered()

    def vote(self, code: int, timeout_s: float | None = None) -> int:
        return self._inner.vote(code, timeout_s)

    def close(self) -> None:
        self._inner.close()


@remote_worker(num_cpus=0)
class SlowWorker(Renewable):
    """Every bucket goes through a slow load_weights, so that a push lasts long enough to be
    struck mid-broadcast; made with remote_worker, so sync_status answers meanwhile."""

    def __init__(self, seed: int, delay_s: float = 0.3) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self.model = BufferModel(zoo(seed, big=BIG))
        self.delay_s = delay_s
        self.hang_join_s = 0.0

    def load_weights(self, weights) -> None:
        time.sleep(self.delay_s)
        WeightSyncWorker.load_weights(self, weights)

    def weight_sync_expected(self) -> dict[str, TensorMeta]:
        return {n: TensorMeta.of(n, t) for n, t in self.model.state_dict().items()}

    def pid(self) -> int:
        return os.getpid()

    def set_delay(self, delay_s: float) -> None:
        """From now, each bucket's load_weights sleeps ``delay_s``."""
        self.delay_s = delay_s

    def hang_in_next_join(self, seconds: float) -> None:
        self.hang_join_s = seconds

    def _weight_sync_lanes_push(self, *args: Any, **kwargs: Any) -> Any:
        if self.hang_join_s and self._weight_sync_member().lanes is None:  # joins in this call
            time.sleep(self.hang_join_s)  # as a worker whose network never lets it connect
        return super()._weight_sync_lanes_push(*args, **kwargs)

    def tamper(self, flip: bool = False, delay_s: float = 0.0) -> None:
        """Tamper with each lane's group's transport (see _Tampered)."""
        for receiver in _receivers(self):
            if receiver._transport is not None:
                receiver._transport = _Tampered(receiver._transport, flip, delay_s)


def mutate(state_dict: dict[str, torch.Tensor], mutation: str) -> dict[str, torch.Tensor]:
    if "," in mutation:
        for each in mutation.split(","):
            state_dict = mutate(state_dict, each)
    elif mutation == "finite":  # the zoo's random bits include NaN and Inf patterns
        for name, tensor in state_dict.items():
            if tensor.dtype in (
                torch.float16,
                torch.bfloat16,
                torch.float32,
                torch.float64,
                torch.complex64,
                torch.complex128,
            ):
                state_dict[name] = torch.nan_to_num(tensor, nan=0.0, posinf=1.0, neginf=-1.0)
    elif mutation == "nan":
        state_dict["float32_matrix"] = state_dict["float32_matrix"].clone()
        state_dict["float32_matrix"][1, 2] = float("nan")
    elif mutation == "extra":
        state_dict["not_in_model"] = torch.zeros(3)
    elif mutation == "missing":
        state_dict.pop("float32_matrix")
    elif mutation == "shape":
        state_dict["float32_matrix"] = torch.zeros(13, 7)
    elif mutation == "dtype":
        state_dict["float32_matrix"] = state_dict["float32_matrix"].double()
    elif mutation != "none":
        raise ValueError(mutation)
    return state_dict


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, workers: list, **config: Any) -> None:
        torch.set_num_threads(1)
        self.updater = WeightUpdater(workers, SyncConfig(**config))

    def push_zoo(self, seed: int, mutation: str = "none", version: int | None = None) -> PushResult:
        # Built here, so the non-contiguous views really are non-contiguous at the sender.
        return self.updater.push(mutate(zoo(seed, big=BIG), mutation), version=version)

    def push(self, state_dict: Any) -> PushResult:
        return self.updater.push(state_dict)

    def push_partial_zoo(self, seed: int, names: list[str]) -> PushResult:
        """Push only ``names`` of a zoo (``partial=True``)."""
        tensors = zoo(seed, big=BIG)
        return self.updater.push({name: tensors[name] for name in names}, partial=True)

    def timed_push_zoo(self, seed: int) -> tuple[str, float]:
        """Push a zoo; how it ended (the error's class name, or "ok") and how long the call took,
        timed here (so without the Ray call that asked for it)."""
        start = time.monotonic()
        try:
            self.push_zoo(seed)
        except WeightSyncError as exc:
            return type(exc).__name__, time.monotonic() - start
        return "ok", time.monotonic() - start

    def push_from_threads(self, seeds: list[int]) -> list[tuple[int, int]]:
        """Push one zoo per thread, all at once; returns (seed, version) pairs."""
        with ThreadPoolExecutor(len(seeds)) as pool:
            results = list(pool.map(lambda seed: self.updater.push(zoo(seed, big=BIG)), seeds))
        return [(seed, result.version) for seed, result in zip(seeds, results, strict=True)]

    def version(self) -> int:
        return self.updater.version

    def worker_count(self) -> int:
        return len(self.updater.workers)

    def add_workers(self, workers: list) -> None:
        self.updater.add_workers(workers)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.updater.close()

    def renew(self, **init: Any) -> None:
        """Start over as ``Trainer(**init)`` would (its updater closed first): tests reuse
        actors (tests/ray/pool.py)."""
        self.close()
        start_over(self, **init)


QKV = fuse(["q_proj", "k_proj", "v_proj"], into="qkv_proj")


class TinyLM(torch.nn.Module):
    """An LM head tied to the embedding, and attention projections kept apart (as a trainer
    has them) or stacked into one qkv_proj (as an inference engine has them)."""

    def __init__(self, fused: bool, seed: int, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, dim)
        if fused:
            self.qkv_proj = torch.nn.Linear(dim, 3 * dim)
        else:
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.adapter = torch.nn.Linear(dim, dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(h).chunk(3, dim=-1)
        else:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        return self.lm_head(self.adapter(h + q * k + v))


def _die_on_second_bucket(group: Any) -> None:
    """End this process (no cleanup) as ``group`` starts its second broadcast of a push, once
    the first has completed here: a sender, or a worker, dying while a lane's bytes flow."""
    assert group is not None, "push once first: a lane's group forms in its first push"
    broadcast, started = group.broadcast, []

    def dying(tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> Any:
        if started:
            started[0].wait()
            os._exit(9)
        started.append(broadcast(tensor, src, timeout_s))
        return started[0]

    group.broadcast = dying


@ray.remote(num_cpus=0)
class LMTrainer:
    def __init__(self, workers: list, **config: Any) -> None:
        torch.set_num_threads(1)
        self.model = TinyLM(fused=False, seed=0)
        self.updater = WeightUpdater(workers, SyncConfig(**config))

    def step(self) -> None:
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.add_(torch.randn_like(parameter))

    def push(self, prefix: str = "", partial: bool = False, fuse: bool = True) -> PushResult:
        state = {n: t for n, t in self.model.state_dict().items() if n.startswith(prefix)}
        return self.updater.push(state, transform=QKV if fuse else None, partial=partial)

    def fused_state(self) -> dict[str, torch.Tensor]:
        """The model as the workers should hold it: fused, in their names."""
        return {n: t.clone() for n, t in QKV(self.model.state_dict().items())}

    def digests(self) -> dict[str, str]:
        return state_dict_digests(self.fused_state())


# The methods a trainer calls on a worker (the rest of ``WeightSyncWorker``'s are its own).
PROTOCOL = tuple(
    f"_weight_sync_{step}"
    for step in ("info", "lanes_push", "lanes_join", "lanes_leave", "apply")
)


def _counting(name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        counted = self.__dict__.setdefault("_protocol_calls", {})
        counted[name] = counted.get(name, 0) + 1
        return getattr(super(Counting, self), name)(*args, **kwargs)

    return method


# A worker that counts the protocol's calls it is sent (``protocol_calls``).
Counting = type("Counting", (Renewable,), {name: _counting(name) for name in PROTOCOL})


@ray.remote(num_cpus=0)
class LMWorker(Counting):  # type: ignore[valid-type,misc]
    def __init__(self, fused: bool = True) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self.model = TinyLM(fused=fused, seed=1)

    def renew(self, **init: Any) -> None:
        self.lose_lanes()  # its lanes too, not only its group
        super().renew(**init)

    def protocol_calls(self) -> dict[str, int]:
        """The protocol's methods called on this worker since the last ask, and how often."""
        return dict(self.__dict__.pop("_protocol_calls", {}))

    def still_tied(self) -> bool:
        """The tie kept, and every parameter still a trainable leaf: pushes land in them in
        place (under no_grad) and record no autograd history."""
        params = list(self.model.parameters())
        trainable = all(p.requires_grad and p.is_leaf and p.grad_fn is None for p in params)
        return trainable and self.model.lm_head.weight is self.model.embed.weight

    def fail_after_lanes(self, on: bool) -> None:
        """From now (``on``), each push from many senders raises here once every lane committed:
        a worker that fails after its bytes landed (fault injection)."""
        self._fail_after_lanes = on

    def fail_before_bytes(self, sender: int | None) -> None:
        """From now, the lane from ``sender`` (None: no lane) fails here as its bytes are about
        to flow -- its push accepted, its sender sending -- before it takes one (fault
        injection: a worker that cannot take what it agreed to)."""
        self._fail_before_bytes = sender

    def fail_assembly(self, on: bool) -> None:
        """From now (``on``), where a push from many senders lands cannot be had as the push
        begins: a user's hook that fails as the worker checks the push against it, the one
        call of it a push makes (fault injection)."""
        self._fail_assembly = on

    def _weight_sync_lanes_push(self, *args: Any, **kwargs: Any) -> int | None:
        if getattr(self, "_fail_assembly", False):
            self.weight_sync_destinations = _injected_failure  # type: ignore[method-assign]
        try:
            held = super()._weight_sync_lanes_push(*args, **kwargs)
        finally:
            self.__dict__.pop("weight_sync_destinations", None)
        if getattr(self, "_fail_after_lanes", False):
            raise RuntimeError("failed once every lane had committed (fault injection)")
        return held

    def _weight_sync_assembly(self, layout: Any) -> Any:
        assembly = super()._weight_sync_assembly(layout)
        failing = getattr(self, "_fail_before_bytes", None)
        if failing is not None:  # on a copy: the worker's own serves the pushes after
            assembly = copy.copy(assembly)
            where = assembly.destinations

            def destinations(sender: int) -> Any:
                if sender == failing:
                    raise RuntimeError("failed as its bytes were to flow (fault injection)")
                return where(sender)

            assembly.destinations = destinations
        return assembly

    def die_mid_push(self, sender: int) -> None:
        """End this process (no cleanup) as the next push's second bucket from trainer rank
        ``sender`` is to arrive, its first already here: a worker killed while the bytes flow
        (its lane's group formed: push once first)."""
        lanes = self._weight_sync_member().lanes
        assert lanes is not None, "push once first: a worker follows the lanes in a push"
        _die_on_second_bucket(lanes.inbound[sender].member.receiver.transport)

    def fail_after_join(self) -> None:
        """From now, joining one group raises once joined: a worker that fails after the group
        formed with it (fault injection)."""
        self._fail_after_join = True

    def lose_lanes(self) -> None:
        """Let go of its lanes as if another updater's had taken their place."""
        self._weight_sync_member().close()

    def _weight_sync_lanes_join(self, *args: Any, **kwargs: Any) -> None:
        super()._weight_sync_lanes_join(*args, **kwargs)
        if getattr(self, "_fail_after_join", False):
            raise RuntimeError("failed once it had joined the one group (fault injection)")


def _injected_failure() -> Any:
    raise RuntimeError("its model is not there (fault injection)")


@remote_worker(num_cpus=0)
class BusyLMWorker(WeightSyncWorker):
    """A TinyLM worker made with ``remote_worker`` whose own methods may keep its default group
    busy, as an engine generating does."""

    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self.model = TinyLM(fused=False, seed=1)

    def busy(self, seconds: float) -> None:
        time.sleep(seconds)


@ray.remote(num_cpus=0)
class ShardedTrainer:
    """One rank of a data-parallel trainer whose TinyLM is sharded with FSDP2 over Gloo; rank 0
    owns the WeightUpdater."""

    def __init__(self, rank: int, world_size: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.world_size = rank, world_size
        self.listener = bind_listener("127.0.0.1") if rank == 0 else None

    def port(self) -> int:
        assert self.listener is not None
        return self.listener.getsockname()[1]

    def setup(
        self, port: int, workers: list | None, **config: Any
    ) -> None:
        """``workers``: this rank owns a one-sender ``WeightUpdater`` over them."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        store = open_store("127.0.0.1", port, self.world_size, 60, self.listener)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        mesh = init_device_mesh("cpu", (self.world_size,))
        self.model = TinyLM(fused=False, seed=0)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.updater = WeightUpdater(workers, SyncConfig(**config)) if workers else None

    def step(self, poison: bool = False) -> None:
        """One real FSDP training step (its all-gathers and reduce-scatters run on the same
        group the push gathers on)."""
        loss = self.model(torch.arange(32).reshape(4, 8)).logsumexp(-1).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        if poison and self.rank == 1:
            with torch.no_grad():
                self.model.adapter.weight.to_local()[0, 0] = float("nan")

    def push(
        self, version: int | None = None, only: list[str] | None = None, whole: bool = False
    ) -> tuple[Any, int]:
        """(PushResult on rank 0 / version elsewhere, peak gathered bytes on rank 0); ``only``:
        these tensors, as a partial push; ``whole``: gathered whole on every rank first (a
        state dict of plain tensors: deltas can apply), not bucket by bucket."""
        state = self.model.state_dict()
        if only is not None:
            state = {name: state[name] for name in only}
        if whole:
            state = {name: tensor.full_tensor() for name, tensor in state.items()}
            if self.updater is None:
                return version, 0
            return self.updater.push(state, partial=only is not None, version=version), 0
        source = ShardedSource(state)
        if self.updater is None:
            return source.serve(), 0
        result = self.updater.push(source, partial=only is not None, version=version)
        return result, source.peak_gathered_bytes

    def keep(self) -> None:
        """Remember this rank's shards as they are (``restore`` puts them back)."""
        self.kept = {n: t.to_local().clone() for n, t in self.model.state_dict().items()}

    def restore(self) -> None:
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                tensor.to_local().copy_(self.kept[name])

    def push_sharded(self) -> Any:
        return push_sharded(self.model.state_dict(), self.updater)

    def lanes_setup(self, workers: list, one_group: bool = False, **config: Any) -> None:
        """Every rank: a WeightUpdater with senders over the same workers (a collective)."""
        from weight_sync.actors import WeightUpdater

        self.lanes = WeightUpdater(
            workers, SyncConfig(**config), senders=dist.group.WORLD, one_group=one_group
        )

    def lanes_routes(self) -> tuple[list[str], bool]:
        """How each worker takes this rank's lane, and whether its group is formed."""
        return self.lanes.routes, self.lanes.group is not None

    def lanes_push(
        self,
        version: int | None = None,
        die: bool | Literal["mid"] = False,
        only: list[str] | None = None,
    ) -> Any:
        """Every rank pushes its own shards; (the result, or the error's type and message).
        ``die``: this rank's process ends (no cleanup) once the senders agreed, before its lane
        moves a byte; ``"mid"``: once its lane's first bucket reached every worker, as it
        starts the second (the lane's group must have formed: push once before). ``only``:
        these tensors, as a partial push."""
        if die == "mid":
            _die_on_second_bucket(self.lanes.group)  # this rank's lane's group
        elif die:
            self.lanes._pushes._lanes.out.push = lambda *args, **kwargs: os._exit(9)
        state = self.model.state_dict()
        if only is not None:
            state = {name: state[name] for name in only}
        try:
            return self.lanes.push(state, version=version, partial=only is not None)
        except Exception as exc:
            return type(exc).__name__, str(exc)

    def lanes_close(self) -> None:
        self.lanes.close()

    def lanes_workers(self) -> int:
        return len(self.lanes.workers)

    def lanes_add(self, workers: list) -> None:
        self.lanes.add_workers(workers)

    def lane_ops(self) -> list[str]:
        """The steps this rank's lane posted in its store for its last push, in order (none:
        not even its frame)."""
        senders = self.lanes._pushes._lanes
        store = senders.out.plane._mailbox._store
        if not store.check([f"cmd/begin/{senders.pushes}"]):
            return []
        ops, number = [], int(store.get(f"cmd/begin/{senders.pushes}"))
        while store.check([f"cmd/{number}"]):
            ops.append(json.loads(store.get(f"cmd/{number}"))["op"])
            number += 1
        return ops

    def lanes_answered(self) -> list[bool]:
        """Rank 0: whether each worker's call of the last push returned its reply to this
        rank's lane (``LanePush.answer``) rather than answering in the store."""
        return [call.result() is not None for call in self.lanes._pushes._calls]

    def lanes_one_group(self) -> str | None:
        """The id of the one group this rank's lanes send over (a new one once it re-forms)."""
        group = self.lanes._pushes._lanes.one_group
        return None if group is None else group._spec.group_id

    def full_digests(self) -> dict[str, str]:
        """Every rank must call this at once (it gathers)."""
        return state_dict_digests({n: t.full_tensor() for n, t in self.model.state_dict().items()})

    def model_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.parameters())

    def close(self) -> None:
        if self.updater is not None:
            self.updater.close()
        dist.destroy_process_group()


@ray.remote(num_cpus=0)
class LoneTrainer:
    """A trainer of one process that never calls ``init_process_group``, pushing through the
    many-senders front over ``OneRank`` (the K = 1 case); its methods are ``ShardedTrainer``'s
    that the K = 1 test calls."""

    def __init__(self, rank: int, world_size: int) -> None:
        assert (rank, world_size) == (0, 1), "a trainer of one process"
        torch.set_num_threads(1)

    def port(self) -> int:
        return 0  # no rendezvous to hold

    def setup(self, port: int, workers: None) -> None:
        self.model = TinyLM(fused=False, seed=0)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)

    def step(self) -> None:
        loss = self.model(torch.arange(32).reshape(4, 8)).logsumexp(-1).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def lanes_setup(self, workers: list, one_group: bool = False, **config: Any) -> None:
        from weight_sync.actors.lanes import RayLanes

        self.lanes = RayLanes(workers, SyncConfig(**config), group=OneRank(), one_group=one_group)
        assert not dist.is_initialized(), "no torch.distributed group was made"

    def lanes_routes(self) -> tuple[list[str], bool]:
        return self.lanes.routes, self.lanes.group is not None

    def lanes_push(self) -> Any:
        return self.lanes.push(self.model.state_dict(), {})

    def lanes_answered(self) -> list[bool]:
        return [call.result() is not None for call in self.lanes._calls]

    def full_digests(self) -> dict[str, str]:
        return state_dict_digests(self.model.state_dict())

    def lanes_close(self) -> None:
        self.lanes.close()
