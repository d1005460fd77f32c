"""Run a function on N spawned ranks with a hard deadline; every rank is killed on the way out.

Rank 0 binds the ports it needs (port 0, socket kept) and publishes them through a queue, so no
port is ever guessed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import secrets
import socket
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tests import forked
from weight_sync.wire.checksums import state_dict_digests
from weight_sync.wire.metadata import GroupSpec, PrepareRequest, SyncPlan, TensorMeta
from weight_sync.receive.receiver import Receiver, expecting
from weight_sync.send.sender import Sender
from weight_sync.transport import TorchGroup, bind_listener, shm

Target = Callable[..., Any]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def repo_env() -> dict[str, str]:
    """This environment, with the repository importable: for a child run as ``python -c``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}


class RankContext:
    """Handed to each rank: who it is, and how to meet the others."""

    def __init__(self, rank: int, world_size: int, ports: mp.Queue, group_id: str) -> None:
        self.rank, self.world_size = rank, world_size
        self._ports_queue, self._ports, self.group_id = ports, None, group_id
        self._listeners: list[socket.socket] = []

    def ports(self, count: int = 1) -> list[int]:
        """``count`` rendezvous ports, bound by rank 0 (its listeners: see ``listener``)."""
        if self._ports is None:
            if self.rank == 0:
                self._listeners = [bind_listener("127.0.0.1") for _ in range(count)]
                self._ports = [s.getsockname()[1] for s in self._listeners]
                for _ in range(self.world_size - 1):
                    self._ports_queue.put(self._ports)
            else:
                self._ports = self._ports_queue.get(timeout=60)
        return self._ports

    def listener(self, index: int) -> socket.socket | None:
        return self._listeners[index] if self.rank == 0 else None

    def spec(self, mode: str, port_index: int = 0, **overrides: Any) -> GroupSpec:
        fields = dict(
            group_id=self.group_id, address="127.0.0.1", port=self.ports()[port_index],
            world_size=self.world_size, rank=self.rank, backend="gloo", mode=mode,
            rendezvous_timeout_s=30, collective_timeout_s=30,
        )  # fmt: skip
        fields.update(overrides)
        return GroupSpec(**fields)

    def shm_spec(self, **overrides: Any) -> GroupSpec:
        """This rank's place on rank 0's shared-memory ring (see ``weight_sync.transport.shm``)."""
        fields = dict(
            group_id=self.group_id, address=shm.socket_name(self.group_id), port=0,
            transport="shm", world_size=self.world_size, rank=self.rank, backend="gloo",
            mode="standalone", rendezvous_timeout_s=30, collective_timeout_s=30,
        )  # fmt: skip
        fields.update(overrides)
        return GroupSpec(**fields)


def _entry(
    target: Target,
    rank: int,
    world_size: int,
    ports: mp.Queue,
    results: mp.Queue,
    group_id: str,
    args: tuple,
) -> None:
    try:
        value = target(RankContext(rank, world_size, ports, group_id), *args)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    target: Target,
    world_size: int,
    *args: Any,
    timeout_s: float = 90,
    expect_dead: set[int] = frozenset(),
) -> list[Any]:  # type: ignore[assignment]
    """Results by rank; raises AssertionError with the rank's traceback if any rank failed.
    Ranks in ``expect_dead`` (killed or frozen on purpose) are not waited for; their result is
    None."""
    ctx = forked.context()
    ports, results = ctx.Queue(), ctx.Queue()
    group_id = secrets.token_hex(8)
    procs = [
        ctx.Process(
            target=_entry,
            args=(target, rank, world_size, ports, results, group_id, args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        for _ in range(world_size - len(expect_dead)):
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(
                    f"ranks {sorted(set(range(world_size)) - set(out) - set(errors))} "
                    f"did not finish within {timeout_s}s"
                ) from None
            (out if ok else errors)[rank] = value
        assert not errors, "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(errors.items()))
        return [out.get(rank) for rank in range(world_size)]
    finally:
        for rank, proc in enumerate(procs):
            if proc.is_alive() and rank not in expect_dead:
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def send_plan(
    ctx: RankContext,
    spec: GroupSpec,
    plan: SyncPlan,
    tensors: Sequence[torch.Tensor],
    device: torch.device | None = None,
) -> None:
    """Rank 0: form the group (NCCL: on ``device``), broadcast every bucket of ``plan``, leave."""
    group = TorchGroup.join(spec, ctx.listener(spec_port_index(ctx, spec)), device=device)
    try:
        Sender(group).send(plan, tensors)
    finally:
        group.close()


def receive_plan(
    spec: GroupSpec,
    plan: SyncPlan,
    expected: Mapping[str, TensorMeta] | None = None,
    version: int = 1,
    destinations: Mapping[str, torch.Tensor] | None = None,
    staging: str = "stream",
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """Any other rank: join, prepare, receive and commit ``plan`` (receiving on ``device``, the
    CPU by default); returns copies of what went through ``load_weights`` merged with
    ``destinations`` (where tensors may land in place)."""
    receiver = Receiver(device)
    receiver.join(spec, max_metadata_bytes=1 << 20)
    try:
        request = PrepareRequest(
            version=version, plan_digest=plan.digest, plan=plan, staging=staging
        ).model_dump_json()
        reply = receiver.prepare(request, expecting(lambda: expected))
        assert reply.accepted, reply.problems
        got: dict[str, torch.Tensor] = {}

        def apply(items: list[tuple[str, torch.Tensor]]) -> None:
            got.update((n, t.clone()) for n, t in items)

        before = state_dict_digests(dict(destinations or {}))
        receiver.receive(version, apply, destinations)
        if staging == "atomic":  # nothing reached the model, nothing claimed
            assert not got and not receiver.dirty and receiver.staged
            assert state_dict_digests(dict(destinations or {})) == before
        else:  # streamed in, but nothing claimed before commit
            assert receiver.version is None and receiver.dirty
        receiver.commit(version, apply, destinations)
        assert receiver.version == version and not receiver.dirty
        return {**got, **(destinations or {})}
    finally:
        receiver.leave()


def spec_port_index(ctx: RankContext, spec: GroupSpec) -> int:
    return ctx.ports().index(spec.port)
