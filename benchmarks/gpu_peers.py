"""The peers' colocated strategies on one GPU, timed beside ours (issue 42, item 4).

The trainer is the calling process and holds a state dict on its current CUDA device; ``readers``
reader processes (spawned, on the same device) each hold their OWN preallocated weights of the
same shapes. A timed push runs from the moment the trainer starts until every reader has the
bytes landed in its own weights (its stream synchronised) and has said so over a pipe. Median
over ``repeats`` pushes after one warm-up, like ``benchmarks/gpu.py``'s ``median_time``.

Strategies, each our own code written after the peer's source (read at the addresses below):

* ``per_tensor_ipc`` -- vLLM's IPC weight-transfer engine, unpacked:
  ``IPCWeightTransferEngine.trainer_send_weights`` / ``receive_weights`` in
  https://github.com/vllm-project/vllm/blob/main/vllm/distributed/weight_transfer/ipc_engine.py
  Per push the trainer exports one CUDA IPC handle per tensor (``reduce_tensor``); a reader opens
  every handle (``rebuild_cuda_tensor`` with the device index patched, as vLLM does), copies each
  into its weight (``load_weights``), then drops them, which closes the mappings and releases
  the trainer's IPC reference counts.
* ``packed_reused_buffer`` -- vLLM's packed IPC mode: ``packed_ipc_producer``,
  ``packed_ipc_consumer`` and ``PackedBufferImporter`` in
  https://github.com/vllm-project/vllm/blob/main/vllm/distributed/weight_transfer/packed_tensor.py
  One buffer of ``bucket_bytes`` on the trainer, exported once; per chunk the trainer packs the
  next tensors into it, synchronises its stream, sends the chunk's layout; readers copy out into
  their weights, synchronise, answer; the trainer waits for every answer (the barrier) before
  packing the next chunk.
* ``flat_bucket_per_dtype`` -- SGLang's ``update_weights_from_tensor(load_format=
  "flattened_bucket")`` as slime and verl drive it: ``FlattenedTensorBucket`` in
  https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/weight_sync/tensor_bucket.py,
  ``MultiprocessingSerializer`` in python/sglang/srt/utils/common.py (``ForkingPickler``, so
  torch's CUDA reductions), ``_update_weights_from_flattened_bucket`` in
  python/sglang/srt/model_executor/model_runner.py, and slime's ``_send_to_colocated_engine`` in
  https://github.com/THUDM/slime/blob/main/slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py
  Per push, per chunk of at most ``bucket_bytes`` (slime's ``chunk_named_params_by_size`` with
  ``update_weight_buffer_size``), per dtype: ``torch.cat`` of the flattened tensors into one new
  buffer, serialised (one CUDA IPC export) for each reader; a reader deserialises it, copies
  each slice into its weight, drops it; the trainer drops the buffer once every reader answered
  (slime's ``ray.get(refs)`` then ``del long_live_tensors``). With ``bucket_bytes`` at least the
  model's size this is exactly one new buffer per dtype per push.

Where we are kinder to a peer than its code, it is said at the place (one copy per reader where
vLLM's packed consumer clones and then loads; the packed buffer exported once per run, not once
per transfer). Torch's side of every handle: ``reduce_tensor`` / ``rebuild_cuda_tensor`` in
torch/multiprocessing/reductions.py and ``THPStorage_shareCuda`` / ``THPStorage_newSharedCuda``
in torch/csrc/StorageSharing.cpp: an export records an interprocess event on the trainer's
current stream and the first open of a storage makes the reader's current stream wait on it; a
storage already open (cached by handle and offset) waits on nothing, which is why the packed
mode synchronises the trainer's stream before every chunk.

``bit_exact``: before push ``v`` the trainer refills its weights in place from a CUDA generator
seeded with ``(seed, v)``; after the last push every reader regenerates the expected tensors of
the last version from the same seed on the same device, one at a time, and compares their bytes
with its weights (``torch.equal`` on uint8 views). A lost, stale or partial copy fails it.

    python benchmarks/gpu_peers.py --gib 0.25 --readers 1 --repeats 3 [--out peers.json]

prints a table: each strategy's median against the floor (``floor_s``: one device-to-device
copy per reader inside one process). Without CUDA it says so and exits 1; ``--cpu`` runs the
same harness over shared memory (torch's CPU reductions) to smoke-test it, not a GPU figure.
``benchmarks/gpu.py`` imports ``STRATEGIES``, ``run_peers`` and ``floor_s`` from here (this
folder on ``sys.path``; the spawned readers inherit it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as torch_mp  # registers torch's tensor reductions on ForkingPickler
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

STRATEGIES: tuple[str, ...] = ("per_tensor_ipc", "packed_reused_buffer", "flat_bucket_per_dtype")
MIRRORS = {
    "per_tensor_ipc": "vLLM ipc_engine.py (unpacked)",
    "packed_reused_buffer": "vLLM packed_tensor.py packed_ipc_producer/consumer",
    "flat_bucket_per_dtype": "SGLang FlattenedTensorBucket via slime/verl",
}
Shapes = list[tuple[str, tuple[int, ...]]]
Layout = list[tuple[int, int, int]]  # (tensor index, byte offset in the buffer, bytes)
_DIRECT_NORMAL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_REBUILD_DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device (vLLM patches the same index)


def llama_shapes(gib: float, hidden: int = 4096) -> Shapes:
    """A Llama-shaped state dict of about ``gib`` GiB in bf16 (at least one layer): per layer
    four square attention matrices, three MLP matrices and two norms. ``gpu.py`` pushes the
    same model."""
    mlp = hidden * 11008 // 4096
    per_layer = (4 * hidden * hidden + 3 * hidden * mlp + 2 * hidden) * 2
    shapes: Shapes = []
    for layer in range(max(1, int(gib * (1 << 30) / per_layer))):
        prefix = f"layers.{layer}."
        shapes += [(prefix + f"attn.{p}.weight", (hidden, hidden)) for p in "qkvo"]
        shapes += [(prefix + f"mlp.{p}.weight", (mlp, hidden)) for p in ("gate", "up")]
        shapes += [(prefix + "mlp.down.weight", (hidden, mlp))]
        shapes += [(prefix + f"{p}.weight", (hidden,)) for p in ("input_norm", "post_norm")]
    return shapes


def chunk_plan(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Tensor indices in order, a new chunk started when the next tensor would overflow
    ``bucket_bytes`` (vLLM's ``packed_ipc_producer`` and slime's ``chunk_named_params_by_size``
    cut the same way); a tensor larger than a bucket gets a chunk of its own."""
    chunks: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, size in enumerate(sizes):
        if current and used + size > bucket_bytes:
            chunks.append(current)
            current, used = [], 0
        current.append(index)
        used += size
    if current:
        chunks.append(current)
    return chunks


