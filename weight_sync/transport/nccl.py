"""What NCCL needs that Gloo does not: a construction that no watchdog can turn into a process
kill, a check-in before the first NCCL call, and an eager communicator bounded by our own clock.

Everything here is written from PyTorch's source (torch/csrc/distributed/c10d/
ProcessGroupNCCL.cpp, NCCLUtils.cpp; torch 2.8+, the ``Watchdog``/``HeartbeatMonitor`` classes);
the functions cite what they rely on. It ran on one H100 (torch 2.11, NCCL 2.28.9: one-rank
groups, tests/gpu/test_nccl.py), and was read again against torch 2.14 and 2.15, whose
``ProcessGroupNCCL`` keeps every behaviour below -- but whose "nccl" may build another class
(see ``LEGACY_NAME``).

Why blocking-wait mode (``TORCH_NCCL_BLOCKING_WAIT=1``, only while our group is constructed):

* ``ProcessGroupNCCL::ProcessGroupNCCL`` reads it into ``blockingWait_`` once, and in that mode
  never starts ``watchdog_`` ("in blockingWait mode, we don't need to enable the watchdog
  thread"). The heartbeat monitor is started only by ``Watchdog::run``, so it never runs either.
* ``workEnqueue`` skips ``workMetaList_`` in that mode: no thread of ours ever looks at a failed
  work. Otherwise ``Watchdog::runLoop`` would, on our timeout, call ``broadcastDumpSignal``
  (which sets the *static* ``shouldDump_`` that the heartbeat monitor of the process's first
  group -- the trainer's FSDP world, vLLM's world group -- acts on, and which ends in
  ``terminateProcess``), sleep ``4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` and then rethrow from
  the watchdog thread (``std::terminate``) under the default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``.
* The variable is restored at once, under a lock, so the user's own groups keep their mode.

What remains is ``ProcessGroupNCCL::abort``, which starts with ``dumpExtraDebuggingInfo``: if
``TORCH_NCCL_EXTRA_DUMP_ON_EXEC`` is set (read at call time, off by default) it too calls
``broadcastDumpSignal``. ``abort_backend`` therefore clears that variable for the duration of
our abort, in the same window. ``WorkNCCL::wait`` on a failed work aborts only that work's
communicator and rethrows on the calling thread (``handleException(TearDown)``): no dump.

One limitation stays: ``checkDumpSignal`` belongs to the group with uid 0. If our group is the
first ``ProcessGroupNCCL`` of the process it takes uid 0, and a later group of the user's would
find no heartbeat monitor to dump its flight record (its own watchdog still handles its errors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from weight_sync.control.deadline import Deadline
from weight_sync.control.futures import Backoff
from weight_sync.control.keys import StoreGoneError, wait_all, wait_one
from weight_sync.errors import GroupFormationError, SyncTimeoutError
from weight_sync.transport import teardown
from weight_sync.transport.devices import gpu_uuid
from weight_sync.wire.metadata import GroupSpec

logger = logging.getLogger(__name__)

# NCCL reads its NCCL_* parameters once per process (ncclLoadParam caches them), so they cannot
# be set per communicator; where ranks differ, collectives can hang (vLLM pins NCCL_PROTO /
# NCCL_ALGO in batch-invariant mode and says so). We refuse to form a group across a mismatch.
MUST_AGREE = ("NCCL_PROTO", "NCCL_ALGO")

# The one piece of module state: os.environ is process-wide, so every window in which we set a
# variable that torch reads (here, and GLOO_SOCKET_IFNAME in torch_group) is taken under it.
_ENV_LOCK = threading.RLock()


@contextlib.contextmanager
def env_window(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or, for None, unset) environment variables for exactly the duration of the block,
    holding the process-wide lock, and restore what was there before.

    Known risk: the lock orders our own windows, not another thread's ``getenv`` in C++ (a user
    group's watchdog), and a process group the user builds on another thread meanwhile would be
    built in blocking-wait mode too. torch's own constructor changes the environment the same way
    (``c10::utils::set_env("NCCL_ALGO", ...)`` in ProcessGroupNCCL's constructor); the window is
    the few milliseconds of one constructor call."""
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in values}
        try:
            for name, value in values.items():
                _put_env(name, value)
            yield
        finally:
            for name, value in saved.items():
                _put_env(name, value)


def _put_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def construct(build: Callable[[], object]) -> object:
    """Run ``build`` (which creates our ProcessGroupNCCL objects) in blocking-wait mode: see the
    module docstring for why this, and nothing more, keeps every watchdog thread away."""
    with env_window({"TORCH_NCCL_BLOCKING_WAIT": "1"}):
        return build()


