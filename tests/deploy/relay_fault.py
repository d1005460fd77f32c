"""Run inside node 0 of a shaped two-node cluster (``tests/deploy/test_shaped_links.py``): three
workers on node 1 -- the first in the group, relaying to the other two -- and the trainer here.
A follower is killed mid-push; prints what the push raised and what the next push did, as one
``RESULT {json}`` line. Classes are defined here, in ``__main__``, so Ray ships them by value."""

from __future__ import annotations

import json
import sys
import threading
import time

import ray
import torch

from weight_sync import SyncConfig, WeightSyncWorker, WeightUpdater
from weight_sync.tools.bench.netns import NODE_LINK, node_resource
from weight_sync.wire.checksums import state_dict_digests
from weight_sync.errors import WorkerFailedError

TENSORS, ELEMENTS = 8, 1 << 20  # 32 MB of fp32: ~2.7 s at 100 Mbit/s


@ray.remote(num_cpus=0)
class Worker(WeightSyncWorker):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        for index in range(TENSORS):
            self.model.register_buffer(f"w{index}", torch.zeros(ELEMENTS))

    def digests(self) -> dict[str, str]:
        return state_dict_digests(dict(self.model.state_dict()))


def main(address: str) -> int:
    ray.init(address=address)
    workers = [Worker.options(resources={node_resource(1): 1}).remote() for _ in range(3)]
    state = {f"w{index}": torch.randn(ELEMENTS) for index in range(TENSORS)}
    config = SyncConfig(interface=NODE_LINK, collective_timeout_s=20, push_timeout_s=90)
    updater = WeightUpdater(workers, config)
    try:
        updater.push(state)
        routes = updater.routes
        for tensor in state.values():
            tensor.add_(1.0)
        killer = threading.Timer(0.8, ray.kill, (workers[2],))
        killer.start()
        started = time.monotonic()
        try:
            updater.push(state)
            failure: dict[str, object] = {"raised": None}
        except WorkerFailedError as exc:
            failure = {"raised": type(exc).__name__, "workers": exc.workers,
                       "dropped": exc.dropped, "message": str(exc)}  # fmt: skip
        failure["seconds"] = time.monotonic() - started
        killer.join()
        for tensor in state.values():
            tensor.add_(1.0)
        after = updater.push(state)
        want = state_dict_digests(state)
        got = ray.get([worker.digests.remote() for worker in workers[:2]], timeout=60)
        print("RESULT " + json.dumps({
            "routes": routes, "failure": failure, "after_routes": updater.routes,
            "after_version": after.version, "held": [g == want for g in got],
            "left": len(updater.workers),
        }), flush=True)  # fmt: skip
        return 0
    finally:
        updater.close()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
