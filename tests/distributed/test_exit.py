"""A process may exit at any time after a failed push: background teardowns and the exit.

A thread that returns from a C++ call (one that released the GIL) while the interpreter
finalises is ended by CPython with ``pthread_exit``; through pybind11's ``gil_scoped_release``
that is ``std::terminate``. The first test shows the hazard with nothing of ours in it; the
others show ``weight_sync.transport.teardown`` keeping every exit clean: waiting for teardowns
that end in time, ending the process at its bound (status 0, or 1 after an uncaught exception)
for those that do not, and a real Gloo group aborted with a collective in flight. Every child is
a real process with a hard time limit.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.harness import repo_env
from weight_sync.transport import bind_listener, teardown

pytestmark = pytest.mark.timeout(120)

# A daemon thread inside TCPStore.wait (GIL released) for WAIT_S, and a finalisation that takes
# FINALISE_S (an object whose __del__ sleeps, collected at module teardown): the wait returns in
# the middle of finalisation unless the exit waits for it first.
STORE_WAIT = """
import datetime, socket, sys, threading, time
import torch.distributed as dist
from weight_sync.transport import teardown
teardown.EXIT_WAIT_S = {exit_wait_s}
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], 1, True, use_libuv=False,
                      timeout=datetime.timedelta(seconds=60), master_listen_fd=sock.detach())

def blocked_in_cpp():
    try:
        store.wait(["never-set"], datetime.timedelta(seconds={wait_s}))
    except Exception:
        pass
    open({marker!r}, "w").close()

if {tracked}:
    teardown.start("store-wait", blocked_in_cpp)
else:
    threading.Thread(target=blocked_in_cpp, daemon=True).start()

log = open({log!r}, "w")
log.write("written, never closed")

class SlowFinalisation:
    def __init__(self):
        self.sleep = time.sleep
    def __del__(self):
        self.sleep({finalise_s})

slow = SlowFinalisation()
print("main done", flush=True)
{ending}
"""


def run_child(code: str, timeout_s: float = 60) -> tuple[int, str, float]:
    """Run ``code`` in a fresh interpreter (the repository importable); its status, stderr and
    how long it took."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=repo_env(), timeout=timeout_s, check=False)  # fmt: skip
    return done.returncode, done.stderr, time.monotonic() - started


def store_wait_child(tmp_path: Path, *, tracked: bool, wait_s: float, exit_wait_s: float = 10,
                     finalise_s: float = 3, ending: str = "") -> tuple[int, str, float, bool]:  # fmt: skip
    marker, log = tmp_path / "returned", tmp_path / "log.txt"
    code = STORE_WAIT.format(tracked=tracked, wait_s=wait_s, exit_wait_s=exit_wait_s,
                             finalise_s=finalise_s, marker=str(marker), log=str(log),
                             ending=ending)  # fmt: skip
    status, stderr, took = run_child(code)
    assert log.read_text() == "written, never closed"  # flushed, however the process ended
    return status, stderr, took, marker.exists()


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="CPython 3.14 parks such threads instead")
def test_the_hazard_a_cpp_call_returning_during_finalisation_terminates_the_process(
    tmp_path: Path,
) -> None:
    status, stderr, _, _ = store_wait_child(tmp_path, tracked=False, wait_s=1)
    assert status == -6 or status == 134, (status, stderr)  # SIGABRT from std::terminate
    assert "terminate called" in stderr, stderr


def test_an_exit_waits_for_a_teardown_that_ends_within_its_bound(tmp_path: Path) -> None:
    status, stderr, took, returned = store_wait_child(tmp_path, tracked=True, wait_s=1.5,
                                                      ending="sys.exit(3)")  # fmt: skip
    assert status == 3, (status, stderr)  # the exit went on as it would have: its own status
    assert returned and "terminate called" not in stderr, stderr
    assert took >= 1.5


@pytest.mark.parametrize("ending", ["", "sys.exit(0)", "sys.exit(3)", "raise RuntimeError('boom')"])
def test_an_exit_ends_the_process_at_its_bound_naming_what_still_runs(
    tmp_path: Path, ending: str
) -> None:
    """Past the bound the status is FORCED_EXIT_STATUS whatever the process was exiting with
    (an exit handler cannot read it): never 0 after a teardown hung, never 134."""
    status, stderr, took, returned = store_wait_child(
        tmp_path, tracked=True, wait_s=40, exit_wait_s=1.0, ending=ending
    )
    assert status == teardown.FORCED_EXIT_STATUS, (status, stderr)
    assert not returned and "terminate called" not in stderr, stderr
    assert re.search(r"teardowns still running after 1\.\ds: store-wait", stderr), stderr
    assert took < 30  # the bound, not the 40 s wait (and interpreter start-up on a busy CI)