def nccl_group(spec: GroupSpec, store: dist.Store, collective: datetime.timedelta) -> object:
    """A standalone ``ProcessGroupNCCL`` over ``store``; its communicator does not exist yet
    (``connect`` creates it)."""
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = collective  # also bounds ProcessGroupNCCL::abort's own wait
    return construct(lambda: ProcessGroupNCCL(store, spec.rank, spec.world_size, options))


# torch 2.14 added a second NCCL backend built on the torchcomms engine (``ProcessGroupNCCL2``,
# "nccl2"), and 2.15 made it what "nccl" builds in ``init_process_group`` / ``new_group``
# (``_register_builtin_nccl_backend`` in distributed_c10d.py: ``_create_nccl2_process_group``
# unless TORCH_DIST_USE_NCCL2=0, read once, when "nccl" is first registered). Everything in this
# module is about ``ProcessGroupNCCL``: nccl2 has a watchdog of its own, an abort with no bounded
# wait, and picks its device itself. Both releases keep the old one as "nccl-legacy", and
# constructing ``ProcessGroupNCCL`` directly (standalone mode) still builds it.
LEGACY_NAME = "nccl-legacy"


def world_backend(registered: Iterable[str] | None = None) -> str:
    """The backend name under which ``init_process_group`` / ``new_group`` build a
    ``ProcessGroupNCCL``: "nccl-legacy" where torch knows that name (registered, or declared as
    an entry point of ``torch.distributed.backends``), else "nccl" (torch before 2.14).
    ``registered``: the names to look among (default: this torch's)."""
    names = _known_backends() if registered is None else registered
    return LEGACY_NAME if LEGACY_NAME in {name.lower() for name in names} else "nccl"


def _known_backends() -> list[str]:
    from importlib.metadata import entry_points

    plugins = list(getattr(dist.Backend, "_plugins", {}))
    return plugins + [point.name for point in entry_points(group="torch.distributed.backends")]


def require_process_group_nccl(backend: object, mode: str) -> None:
    """Refuse a group whose NCCL backend is not ``ProcessGroupNCCL`` (nccl2, or a torchcomms
    wrapper under TORCH_DISTRIBUTED_USE_TORCHCOMMS): our bounds and our process's survival after
    a timeout rest on that class's blocking-wait construction and abort."""
    expected = getattr(dist, "ProcessGroupNCCL", None)
    if expected is not None and isinstance(backend, expected):
        return
    raise GroupFormationError(
        f"group_mode={mode!r} built a {type(backend).__name__} for the sync group, not the "
        f"torch.distributed.ProcessGroupNCCL whose failure semantics weight_sync relies on "
        f"(torch {torch.__version__}); use group_mode='standalone', which constructs that class "
        "itself, or unset TORCH_DISTRIBUTED_USE_TORCHCOMMS and set TORCH_DIST_USE_NCCL2=0 "
        "before the process builds its first NCCL group"
    )


def abort_backend(abort: Callable[[], None]) -> None:
    """Call a ProcessGroupNCCL abort so that it cannot signal a dump (see module docstring).

    The window is taken only if the user set TORCH_NCCL_EXTRA_DUMP_ON_EXEC, so that an abort,
    which may take a while in ncclCommAbort, does not hold the lock in the common case."""
    if os.environ.get("TORCH_NCCL_EXTRA_DUMP_ON_EXEC") is None:
        abort()
        return
    with env_window({"TORCH_NCCL_EXTRA_DUMP_ON_EXEC": "0"}):
        abort()


# -- check-in: who is there, on which GPU, with which NCCL ------------------------------------


@dataclasses.dataclass(frozen=True)
class Report:
    """What one rank says about itself before any NCCL call."""

    gpu: str  # torch.cuda.get_device_properties(device).uuid
    nccl: str  # torch.cuda.nccl.version()
    env: dict[str, str | None]  # MUST_AGREE, as this process sees them

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Report:
        data = json.loads(text)
        return cls(gpu=str(data["gpu"]), nccl=str(data["nccl"]), env=dict(data["env"]))


def local_report(device: torch.device) -> Report:
    """This process's report for ``device`` (a CUDA device with an index)."""
    uuid = gpu_uuid(device)
    assert uuid is not None, "an NCCL member is on a GPU"
    version = ".".join(str(part) for part in torch.cuda.nccl.version())
    return Report(gpu=uuid, nccl=version, env={name: os.environ.get(name) for name in MUST_AGREE})


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Rank 0's answer to a check-in: ``ok``, or what is wrong and whom to blame."""

    ok: bool
    message: str = ""
    ranks: tuple[int, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "message": self.message, "ranks": list(self.ranks)})

    @classmethod
    def from_json(cls, text: str | bytes) -> Verdict:
        data = json.loads(text)
        return cls(bool(data["ok"]), str(data["message"]), tuple(int(r) for r in data["ranks"]))

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise GroupFormationError(self.message, self.ranks)


