"""A trainer that pushes into a ``vllm serve`` and is SIGKILLed by the test in the middle of its
second push: ``python -m tests.vllm_serve.dying_trainer URL WHERE``. It prints ``pushed N`` after
the first push and ``striking`` once the second one is where the test should kill it (WHERE):

* ``broadcast`` -- its bytes are moving (over the broadcast group, each bucket slowed: ~5 s);
* ``commit`` -- every worker received it, the verdict each waits for to commit not yet posted
  (held for 30 s).

It ends itself after ``LIFETIME_S`` whatever happens."""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

import torch

from tests.vllm.models import QWEN2
from weight_sync import SyncConfig
from weight_sync.adapters.hf import load_model
from weight_sync.adapters.vllm import VLLMServers

LIFETIME_S = 300


def main(url: str, where: str) -> None:
    signal.alarm(LIFETIME_S)
    torch.manual_seed(7)
    model = load_model(QWEN2)
    # Tiny buckets over the group (not the host ring, which batches them): ~100 broadcasts.
    config = SyncConfig(bucket_bytes=4096, direct_min_bytes=None, same_host="group",
                        push_timeout_s=60)  # fmt: skip
    servers = VLLMServers([url], config)
    print(f"pushed {servers.push(model.state_dict()).version}", flush=True)
    # Test hooks on the lane's group and verdicts, formed by the push that just ran.
    if where == "broadcast":
        group = servers._lanes._lanes.out.pusher.group
        broadcast = group.broadcast

        def slow(tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> Any:
            print("striking", flush=True)
            time.sleep(0.05)
            return broadcast(tensor, src, timeout_s)

        group.broadcast = slow
    else:  # the lane's verdict, which each worker waits for before it commits
        verdicts = servers._lanes._lanes.verdicts
        settle = verdicts.settle

        def held(*args: Any, **kwargs: Any) -> Any:
            print("striking", flush=True)
            time.sleep(30)
            return settle(*args, **kwargs)

        verdicts.settle = held  # type: ignore[method-assign]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)
    servers.push(model.state_dict())
    print("the push ended: the test should have killed this trainer", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
