"""The NCCL check-in before any NCCL call: rank 0's verdicts as a table (pure), the store
protocol on a real TCPStore (threads as ranks), the environment window, and the device rule.
Nothing here needs a GPU."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from weight_sync.errors import GroupFormationError
from weight_sync.wire.metadata import GroupSpec
from weight_sync.transport import TorchGroup, bind_listener
from weight_sync.transport.nccl import (
    MUST_AGREE,
    Report,
    Verdict,
    check_in,
    env_window,
    judge,
    judge_init,
    require_process_group_nccl,
    world_backend,
)
from weight_sync.transport.rendezvous import open_store

GPU = [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(4)]
PINNED = {"NCCL_PROTO": "Simple", "NCCL_ALGO": "Ring"}
UNSET = {name: None for name in MUST_AGREE}


def report(gpu: int, nccl: str = "2.27.3", **env: str | None) -> Report:
    return Report(gpu=GPU[gpu], nccl=nccl, env={**UNSET, **env})


@pytest.mark.parametrize(
    ("reports", "world_size", "ok", "blamed", "says"),
    [
        ({0: report(0), 1: report(1), 2: report(2)}, 3, True, (), ""),
        ({0: report(0)}, 1, True, (), ""),
        ({0: report(0, **PINNED), 1: report(1, **PINNED)}, 2, True, (), ""),
        ({0: report(0), 2: report(2)}, 4, False, (1, 3), "did not check in"),
        ({1: report(1), 2: report(2)}, 3, False, (0,), "did not check in"),
        ({0: report(0), 1: report(0)}, 2, False, (1,), "two ranks on one GPU"),
        ({0: report(0), 1: report(1), 2: report(1), 3: report(0)}, 4, False, (2, 3), "one GPU"),
        ({0: report(0), 1: report(1, nccl="2.21.5")}, 2, False, (1,), "NCCL 2.21.5"),
        ({0: report(0), 1: report(1, NCCL_PROTO="Simple")}, 2, False, (1,), "NCCL_PROTO='Simple'"),
        ({0: report(0, **PINNED), 1: report(1), 2: report(2, **PINNED)}, 3, False, (1,),
         "NCCL_ALGO=None"),
        ({0: report(0), 1: report(1, NCCL_ALGO="Tree"), 2: report(2, nccl="2.28.1")}, 3, False,
         (1, 2), "must match"),
        # a missing rank is reported before anything the present ones disagree on
        ({0: report(0), 1: report(0)}, 3, False, (2,), "did not check in"),
    ],
)  # fmt: skip
def test_check_in_verdicts(
    reports: dict[int, Report], world_size: int, ok: bool, blamed: tuple[int, ...], says: str
) -> None:
    verdict = judge(reports, world_size)
    assert verdict.ok is ok
    assert verdict.ranks == blamed
    assert says in verdict.message
    if not ok:
        with pytest.raises(GroupFormationError) as caught:
            verdict.raise_if_failed()
        assert caught.value.ranks == list(blamed)


@pytest.mark.parametrize(
    ("outcomes", "world_size", "ok", "blamed", "says"),
    [
        ({0: "ok", 1: "ok"}, 2, True, (), ""),
        ({0: "late: ncclCommInitRank did not return in time", 1: "DistBackendError: NCCL error: "
          "unhandled cuda error (out of memory)"}, 2, False, (1,), "out of memory"),
        ({0: "late: x", 2: "late: x"}, 3, False, (1,), "never reported"),
        ({0: "late: x", 1: "late: x"}, 2, False, (0, 1), "NCCL_SOCKET_IFNAME"),
        ({0: "ok", 1: "the warm-up all-reduce gave 1, not 2"}, 2, False, (1,), "gave 1"),
    ],
)  # fmt: skip
def test_communicator_verdicts(
    outcomes: dict[int, str], world_size: int, ok: bool, blamed: tuple[int, ...], says: str
) -> None:
    verdict = judge_init(outcomes, world_size, deadline_s=30)
    assert (verdict.ok, verdict.ranks) == (ok, blamed)
    assert says in verdict.message


def test_reports_and_verdicts_survive_the_store() -> None:
    original = report(2, NCCL_PROTO="LL128")
    assert Report.from_json(original.to_json()) == original
    verdict = Verdict(False, "why", (1, 3))
    assert Verdict.from_json(verdict.to_json()) == verdict


def spec(rank: int, world_size: int, port: int) -> GroupSpec:
    return GroupSpec(group_id="00c0ffee", address="127.0.0.1", port=port, world_size=world_size,
                     rank=rank, backend="nccl", mode="standalone", rendezvous_timeout_s=5,
                     collective_timeout_s=5)  # fmt: skip


@pytest.mark.timeout(60)
def test_every_rank_learns_the_verdict_through_a_real_store() -> None:
    """Three ranks (threads) check in on a real TCPStore; rank 2 shares rank 1's GPU. Every
    rank raises the same GroupFormationError blaming rank 2, well within the deadline."""
    listener = bind_listener("127.0.0.1")
    port = listener.getsockname()[1]
    master = open_store("127.0.0.1", port, 3, 5, listener)
    stores = [master] + [open_store("127.0.0.1", port, 3, 5, None) for _ in range(2)]
    gpus = [0, 1, 1]
    errors: dict[int, GroupFormationError] = {}
    deadline = time.monotonic() + 5

    def rank(r: int) -> None:
        try:
            check_in(stores[r], spec(r, 3, port), report(gpus[r]), deadline)
        except GroupFormationError as exc:
            errors[r] = exc

    started = time.monotonic()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert time.monotonic() - started < 2
    assert sorted(errors) == [0, 1, 2]
    assert all(exc.ranks == [2] and "one GPU" in str(exc) for exc in errors.values())


@pytest.mark.timeout(60)
def test_a_rank_that_never_checks_in_is_blamed_at_the_deadline() -> None:
    listener = bind_listener("127.0.0.1")
    port = listener.getsockname()[1]
    master = open_store("127.0.0.1", port, 2, 5, listener)
    started = time.monotonic()
    with pytest.raises(GroupFormationError) as caught:
        check_in(master, spec(0, 2, port), report(0), time.monotonic() + 1.0)
    assert 1.0 <= time.monotonic() - started < 2.0
    assert caught.value.ranks == [1]


def test_env_window_sets_and_restores_under_the_lock() -> None:
    name, other = "WEIGHT_SYNC_TEST_VAR", "WEIGHT_SYNC_TEST_OTHER"
    os.environ[other] = "kept"
    os.environ.pop(name, None)
    with env_window({name: "1", other: None}):
        assert os.environ[name] == "1" and other not in os.environ
    assert name not in os.environ and os.environ.pop(other) == "kept"
    with pytest.raises(RuntimeError), env_window({name: "2"}):
        raise RuntimeError("a failed construction restores too")
    assert name not in os.environ


@pytest.mark.parametrize(
    ("backend", "device", "error"),
    [
        ("nccl", None, "needs the CUDA device"),
        ("nccl", torch.device("cpu"), "needs a CUDA device with an index"),
        ("nccl", torch.device("cuda"), "needs a CUDA device with an index"),
        ("gloo", torch.device("cuda", 0), "keeps its buffers on the CPU"),
    ],
)
def test_join_refuses_a_device_it_cannot_use(
    backend: str, device: torch.device | None, error: str
) -> None:
    """Refused before any socket is opened (port 9 would refuse a connection anyway)."""
    bad = GroupSpec(group_id="00c0ffee", address="127.0.0.1", port=9, world_size=2, rank=1,
                    backend=backend, mode="standalone", rendezvous_timeout_s=1,
                    collective_timeout_s=1)  # fmt: skip
    with pytest.raises(ValueError, match=error):
        TorchGroup.join(bad, None, device)


def test_gloo_takes_the_cpu_device() -> None:
    """A one-rank Gloo group (``world_size=1``), formed and voted in (``device=None`` is what
    every other Gloo test passes)."""
    listener = bind_listener("127.0.0.1")
    one = GroupSpec(group_id="00c0ffee", address="127.0.0.1", port=listener.getsockname()[1],
                    world_size=1, rank=0, backend="gloo", mode="standalone",
                    rendezvous_timeout_s=5, collective_timeout_s=5)  # fmt: skip
    group = TorchGroup.join(one, listener, torch.device("cpu"))
    try:
        assert group.device == torch.device("cpu") and group.vote(3) == 3
    finally:
        group.close()


@pytest.mark.parametrize(("registered", "expected"), [
    (["GLOO", "NCCL", "UCC"], "nccl"),                            # torch before 2.14
    (["gloo", "nccl", "nccl-legacy", "nccl2", "nccl-lazy"], "nccl-legacy"),  # 2.14, 2.15
    (["NCCL-LEGACY"], "nccl-legacy"),                             # Backend._plugins: upper case
    ([], "nccl"),
])  # fmt: skip
def test_world_mode_names_the_backend_that_builds_process_group_nccl(
    registered: list[str], expected: str
) -> None:
    assert world_backend(registered) == expected


def test_this_torch_gets_a_backend_name_it_knows() -> None:
    assert world_backend() in ("nccl", "nccl-legacy")


def test_a_backend_that_is_not_process_group_nccl_is_refused_with_what_to_do() -> None:
    class ProcessGroupNCCL2:  # what torch 2.15's "nccl" builds: another class altogether
        pass

    with pytest.raises(GroupFormationError, match="ProcessGroupNCCL2.*group_mode='standalone'"):
        require_process_group_nccl(ProcessGroupNCCL2(), "world")