# -- deterministic weights and the check -------------------------------------------------------


def _generator(seed: int, version: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + version)


def _fill_one(tensor: torch.Tensor, generator: torch.Generator) -> None:
    if tensor.dtype in _DIRECT_NORMAL:
        tensor.normal_(generator=generator)
    elif tensor.is_floating_point():  # fp8 and the like: drawn in fp32, then cast
        drawn = torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)
        tensor.copy_(drawn.normal_(generator=generator))
    else:
        tensor.random_(0, 128, generator=generator)


def fill(tensors: Sequence[torch.Tensor], seed: int, version: int) -> None:
    """Version ``version``'s weights, in place, in order (the same bytes in every process on
    the same device and torch)."""
    if tensors:
        generator = _generator(seed, version, tensors[0].device)
        for tensor in tensors:
            _fill_one(tensor, generator)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def mismatches(tensors: Sequence[torch.Tensor], seed: int, version: int) -> list[int]:
    """Indices of the tensors whose bytes differ from version ``version``'s (regenerated one at
    a time, so the check never holds a second copy of the model)."""
    bad: list[int] = []
    if tensors:
        generator = _generator(seed, version, tensors[0].device)
        for index, tensor in enumerate(tensors):
            expected = torch.empty_like(tensor)
            _fill_one(expected, generator)
            if not torch.equal(_raw(tensor), _raw(expected)):
                bad.append(index)
    return bad


# -- readers (spawned processes) ---------------------------------------------------------------


