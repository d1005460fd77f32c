"""One rank of a job whose sharded trainer pushes from every rank: ``JobSync(senders=K)``.

Ranks ``0..K-1`` train one model under FSDP2 (``fully_shard`` over a mesh of those ranks, on
CPU/Gloo) and each pushes its own shards; the other ranks receive whole tensors, the last of
them through ``load_weights`` (put together from every lane's blocks) instead of in place. Run
by ``mp.spawn`` (``spawned``) or ``torchrun`` (``python tests/launch/sharded_job.py SCENARIO
SENDERS OUT``); each rank writes what it saw to ``OUT/rank<r>.json``.

Scenarios:

* ``steps`` -- three optimizer steps, a push after each; the senders record the full model's
  digests (gathered, for the check only), the receivers theirs;
* ``refuse`` -- first the senders push a state dict one of them refuses itself, then a receiver
  with a layer of another shape refuses the layout: both before any byte moves, everywhere;
  then the right model and two pushes land;
* ``rename`` -- the receivers' models name every tensor ``inner.<the trainer's name>``: the
  senders push with ``rename``;
* ``tp`` -- FSDP2 over tensor parallelism: four senders on a (2, 2) mesh, the first layer
  column-parallel (its rows split by both mesh dimensions: ``_StridedShard``, 50 rows, uneven),
  the last row-parallel; three steps as ``steps``;
* ``partial`` -- ``push(subset, partial=True)`` before any version is held, refused; a full
  push; then, after a step that changed every tensor, the last layer alone, partial;
* ``cast`` -- the receivers hold the model in bf16, the senders train in fp32 and push with
  ``SyncConfig(cast_dtype="bfloat16")``: each lane casts its own shards;
* ``kill_sender`` -- sender 1 dies in the middle of the second push (once a receiver has put
  a first tensor together, every lane had begun): no receiving rank may claim version 2, and
  rank 0's error names rank 1;
* ``kill_receiver`` -- the same, but the last rank dies (the receiver that put the tensor
  together): every sender's error names it, and the other receiving rank claims no version;
* ``fail_load`` -- the last rank's ``load_weights`` raises in the second push, as its first
  bytes land: the push fails on every rank, and the third lands (over one group, which the
  failure aborted, once every rank formed it again);
* ``differ`` -- every rank gives a ``SyncConfig`` of its own in each field that may differ
  (``PER_RANK``): three steps as ``steps``;
* ``disagree`` -- sender 1 gives another ``cast_dtype`` (over one group, the last rank another
  backend as well): every rank's ``JobSync`` raises ``ValueError`` naming the field.

``SCENARIO+one_group``: the same, every lane's buckets over one group of every rank
(``JobSync(one_group=True)``, ``transport.rounds``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from weight_sync import SyncConfig, WeightSyncError
from weight_sync.launch.job_sync import JobSync
from weight_sync.wire.checksums import state_dict_digests

TIMEOUT_S = 30.0  # push_timeout_s: the bound every failure must be seen within
KILLED_TIMEOUT_S = 12.0  # where a rank is killed: as job.py's, for the reason said there

# ``differ``: each rank's own value of every SyncConfig field that may differ from rank to rank
# (docs/many-senders.md, "Each rank's SyncConfig"), rank r taking the r-th (mod 2) of each.
PER_RANK: dict[str, tuple[Any, Any]] = {
    "bucket_bytes": (1 << 20, 4096),  # each lane plans its own buckets
    "direct_min_bytes": ("auto", None),
    "alignment": (64, 256),
    "staging": ("stream", "atomic"),
    "checksum": (False, True),
    "delta": (False, "always"),
    "check_finite": (True, False),
    "metrics": (False, True),
    "interface": (None, "lo"),  # each sender listens on its own store
    "rendezvous_timeout_s": (20.0, 40.0),
    "collective_timeout_s": (10.0, 20.0),
    "rpc_timeout_s": (10.0, 20.0),
    "push_timeout_s": (TIMEOUT_S, TIMEOUT_S + 15),
    "max_tensors": (100_000, 1000),
    "max_metadata_bytes": (64 << 20, 1 << 20),
}


def make_model(big: bool = False, wide_last: int = 7) -> torch.nn.Module:
    """Uneven shapes (30 and 50 rows over 2 or 3 ranks), a buffer FSDP2 leaves whole, and for
    ``big`` 24 layers of 4 MB: a push of many buckets on every lane."""
    torch.manual_seed(1)  # every rank starts alike; only the senders' steps change the weights
    if big:
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])
    else:
        model = torch.nn.Sequential(
            torch.nn.Linear(30, 50), torch.nn.ReLU(), torch.nn.Linear(50, wide_last)
        )
    model.register_buffer("scale", torch.arange(5.0))
    return model


def full_digests(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, str]:
    """The digests of the senders' whole model (every sender gathers, as a collective), in
    ``dtype`` if given."""
    with torch.no_grad():
        full = {
            name: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).cpu()
            for name, tensor in model.state_dict().items()
        }
        full = {name: tensor.to(dtype or tensor.dtype) for name, tensor in full.items()}
    return state_dict_digests(full)


def run(scenario: str, senders: int, out: Path, device: str = "cpu") -> None:
    """``device``: where the senders train ("cuda": sender r on GPU r, FSDP2 over NCCL; the
    receiving ranks stay on the host, but over one group, which is then NCCL's, every rank r
    holds its model on GPU r)."""
    scenario, _, option = scenario.partition("+")
    one_group = option == "one_group"
    on_gpus = device == "cuda" and one_group  # every rank on a GPU of its own
    if on_gpus:
        torch.cuda.set_device(dist.get_rank())  # the one group's NCCL rank takes the current GPU
    big, renamed = scenario.startswith("kill"), scenario == "rename"
    cast = torch.bfloat16 if scenario == "cast" else None
    config = SyncConfig(push_timeout_s=KILLED_TIMEOUT_S if big else TIMEOUT_S,
                        bucket_bytes=1 << 20, cast_dtype="bfloat16" if cast else None,
                        backend="nccl" if on_gpus else "auto")  # fmt: skip
    here = dist.get_rank()
    if scenario == "differ":
        mine = {field: values[here % 2] for field, values in PER_RANK.items()}
        config = SyncConfig.model_validate({**config.model_dump(exclude_unset=True), **mine})  # validated
    if scenario == "disagree":
        _disagree(config, senders, one_group, out)
        return
    trainers = None
    if scenario == "group_first":  # as a trainer sets FSDP2 up before its sync: the senders'
        trainers = dist.new_group(list(range(senders)))  # group, no receiving rank a member
    sync = JobSync(config, senders=senders, one_group=one_group)
    rank, world = sync.rank, sync.world_size
    loads = rank == world - 1  # this receiver takes whole tensors through load_weights
    model = make_model(big)
    record: dict[str, Any] = {"rank": rank, "versions": [], "errors": [], "digests": []}
    gpu = device == "cuda" and (sync.is_sender or on_gpus)
    where = torch.device(device, rank) if gpu else torch.device("cpu")
    if where.type == "cuda":
        torch.cuda.set_device(where)
    # The senders' group: new_group is collective over the job, so every rank makes it; only
    # the senders build a mesh on it (DeviceMesh(...) would pick a GPU on every rank).
    if scenario == "tp":  # a (dp, tp) mesh of the senders; DeviceMesh too is collective
        grid = torch.arange(senders).reshape(2, -1)
        mesh = DeviceMesh(device, grid, mesh_dim_names=("dp", "tp"))
    elif trainers is None:
        trainers = dist.new_group(list(range(senders)))
    if sync.is_sender:
        model.to(where)
        if scenario == "tp":  # the first layer's rows split by both: FSDP2's _StridedShard
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(model, mesh=mesh["dp"])
            record["placements"] = {
                name: [type(p).__name__ for p in tensor.placements]
                for name, tensor in model.state_dict().items()
                if hasattr(tensor, "placements")
            }
        else:
            fully_shard(model, mesh=DeviceMesh.from_group(trainers, device))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        model.to(where)  # a receiving rank: the host, or its GPU over one NCCL group
        if cast is not None:
            model.to(cast)
    if scenario == "refuse":
        _refusals(sync, model, record)
    if scenario == "partial":
        _partial(sync, model, optimizer if sync.is_sender else None, record)
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        sync.close()
        return
    landed = out / "landed"
    loaded: dict[str, torch.Tensor] = {}
    for step in range(2 if big else 3):
        if sync.is_sender:
            inputs = torch.randn(
                4, 1024 if big else 30, generator=torch.Generator().manual_seed(step)
            )
            loss = model(inputs.to(where)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if big and step == 1 and rank == (1 if scenario == "kill_sender" else world - 1):
            _die_once(landed)
        started = time.monotonic()
        try:
            if renamed and sync.is_sender:  # the receivers' names: the trainer's, under "inner."
                version = sync.push(model.state_dict(), rename=lambda n: f"inner.{n}").version
            elif loads and scenario == "fail_load" and step == 1:
                version = sync.receive(load_weights=_fail_to_load)
            elif loads:  # in the second push of kill_sender, says when a first tensor is whole
                marker = landed if big and step == 1 else None
                version = sync.receive(load_weights=_load_and_say(loaded, marker))
            elif renamed:
                version = sync.receive(_Wrapper(model))
            else:
                version = sync.update(model)
            record["versions"].append(version)
            record.setdefault("took", []).append(time.monotonic() - started)  # for the margins
        except WeightSyncError as exc:
            record["errors"].append({"step": step, "type": type(exc).__name__, "message": str(exc),
                                     "seconds": time.monotonic() - started,
                                     "senders": getattr(exc, "senders", None)})  # fmt: skip
            record["versions"].append(None)
            if big:  # a rank is gone: the job is over (a launcher would restart it)
                break
        if not big:
            if sync.is_sender:
                record["digests"].append(full_digests(model, cast))
            else:
                held = {k.removeprefix("inner."): t for k, t in loaded.items()} if loads else None
                record["digests"].append(state_dict_digests(held or model.state_dict()))
        if big and not sync.is_sender:
            record.setdefault("at", {})[str(version)] = state_dict_digests(
                loaded if loads else model.state_dict()
            )
    record["held"] = sync.version
    if big and not sync.is_sender:
        record["now"] = state_dict_digests(loaded if loads else model.state_dict())
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if not big:
        sync.close()


def _disagree(config: SyncConfig, senders: int, one_group: bool, out: Path) -> None:
    """Sender 1 another cast_dtype; over one group, the last rank (receiving) the NCCL backend:
    each rank records what its JobSync raised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    update: dict[str, Any] = {"cast_dtype": "bfloat16"} if rank == 1 else {}
    if one_group and rank == world - 1:
        update["backend"] = "nccl"
    try:
        mine = SyncConfig.model_validate({**config.model_dump(exclude_unset=True), **update})
        JobSync(mine, senders=senders, one_group=one_group).close()
        raised = None
    except Exception as exc:  # what the rank was told to change
        raised = f"{type(exc).__name__}: {exc}"
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "raised": raised}))


