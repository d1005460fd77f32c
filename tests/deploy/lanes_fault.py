"""Run inside node 0 of a three-node cluster (``tests/deploy/test_shaped_links.py``): a sharded
trainer of two ranks, rank 0 on node 0 and rank 1 on node 1 (FSDP2 over Gloo across the link), each
with a ``WeightUpdater(senders=...)`` over the same two workers on node 2 (``one_group``: over one
group, each lane entering node 2 at one worker, which relays it to the other). Three pushes after
Adam steps, each checked bit for bit against the model gathered on the ranks; then rank 1 dies once
the senders agreed on a fourth push. Prints what every push did as one ``RESULT {json}`` line.
Classes are defined here, in ``__main__``, so Ray ships them by value."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

import ray
import torch
import torch.distributed as dist

from weight_sync import SyncConfig, WeightSyncWorker
from weight_sync.tools.bench.netns import NODE_LINK, node_resource
from weight_sync.wire.checksums import state_dict_digests
from weight_sync.transport import address_of_interface, bind_listener
from weight_sync.transport.rendezvous import open_store

TIMEOUT_S = 60.0


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every process starts alike; only the trainer's steps change it
    return torch.nn.Sequential(
        torch.nn.Embedding(300, 64), torch.nn.Linear(64, 301), torch.nn.Linear(301, 300)
    )


@ray.remote(num_cpus=0)
class Rank:
    """One rank of the sharded trainer, on its own node."""

    def __init__(self, rank: int, world_size: int) -> None:
        torch.set_num_threads(1)
        os.environ["GLOO_SOCKET_IFNAME"] = NODE_LINK  # the trainers' own group crosses nodes
        self.rank, self.world_size = rank, world_size
        self.address = address_of_interface(NODE_LINK)
        self.listener = bind_listener(self.address) if rank == 0 else None

    def endpoint(self) -> tuple[str, int]:
        assert self.listener is not None
        return self.address, self.listener.getsockname()[1]

    def setup(self, master: tuple[str, int], workers: list, one_group: bool) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from weight_sync.actors import WeightUpdater

        store = open_store(*master, self.world_size, TIMEOUT_S, self.listener)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))  # fmt: skip
        self.model = make_model()
        fully_shard(self.model, mesh=init_device_mesh("cpu", (self.world_size,)))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        config = SyncConfig(interface=NODE_LINK, push_timeout_s=TIMEOUT_S)
        self.lanes = WeightUpdater(workers, config, senders=dist.group.WORLD, one_group=one_group)

    def targets(self) -> list[int]:
        """The ranks of the one group this rank's lane sends to (none: lanes of their own)."""
        senders = self.lanes._pushes._lanes
        return list(senders.paths[senders.rank].targets) if senders.paths else []

    def step(self, step: int) -> None:
        tokens = torch.randint(0, 300, (4, 9), generator=torch.Generator().manual_seed(step))
        logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def push(self, die: bool = False) -> dict[str, Any]:
        """This rank's lane of one push; ``die``: its process ends once the senders agreed,
        before its lane moves a byte."""
        if die:
            self.lanes._pushes._lanes.out.push = lambda *args, **kwargs: os._exit(9)
        started = time.monotonic()
        try:
            result = self.lanes.push(self.model.state_dict())
            outcome: dict[str, Any] = {"version": result.version, "nbytes": result.nbytes}
        except Exception as exc:
            outcome = {"raised": type(exc).__name__, "message": str(exc),
                       "senders": getattr(exc, "senders", None)}  # fmt: skip
        outcome["seconds"] = time.monotonic() - started
        return outcome

    def digests(self) -> dict[str, str]:
        """Every rank at once (it gathers)."""
        state = self.model.state_dict()
        return state_dict_digests({name: tensor.full_tensor() for name, tensor in state.items()})


@ray.remote(num_cpus=0)
class Worker(WeightSyncWorker):
    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self.model = make_model()

    def digests(self) -> dict[str, str]:
        return state_dict_digests(dict(self.model.state_dict()))


def main(address: str, one_group: bool) -> int:
    ray.init(address=address)
    workers = [Worker.options(resources={node_resource(2): 1}).remote() for _ in range(2)]
    ranks = [Rank.options(resources={node_resource(r): 1}).remote(r, 2) for r in range(2)]
    master = ray.get(ranks[0].endpoint.remote(), timeout=TIMEOUT_S)
    ray.get([rank.setup.remote(master, workers, one_group) for rank in ranks], timeout=TIMEOUT_S)
    targets = ray.get([rank.targets.remote() for rank in ranks], timeout=TIMEOUT_S)
    pushes = []
    for step in range(3):
        ray.get([rank.step.remote(step) for rank in ranks], timeout=TIMEOUT_S)
        outcomes = ray.get([rank.push.remote() for rank in ranks], timeout=2 * TIMEOUT_S)
        want = ray.get([rank.digests.remote() for rank in ranks], timeout=TIMEOUT_S)[0]
        got = ray.get([worker.digests.remote() for worker in workers], timeout=TIMEOUT_S)
        held = ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT_S)
        pushes.append({"outcomes": outcomes, "exact": [g == want for g in got], "held": held})
    ray.get([rank.step.remote(3) for rank in ranks], timeout=TIMEOUT_S)
    calls = [ranks[0].push.remote(), ranks[1].push.remote(die=True)]
    death = ray.get(calls[0], timeout=2 * TIMEOUT_S)
    held = ray.get([w.weights_version.remote() for w in workers], timeout=TIMEOUT_S)
    print("RESULT " + json.dumps({"targets": targets, "pushes": pushes, "death": death,
                                  "held_after": held}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:] == ["one_group"]))
