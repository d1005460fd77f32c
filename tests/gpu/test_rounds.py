"""Several senders over one NCCL group, point to point (``transport.rounds``): each sender's
buckets sent to every receiving rank as one coalesced batch, each receiving rank taking every
sender's k-th bucket in one coalesced round. The same code as tests/distributed/test_rounds.py
runs over Gloo; here it meets what Gloo cannot show: ``ncclGroupStart/End`` around a rank's
transfers with several peers, on a GPU per rank. Needs three GPUs (two senders, a receiver;
NCCL puts no two ranks of a communicator on one GPU) and skips on fewer; no Ray.

    pytest -m gpu tests/gpu/test_rounds.py -v
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.test_rounds import relay_rank, rounds_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs three GPUs, one per rank"),
]


@pytest.mark.parametrize(("counts", "receivers"), [([4, 2], 1), ([3, 3], 2)])
def test_two_senders_to_every_receiver_over_one_nccl_group(
    counts: list[int], receivers: int
) -> None:
    world = len(counts) + receivers
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, one per rank")
    results = run_ranks(rounds_rank, world, counts, None, 60, "nccl", timeout_s=240)
    assert [outcome for outcome, _ in results] == ["done"] * world


def test_two_receiving_ranks_relaying_to_each_other_over_one_nccl_group() -> None:
    """Hosts named in the test (all four GPUs are on one machine): each lane enters the
    receivers' host at a rank of its own, which relays it to the other in the second batch of
    the same round -- two coalesced batches a round, each rank sending to the rank it receives
    from. Needs four GPUs."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs four GPUs, one per rank")
    results = run_ranks(relay_rank, 4, [3, 2], "abcc", None, "nccl", timeout_s=240)
    assert [outcome for outcome, _ in results] == ["done"] * 4
