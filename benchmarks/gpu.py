"""GPU benchmark without Ray: weight_sync's data plane against the raw collective it rides on.

Two cases, each timed as the median of several pushes after one warm-up, rank 0 timing from the
start of a push until every rank has said it holds the bytes (an all-reduce or a ring vote):

* ``nccl`` (needs 2+ GPUs, one rank each; rank 0 is the trainer): a plan of a synthetic
  Llama-shaped state dict in bf16 pushed by ``Sender``/``Receiver`` over one NCCL group, against
  one raw NCCL broadcast of a flat buffer of the same bytes over the very same communicator.
  Bus bandwidth for a broadcast equals the algorithm bandwidth (bytes / time), as in nccl-tests.
* ``colocated`` (one GPU is enough): 1 and 7 processes on the trainer's GPU receive the same
  push over the CUDA ring (``cuda_ipc``), and 1 over the host ring (``shm``, device to host to
  device), against one device-to-device copy of the same bytes per reader inside one process
  (the floor). Buckets as ``SyncConfig()`` sizes them on the trainer's GPU (``bucket_bytes``
  "auto"), unless ``--bucket-mb`` says; ``--sweep 64,128,512`` adds the 7-reader push at each
  of those sizes, to compare the default with the best.

    python benchmarks/gpu.py --gib 2 --repeats 5 --out benchmarks/results/gpu

Writes ``gpu.json`` and ``gpu.md`` under ``--out``. ``--cpu`` runs the same harness over Gloo
and the host ring on the CPU (a smoke test of the harness itself, not a GPU figure).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import queue
import secrets
import socket
import statistics
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gpu_peers  # beside this script (benchmarks/ is on sys.path when it runs)
import torch
from gpu_peers import llama_shapes as model_shapes

from weight_sync.tools.bench import timing as bench_timing
from weight_sync.config import SyncConfig
from weight_sync.transport.devices import sized_for
from weight_sync.wire.metadata import GroupSpec, PrepareRequest, SyncPlan, TensorMeta
from weight_sync.wire.planner import direct_threshold, make_plan
from weight_sync.receive.receiver import Receiver, accept_all
from weight_sync.send.sender import Sender
from weight_sync.transport import TorchGroup, bind_listener, cuda_ipc, shm

ALIGN = 256
PEER_BUCKET = 1 << 30


def bucket_bytes(args: argparse.Namespace, device: torch.device, bucket_mb: int | None) -> int:
    """The bucket size of a case: ``bucket_mb`` if given, else what ``SyncConfig()`` picks for
    a trainer on ``device`` (its default, "auto")."""
    if bucket_mb is not None:
        return bucket_mb << 20
    return sized_for(SyncConfig(), device).sized_bucket_bytes


def plan_of(metas: list[TensorMeta], bucket: int, device_type: str, collective: bool) -> SyncPlan:
    """The plan the library makes (``direct_min_bytes="auto"``) for these buckets, over a
    collective or over the rings only (see ``direct_threshold``)."""
    threshold = direct_threshold("auto", device_type, bucket, collective)
    direct = [threshold is not None and meta.nbytes >= threshold for meta in metas]
    return make_plan(metas, bucket, ALIGN, direct)


def build(
    gib: float, hidden: int, device: torch.device, bucket: int, collective: bool
) -> tuple[SyncPlan, dict[str, torch.Tensor]]:
    generator = torch.Generator(device=device).manual_seed(1)
    tensors = {
        name: torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
        for name, shape in model_shapes(gib, hidden)
    }
    metas = [TensorMeta.of(name, tensor) for name, tensor in tensors.items()]
    return plan_of(metas, bucket, device.type, collective), tensors


def spec(
    group_id: str, rank: int, world: int, transport: str, port: int, backend: str
) -> GroupSpec:
    if transport == "group":
        address = "127.0.0.1"
    else:
        address = (cuda_ipc.socket_name if transport == "cuda_ipc" else shm.socket_name)(group_id)
    return GroupSpec(
        group_id=group_id,
        address=address,
        port=port,
        transport=transport,
        world_size=world,
        rank=rank,
        backend=backend,
        mode="standalone",
        rendezvous_timeout_s=120,
        collective_timeout_s=120,
    )


def median_time(step: Any, repeats: int) -> float:
    # One warm-up: communicators, staging buffers, IPC handles.
    return statistics.median(bench_timing.timed(step, repeats))


@dataclass(frozen=True)
class Case:
    name: str
    transport: str  # "group", "cuda_ipc" or "shm"
    world: int  # the trainer and its readers
    bucket_mb: int | None = None  # None: the default config's ("auto")


def cases_for(args: argparse.Namespace, gpus: int) -> list[Case]:
    mb = args.bucket_mb
    if args.cpu:
        return [Case("gloo 1 -> 2", "group", 3, mb), Case("host ring 1 -> 1", "shm", 2, mb)]
    cases = [
        Case("colocated cuda_ipc 1 -> 1", "cuda_ipc", 2, mb),
        Case("colocated cuda_ipc 1 -> 7", "cuda_ipc", 8, mb),
        Case("colocated shm (host ring) 1 -> 1", "shm", 2, mb),
    ]
    cases += [Case(f"colocated cuda_ipc 1 -> 7, {size} MiB", "cuda_ipc", 8, size)
              for size in args.sweep]  # fmt: skip
    if gpus >= 2:
        cases.insert(0, Case(f"nccl 1 -> {gpus - 1}", "group", gpus, mb))
    return cases


# -- ranks ---------------------------------------------------------------------------------------


def _backend(args: argparse.Namespace) -> str:
    return "gloo" if args.cpu else "nccl"


def trainer(args: argparse.Namespace, case: Case, port_queue: Any, world: int) -> dict[str, Any]:
    transport = case.transport
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    bucket = bucket_bytes(args, device, case.bucket_mb)
    plan, tensors = build(args.gib, args.hidden, device, bucket, transport == "group")
    group_id = secrets.token_hex(8)
    listener: socket.socket | None = None
    if transport == "group":
        listener = bind_listener("127.0.0.1")
        port = listener.getsockname()[1]
        part: Any = None
    else:
        port = 0
        slot = shm.slot_bytes_for(bucket, 4096)
        part = (
            cuda_ipc.CudaIpcWriter(group_id, world - 1, slot, 120, device)
            if transport == "cuda_ipc"
            else shm.ShmWriter(group_id, world - 1, slot, 120, device=device)
        )
    for _ in range(world - 1):
        port_queue.put((group_id, port, bucket))
    if listener is not None:
        on = None if args.cpu else device
        part = TorchGroup.join(
            spec(group_id, 0, world, "group", port, _backend(args)), listener, device=on
        )
    else:
        part.accept(120)
    sender = Sender(part)
    result: dict[str, Any] = {
        "bytes": plan.nbytes,
        "tensors": len(plan.tensors),
        "buckets": len(plan.buckets),
        "bucket_mib": bucket >> 20,
        "ranks": world,
    }

    def push() -> None:
        sender.send(plan, list(tensors.values()))
        part.vote(0)  # every rank holds the bytes

    result["weight_sync_s"] = median_time(push, args.repeats)
    flat = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    if transport == "group":

        def raw() -> None:
            part.broadcast(flat, src=0).wait()
            part.vote(0)

        result["raw_broadcast_s"] = median_time(raw, args.repeats)
    else:
        copy = torch.empty_like(flat)

        def floor() -> None:  # each reader writes its own copy of the bytes once
            for _ in range(world - 1):
                copy.copy_(flat)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        result["d2d_copy_s"] = median_time(floor, args.repeats)
        part.vote(0)  # measured while the readers' processes still idle: they leave now
    part.close()
    return result


def worker(args: argparse.Namespace, case: Case, port_queue: Any, world: int, rank: int) -> bool:
    """Receive the pushes into this reader's own weights; returns whether they equal the
    trainer's, byte for byte."""
    transport = case.transport
    device = torch.device("cuda", rank if transport == "group" else 0)
    if args.cpu:
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(device)  # for libraries that read it; weight_sync is told the device
    group_id, port, bucket = port_queue.get(timeout=120)
    receiver = Receiver(device)
    receiver.join(spec(group_id, rank, world, transport, port, _backend(args)), 1 << 26)
    # The same plan as the trainer's, derived here (the shapes alone; no weights are needed).
    shapes = model_shapes(args.gib, args.hidden)
    metas = [TensorMeta(name=n, dtype="bfloat16", shape=s) for n, s in shapes]
    plan = plan_of(metas, bucket, "cpu" if args.cpu else "cuda", transport == "group")
    # The reader's weights, where the bytes land (in place, as in a worker with a model).
    weights = {
        name: torch.empty(shape, dtype=torch.bfloat16, device=device) for name, shape in shapes
    }
    version = 0

    def push() -> None:
        nonlocal version
        version += 1
        request = PrepareRequest(version=version, plan_digest=plan.digest, plan=plan)
        assert receiver.prepare(request.model_dump_json(), accept_all).accepted
        receiver.receive(version, lambda items: None, destinations=weights)
        receiver.commit(version, lambda items: None, destinations=weights)
        assert receiver.transport is not None
        receiver.transport.vote(0)

    for _ in range(1 + args.repeats):
        push()
    if transport == "group":
        flat = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
        assert receiver.transport is not None
        for _ in range(1 + args.repeats):
            receiver.transport.broadcast(flat, src=0).wait()
            receiver.transport.vote(0)
    else:
        assert receiver.transport is not None
        receiver.transport.vote(0)  # the trainer times its floor first
    receiver.leave()
    _, expected = build(args.gib, args.hidden, device, bucket, transport == "group")
    return all(torch.equal(weights[name], tensor) for name, tensor in expected.items())


