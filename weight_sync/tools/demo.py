"""The main job: a trainer actor takes optimizer steps and pushes after each one to N workers.

Used by ``weight-sync demo``; also the smallest complete picture of how the pieces fit.
"""

from __future__ import annotations

import logging
import os
import sys

import ray
import torch
from torch import nn

from weight_sync import PushResult, SyncConfig, WeightSyncWorker, WeightUpdater, remote_worker
from weight_sync.actors.fleet import count_verified, take_down
from weight_sync.actors.placement import describe_share, gpu_share, largest_node_gpus
from weight_sync.send.routes import describe_routes
from weight_sync.wire.checksums import state_dict_digests

MiB = 1 << 20


class TinyLM(nn.Module):
    """A small residual MLP language model (~29 MB of fp32), built in code: no downloads."""

    def __init__(self, vocab: int = 8192, dim: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def build_model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


@remote_worker(num_cpus=0)  # ray.remote plus weight_sync's concurrency groups
class DemoWorker(WeightSyncWorker):
    """An inference worker: its own randomly initialised model until the first push lands."""

    def __init__(self, seed: int, device: str = "cpu") -> None:
        super().__init__()
        torch.set_num_threads(1)
        self.model = build_model(seed).to(device)


@ray.remote(num_cpus=0)
class DemoTrainer:
    def __init__(self, workers: list, config: SyncConfig, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.model = build_model(seed=0).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.updater = WeightUpdater(workers, config)

    def step(self) -> tuple[float, PushResult]:
        tokens = torch.randint(0, 8192, (8, 32), device=self.device)
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item(), self.updater.push(self.model.state_dict())

    def digests(self) -> dict[str, str]:
        return state_dict_digests(self.model.state_dict())

    def routes(self) -> list[str]:
        return list(self.updater.routes)

    def close(self) -> None:
        self.updater.close()


def resolve_device(device: str, cluster_gpus: float, torch_has_cuda: bool = True) -> str:
    """``auto``: "cuda" where the Ray cluster has a GPU and torch can use it, else "cpu";
    "cuda" needs both (pure). ``torch_has_cuda``: whether the actors' torch is a CUDA build."""
    if device == "auto":
        return "cuda" if cluster_gpus >= 1 and torch_has_cuda else "cpu"
    if device == "cuda" and not torch_has_cuda:
        raise ValueError(
            f"--device cuda, but this torch ({torch.__version__}) cannot use a GPU; install a "
            "CUDA build of torch, or use --device cpu (or auto)"
        )
    if device == "cuda" and cluster_gpus < 1:
        raise ValueError(
            f"--device cuda, but the Ray cluster has {cluster_gpus:g} GPUs; "
            "use --device cpu (or auto), or join a cluster with a GPU (--address)"
        )
    return device


def run_demo(
    workers: int = 7,
    steps: int = 5,
    address: str | None = None,
    bucket_mb: int | None = None,
    timeout_s: float = 600.0,
    device: str = "auto",
    verbose: bool = False,
) -> int:
    """Run the loop and verify every worker; returns a process exit code.
    ``bucket_mb`` None keeps SyncConfig's default bucket size. ``device``: "cpu", "cuda" or
    "auto" (the GPUs the Ray cluster has, if any): with GPUs, one per actor where there are
    enough, else the actors share them (Ray's fractional GPUs: the colocated deployment).
    ``verbose``: Ray's own log lines and the actors' output too; else the demo's output only."""
    config = SyncConfig() if bucket_mb is None else SyncConfig(bucket_bytes=bucket_mb * MiB)
    started_here = not ray.is_initialized()
    if started_here:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # the demo talks to loopback only
        level = logging.INFO if verbose else logging.ERROR  # quiet: the demo's output only
        if address is None:
            ray.init(
                num_cpus=os.cpu_count(),
                include_dashboard=False,
                logging_level=level,
                log_to_driver=verbose,
            )
        else:
            ray.init(address=address, logging_level=level, log_to_driver=verbose)
    try:
        gpus = largest_node_gpus()
        try:  # a local cluster's actors run this torch; a joined cluster's, what its nodes have
            device = resolve_device(device, gpus, address is not None or torch.cuda.is_available())
        except ValueError as exc:  # a choice this cluster cannot honour: say so, no traceback
            print(f"weight-sync demo: {exc}", file=sys.stderr)
            return 2
        share = gpu_share(workers + 1, gpus) if device == "cuda" else 0.0
        return _run(workers, steps, config, device, share, timeout_s)
    finally:
        if started_here:
            ray.shutdown()


def _run(
    workers: int, steps: int, config: SyncConfig, device: str, share: float, timeout_s: float
) -> int:
    handles = [
        DemoWorker.options(num_gpus=share).remote(seed=i + 1, device=device)  # type: ignore[attr-defined]
        for i in range(workers)
    ]
    trainer = DemoTrainer.options(num_gpus=share).remote(handles, config, device)  # type: ignore[attr-defined]
    try:
        where = "" if device == "cpu" else f" on {describe_share(workers + 1, share)}"
        print(
            f"trainer -> {workers} workers{where}, {_buckets(config, device)} buckets, {steps} steps"
        )
        print(f"{'version':>7} {'loss':>7} {'MB':>8} {'buckets':>7} {'seconds':>8} {'GB/s':>6}")
        result = None
        for _ in range(steps):
            loss, result = ray.get(trainer.step.remote(), timeout=timeout_s)
            print(
                f"{result.version:>7} {loss:>7.3f} {result.nbytes / 1e6:>8.1f} "
                f"{result.buckets:>7} {result.seconds:>8.3f} {result.gbps:>6.2f}"
            )
        if result is None:
            return 0
        good, tensors = count_verified(trainer, handles, result.version, timeout_s)
        if device != "cpu":  # on the CPU every worker is on the trainer's host: the ring
            routes = ray.get(trainer.routes.remote(), timeout=timeout_s)
            print(f"routes (workers): {describe_routes(routes)}")
        verdict = "OK" if good == workers else "FAILED"
        print(
            f"verified: {good}/{workers} workers hold version {result.version}, "
            f"{tensors} tensors bit-exact (sha256) -- {verdict}"
        )
        return 0 if good == workers else 1
    finally:
        take_down(trainer, handles)


def _buckets(config: SyncConfig, device: str) -> str:
    """The bucket size the trainer will take ("auto" on a GPU: at most, see auto_bucket_bytes)."""
    return f"{config.sized_for(device).sized_bucket_bytes // MiB} MiB"
