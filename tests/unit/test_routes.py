"""Who takes which route (weight_sync.send.routes): the NCCL group, the host ring or the CUDA ring,
decided from the members' GPU UUIDs and host keys alone -- so it is tested here, without GPUs."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from weight_sync.config import SyncConfig
from weight_sync.transport.devices import CPU, module_device, push_device
from weight_sync.errors import TransportError
from weight_sync.wire.metadata import MemberInfo
from weight_sync.send.formation import _choose_mode
from weight_sync.send.routes import (
    ROUTE_WORDS,
    Route,
    choose_routes,
    describe_routes,
    members_nccl_problem,
)

HERE, THERE, OTHER_NS = "boot-a/net:[1]", "boot-b/net:[1]", "boot-a/net:[2]"
G0, G1, G2, G3 = "GPU-0000", "GPU-1111", "GPU-2222", "GPU-3333"


def member(host: str | None, *gpus: str, ranks: int = 1) -> MemberInfo:
    return MemberInfo(has_default_group=False, cuda=bool(gpus), gpus=gpus, version=None,
                      hostname="h", pid=1, host=host, ranks=ranks)  # fmt: skip


@pytest.mark.parametrize(
    ("backend", "same_host", "trainer_gpu", "members", "ipc_refused", "chosen", "routes"),
    [
        # CPU weights: Gloo; the trainer's host takes the host ring unless told otherwise.
        ("auto", "shm", None, [member(HERE), member(THERE), member(OTHER_NS), member(None)], False,
         "gloo", ("shm", "group", "group", "group")),
        ("auto", "group", None, [member(HERE), member(HERE)], False, "gloo", ("group", "group")),
        # The reference node: trainer on GPU 0, seven workers on the other GPUs: all NCCL.
        ("auto", "shm", G0, [member(HERE, G1), member(HERE, G2), member(THERE, G3)], False,
         "nccl", ("group", "group", "group")),
        # Colocated: the engine on the trainer's own GPU takes the CUDA ring beside NCCL ...
        ("auto", "shm", G0, [member(HERE, G0), member(HERE, G1)], False,
         "nccl", ("cuda_ipc", "group")),
        # ... or the host ring where IPC was refused on this deployment.
        ("auto", "shm", G0, [member(HERE, G0), member(HERE, G1)], True, "nccl", ("shm", "group")),
        # A tensor-parallel engine whose first worker shares the trainer's GPU: all its ranks ring.
        ("auto", "shm", G0, [member(HERE, G0, G1, ranks=2)], False, "nccl", ("cuda_ipc",)),
        # Two workers sharing a GPU cannot both be NCCL ranks: Gloo for everyone.
        ("auto", "shm", G0, [member(THERE, G1), member(THERE, G1)], False,
         "gloo", ("group", "group")),
        # A worker without a GPU: Gloo.
        ("auto", "shm", G0, [member(THERE, G1), member(THERE)], False, "gloo", ("group", "group")),
        # Sharing the trainer's GPU from another network namespace: no ring reaches it, no NCCL.
        ("auto", "shm", G0, [member(OTHER_NS, G0)], False, "gloo", ("group",)),
        # Explicit Gloo with CUDA weights: NCCL's rules do not apply.
        ("gloo", "shm", G0, [member(HERE, G0), member(THERE, G1)], False,
         "gloo", ("shm", "group")),
        ("auto", "shm", G0, [], False, "nccl", ()),
    ],
)  # fmt: skip
def test_routes(
    backend: str,
    same_host: str,
    trainer_gpu: str | None,
    members: list[MemberInfo],
    ipc_refused: bool,
    chosen: str,
    routes: tuple[str, ...],
) -> None:
    got = choose_routes(backend=backend, same_host=same_host, trainer_gpu=trainer_gpu,  # type: ignore[arg-type]
                        trainer_host=HERE, infos=members, ipc_refused=ipc_refused)  # fmt: skip
    assert (got.backend, got.routes) == (chosen, routes)


@pytest.mark.parametrize(
    ("trainer_gpu", "members", "says"),
    [
        (None, [member(HERE, G1)], "not on a GPU"),
        (G0, [member(THERE, G1), member(THERE, G1)], "workers 0 and 1 share GPU"),
        (G0, [member(THERE, G1, G1, ranks=2)], "worker 0 has two ranks on GPU"),
        (G0, [member(THERE)], "worker 0 does not receive on a GPU"),
        (G0, [member(OTHER_NS, G0)], "not its host namespace"),
    ],
)  # fmt: skip
def test_an_explicit_nccl_that_cannot_work_is_refused_naming_who(
    trainer_gpu: str | None, members: list[MemberInfo], says: str
) -> None:
    with pytest.raises(TransportError, match=says):
        choose_routes(backend="nccl", same_host="shm", trainer_gpu=trainer_gpu, trainer_host=HERE,
                      infos=members)  # fmt: skip


@pytest.mark.parametrize(
    ("trainer_gpu", "members", "says"),
    [
        (G2, [member(HERE, G0), member(THERE, G1)], None),
        # No ring stands in for a worker on a GPU already taken: each one is a rank.
        (None, [member(HERE, G0), member(HERE, G0)], "workers 0 and 1 share GPU GPU-0000"),
        (None, [member(HERE, G1, G1, ranks=2)], "worker 0 has two ranks on GPU"),
        (None, [member(HERE, G1), member(HERE)], "worker 1 does not receive on a GPU"),
        (None, [member(HERE, G1, ranks=2)], "worker 0 does not receive on a GPU"),
        (G0, [], None),
        # Rank 0's GPU, where it is known: a worker there would be its second rank.
        (G0, [member(HERE, G1), member(HERE, G0)], "worker 1 is on the trainer's GPU GPU-0000"),
    ],
)  # fmt: skip
def test_which_members_one_nccl_group_can_take(
    trainer_gpu: str | None, members: list[MemberInfo], says: str | None
) -> None:
    problem = members_nccl_problem(members, trainer_gpu)
    if says is None:
        assert problem is None
    else:
        assert problem is not None and says in problem


def test_the_host_key_of_a_platform_without_rings_puts_nobody_on_one() -> None:
    got = choose_routes(backend="auto", same_host="shm", trainer_gpu=None, trainer_host=None,
                        infos=[member(None), member(None)])  # fmt: skip
    assert got.routes == ("group", "group")


def test_the_push_device_comes_from_the_tensors_not_the_thread() -> None:
    assert push_device([torch.zeros(2), torch.ones(3)]) == CPU
    assert push_device([]) == CPU
    assert module_device(torch.nn.Linear(2, 2)) == CPU


@pytest.mark.parametrize(
    ("backend", "mode", "has_default", "expected"),
    [
        ("gloo", "auto", False, "world"),
        ("gloo", "auto", True, "standalone"),
        ("nccl", "auto", False, "standalone"),  # NCCL always stands alone: aborts don't block
        ("nccl", "world", False, "world"),  # asked for: kept
    ],
)  # fmt: skip
def test_the_group_mode(backend: str, mode: str, has_default: bool, expected: str) -> None:
    infos = [member(THERE, G1).model_copy(update={"has_default_group": has_default})]
    config = SyncConfig(group_mode=mode)  # type: ignore[arg-type]
    assert _choose_mode(config, infos, backend) == expected  # type: ignore[arg-type]


THIRD = "boot-c/net:[1]"


@pytest.mark.parametrize(
    ("backend", "same_host", "trainer_gpu", "members", "routes", "leaders"),
    [
        # Three members on one far host: the first stays in the group and relays to the others.
        ("auto", "shm", None, [member(THERE), member(THERE), member(THERE)],
         ("group", "relay", "relay"), {1: 0, 2: 0}),
        # Two far hosts, interleaved, beside the trainer's own: one leader per far host.
        ("auto", "shm", None,
         [member(HERE), member(THERE), member(THIRD), member(THERE), member(THIRD), member(HERE)],
         ("shm", "group", "group", "relay", "relay", "shm"), {3: 1, 4: 2}),
        # The trainer's host in the group (same_host="group"): its members stay there.
        ("auto", "group", None, [member(HERE), member(HERE), member(THERE), member(THERE)],
         ("group", "group", "group", "relay"), {3: 2}),
        # No host key (no ring on that platform), or an engine bringing several ranks: the group.
        ("auto", "shm", None, [member(None), member(None), member(THERE, ranks=2), member(THERE)],
         ("group", "group", "group", "group"), {}),
        # A lone member of a host has no one to relay to.
        ("auto", "shm", None, [member(THERE), member(THIRD)], ("group", "group"), {}),
        # NCCL relays by itself (its rings and trees cross each link once): never a relay.
        ("auto", "shm", G0, [member(THERE, G1), member(THERE, G2)], ("group", "group"), {}),
        # Gloo with CUDA weights relays like any Gloo push.
        ("gloo", "shm", G0, [member(THERE, G1), member(THERE, G2)], ("group", "relay"), {1: 0}),
    ],
)  # fmt: skip
def test_members_of_a_far_host_relay_through_the_first_of_them(
    backend: str,
    same_host: str,
    trainer_gpu: str | None,
    members: list[MemberInfo],
    routes: tuple[str, ...],
    leaders: dict[int, int],
) -> None:
    got = choose_routes(backend=backend, same_host=same_host, trainer_gpu=trainer_gpu,  # type: ignore[arg-type]
                        trainer_host=HERE, infos=members, relay=True)  # fmt: skip
    assert (got.routes, dict(got.leaders)) == (routes, leaders)
    off = choose_routes(backend=backend, same_host=same_host, trainer_gpu=trainer_gpu,  # type: ignore[arg-type]
                        trainer_host=HERE, infos=members, relay=False)  # fmt: skip
    assert "relay" not in off.routes and not off.leaders


def test_every_route_has_words_and_a_summary_counts_every_route() -> None:
    assert set(ROUTE_WORDS) == set(get_args(Route))
    summary = describe_routes(["cuda_ipc"] * 7)
    assert summary == ("0 through the group, 0 through shared memory, 7 through the trainer's "
                       "GPU (CUDA IPC), 0 relayed on their host")  # fmt: skip
    assert describe_routes(["group", "shm", "mystery"]).endswith(", 1 mystery")
