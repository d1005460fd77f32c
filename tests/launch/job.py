"""One rank of a launched job, as a user writes it: ``JobSync`` on every rank, ``update(model)``
once per push. Run by ``torchrun``/``mpirun`` (``python tests/launch/job.py SCENARIO OUT``) or by
``mp.spawn`` (``spawned``); each rank writes what it saw to ``OUT/rank<r>.json`` for the test.

Scenarios:

* ``steps`` -- three optimizer steps on rank 0, a push after each;
* ``long`` -- twelve, rank 0 counting the keys its control store holds after each push;
* ``refuse`` -- rank 0 is handed a state dict it refuses itself (the others hear the push was
  called off); a push lands; then rank 2's model has a layer of another shape (the layout it
  holds from that push no longer fits it): the push is refused everywhere before any byte
  moves; rank 2 then takes the right model, at stale weights, and the next push lands;
* ``kill_receiver`` -- rank 2 dies on the first bucket of the second push;
* ``kill_trainer`` -- rank 0 dies in the middle of sending the second push: once rank 1 has
  its first bucket, rank 0 still has most of them to send.
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

from weight_sync import SyncConfig, WeightSyncError
from weight_sync.wire.checksums import state_dict_digests
from weight_sync.launch.job_sync import JobSync

TIMEOUT_S = 30.0  # push_timeout_s: the bound every failure must be seen within
# Where a rank is killed, a short push_timeout_s: a dead receiver is named at the report bound
# (push_timeout_s / 2), which is this test's wait. The big push lands well inside it beside two
# spinning processes (docs/testing.md, "Where the time goes"). sharded_job.py's kill cases too.
KILLED_TIMEOUT_S = 12.0


def make_model(wide: int = 64, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(1)  # every rank starts alike; only rank 0's steps change the weights
    return torch.nn.Sequential(*[torch.nn.Linear(wide, wide) for _ in range(layers)])


def run(scenario: str, out: Path, init_method: str | None = None) -> None:
    big = scenario.startswith("kill")
    model = make_model(1024, 24) if big else make_model()  # 24 x 4 MB: a push of many buckets
    sync = JobSync(
        SyncConfig(push_timeout_s=KILLED_TIMEOUT_S if big else TIMEOUT_S, bucket_bytes=1 << 20),
        init_method=init_method,
    )
    rank = sync.rank
    record: dict[str, Any] = {"rank": rank, "world": sync.world_size, "versions": [], "errors": []}
    if scenario == "silent_trainer":  # rank 0 alive, its store up, but it never pushes
        _wait_silently(sync, model, record, out)
        return
    if scenario == "refuse":  # first, a state dict rank 0 itself refuses before sending
        try:
            sync.push({"weight": "not a tensor"}) if rank == 0 else sync.receive(model)  # type: ignore[dict-item]
        except (TypeError, WeightSyncError) as exc:
            record["bad"] = f"{type(exc).__name__}: {exc}"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if rank == 0 else None
    for step in range(2 if big else 12 if scenario == "long" else 3):
        if optimizer is not None:
            loss = model(torch.randn(4, model[0].in_features)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        kill_trainer = big and step == 1 and scenario == "kill_trainer"
        landed = out / "landed"  # rank 1 made it: push 2's first bucket reached a receiver
        if kill_trainer and rank == 0:
            _die_once(landed)
        started = time.monotonic()
        try:
            if big and step == 1 and scenario == "kill_receiver" and rank == 2:
                sync.receive(load_weights=_die)  # dies on the first bucket of the broadcast
            if kill_trainer and rank == 1:
                version = sync.receive(load_weights=_load_and_say(model, landed))
            else:  # "named": the loop's own step names each version (read on rank 0)
                named = 10 * (step + 1) if scenario == "named" else None
                version = sync.update(model, version=named)
            record["versions"].append(version)
            record.setdefault("took", []).append(time.monotonic() - started)  # for the margins
            if rank == 0 and sync.last_result is not None:  # the steps the lane's push took
                record.setdefault("phases", []).append(sorted(sync.last_result.phases))
            if scenario == "long" and rank == 0:  # what rank 0's control store holds now,
                mailbox = sync._out.plane._mailbox  # type: ignore[union-attr]
                waited = time.monotonic() + 10  # once its poller deleted what was forgotten
                while mailbox._doomed and time.monotonic() < waited:
                    time.sleep(0.005)
                record.setdefault("keys", []).append(mailbox._store.num_keys())
            if big:  # what this rank held at each version, for a later failed push to keep
                record.setdefault("at", {})[version] = state_dict_digests(model.state_dict())
        except WeightSyncError as exc:
            record["errors"].append({"step": step, "type": type(exc).__name__, "message": str(exc),
                                     "seconds": time.monotonic() - started})  # fmt: skip
            record["versions"].append(None)
            if big:  # a rank is gone: the job is over (a launcher would restart it)
                break
        if scenario == "refuse" and rank == 2 and step == 0:  # for the push of step 1
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
        elif scenario == "refuse" and rank == 2 and step == 1:
            model = make_model()  # the right shapes, its own (stale) weights: the push must land
    if scenario == "named":  # a version already served: refused on rank 0, nothing sent
        try:
            sync.update(model, version=20)
        except (ValueError, WeightSyncError) as exc:
            record["stale"] = f"{type(exc).__name__}: {exc}"
    record["held"] = sync.version
    record["digests"] = state_dict_digests(model.state_dict())
    if rank == 0 and sync._out is not None and sync._out.pusher.group is not None:
        # Which kind of group carried the bytes (the test checks it is the job's new_group).
        record["mode"] = sync._out.pusher.group._spec.mode  # type: ignore[attr-defined]
        record["routes"] = sync._out.pusher.routes
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if not big:
        sync.close()


SILENT_WAIT_S = 3  # how long the other ranks wait for a push that never begins


def _wait_silently(sync: JobSync, model: torch.nn.Module, record: dict, out: Path) -> None:
    """Rank 0 stays silent until every other rank has written its record (bounded); the others
    each wait SILENT_WAIT_S for its push and must give up with an error in that bound."""
    if sync.rank == 0:
        end = time.monotonic() + 60
        while time.monotonic() < end and len(list(out.glob("rank*.json"))) < sync.world_size - 1:
            time.sleep(0.1)
    else:
        started = time.monotonic()
        try:
            record["versions"].append(sync.update(model, timeout_s=SILENT_WAIT_S))
        except WeightSyncError as exc:
            record["errors"].append({"type": type(exc).__name__, "message": str(exc),
                                     "seconds": time.monotonic() - started})  # fmt: skip
    (out / f"rank{sync.rank}.json").write_text(json.dumps(record))


def _die(weights: object) -> None:
    os._exit(9)


def _die_once(landed: Path) -> None:
    """Kill this process, from a thread, as soon as ``landed`` exists: in the middle of the push
    begun meanwhile (SIGKILL-like: no cleanup, sockets closed by the kernel). A timer timed from
    the first push was not enough: on a loaded machine it fired before push 2's first byte."""

    def watch() -> None:
        while not landed.exists():
            time.sleep(0.001)
        os._exit(9)

    threading.Thread(target=watch, daemon=True).start()


def _load_and_say(model: torch.nn.Module, landed: Path) -> Any:
    """A ``load_weights`` that writes each bucket into ``model`` and, after the first, makes
    ``landed``."""
    params = model.state_dict()

    def load(weights: Any) -> None:
        for name, tensor in weights:
            params[name].copy_(tensor)
        landed.touch()

    return load


def spawned(index: int, world_size: int, scenario: str, out: str, store_file: str) -> None:
    """``mp.spawn``'s entry: the textbook makes the default group itself."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=index,
                            world_size=world_size)  # fmt: skip
    run(scenario, Path(out))


if __name__ == "__main__":
    scenario, out = sys.argv[1], Path(sys.argv[2])
    init = sys.argv[3] if len(sys.argv) > 3 else None
    run(scenario, out, init)
