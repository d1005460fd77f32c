"""An FSDP2 trainer whose every rank pushes its own shards, to the other ranks of its job.

    torchrun --standalone --nproc_per_node 4 examples/fsdp_many_senders.py --senders 2
    torchrun --standalone --nproc_per_node 6 examples/fsdp_many_senders.py --senders 4 --tp 2

Ranks ``0..senders-1`` train one model sharded with FSDP2 (``fully_shard`` over a mesh of them,
CPU/Gloo here; the same on GPUs with a ``"cuda"`` mesh); the other ranks serve. After each
optimizer step every rank calls ``sync.update(model)``: each trainer rank sends the blocks of
its own shards, at once and over its own lane -- no rank gathers the model -- and each serving
rank writes them in place into its whole model. ``--tp N``: FSDP2 over tensor parallelism
(torchtitan's layout), a mesh of ``senders / N`` by ``N`` trainer ranks, the first linear layer
column-parallel and the last row-parallel; each rank still pushes exactly what it holds. At the end
the trainer ranks gather the model once, for the check only, and every serving rank compares its
weights with it: rank 0 prints ``<N> serving ranks hold version <V>, bit for bit: True`` (every rank
exits 1 otherwise).
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from weight_sync import JobSync, SyncConfig
from weight_sync.wire.checksums import state_dict_digests


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every rank starts alike; only the trainer ranks train
    return torch.nn.Sequential(
        torch.nn.Embedding(1000, 128),
        torch.nn.Linear(128, 500),  # 500 rows: uneven shards over 3 trainer ranks
        torch.nn.GELU(),
        torch.nn.Linear(500, 1000),
    )


def fingerprint(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weights' SHA-256 as 32 bytes, to compare across ranks with one all-gather."""
    digests = state_dict_digests(state)
    whole = hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(digests.items())).encode())
    return torch.frombuffer(bytearray(whole.digest()), dtype=torch.uint8).clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel degree (divides senders)"
    )
    args = parser.parse_args()
    if args.senders % args.tp:
        parser.error(f"--tp {args.tp} must divide --senders {args.senders}")
    model = build_model()
    with JobSync(SyncConfig(push_timeout_s=120), senders=args.senders) as sync:
        # The trainer ranks' mesh: every rank makes it (its groups are made with new_group,
        # collective over the job), only they shard on it (on GPUs: a "cuda" mesh).
        grid = torch.arange(args.senders).reshape(-1, args.tp)
        mesh = DeviceMesh("cpu", grid, mesh_dim_names=("dp", "tp"))
        optimizer = None
        if sync.is_sender:
            if args.tp > 1:  # the first layer's rows split by both: FSDP2's _StridedShard
                plan = {"1": ColwiseParallel(), "3": RowwiseParallel()}
                parallelize_module(model, mesh["tp"], plan)
            fully_shard(model, mesh=mesh["dp"])
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        for step in range(args.steps):
            if optimizer is not None:
                tokens = torch.randint(
                    0, 1000, (8, 16), generator=torch.Generator().manual_seed(step)
                )
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
                    f"pushed version {version} from {args.senders} ranks: "
                    f"{result.nbytes / 1e6:.1f} MB in {result.buckets} bucket(s), "
                    f"{result.seconds:.3f}s",
                    flush=True,
                )
        state = model.state_dict()
        if sync.is_sender:  # the whole model, gathered once for the check (a collective)
            state = {
                k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()
            }
        mine = fingerprint(state)
        everyone = [torch.empty_like(mine) for _ in range(sync.world_size)]
        dist.all_gather(everyone, mine)  # over the job's own default group
        same = all(torch.equal(theirs, everyone[0]) for theirs in everyone)
        if sync.rank == 0:
            serving = sync.world_size - args.senders
            print(
                f"{serving} serving ranks hold version {version}, bit for bit: {same}", flush=True
            )
        if not same:
            raise SystemExit(f"rank {sync.rank}: weights differ from the trainer's")


if __name__ == "__main__":
    main()