def _sync(device: torch.device) -> None:
    """Wait until this process's work queued on ``device`` (its current stream) is done."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _open(handle: tuple[Callable[..., torch.Tensor], tuple[Any, ...]], device: torch.device) -> Any:
    """Open one exported tensor the way vLLM's ``receive_weights`` does: the rebuild function
    called on its args, a CUDA one's storage device replaced by this process's index."""
    rebuild, args = handle
    if rebuild is rebuild_cuda_tensor:
        patched = list(args)
        patched[_REBUILD_DEVICE_ARG] = device.index
        args = tuple(patched)
    return rebuild(*args)


class _PerTensorReader:
    """vLLM ``IPCWeightTransferEngine.receive_weights``: every handle opened into a list, the
    list handed to ``load_weights`` (here: a copy into each weight), then dropped."""

    def __init__(self, weights: list[torch.Tensor], device: torch.device) -> None:
        self.weights, self.device = weights, device

    def on_push(self, handles: list[Any]) -> int:
        opened = [_open(handle, self.device) for handle in handles]
        for weight, tensor in zip(self.weights, opened, strict=True):
            weight.copy_(tensor)
        _sync(self.device)  # landed before we answer or release
        # Returning drops every opened tensor (before the answer goes out): the mappings close
        # and each release decrements the trainer's IPC reference count.
        return len(opened)


class _PackedReader:
    """vLLM ``packed_ipc_consumer`` with one ``PackedBufferImporter``: the shared buffer opened
    once and kept; per chunk each tensor's bytes copied out. vLLM clones each slice and its
    ``load_weights`` then copies the clone into the parameter: two copies; here one, straight
    into the weight (kinder to the peer)."""

    def __init__(self, weights: list[torch.Tensor], device: torch.device) -> None:
        self.device = device
        self.views = [_raw(weight) for weight in weights]  # uint8 views of our own weights
        self.buffer: torch.Tensor | None = None

    def on_setup(self, handle: Any) -> int:
        self.buffer = _open(handle, self.device)
        _sync(self.device)
        return int(self.buffer.numel())

    def on_chunk(self, layout: Layout) -> int:
        assert self.buffer is not None, "chunk before setup"
        for index, offset, nbytes in layout:
            self.views[index].copy_(self.buffer[offset : offset + nbytes])
        # Finished reading before we answer: the trainer overwrites the buffer after the barrier.
        _sync(self.device)
        return len(layout)


class _FlatReader:
    """SGLang ``update_weights_from_tensor(load_format="flattened_bucket")``:
    ``MultiprocessingSerializer.deserialize`` (which opens the handle and makes this stream wait
    on the trainer's export event), ``FlattenedTensorBucket.reconstruct_tensors`` (slices of the
    flat buffer) and ``load_weights`` (a copy into each weight), then the bucket dropped."""

    def __init__(self, weights: list[torch.Tensor], device: torch.device) -> None:
        self.device = device
        self.flat = [weight.reshape(-1) for weight in weights]

    def on_bucket(self, data: bytes) -> int:
        bucket = ForkingPickler.loads(data)
        flattened, metadata = bucket["flattened_tensor"], bucket["metadata"]
        for index, start, end in metadata:
            self.flat[index].copy_(flattened[start:end])
        _sync(self.device)
        del bucket, flattened  # released before we answer, so the trainer may free it
        return len(metadata)


_READERS: dict[str, Callable[[list[torch.Tensor], torch.device], Any]] = {
    "per_tensor_ipc": _PerTensorReader,
    "packed_reused_buffer": _PackedReader,
    "flat_bucket_per_dtype": _FlatReader,
}


def _reader_main(
    conn: Connection,
    strategy: str,
    device_name: str,
    shapes: Shapes,
    dtype: torch.dtype,
    seed: int,
    timeout_s: float,
) -> None:
    """One reader: its own zeroed weights on the trainer's device, then (tag, payload) messages
    answered with (tag, result) until "close"; any failure is answered ("error", traceback)."""
    try:
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        weights = [torch.zeros(shape, dtype=dtype, device=device) for _, shape in shapes]
        reader = _READERS[strategy](weights, device)
        _sync(device)
        conn.send(("ready", None))
        while True:
            if not conn.poll(timeout_s):
                raise TimeoutError(f"no message from the trainer in {timeout_s}s")
            tag, payload = conn.recv()
            if tag == "close":
                break
            if tag == "check":
                result: Any = mismatches(weights, seed, payload)
            else:
                result = getattr(reader, "on_" + tag)(payload)
            conn.send((tag, result))
    except (EOFError, BrokenPipeError):
        pass  # the trainer is gone: nothing left to answer
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


# -- the trainer's side ------------------------------------------------------------------------


class _Readers:
    """The spawned readers of one strategy, one duplex pipe each. Every wait is bounded: answers
    by a deadline of ``timeout_s`` per gather, and a send (which blocks only while a reader does
    not drain its pipe) by a watchdog that kills the readers ``timeout_s`` after it started."""

    def __init__(
        self,
        strategy: str,
        count: int,
        device: torch.device,
        shapes: Shapes,
        dtype: torch.dtype,
        seed: int,
        timeout_s: float,
    ) -> None:
        self.timeout_s = timeout_s
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self._deadline: float | None = None
        self._expired = False
        self._closed = threading.Event()
        ctx = torch_mp.get_context("spawn")
        try:
            for rank in range(count):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_reader_main,
                    args=(child, strategy, str(device), shapes, dtype, seed, timeout_s),
                    name=f"gpu-peers-{strategy}-{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()  # ours closed: a reader's death reads as EOF here
                self.conns.append(parent)
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, daemon=True)
        self._watchdog.start()

    @property
    def count(self) -> int:
        return len(self.conns)

    def _watch(self) -> None:
        while not self._closed.wait(0.2):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._expired = True
                for proc in self.procs:
                    proc.kill()
                return

    def send(self, rank: int, message: tuple[str, Any]) -> None:
        self._deadline = time.monotonic() + self.timeout_s
        try:
            self.conns[rank].send(message)
        except OSError as exc:  # BrokenPipeError included
            if self._expired:
                raise TimeoutError(
                    f"reader {rank} did not take {message[0]!r} in {self.timeout_s}s"
                ) from exc
            code = self.procs[rank].exitcode
            raise RuntimeError(f"reader {rank} is gone (exit code {code})") from exc
        finally:
            self._deadline = None

    def broadcast(self, message: tuple[str, Any]) -> None:
        for rank in range(self.count):
            self.send(rank, message)

    def gather(self, tag: str) -> list[Any]:
        """Every reader's answer to ``tag``, within ``timeout_s`` from now."""
        deadline = time.monotonic() + self.timeout_s
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        answers: dict[int, Any] = {}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"readers {sorted(pending.values())} did not answer {tag!r} "
                    f"in {self.timeout_s}s"
                )
            for conn in wait_connections(list(pending), timeout=remaining):
                assert isinstance(conn, Connection)
                rank = pending.pop(conn)
                try:
                    got, value = conn.recv()
                except EOFError:
                    code = self.procs[rank].exitcode
                    raise RuntimeError(
                        f"reader {rank} exited (code {code}) before answering {tag!r}"
                    ) from None
                if got == "error":
                    raise RuntimeError(f"reader {rank} failed:\n{value}")
                if got != tag:
                    raise RuntimeError(f"reader {rank} answered {got!r} to {tag!r}")
                answers[rank] = value
        return [answers[rank] for rank in range(self.count)]

    def close(self, kill: bool = False) -> None:
        """Ask every reader to finish (10 s for all of them), then kill whoever is left;
        ``kill`` (after a failure) kills at once."""
        self._closed.set()
        if not kill:
            for conn in self.conns:
                with contextlib.suppress(Exception):
                    conn.send(("close", None))
            deadline = time.monotonic() + 10
            for proc in self.procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        for conn in self.conns:
            conn.close()


