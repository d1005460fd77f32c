"""The textbook shape, no Ray: one job of N ranks, rank 0 trains and pushes, the others receive.

    torchrun --standalone --nproc_per_node 4 examples/torchrun_job.py
    mpirun -n 4 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 python examples/torchrun_job.py

Every rank makes a ``JobSync`` (a collective: the job's default group is made from the
launcher's variables if the script has none) and calls ``update(model)`` after each step: rank 0
sends ``model.state_dict()`` over a dedicated group made with ``new_group``, the others receive
into their copy of the model, checked before any byte moves. Each rank ends by printing the
version it holds and whether its weights equal rank 0's (SHA-256 of every tensor, gathered over
the job's default group); rank 0 prints ``<N> ranks hold version <V>: True``.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist

from weight_sync import JobSync, SyncConfig
from weight_sync.wire.checksums import state_dict_digests


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every rank starts alike; only rank 0 trains
    return torch.nn.Sequential(
        torch.nn.Embedding(1000, 128),
        torch.nn.Linear(128, 512),
        torch.nn.GELU(),
        torch.nn.Linear(512, 1000),
    )


def fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """The weights' SHA-256 as 32 bytes, to compare across ranks with one all-gather."""
    digests = state_dict_digests(model.state_dict())
    whole = hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(digests.items())).encode())
    return torch.frombuffer(bytearray(whole.digest()), dtype=torch.uint8).clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    model = build_model()
    with JobSync(SyncConfig(push_timeout_s=120)) as sync:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3) if sync.rank == 0 else None
        for _ in range(args.steps):
            if optimizer is not None:
                tokens = torch.randint(0, 1000, (8, 16))
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), tokens[:, 1:].flatten()
                )
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            version = sync.update(model)
            if sync.rank == 0 and sync.last_result is not None:
                result = sync.last_result
                print(
                    f"pushed version {version}: {result.nbytes / 1e6:.1f} MB in "
                    f"{result.buckets} bucket(s), {result.seconds:.3f}s",
                    flush=True,
                )
        mine = fingerprint(model)
        everyone = [torch.empty_like(mine) for _ in range(sync.world_size)]
        dist.all_gather(everyone, mine)  # over the job's own default group
        same = all(torch.equal(theirs, everyone[0]) for theirs in everyone)
        if sync.rank == 0:
            print(f"{sync.world_size} ranks hold version {sync.version}: {same}", flush=True)
        if not same:
            raise SystemExit(f"rank {sync.rank}: weights differ from rank 0's")


if __name__ == "__main__":
    main()