def _refusals(sync: JobSync, model: torch.nn.Module, record: dict[str, Any]) -> None:
    """Three pushes refused before any byte moves: by a sender, by a receiver, then by every
    sender (a transform, which takes whole tensors, of DTensors)."""
    for case in ("sender", "receiver", "transform"):
        try:
            if sync.is_sender:
                state = model.state_dict()
                if case == "sender" and sync.rank == 1:
                    state = {**state, "scale": "not a tensor"}
                sync.push(state, transform=(lambda items: items) if case == "transform" else None)
            elif case == "receiver" and sync.rank == sync.senders:
                sync.receive(make_model(wide_last=8))  # a last layer of another shape
            else:
                sync.receive(model)
        except (TypeError, ValueError, WeightSyncError) as exc:
            record.setdefault("refused", []).append(f"{type(exc).__name__}: {exc}")
    record["after_refusals"] = sync.version


def _partial(
    sync: JobSync,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    record: dict[str, Any],
) -> None:
    """A partial push before any version is held (refused by the receiving ranks), a full
    push, a partial push of nothing (an empty push: every rank keeps the version), then after an
    SGD step that changed every tensor a partial push of the last layer only. Records each
    outcome and, after each push, the digests every rank holds (the senders: their whole
    model's, gathered)."""
    last = ("2.weight", "2.bias")

    def push_or_receive(partial: bool, names: tuple[str, ...] = last) -> None:
        try:
            if sync.is_sender:
                state = model.state_dict()
                subset = {name: state[name] for name in names} if partial else state
                version = sync.push(subset, partial=partial).version
            else:
                version = sync.receive(model)
            record["versions"].append(version)
        except WeightSyncError as exc:
            record["errors"].append(f"{type(exc).__name__}: {exc}")
            record["versions"].append(None)
        digests = full_digests(model) if sync.is_sender else state_dict_digests(model.state_dict())
        record["digests"].append(digests)

    push_or_receive(partial=True)  # nothing held yet to complete
    push_or_receive(partial=False)
    push_or_receive(partial=True, names=())  # nothing to move
    if optimizer is not None:
        model(torch.randn(4, 30, generator=torch.Generator().manual_seed(0))).pow(
            2
        ).mean().backward()
        optimizer.step()
    push_or_receive(partial=True)


class _Wrapper(torch.nn.Module):
    """A receiver's model whose names are the trainer's under ``inner.``."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner


def _die_once(landed: Path) -> None:
    """Kill this process (no cleanup: the kernel closes its sockets) once ``landed`` exists."""

    def watch() -> None:
        while not landed.exists():
            time.sleep(0.001)
        os._exit(9)

    threading.Thread(target=watch, daemon=True).start()


def _fail_to_load(weights: Any) -> None:
    raise RuntimeError("this engine cannot load its weights")


def _load_and_say(loaded: dict[str, torch.Tensor], landed: Path | None) -> Any:
    def load(weights: Any) -> None:
        for name, tensor in weights:
            loaded[name] = tensor.clone()
        if landed is not None:
            landed.touch()

    return load


def spawned(
    index: int,
    world_size: int,
    scenario: str,
    senders: int,
    out: str,
    store: str,
    device: str = "cpu",
) -> None:
    """``mp.spawn``'s entry: the textbook makes the default group itself (with GPUs, Gloo for
    the host's tensors and NCCL for the senders' mesh)."""
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=index,
                            world_size=world_size)  # fmt: skip
    try:
        run(scenario, senders, Path(out), device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