def _push_per_tensor(readers: _Readers, weights: list[torch.Tensor]) -> None:
    """vLLM ``trainer_send_weights``: ``reduce_tensor(tensor.detach().contiguous())`` per
    tensor, the (rebuild, args) list in one message. One export per reader, so each reader's
    release pairs with its own export in torch's IPC reference count."""
    for rank in range(readers.count):
        handles = [reduce_tensor(weight.detach().contiguous()) for weight in weights]
        readers.send(rank, ("push", handles))
    readers.gather("push")


class _PackedTrainer:
    """vLLM ``packed_ipc_producer``: one uint8 buffer of ``bucket_bytes``, exported once; per
    chunk the tensors' bytes copied in at consecutive offsets, the stream synchronised ("drain
    queued copies so the consumer sees a fully-written buffer"), the chunk's layout sent, and
    the next chunk packed only after every reader answered (vLLM: the caller's ``ray.get`` and
    the per-chunk barrier). vLLM exports a new buffer per transfer; exported once here (kinder
    to the peer: no fresh ``cudaIpcOpenMemHandle`` per push)."""

    def __init__(self, readers: _Readers, weights: list[torch.Tensor], bucket_bytes: int) -> None:
        sizes = [weight.nbytes for weight in weights]
        _check_fits(sizes, bucket_bytes)
        self.readers, self.device = readers, weights[0].device
        self.sources = [_raw(weight) for weight in weights]
        self.layouts: list[Layout] = []
        for chunk in chunk_plan(sizes, bucket_bytes):
            layout: Layout = []
            offset = 0
            for index in chunk:
                layout.append((index, offset, sizes[index]))
                offset += sizes[index]
            self.layouts.append(layout)
        self.buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=self.device)
        for rank in range(readers.count):
            readers.send(rank, ("setup", reduce_tensor(self.buffer)))
        readers.gather("setup")

    def push(self) -> None:
        for layout in self.layouts:
            for index, offset, nbytes in layout:
                self.buffer[offset : offset + nbytes].copy_(self.sources[index])
            _sync(self.device)
            self.readers.broadcast(("chunk", layout))
            self.readers.gather("chunk")  # nobody reads the buffer any more: we may overwrite it