def _entry(
    role: str,
    args: argparse.Namespace,
    case: Case,
    ports: Any,
    results: Any,
    world: int,
    rank: int,
) -> None:
    try:
        if role == "trainer":
            results.put((rank, True, trainer(args, case, ports, world)))
        else:
            results.put((rank, True, worker(args, case, ports, world, rank)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_case(args: argparse.Namespace, case: Case) -> dict[str, Any]:
    transport, world = case.transport, case.world
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(
            target=_entry,
            args=(
                "trainer" if rank == 0 else "worker",
                args,
                case,
                ports,
                results,
                world,
                rank,
            ),
            daemon=True,
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        out: dict[str, Any] = {}
        exact = []
        for _ in range(world):
            try:
                rank, ok, value = results.get(timeout=args.timeout)
            except queue.Empty:
                raise RuntimeError(
                    f"{transport}: ranks did not finish in {args.timeout}s"
                ) from None
            if not ok:
                raise RuntimeError(f"{transport} rank {rank} failed:\n{value}")
            if rank == 0:
                out = value
            else:
                exact.append(value)
        if not all(exact):
            raise RuntimeError(f"{transport}: readers {exact} (bit-exact) -- a wrong byte landed")
        return {**out, "bit_exact": True}
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def peers(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The peers' colocated strategies (``gpu_peers``), into their readers' own weights, beside
    one device-to-device copy per reader, with the same model and buckets as our cases. Run
    from this (main) process: ``run_peers`` spawns its readers."""
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    shapes = model_shapes(args.gib, args.hidden)
    # The peers' own default chunk: 1 GiB (vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES; slime's
    # documented bucket), at least the largest tensor (vLLM's packed mode refuses one larger);
    # on the CPU smoke test, ours.
    largest = max(math.prod(shape) for _, shape in shapes) * 2  # bf16
    ours = bucket_bytes(args, device, args.bucket_mb)
    bucket = max(ours if args.cpu else PEER_BUCKET, largest)
    rows: dict[str, dict[str, Any]] = {}
    for readers in (1,) if args.cpu else (1, 7):
        found = gpu_peers.run_peers(
            shapes, torch.bfloat16, readers, args.repeats, args.timeout, bucket, device=device
        )
        floor = None
        for strategy, result in found.items():
            name = f"peer {strategy} 1 -> {readers}"
            if "error" in result or not result["bit_exact"]:
                rows[name] = {"error": result.get("error", "not bit-exact")}
                continue
            if floor is None:
                floor = gpu_peers.floor_s(result["bytes"], readers, args.repeats, device=device)
            rows[name] = {
                "bytes": result["bytes"],
                "ranks": readers + 1,
                "bucket_mib": bucket >> 20,
                "push_s": result["median_s"],
                "d2d_copy_s": floor,
            }
            print(name, json.dumps(rows[name]), flush=True)
    return rows


def report(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| case | ranks | bytes | buckets | push | baseline | ratio | push GB/s | baseline GB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, r in results.items():
        if "error" in r:
            lines.append(f"| {case} | | | | failed: {r['error'].splitlines()[-1][:80]} | | | | |")
            continue
        base_key = "raw_broadcast_s" if "raw_broadcast_s" in r else "d2d_copy_s"
        ours = r["weight_sync_s"] if "weight_sync_s" in r else r["push_s"]
        base = r[base_key]
        lines.append(
            f"| {case} | {r['ranks']} | {r['bytes'] / 1e9:.2f} GB | {r['bucket_mib']} MiB | "
            f"{ours * 1e3:.1f} ms | "
            f"{base_key.removesuffix('_s')} {base * 1e3:.1f} ms | {ours / base:.2f}x | "
            f"{r['bytes'] / ours / 1e9:.1f} | {r['bytes'] / base / 1e9:.1f} |"
        )
    return "\n".join(lines) + "\n"


def write(args: argparse.Namespace, device: str, results: dict[str, dict[str, Any]]) -> str:
    """Write ``gpu.json`` and ``gpu.md`` under ``--out``; returns the table."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps({"device": device, "results": results}, indent=2))
    table = report(results)
    (args.out / "gpu.md").write_text(
        f"# GPU benchmark\n\n{device}; median of {args.repeats} pushes.\n\n{table}"
    )
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="size of the synthetic model")
    parser.add_argument("--hidden", type=int, default=4096, help="the model's hidden size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=540.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu"))
    parser.add_argument("--cpu", action="store_true", help="smoke-test the harness on the CPU")
    parser.add_argument(
        "--bucket-mb", type=int, default=None, help="bucket size (default: SyncConfig's auto)"
    )
    parser.add_argument(
        "--sweep",
        type=lambda text: [int(size) for size in text.split(",") if size],
        default=[],
        help="bucket sizes in MiB to push to 7 colocated readers at, beside the default",
    )
    args = parser.parse_args()
    if args.cpu:
        cases = cases_for(args, 0)
        device = f"CPU (smoke test), torch {torch.__version__}"
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (--cpu smoke-tests the harness)", file=sys.stderr)
        return 1
    else:
        gpus = torch.cuda.device_count()
        cases = cases_for(args, gpus)
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        device = f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL {nccl}"
    results: dict[str, dict[str, Any]] = {}
    for case in cases:
        try:
            results[case.name] = run_case(args, case)
        except RuntimeError as exc:
            results[case.name] = {"error": str(exc)}
        print(case.name, json.dumps(results[case.name]), flush=True)
    write(args, device, results)  # what was measured is kept, whatever the peers do
    try:
        results |= peers(args)
    except Exception as exc:  # a CUDA error, out of memory for the floor: the rest stands
        results["peers"] = {"error": f"{type(exc).__name__}: {exc}"}
    table = write(args, device, results)
    print(table)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