FORKED = """
import os, sys, time
from weight_sync.transport import teardown
teardown.start("parent-only", lambda: time.sleep(30))
pid = os.fork()
if pid == 0:  # the child: the parent's teardown does not run here, nothing to wait for
    print("child sees", teardown.running(), flush=True)
    sys.exit(5)
_, status = os.waitpid(pid, 0)
print("child status", os.waitstatus_to_exitcode(status), flush=True)
teardown.EXIT_WAIT_S = 0.5
"""


def test_a_forked_child_does_not_wait_for_its_parents_teardowns() -> None:
    done = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True,
                          env=repo_env(), timeout=60, check=False)  # fmt: skip
    assert "child sees []" in done.stdout and "child status 5" in done.stdout, done
    assert done.returncode == teardown.FORCED_EXIT_STATUS, done  # the parent's still runs


GROUP_RANK = """
import socket, sys, time
import torch
from weight_sync.wire.metadata import GroupSpec
from weight_sync.transport import TorchGroup, teardown
rank, port, fd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
spec = GroupSpec(group_id="{group_id}", address="127.0.0.1", port=port, world_size=2, rank=rank,
                 backend="gloo", mode="standalone", rendezvous_timeout_s=30,
                 collective_timeout_s={collective_s})
listener = socket.socket(fileno=fd) if rank == 0 else None
group = TorchGroup.join(spec, listener)
print("joined", flush=True)
if rank == 1:
    time.sleep(60)  # alive, but never takes part: the trainer's broadcast stays in flight
    sys.exit(0)
group.broadcast(torch.zeros(256 << 20, dtype=torch.uint8), src=0)
time.sleep(0.5)
group.close()  # a collective in flight: an abort, finished on a background thread
print("closed; running:", teardown.running(), flush=True)
"""


def test_a_trainer_exiting_right_after_an_aborted_gloo_push_exits_cleanly() -> None:
    """Rank 0 posts a 256 MiB broadcast that rank 1 never joins, closes the group (an abort,
    on a teardown thread) and exits at once, with status 0. (Gloo's abort closes its pairs and
    is done in milliseconds; NCCL's waits for ncclCommAbort: tests/gpu/test_nccl.py.)"""
    listener = bind_listener("127.0.0.1")
    port = listener.getsockname()[1]
    code = GROUP_RANK.format(group_id="e1a7" * 4, collective_s=4)
    env = repo_env()
    member = subprocess.Popen([sys.executable, "-c", code, "1", str(port), "-1"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        fd = listener.fileno()
        started = time.monotonic()
        trainer = subprocess.run(
            [sys.executable, "-c", code, "0", str(port), str(fd)], env=env, pass_fds=(fd,),
            capture_output=True, text=True, timeout=90, check=False,
        )  # fmt: skip
        took = time.monotonic() - started
    finally:
        listener.close()
        member.kill()
        member.wait(10)
    assert trainer.returncode == 0, (trainer.returncode, trainer.stdout, trainer.stderr)
    assert "closed; running:" in trainer.stdout, trainer.stdout
    assert "terminate called" not in trainer.stderr
    assert "teardowns still running" not in trainer.stderr, trainer.stderr  # done within bound
    assert took < 60, took


# The trainer's end of the store plane waiting for an answer that never comes (a member died):
# its poll thread calls Store.check every few ms, GIL released, for as long as the process lives.
MAILBOX_POLLING = """
import datetime, socket, time
import torch.distributed as dist
from weight_sync.control.store import _Mailbox
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], 1, True, use_libuv=False,
                      timeout=datetime.timedelta(seconds=60), master_listen_fd=sock.detach())
mailbox = _Mailbox(store)
answer = mailbox.expect("never-answered")

class SlowFinalisation:
    def __init__(self):
        self.sleep = time.sleep
    def __del__(self):
        self.sleep(2)

slow = SlowFinalisation()
time.sleep(0.2)
print("main done", flush=True)
"""


def test_a_process_exits_cleanly_while_its_store_plane_waits_for_an_answer() -> None:
    """A sender whose push failed on a member that died leaves the store plane polling for that
    member's answer; the exit stops the poll before finalising (else a check returning during
    finalisation ends the process with std::terminate, as a sender did once in four runs)."""
    status, stderr, took = run_child(MAILBOX_POLLING)
    assert status == 0 and "terminate called" not in stderr, (status, stderr)
    assert took < 30
