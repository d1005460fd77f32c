"""The benchmark's trainer and worker actors, and every strategy they can move weights with.

All strategies run on the same processes and, where they use collectives, over the same group
that ``WeightUpdater`` formed, so the comparison measures the strategy and nothing else. Each
baseline is written the way its users write it:

* ``raw`` -- the floor: one flat broadcast of as many bytes, preallocated, nothing packed or
  applied.
* ``per_tensor`` -- one broadcast per tensor in its own dtype, with one Ray call per tensor per
  worker carrying its metadata (the OpenRLHF / TRL pattern).
* ``fanout`` -- the trainer sends every tensor to each worker in turn, point to point.
* ``object_store`` -- ``ray.put`` the state dict once; every worker ``ray.get``s and loads it.
* ``ray_call`` -- not a way to push but the floor of the control plane: one Ray call per worker
  that carries nothing, all at once.
* ``memcpy`` -- not a way to push but the memory-bandwidth limit of one on a single host: the
  trainer writes the bytes once into memory every worker maps, and every worker reads them once
  into a buffer of its own, all at the same time.

Two more are not baselines but what a training loop pushes (``SyncConfig.delta`` on or off):
``after_step`` -- the push after one Adam step at an RL learning rate (1e-6), on weights drawn
as a model's are (normal, std 0.02); ``all_changed`` -- the push after every value changed.
"""

from __future__ import annotations

import gc
import mmap
import os
from collections.abc import Callable, Sequence

import ray
import torch
import torch.distributed as dist

from weight_sync import SyncConfig, WeightSyncWorker, WeightUpdater
from weight_sync.tools.bench.timing import seconds_of
from weight_sync.tools.bench.workloads import Workload
from weight_sync.transport import TorchGroup
from weight_sync.wire.checksums import state_dict_digests
from weight_sync.wire.metadata import TRAINER_RANK, TensorMeta

STRATEGIES = ("weight_sync", "raw", "per_tensor", "fanout", "object_store", "memcpy", "ray_call")
TRAINING = ("after_step", "all_changed")  # pushes in a training loop: need ``setup(trained=True)``


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class MemoryProbe:
    """Peak memory above a baseline where the weights live: host memory via the kernel's
    resettable high-water mark, or CUDA memory via the caching allocator's peak statistics."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            return
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to the current RSS
        self._baseline = _status_kib("VmRSS") * 1024

    def peak_extra_bytes(self) -> int:
        if self.device.type == "cuda":
            return max(0, torch.cuda.max_memory_allocated(self.device) - self._baseline)
        return max(0, _status_kib("VmHWM") * 1024 - self._baseline)


def link_tx_bytes(device: str) -> int:
    """Bytes sent out of network interface ``device`` so far, in this process's network
    namespace (``/proc/net/dev``: after the name, 8 receive counters, then transmit bytes)."""
    with open("/proc/net/dev") as table:
        for line in table:
            name, _, counters = line.partition(":")
            if name.strip() == device:
                return int(counters.split()[8])
    raise ValueError(f"no network interface {device!r} here; see /proc/net/dev")


def describe(device: str) -> str:
    """The device named for the report: 'cpu', or 'cuda (NVIDIA H100 80GB HBM3)'."""
    if device == "cuda":
        return f"cuda ({torch.cuda.get_device_name()})"
    return device


class TensorBank(torch.nn.Module):
    """A model whose state dict is exactly the given tensors (as buffers)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)


def _group_of(transport: object) -> TorchGroup:
    assert isinstance(transport, TorchGroup), "no sync group: push once before the baselines"
    return transport