def judge(reports: Mapping[int, Report], world_size: int) -> Verdict:
    """Whether ranks ``0..world_size-1`` can form one NCCL group (pure).

    Blame, in this order: ranks that never checked in; ranks that share a GPU with a lower rank
    (NCCL refuses two ranks on one device: "Duplicate GPU detected"); ranks whose NCCL version or
    MUST_AGREE settings differ from rank 0's (or, without rank 0, from the lowest rank's)."""
    missing = [rank for rank in range(world_size) if rank not in reports]
    if missing:
        return Verdict(
            False,
            f"ranks {missing} did not check in to the sync group in time; "
            "check that those workers are alive and can reach the trainer",
            tuple(missing),
        )
    first_on: dict[str, int] = {}
    shared: list[str] = []
    blamed: list[int] = []
    for rank in sorted(reports):
        owner = first_on.setdefault(reports[rank].gpu, rank)
        if owner != rank:
            shared.append(f"rank {rank} is on the GPU of rank {owner} ({reports[rank].gpu})")
            blamed.append(rank)
    if shared:
        return Verdict(
            False,
            "NCCL cannot put two ranks on one GPU: "
            + "; ".join(shared)
            + ". Colocated members need another route (CUDA IPC, host ring)",
            tuple(blamed),
        )
    reference = reports[min(reports)]
    skewed: list[str] = []
    for rank in sorted(reports):
        report = reports[rank]
        if report.nccl != reference.nccl:
            skewed.append(
                f"rank {rank} has NCCL {report.nccl}, rank {min(reports)} {reference.nccl}"
            )
            blamed.append(rank)
            continue
        differ = [
            f"{name}={report.env.get(name)!r} (not {reference.env.get(name)!r})"
            for name in MUST_AGREE
            if report.env.get(name) != reference.env.get(name)
        ]
        if differ:
            skewed.append(f"rank {rank} has " + ", ".join(differ))
            blamed.append(rank)
    if skewed:
        return Verdict(
            False,
            "the sync group's NCCL settings must match on every rank (NCCL "
            "reads them once per process; a mismatched peer can hang): " + "; ".join(skewed),
            tuple(blamed),
        )
    return Verdict(True)


def check_in(store: dist.Store, spec: GroupSpec, report: Report, deadline: float) -> None:
    """Every rank writes its report; rank 0 judges them and every rank learns the verdict.
    Raises ``GroupFormationError`` (on every rank) if the group must not form."""
    store.set(f"checkin/{spec.rank}", report.to_json())
    if spec.rank == 0:
        found = gather(store, "checkin", spec.world_size, deadline)
        verdict = judge({r: Report.from_json(v) for r, v in found.items()}, spec.world_size)
        store.set("checkin-verdict", verdict.to_json())
    else:
        verdict = _await_verdict(store, "checkin-verdict", deadline, "check-in")
    verdict.raise_if_failed()


def gather(store: dist.Store, stem: str, world_size: int, deadline: float) -> dict[int, bytes]:
    """``stem/<rank>`` of every rank that wrote it before ``deadline`` (monotonic)."""
    keys = {rank: f"{stem}/{rank}" for rank in range(world_size)}
    with contextlib.suppress(StoreGoneError):  # rank 0 hosts it: only at its own exit
        found = wait_all(store, list(keys.values()), _until(deadline, stem))
        return {rank: found[key] for rank, key in keys.items() if key in found}
    return {}


def _await_verdict(store: dist.Store, key: str, deadline: float, what: str) -> Verdict:
    try:
        return Verdict.from_json(wait_one(store, key, _until(deadline, what)))
    except (SyncTimeoutError, StoreGoneError) as exc:  # late, or the trainer's store went away
        return Verdict(
            False,
            f"the trainer (rank 0) gave no {what} verdict in time ({exc}); "
            "check that the trainer is alive",
            (0,),
        )


def _until(deadline: float, what: str) -> Deadline:
    """A monotonic ``deadline`` as the ``Deadline`` the store's waits take."""
    return Deadline(deadline - time.monotonic(), what)


# -- the communicator: eager, checked, bounded ---------------------------------------------------


