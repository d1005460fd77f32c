"""Quickstart: a trainer actor steps a small model and pushes its weights to 7 workers after
every optimizer step; at the end every worker must hold the trainer's weights bit for bit.

    python examples/quickstart.py

The API it uses: docs/api.md.
"""

import os

import ray
import torch
from torch import nn

from weight_sync import SyncConfig, WeightSyncWorker, WeightUpdater
from weight_sync.wire.checksums import state_dict_digests


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(1000, 128), nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 1000)
    )


@ray.remote(num_cpus=0)  # or weight_sync.remote_worker(num_cpus=0): status answers mid-push
class Inference(WeightSyncWorker):
    def __init__(self, seed: int):
        super().__init__()
        self.model = build_model(seed)  # the default load_weights copies into self.model by name


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, workers):
        self.model = build_model(seed=0)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.updater = WeightUpdater(workers, SyncConfig(bucket_bytes=16 << 20))

    def train_step_and_push(self):
        tokens = torch.randint(0, 1000, (16, 8))
        loss = nn.functional.cross_entropy(self.model(tokens).flatten(0, 1), tokens.flatten())
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return self.updater.push(self.model.state_dict())

    def digests(self):
        return state_dict_digests(self.model.state_dict())

    def close(self):
        self.updater.close()


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves this machine
    ray.init(include_dashboard=False)
    workers = [Inference.remote(seed=i + 1) for i in range(7)]
    trainer = Trainer.remote(workers)
    for _ in range(3):
        result = ray.get(trainer.train_step_and_push.remote(), timeout=300)
        print(
            f"pushed version {result.version}: {result.nbytes / 1e6:.1f} MB in "
            f"{result.buckets} bucket(s), {result.seconds:.3f}s"
        )
    want = ray.get(trainer.digests.remote())
    assert ray.get([w.weight_sync_digests.remote() for w in workers]) == [want] * 7
    assert ray.get([w.weights_version.remote() for w in workers]) == [result.version] * 7
    print(f"all 7 workers hold version {result.version}, bit-exact")
    ray.get(trainer.close.remote())
    ray.shutdown()