def _broadcast(group: TorchGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = TRAINER_RANK
    group.process_group.broadcast([tensor], options).wait()
    _synchronize(tensor)


def _synchronize(tensor: torch.Tensor) -> None:
    """NCCL's wait only orders the stream: the bytes are there once the stream has run."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


@ray.remote(num_cpus=0)
class BenchWorker(WeightSyncWorker):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        torch.set_num_threads(1)
        self.device = torch.device(device)
        self.memory = MemoryProbe(device)
        self.state: dict[str, torch.Tensor] = {}

    def setup(self, workload: Workload, dtype: str | None = None) -> None:
        """The workload's tensors, in ``dtype`` (the push's cast_dtype) if given."""
        self.__dict__.pop("model", None)
        self.state = {}
        gc.collect()
        tensors = workload.build(fill=0.0, device=self.device)
        if dtype is not None:
            tensors = {n: t.to(getattr(torch, dtype)) for n, t in tensors.items()}
        self.model = TensorBank(tensors)
        self.state = dict(self.model.state_dict())

    def memory_reset(self) -> None:
        self.memory.reset()

    def memory_peak(self) -> int:
        return self.memory.peak_extra_bytes()

    def digests(self) -> dict[str, str]:
        return state_dict_digests(self.state)

    # -- baselines -----------------------------------------------------------------------------

    def raw_prepare(self, nbytes: int) -> None:
        self.raw_buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self._group().device)

    def raw_receive(self) -> None:
        _broadcast(self._group(), self.raw_buffer)

    def raw_release(self) -> None:
        self.__dict__.pop("raw_buffer", None)

    def per_tensor_receive(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        meta = TensorMeta(name=name, dtype=dtype, shape=shape)
        tensor = torch.empty(meta.shape, dtype=meta.torch_dtype, device=self.device)
        _broadcast(self._group(), tensor)
        self.load_weights([(name, tensor)])

    def fanout_receive(self, names: list[str]) -> None:
        pg = self._group().process_group
        for name in names:  # into the model's own storage: receiving is the whole cost
            pg.recv([self.state[name]], TRAINER_RANK, 0).wait()  # type: ignore[attr-defined]
            _synchronize(self.state[name])

    def memcpy_prepare(self, pid: int, fd: int, nbytes: int) -> None:
        with open(f"/proc/{pid}/fd/{fd}", "r+b") as shared:  # the trainer's memfd
            self.shared_map = mmap.mmap(shared.fileno(), nbytes)
        self.shared = torch.frombuffer(self.shared_map, dtype=torch.uint8)
        self.own = torch.zeros(nbytes, dtype=torch.uint8)

    def memcpy_read(self) -> None:
        self.own.copy_(self.shared)

    def memcpy_release(self) -> None:
        for name in ("shared", "own", "shared_map"):
            self.__dict__.pop(name, None)

    def nothing(self) -> None:
        return None

    def object_store_load(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.load_weights(state_dict.items())

    def _group(self) -> TorchGroup:
        """The group of this worker's lane from the bench's one trainer (its first push formed
        it): the raw baselines broadcast over the very group the push does."""
        lanes = self._weight_sync_member().lanes
        return _group_of(lanes.inbound[0].member.receiver.transport if lanes else None)


@ray.remote(num_cpus=0)
class BenchTrainer:
    def __init__(self, workers: list, device: str = "cpu") -> None:
        torch.set_num_threads(1)
        self.all_workers = workers
        self.device = torch.device(device)
        self.memory = MemoryProbe(device)
        self.updater: WeightUpdater | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.wire_bytes: int | None = None  # of the last push
        self.raw_nbytes: int | None = None  # of the raw broadcast, where not the state dict's
        self.cast: torch.dtype | None = None  # the push's cast dtype: what the workers hold
        self.sent_delta = False  # whether the last push went as a delta
        self.phases: dict[str, float] = {}  # the last push's PushResult.phases

    def describe(self) -> str:
        return describe(self.device.type)

    def setup(
        self,
        workload: Workload,
        workers: int,
        config: SyncConfig,
        trained: bool = False,
        members: Sequence[int] | None = None,
    ) -> int:
        """Build the workload, form a group over the first ``workers`` workers (one warm-up push
        that must land bit-exactly); returns the payload bytes. ``trained``: the values of a
        model's weights and an optimizer to step them (for ``after_step``). ``members``: which
        workers (indices into the trainer's list) instead of the first ``workers`` -- the
        multi-node bench picks them by node."""
        if self.updater is not None:
            self.updater.close()
        self.state = {}
        gc.collect()
        self.state = workload.build(fill=1.0, device=self.device)
        if trained:
            generator = torch.Generator(device=self.device).manual_seed(0)
            for tensor in self.state.values():
                tensor.normal_(0.0, 0.02, generator=generator)
            self.parameters = [torch.nn.Parameter(t) for t in self.state.values()]
            self.state = {n: p.data for n, p in zip(self.state, self.parameters, strict=True)}
            self.optimizer = torch.optim.Adam(self.parameters, lr=1e-6)
        if members is None:
            self.workers = self.all_workers[:workers]
        else:
            self.workers = [self.all_workers[i] for i in members]
        self.cast = getattr(torch, config.cast_dtype) if config.cast_dtype else None
        self.updater = WeightUpdater(self.workers, config)
        self.updater.push(self.state)
        assert self.verify(), "warm-up push did not land bit-exactly"
        return workload.nbytes

    def verify(self) -> bool:
        """Whether every worker holds exactly the trainer's weights as last pushed (cast to the
        push's dtype), by sha256 of every tensor."""
        cast = self.cast
        want = state_dict_digests({n: t.to(cast) if cast else t for n, t in self.state.items()})
        got = ray.get([w.digests.remote() for w in self.workers], timeout=600)
        return all(g == want for g in got)

    def link_run(
        self, strategy: str, device: str
    ) -> tuple[float, int | None, int, bool, dict[str, float]]:
        """:meth:`run`, and the bytes this node sent out of ``device`` meanwhile (its
        ``/proc/net/dev`` counter: this actor lives in its node's network namespace, so the
        counter is that node's link). Returns (seconds, wire bytes, bytes sent, whether the
        push went as a delta, the push's phases)."""
        before = link_tx_bytes(device)
        self.sent_delta, self.phases = False, {}
        seconds, _, wire = self.run(strategy)
        return seconds, wire, link_tx_bytes(device) - before, self.sent_delta, self.phases

    def set_raw_bytes(self, nbytes: int | None) -> None:
        """Size the ``raw`` broadcast (None: the state dict's bytes): the multi-node bench
        compares it with a cast push, whose payload is smaller than the state dict."""
        self.raw_nbytes = nbytes

    def run(self, strategy: str) -> tuple[float, int, int | None]:
        """One timed transfer; returns (seconds, peak extra bytes in this process, bytes the push
        put on the wire where it was one)."""
        run: Callable[[], None] = getattr(self, f"_{strategy}")
        prepare = getattr(self, f"_{strategy}_prepare", None)
        if prepare is not None:
            prepare()
        self.memory.reset()
        seconds = seconds_of(run, self.device)
        peak = self.memory.peak_extra_bytes()
        release = getattr(self, f"_{strategy}_release", None)
        if release is not None:
            release()
        wire, self.wire_bytes = self.wire_bytes, None
        return seconds, peak, wire

    def close(self) -> None:
        if self.updater is not None:
            self.updater.close()

    # -- strategies ----------------------------------------------------------------------------

    def _weight_sync(self) -> None:
        assert self.updater is not None
        result = self.updater.push(self.state)
        self.wire_bytes, self.sent_delta = result.wire_bytes, result.delta
        self.phases = dict(result.phases)

    def _after_step_prepare(self) -> None:
        for parameter in self.parameters:
            parameter.grad = torch.randn_like(parameter)
        self.optimizer.step()

    _after_step = _weight_sync

    def _all_changed_prepare(self) -> None:
        with torch.no_grad():
            for parameter in self.parameters:
                parameter.add_(0.01)

    _all_changed = _weight_sync

    def _raw_prepare(self) -> None:
        nbytes = self.raw_nbytes or sum(t.nbytes for t in self.state.values())
        self.raw_buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self._group().device)
        ray.get([w.raw_prepare.remote(nbytes) for w in self.workers], timeout=600)

    def _raw(self) -> None:
        receiving = [w.raw_receive.remote() for w in self.workers]
        _broadcast(self._group(), self.raw_buffer)
        ray.get(receiving, timeout=600)

    def _memcpy_prepare(self) -> None:
        nbytes = sum(t.nbytes for t in self.state.values())
        self.memfd = os.memfd_create("weight_sync-bench", os.MFD_CLOEXEC)
        os.posix_fallocate(self.memfd, 0, nbytes)
        self.shared_map = mmap.mmap(self.memfd, nbytes)
        self.shared = torch.frombuffer(self.shared_map, dtype=torch.uint8)
        ray.get(
            [w.memcpy_prepare.remote(os.getpid(), self.memfd, nbytes) for w in self.workers],
            timeout=600,
        )

    def _memcpy(self) -> None:
        offset = 0
        for tensor in self.state.values():  # one write
            data = tensor.reshape(-1).view(torch.uint8)
            self.shared[offset : offset + data.numel()].copy_(data)
            offset += data.numel()
        ray.get([w.memcpy_read.remote() for w in self.workers], timeout=600)  # N reads

    def _memcpy_release(self) -> None:
        ray.get([w.memcpy_release.remote() for w in self.workers], timeout=600)
        del self.shared, self.shared_map
        os.close(self.memfd)

    def _raw_release(self) -> None:
        del self.raw_buffer
        ray.get([w.raw_release.remote() for w in self.workers], timeout=600)

    def _per_tensor(self) -> None:
        group = self._group()
        for name, tensor in self.state.items():
            meta = TensorMeta.of(name, tensor)
            refs = [w.per_tensor_receive.remote(name, meta.dtype, meta.shape) for w in self.workers]
            _broadcast(group, tensor)
            ray.get(refs, timeout=600)

    def _fanout(self) -> None:
        pg = self._group().process_group
        names = list(self.state)
        receiving = [w.fanout_receive.remote(names) for w in self.workers]
        for rank in range(1, len(self.workers) + 1):
            for tensor in self.state.values():
                pg.send([tensor], rank, 0).wait()  # type: ignore[attr-defined]
        ray.get(receiving, timeout=600)

    def _ray_call(self) -> None:
        ray.get([w.nothing.remote() for w in self.workers], timeout=600)

    def _object_store(self) -> None:
        ref = ray.put(self.state)
        ray.get([w.object_store_load.remote(ref) for w in self.workers], timeout=600)
        del ref

    def _group(self) -> TorchGroup:
        assert self.updater is not None
        return _group_of(self.updater.group)