def connect(
    backend: object, device: torch.device, store: dist.Store, spec: GroupSpec, deadline: float
) -> None:
    """Create the communicator now and prove it with a warm-up all-reduce, within ``deadline``.

    ``eager_connect_single_device`` (``ProcessGroupNCCL::eagerConnectSingleDevice`` ->
    ``initNCCLComm``) runs ``ncclCommInitRank`` on the calling thread. Nothing in torch bounds it:
    blocking mode has no timeout at all, and nonblocking mode (``options.config.blocking = 0``)
    waits in ``NCCLComm::waitReady`` holding the communicator's mutex for
    ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` (default 30 min, cached process-wide on first read by
    ``nccl_nonblocking_timeout``), which also blocks ``abort`` (it takes that mutex). torch keeps
    nonblocking off by default since 2.7.1 (``useNonblocking``, citing pytorch#153960: hangs
    with NCCL 2.26). So the connect runs, in torch's default blocking mode, on a daemon thread
    that this rank waits for until its deadline; a thread still inside ``ncclCommInitRank`` then
    is abandoned with its group (``TorchGroup`` aborts it in the background).

    Every rank writes its outcome ("ok" or the error) to the store; rank 0 blames the ranks
    that failed, or else those that never reported, and every rank raises the same
    ``GroupFormationError``.
    """
    # Leave a little of the budget for the outcomes to travel through the store.
    margin = min(2.0, 0.2 * max(deadline - time.monotonic(), 0.0))
    outcome = _connect_bounded(backend, device, spec.world_size, deadline - margin)
    store.set(f"init/{spec.rank}", outcome)
    if spec.rank == 0:
        found = {r: v.decode() for r, v in gather(store, "init", spec.world_size, deadline).items()}
        verdict = judge_init(found, spec.world_size, deadline_s=spec.rendezvous_timeout_s)
        store.set("init-verdict", verdict.to_json())
    else:
        verdict = _await_verdict(store, "init-verdict", deadline + margin, "communicator")
    verdict.raise_if_failed()


def judge_init(outcomes: Mapping[int, str], world_size: int, deadline_s: float) -> Verdict:
    """Rank 0's verdict on the ranks' communicator outcomes (pure). A rank that reported an
    error is blamed before one that merely timed out or never reported, since the others wait
    on it inside ``ncclCommInitRank``."""
    failed = {
        r: text for r, text in outcomes.items() if text != "ok" and not text.startswith(_LATE)
    }
    if failed:
        detail = "; ".join(f"rank {r}: {text}" for r, text in sorted(failed.items()))
        return Verdict(False, f"NCCL communicator init failed: {detail}", tuple(sorted(failed)))
    silent = [r for r in range(world_size) if r not in outcomes]
    late = sorted(r for r, text in outcomes.items() if text.startswith(_LATE))
    if silent:
        return Verdict(
            False,
            f"ranks {silent} never reported on their NCCL communicator "
            f"within {deadline_s}s; they probably died after checking in",
            tuple(silent),
        )
    if late:
        return Verdict(
            False,
            f"ranks {late} had no NCCL communicator within {deadline_s}s "
            "although every rank reported; check the network NCCL uses "
            "(NCCL_SOCKET_IFNAME, NCCL_DEBUG=INFO)",
            tuple(late),
        )
    return Verdict(True)


_LATE = "late:"


def _connect_bounded(backend: object, device: torch.device, world_size: int, end: float) -> str:
    """The outcome: ``"ok"``, the error text, or ``_LATE`` + why; never after ``end``."""
    result: list[str] = []

    def run() -> None:
        try:
            with torch.cuda.device(device):  # anything implicit lands on our device
                backend.eager_connect_single_device(device)  # type: ignore[attr-defined]
                probe = torch.ones(1, dtype=torch.int32, device=device)
                work = backend.allreduce([probe], dist.AllreduceOptions())  # type: ignore[attr-defined]
                backoff = Backoff(1e-4, 0.01)
                while not work.is_completed():  # WorkNCCL::isCompleted: an event query
                    if time.monotonic() >= end:
                        result.append(f"{_LATE} the warm-up all-reduce did not finish")
                        return
                    backoff.sleep()
                work.wait()  # completed: a stream wait, and the error if it failed
                got = int(probe.item())
            if got != world_size:
                result.append(f"the warm-up all-reduce gave {got}, not {world_size}")
            else:
                result.append("ok")
        except Exception as exc:  # reported as what it is: OOM, duplicate GPU, NCCL error ...
            result.append(f"{type(exc).__name__}: {exc}".strip()[:2000])

    # A teardown: abandoned inside ncclCommInitRank, it must not be killed there at exit.
    thread = teardown.start("weight-sync-nccl-init", run)
    thread.join(max(end - time.monotonic(), 0.0))
    if result:
        return result[0]
    return f"{_LATE} ncclCommInitRank did not return in time"
