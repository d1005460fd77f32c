"""GPU benchmark without Ray: weight_sync's data plane against the raw collective it rides on.

Two cases, each timed as the median of several pushes after one warm-up, rank 0 timing from the
start of a push until every rank has said it holds the bytes (an all-reduce or a ring vote):

* ``nccl`` (needs 2+ GPUs, one rank each; rank 0 is the trainer): a plan of a synthetic
  Llama-shaped state dict in bf16 pushed by ``Sender``/``Receiver`` over one NCCL group, against
  one raw NCCL broadcast of a flat buffer of the same bytes over the very same communicator.
  Bus bandwidth for a broadcast equals the algorithm bandwidth (bytes / time), as in nccl-tests.
* ``colocated`` (one GPU is enough): a second process on the trainer's GPU receives the same
  push over the CUDA ring (``cuda_ipc``) and over the host ring (``shm``, device to host to
  device), against one device-to-device copy of the same bytes inside one process (the floor).

    python benchmarks/gpu.py --gib 2 --repeats 5 --out benchmarks/results/gpu

Writes ``gpu.json`` and ``gpu.md`` under ``--out``. ``--cpu`` runs the same harness over Gloo
and the host ring on the CPU (a smoke test of the harness itself, not a GPU figure).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import secrets
import socket
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from weight_sync.bench import timing as bench_timing
from weight_sync.metadata import GroupSpec, PrepareRequest, SyncPlan, TensorMeta
from weight_sync.planner import make_plan
from weight_sync.receiver import Receiver, accept_all
from weight_sync.send.sender import Sender
from weight_sync.transport import TorchGroup, bind_listener, cuda_ipc, shm

BUCKET = 256 << 20
ALIGN = 256


def model_shapes(gib: float, hidden: int = 4096) -> list[tuple[str, tuple[int, ...]]]:
    """A Llama-shaped state dict of about ``gib`` GiB in bf16 (at least one layer): per layer
    four square attention matrices, three MLP matrices and two norms."""
    mlp = hidden * 11008 // 4096
    per_layer = (4 * hidden * hidden + 3 * hidden * mlp + 2 * hidden) * 2
    layers = max(1, int(gib * (1 << 30) / per_layer))
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for layer in range(layers):
        prefix = f"layers.{layer}."
        shapes += [(prefix + f"attn.{p}.weight", (hidden, hidden)) for p in "qkvo"]
        shapes += [(prefix + f"mlp.{p}.weight", (mlp, hidden)) for p in ("gate", "up")]
        shapes += [(prefix + "mlp.down.weight", (hidden, mlp))]
        shapes += [(prefix + f"{p}.weight", (hidden,)) for p in ("input_norm", "post_norm")]
    return shapes


def build(
    gib: float, hidden: int, device: torch.device
) -> tuple[SyncPlan, dict[str, torch.Tensor]]:
    generator = torch.Generator(device=device).manual_seed(1)
    tensors = {
        name: torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
        for name, shape in model_shapes(gib, hidden)
    }
    metas = [TensorMeta.of(name, tensor) for name, tensor in tensors.items()]
    direct = [tensor.nbytes >= BUCKET for tensor in tensors.values()]
    return make_plan(metas, BUCKET, ALIGN, direct), tensors


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


# -- ranks ---------------------------------------------------------------------------------------


def _backend(args: argparse.Namespace) -> str:
    return "gloo" if args.cpu else "nccl"


def trainer(
    args: argparse.Namespace, transport: str, port_queue: Any, world: int
) -> dict[str, Any]:
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    plan, tensors = build(args.gib, args.hidden, device)
    group_id = secrets.token_hex(8)
    listener: socket.socket | None = None
    if transport == "group":
        listener = bind_listener("127.0.0.1")
        port = listener.getsockname()[1]
        part: Any = None
    else:
        port = 0
        slot = shm.slot_bytes_for(BUCKET, 4096)
        part = (
            cuda_ipc.CudaIpcWriter(group_id, 1, slot, 120, device)
            if transport == "cuda_ipc"
            else shm.ShmWriter(group_id, 1, slot, 120, device=device)
        )
    for _ in range(world - 1):
        port_queue.put((group_id, port))
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

        def floor() -> None:
            copy.copy_(flat)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        result["d2d_copy_s"] = median_time(floor, args.repeats)
    part.close()
    return result


def worker(
    args: argparse.Namespace, transport: str, port_queue: Any, world: int, rank: int
) -> None:
    device = torch.device("cuda", rank if transport == "group" else 0)
    if args.cpu:
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(device)  # for libraries that read it; weight_sync is told the device
    group_id, port = port_queue.get(timeout=120)
    receiver = Receiver(device)
    receiver.join(spec(group_id, rank, world, transport, port, _backend(args)), 1 << 26)
    # The same plan as the trainer's, derived here (the shapes alone; no weights are needed).
    shapes = model_shapes(args.gib, args.hidden)
    metas = [TensorMeta(name=n, dtype="bfloat16", shape=s) for n, s in shapes]
    direct = [m.nbytes >= BUCKET for m in metas]
    plan = make_plan(metas, BUCKET, ALIGN, direct)
    version = 0

    def push() -> None:
        nonlocal version
        version += 1
        request = PrepareRequest(version=version, plan_digest=plan.digest, plan=plan)
        assert receiver.prepare(request.model_dump_json(), accept_all).accepted
        receiver.receive(version, lambda items: None)  # the bytes are what is measured
        receiver.commit(version, lambda items: None)
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
    receiver.leave()


def _entry(
    role: str,
    args: argparse.Namespace,
    transport: str,
    ports: Any,
    results: Any,
    world: int,
    rank: int,
) -> None:
    try:
        if role == "trainer":
            results.put((rank, True, trainer(args, transport, ports, world)))
        else:
            worker(args, transport, ports, world, rank)
            results.put((rank, True, None))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_case(args: argparse.Namespace, transport: str, world: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(
            target=_entry,
            args=(
                "trainer" if rank == 0 else "worker",
                args,
                transport,
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
        return out
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def report(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| case | ranks | bytes | weight_sync | baseline | ratio | weight_sync GB/s | baseline GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, r in results.items():
        if "error" in r:
            lines.append(f"| {case} | | | failed: {r['error'].splitlines()[-1][:80]} | | | | |")
            continue
        base_key = "raw_broadcast_s" if "raw_broadcast_s" in r else "d2d_copy_s"
        ours, base = r["weight_sync_s"], r[base_key]
        lines.append(
            f"| {case} | {r['ranks']} | {r['bytes'] / 1e9:.2f} GB | {ours * 1e3:.1f} ms | "
            f"{base_key.removesuffix('_s')} {base * 1e3:.1f} ms | {ours / base:.2f}x | "
            f"{r['bytes'] / ours / 1e9:.1f} | {r['bytes'] / base / 1e9:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="size of the synthetic model")
    parser.add_argument("--hidden", type=int, default=4096, help="the model's hidden size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=540.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu"))
    parser.add_argument("--cpu", action="store_true", help="smoke-test the harness on the CPU")
    args = parser.parse_args()
    if args.cpu:
        cases = [("gloo 1 -> 2", "group", 3), ("host ring 1 -> 1", "shm", 2)]
        device = f"CPU (smoke test), torch {torch.__version__}"
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (--cpu smoke-tests the harness)", file=sys.stderr)
        return 1
    else:
        gpus = torch.cuda.device_count()
        cases = [("colocated cuda_ipc", "cuda_ipc", 2), ("colocated shm (host ring)", "shm", 2)]
        if gpus >= 2:
            cases.insert(0, (f"nccl 1 -> {gpus - 1}", "group", gpus))
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        device = f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL {nccl}"
    results: dict[str, dict[str, Any]] = {}
    for name, transport, world in cases:
        try:
            results[name] = run_case(args, transport, world)
        except RuntimeError as exc:
            results[name] = {"error": str(exc)}
        print(name, json.dumps(results[name]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps({"device": device, "results": results}, indent=2))
    table = report(results)
    (args.out / "gpu.md").write_text(
        f"# GPU benchmark\n\n{device}; median of {args.repeats} pushes.\n\n{table}"
    )
    print(table)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