def _check_fits(sizes: Sequence[int], bucket_bytes: int) -> None:
    largest = max(sizes, default=0)
    if largest > bucket_bytes:  # vLLM's packed_ipc_producer raises the same way
        raise ValueError(f"a tensor of {largest} bytes exceeds bucket_bytes={bucket_bytes}")


def _serialize(obj: Any) -> bytes:
    """SGLang's ``MultiprocessingSerializer.serialize``: ``ForkingPickler``, so a CUDA tensor
    becomes a CUDA IPC export (torch's ``reduce_tensor``)."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    return buffer.getvalue()


def _push_flat(readers: _Readers, weights: list[torch.Tensor], chunks: list[list[int]]) -> None:
    """slime ``_send_to_colocated_engine`` per chunk: tensors grouped by dtype, each group a
    ``FlattenedTensorBucket`` (flatten + ``torch.cat``: a new buffer), serialised per reader
    (one export each), one ``update_weights_from_tensor`` per group; the buffers kept alive
    (``long_live_tensors``) until every reader answered, then dropped."""
    for chunk in chunks:
        groups: dict[torch.dtype, list[int]] = {}
        for index in chunk:
            groups.setdefault(weights[index].dtype, []).append(index)
        long_live: list[dict[str, Any]] = []
        for indices in groups.values():
            metadata: list[tuple[int, int, int]] = []
            start = 0
            for index in indices:
                numel = weights[index].numel()
                metadata.append((index, start, start + numel))
                start += numel
            flattened = torch.cat([weights[index].reshape(-1) for index in indices])
            bucket = {"flattened_tensor": flattened, "metadata": metadata}
            long_live.append(bucket)
            for rank in range(readers.count):
                readers.send(rank, ("bucket", _serialize(bucket)))
        for _ in long_live:
            readers.gather("bucket")
        del long_live, bucket, flattened


def _run_strategy(
    strategy: str,
    shapes: Shapes,
    weights: list[torch.Tensor],
    readers: int,
    repeats: int,
    timeout_s: float,
    bucket_bytes: int,
    seed: int,
) -> dict[str, Any]:
    device = weights[0].device
    total = sum(weight.nbytes for weight in weights)
    dtype = weights[0].dtype
    if strategy == "packed_reused_buffer":  # before any reader is spawned
        _check_fits([weight.nbytes for weight in weights], bucket_bytes)
    pool = _Readers(strategy, readers, device, shapes, dtype, seed, timeout_s)
    failed = True
    try:
        pool.gather("ready")
        chunks = 1
        push: Callable[[], None]
        if strategy == "per_tensor_ipc":

            def push() -> None:
                _push_per_tensor(pool, weights)

        elif strategy == "packed_reused_buffer":
            packed = _PackedTrainer(pool, weights, bucket_bytes)
            push, chunks = packed.push, len(packed.layouts)
        elif strategy == "flat_bucket_per_dtype":
            plan = chunk_plan([weight.nbytes for weight in weights], bucket_bytes)
            chunks = len(plan)

            def push() -> None:
                _push_flat(pool, weights, plan)

        else:
            raise ValueError(f"unknown strategy {strategy!r}; known: {STRATEGIES}")
        seconds: list[float] = []
        last = repeats + 1  # one warm-up, then the timed pushes
        for version in range(1, last + 1):
            fill(weights, seed, version)  # untimed: the optimizer's step
            _sync(device)
            start = time.perf_counter()
            push()  # returns once every reader said its copy landed
            seconds.append(time.perf_counter() - start)
        pool.broadcast(("check", last))
        bad = pool.gather("check")
        timed = seconds[1:]
        failed = False
        return {
            "median_s": statistics.median(timed),
            "all_s": timed,
            "bit_exact": not any(bad),
            "mismatched_tensors": [len(b) for b in bad],
            "bytes": total,
            "tensors": len(weights),
            "chunks": chunks,
            "readers": readers,
            "mirrors": MIRRORS[strategy],
        }
    finally:
        pool.close(kill=failed)


def run_peers(
    shapes: list[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    readers: int,
    repeats: int,
    timeout_s: float,
    bucket_bytes: int,
    *,
    strategies: Sequence[str] = STRATEGIES,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> dict[str, dict[str, Any]]:
    """Time each of ``strategies`` pushing a state dict of ``shapes`` in ``dtype`` from this
    process's current CUDA device to ``readers`` spawned readers on the same device.

    Per strategy: ``median_s`` and ``all_s`` (seconds of the timed pushes, after one warm-up),
    ``bit_exact`` (every reader's weights equal the last version's, byte for byte), ``bytes``
    (one push), ``tensors``, ``chunks`` (messages per push and reader), ``readers``,
    ``mirrors``; a strategy that failed has ``error`` and ``traceback`` (its readers killed, the
    others still run), ``bit_exact`` False and ``median_s`` NaN. Every wait is bounded by
    ``timeout_s``. Call it from a non-daemonic process, since it spawns the readers:
    benchmarks/gpu.py's main process, say, not one of its ``daemon=True`` ranks.
    ``device="cpu"`` runs the same harness over shared memory (torch's CPU reductions) instead
    of CUDA IPC: a smoke test of the harness, not a figure.
    """
    if readers < 1 or repeats < 1 or bucket_bytes < 1 or timeout_s <= 0:
        raise ValueError("readers, repeats, bucket_bytes and timeout_s must be positive")
    if not shapes:
        raise ValueError("no tensors to push")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; known: {STRATEGIES}")
    if dtype == torch.bool or dtype.is_complex:
        raise ValueError(f"{dtype} is not a weight dtype this benchmark draws")
    if torch_mp.current_process().daemon:
        raise RuntimeError(
            "run_peers spawns its readers, and a daemonic process may not have children: call "
            "it from the main process (or any process started with daemon=False)"
        )
    where = _device(device)
    total = sum(math.prod(shape) for _, shape in shapes) * torch.empty((), dtype=dtype).itemsize
    results: dict[str, dict[str, Any]] = {}
    for strategy in strategies:
        # Weights of its own per strategy: each export of a live storage (per_tensor_ipc's
        # reduce_tensor, readers x tensors a push) wraps it in torch's CudaIPCSentData with an
        # interprocess event until the storage is freed, and past 1000 such events torch
        # exports without one (a stream sync per export instead): what vLLM reaches after
        # enough steps, but it must not carry over into the strategies run after it.
        weights = [torch.empty(shape, dtype=dtype, device=where) for _, shape in shapes]
        try:
            results[strategy] = _run_strategy(
                strategy, shapes, weights, readers, repeats, timeout_s, bucket_bytes, seed
            )
        except Exception as exc:
            results[strategy] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
                "median_s": math.nan,
                "all_s": [],
                "bit_exact": False,
                "bytes": total,
                "readers": readers,
                "mirrors": MIRRORS[strategy],
            }
        finally:
            del weights
            if where.type == "cuda":
                torch.cuda.synchronize(where)
                torch.cuda.ipc_collect()  # blocks whose readers released them late
    return results


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: the peers' colocated strategies are CUDA IPC")
        return torch.device("cuda", torch.cuda.current_device())
    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())
    if where.type not in ("cuda", "cpu"):
        raise ValueError(f"device {where} is neither CUDA nor the CPU")
    return where


def floor_s(
    total_bytes: int, readers: int, repeats: int, *, device: torch.device | str | None = None
) -> float:
    """Median seconds of ``readers`` device-to-device copies of ``total_bytes`` (one per reader)
    inside this process, on its current CUDA device, after one warm-up: the floor."""
    where = _device(device)
    source = torch.empty(total_bytes, dtype=torch.uint8, device=where)
    targets = [torch.empty_like(source) for _ in range(readers)]
    runs: list[float] = []
    for _ in range(1 + repeats):
        _sync(where)
        start = time.perf_counter()
        for target in targets:
            target.copy_(source)
        _sync(where)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs[1:])


def report(results: dict[str, dict[str, Any]], floor: float) -> str:
    lines = [
        "| strategy | mirrors | readers | bytes | chunks | median | floor | ratio | GB/s | exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            error = r["error"].splitlines()[0][:80]
            lines.append(
                f"| {name} | {r['mirrors']} | {r['readers']} | | | failed: {error} | | | | no |"
            )
            continue
        landed = r["bytes"] * r["readers"] / r["median_s"] / 1e9
        lines.append(
            f"| {name} | {r['mirrors']} | {r['readers']} | {r['bytes'] / 1e9:.3f} GB | "
            f"{r['chunks']} | {r['median_s'] * 1e3:.2f} ms | {floor * 1e3:.2f} ms | "
            f"{r['median_s'] / floor:.2f}x | {landed:.1f} | {'yes' if r['bit_exact'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="size of the synthetic model")
    parser.add_argument("--hidden", type=int, default=4096, help="the model's hidden size")
    parser.add_argument("--readers", type=int, default=1, help="reader processes on the GPU")
    parser.add_argument("--repeats", type=int, default=5, help="timed pushes (after a warm-up)")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound on every wait (s)")
    parser.add_argument("--bucket-mib", type=float, default=256.0, help="bucket_bytes in MiB")
    parser.add_argument("--dtype", default="bfloat16", help="a torch dtype name")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument(
        "--cpu", action="store_true", help="smoke-test the harness on the CPU (no GPU figure)"
    )
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print(
            "gpu_peers.py: no CUDA device here; the peers' colocated strategies (CUDA IPC "
            "between processes on one GPU) need one. Nothing was timed "
            "(--cpu smoke-tests the harness).",
            file=sys.stderr,
        )
        return 1
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        parser.error(f"--dtype {args.dtype!r} is not a torch dtype")
    where = _device("cpu" if args.cpu else None)
    strategies = [s for s in args.strategies.split(",") if s]
    shapes = llama_shapes(args.gib, args.hidden)
    bucket = int(args.bucket_mib * (1 << 20))
    results = run_peers(
        shapes,
        dtype,
        args.readers,
        args.repeats,
        args.timeout,
        bucket,
        strategies=strategies,
        device=where,
    )
    total = sum(math.prod(shape) for _, shape in shapes) * dtype.itemsize
    floor = floor_s(total, args.readers, args.repeats, device=where)
    if where.type == "cuda":
        device = f"{torch.cuda.get_device_name(where)}, torch {torch.__version__}"
    else:
        device = f"CPU (smoke test of the harness), torch {torch.__version__}"
    print(
        f"{device}; {len(shapes)} tensors, {total / 1e9:.3f} GB {args.dtype}, "
        f"{args.readers} reader(s), bucket {bucket} B, median of {args.repeats} pushes"
    )
    print(report(results, floor))
    for name, r in results.items():
        if "traceback" in r:
            print(f"{name} failed:\n{r['traceback']}", file=sys.stderr)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"device": device, "floor_s": floor, "results": results}
        args.out.write_text(json.dumps(payload, indent=2))
    ok = all("error" not in r and r["bit_exact"] for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
