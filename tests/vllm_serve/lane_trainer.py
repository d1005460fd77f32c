"""One rank of a sharded trainer pushing into ``vllm serve`` from every rank: ``VLLMServers``
with ``senders``.

Every rank holds the test's ``transformers`` model as DTensors sharded over the trainers' mesh
(``distribute_tensor``: rank 0's weights, scattered) and pushes its own shards. Run as
``mp.spawn`` runs a rank (``spawned``; forked by tests/forked.py); each rank writes what it saw
to ``OUT/rank<r>.json``, and rank 0 the whole state dict of each push that landed to
``OUT/pushed<i>.pt`` (the reference the test checks the servers' generations against).

Scenarios:

* ``steps`` -- two optimizer steps, a push after each;
* ``refuse`` -- a state dict with a tensor the engine has no place for: refused on every rank
  before any byte moves; then the right one lands;
* ``kill`` -- a push lands, then rank 1 dies in the second one, right after telling the
  servers' workers to take its lane (its bytes never come);
* ``lose`` -- a push lands, then in the second one, its lanes' tiny buckets slowed, rank 0
  SIGKILLs the server whose process group ``OUT/victim.pid`` names as its lane's third bucket
  goes (a server crashing mid-push); each rank records how long its failed push took.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests import forked
from tests.reference import Trainer
from tests.vllm.models import QWEN2
from weight_sync import SyncConfig
from weight_sync.adapters.vllm import VLLMServers

TIMEOUT_S = 120.0
RANKS = 2  # trainer ranks of a job
JOB_S = 300.0  # a job's bound, in the test process


def run(scenario: str, urls: list[str], out: Path) -> None:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    trainer = Trainer(QWEN2, seed=11)
    record: dict[str, Any] = {"rank": rank, "versions": [], "errors": []}
    config = SyncConfig(push_timeout_s=TIMEOUT_S, bucket_bytes=64 << 10)
    if scenario == "lose":  # ~50 buckets a lane over its group, each slowed (``_lose_mid_push``);
        # an rpc bound long enough that a wait for a dead server's workers until it would show.
        config = SyncConfig(push_timeout_s=TIMEOUT_S, rpc_timeout_s=60, bucket_bytes=4096,
                            direct_min_bytes=None, same_host="group")  # fmt: skip

    def sharded(extra: bool = False) -> dict[str, torch.Tensor]:
        state = {name: t.detach() for name, t in trainer.state().items()}
        if extra:
            state["model.layers.0.mlp.extra.weight"] = torch.ones(8, 64)
        return {name: distribute_tensor(t, mesh, [Shard(0)]) for name, t in state.items()}

    with VLLMServers(urls, config, senders=dist.group.WORLD) as servers:
        if scenario == "refuse":
            try:
                servers.push(sharded(extra=True))
            except Exception as exc:
                record["errors"].append(f"{type(exc).__name__}: {exc}")
        for step in range(1 if scenario == "refuse" else 2):
            trainer.step()
            if scenario == "kill" and step == 1:
                _die_after_update(servers)
            if scenario == "lose" and step == 1:
                _lose_mid_push(servers, out)
            began = time.monotonic()
            try:
                result = servers.push(sharded())
            except Exception as exc:
                record["errors"].append(f"{type(exc).__name__}: {exc}")
                record["senders"] = list(getattr(exc, "senders", []))
                record["seconds"] = time.monotonic() - began
                break
            record["versions"].append(result.version)
            record["nbytes"] = result.nbytes
            if rank == 0:
                torch.save(trainer.state(), out / f"pushed{step}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def _die_after_update(servers: VLLMServers) -> None:
    """Rank 1 exits as soon as it has posted the command that has the workers take its lane's
    bytes: the one-call push of the steady state, or the receive of the long way (fault
    injection)."""
    if dist.get_rank() != 1:
        return
    commands = servers._lanes._lanes.out.commands
    update, push = commands.update_weights, commands.push_weight_update

    def update_then_die(update_info: dict[str, Any]) -> None:
        update(update_info)
        os._exit(9)

    def push_then_die(request_json: str) -> None:
        push(request_json)
        os._exit(9)

    commands.update_weights = update_then_die  # type: ignore[method-assign]
    commands.push_weight_update = push_then_die  # type: ignore[method-assign]


def _lose_mid_push(servers: VLLMServers, out: Path) -> None:
    """Slow this rank's lane (each bucket 20 ms later); on rank 0, SIGKILL the victim server's
    process group as the lane's third bucket goes (fault injection)."""
    group = servers._lanes._lanes.out.pusher.group  # formed by the first push
    assert group is not None, "push once first"
    broadcast, sent = group.broadcast, [0]
    victim = int((out / "victim.pid").read_text()) if dist.get_rank() == 0 else None

    def slowed(tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> Any:
        sent[0] += 1
        if sent[0] == 3 and victim is not None:
            os.killpg(victim, signal.SIGKILL)
        time.sleep(0.02)
        return broadcast(tensor, src, timeout_s)

    group.broadcast = slowed


def spawned(index: int, world_size: int, scenario: str, urls: list[str], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=index,
                            world_size=world_size)  # fmt: skip
    try:
        run(scenario, urls, Path(out))
    finally:
        dist.destroy_process_group()


# -- in the test process ----------------------------------------------------------------------


def run_job(scenario: str, urls: list[str], out: Path, ranks: int = RANKS) -> list[dict[str, Any]]:
    """Run ``scenario`` on every trainer rank (forked, as ``mp.spawn``'s); the records of ranks
    ``0..ranks-1`` (those that live), the others having exited with 9."""
    out.mkdir(parents=True, exist_ok=True)
    context = forked.start(spawned, (RANKS, scenario, urls, str(out)), RANKS)
    deadline = time.monotonic() + JOB_S
    try:
        for process in context.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    codes = [process.exitcode for process in context.processes]
    assert codes == [0] * ranks + [9] * (RANKS - ranks), codes
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def pushed_model(out: Path, step: int) -> Trainer:
    """The reference: the whole model rank 0 pushed at ``step``."""
    trainer = Trainer(QWEN2)
    trainer.pushed = torch.load(out / f"pushed{step}.pt")
    return trainer
