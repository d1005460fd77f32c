"""Where the test suite's CPU goes, per test group: a run of the suite under process accounting.

The suite is CPU-bound on 2 cores (docs/testing.md), so its time is the CPU-seconds its
processes spend -- mostly in processes the tests start (engines, servers, Ray actors, ranks),
which pytest's ``--durations`` cannot see. Linux's BSD process accounting (``acct(2)``, root
only) writes a record as each process exits: its pid, parent, start time and CPU. This script
turns accounting on, runs the command given (the suite, ``.ci/run`` for instance) with
``PYTEST_ADDOPTS=-v`` and every output line stamped with the time, turns it off, and charges each
process to the test running, when it started, on the xdist worker it descends from. A process
whose parent died before it (an engine's workers once their server was killed) has no worker
ancestor left: it goes to the engine folder running when it started, or is counted apart.

    sudo python benchmarks/suite_cpu.py --out /tmp/cpu -- bash .ci/run

Prints the CPU-seconds per group (a folder whose tests share engines, else a module) and the
25 costliest tests; ``--out DIR`` keeps the stamped log, the records and ``groups.json``. The
records' CPU is in 1/100 s; a process still running when accounting stops is not counted.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import ctypes
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# struct acct_v3 (linux/acct.h): 64 bytes; comp_t fields are 13-bit mantissas, base-8 exponents.
_RECORD = struct.Struct("<BBHIIIIIIf8H16s")
# Folders whose tests share processes (tests/scheduling.py's groups).
SHARED = ("vllm", "vllm_serve", "sglang", "deploy", "no_ray")
# Folders whose processes outlive their parents (an engine's workers, a daemonized `ray start`):
# an orphan is charged to those of them running when it started.
OUTLIVING = ("vllm", "vllm_serve", "sglang", "no_ray", "deploy")
_DONE = re.compile(
    r"^(\d+\.\d+) \[(gw\d+)\] \[\s*\d+%\] (?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (\S+)"
)
_STARTS = "test session starts"


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    started: int  # seconds since the epoch
    elapsed: float  # seconds
    cpu: float  # user + system seconds
    comm: str  # the name at exit (often a thread's)


def _comp(value: int) -> int:
    return (value & 0x1FFF) << (3 * (value >> 13))


def parse_records(raw: bytes) -> list[Proc]:
    """Every version-3 record of an accounting file."""
    procs = []
    for offset in range(0, len(raw) - _RECORD.size + 1, _RECORD.size):
        fields = _RECORD.unpack_from(raw, offset)
        pid, ppid, started, elapsed = fields[6], fields[7], fields[8], fields[9]
        utime, stime, comm = fields[10], fields[11], fields[-1]
        procs.append(
            Proc(pid, ppid, started, elapsed / 100, (_comp(utime) + _comp(stime)) / 100,
                 comm.rstrip(b"\0").decode(errors="replace"))
        )  # fmt: skip
    return procs


def group_of(nodeid: str) -> str:
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 and parts[1] in SHARED else "/".join(parts)


def windows_of(lines: Iterable[str]) -> tuple[float, dict[str, list[tuple[float, str]]]]:
    """From a stamped ``-v`` log: when the session started, and per xdist worker the time each
    of its tests ended, in order (a test ran from its predecessor's end to its own)."""
    started, ends = 0.0, collections.defaultdict(list)
    for line in lines:
        if _STARTS in line and not started:
            started = float(line.split(" ", 1)[0])
        elif match := _DONE.match(line):
            ends[match.group(2)].append((float(match.group(1)), match.group(3)))
    return started, dict(ends)


def find_workers(procs: Sequence[Proc], started: float, span: float) -> dict[int, str]:
    """The xdist workers' pids, named gw0, gw1, ... by pid: the children of pytest's main
    process (started within 5 s before the session) that lived through most of it."""
    children = collections.defaultdict(list)
    for proc in procs:
        children[proc.ppid].append(proc)
    for main in sorted(procs, key=lambda p: p.started):
        if started - 5 <= main.started <= started + 1:
            long = [c for c in children[main.pid] if c.elapsed >= 0.8 * span]
            if len(long) >= 2:
                return {c.pid: f"gw{i}" for i, c in enumerate(sorted(long, key=lambda c: c.pid))}
    return {}


def _running(ends: Sequence[tuple[float, str]], at: float) -> str:
    index = bisect.bisect_left([end for end, _ in ends], at)
    return ends[min(index, len(ends) - 1)][1]


def attribute(
    procs: Sequence[Proc],
    started: float,
    ends: Mapping[str, Sequence[tuple[float, str]]],
    workers: Mapping[int, str],
) -> tuple[collections.Counter[str], collections.Counter[str], float]:
    """CPU-seconds per test and per group, and those of processes started before the session.
    An orphan (no worker among its ancestors any more) is shared among the ``OUTLIVING``
    folders running when it started, else among every test then running."""
    by_pid = {proc.pid: proc for proc in procs}
    tests: collections.Counter[str] = collections.Counter()
    apart = 0.0

    def worker_of(proc: Proc) -> str | None:
        for _ in range(64):
            if proc.ppid in workers:
                return workers[proc.ppid]
            parent = by_pid.get(proc.ppid)
            if parent is None:
                return None
            proc = parent
        return None

    mains = {by_pid[pid].ppid for pid in workers if pid in by_pid}  # pytest's own process
    for proc in procs:
        if proc.started < started - 1:
            apart += proc.cpu
            continue
        if proc.pid in mains:
            tests["<pytest's main process>"] += proc.cpu
            continue
        if proc.pid in workers:
            tests[f"<{workers[proc.pid]} itself>"] += proc.cpu
            continue
        worker = worker_of(proc)
        if worker is not None and worker in ends:
            tests[_running(ends[worker], proc.started)] += proc.cpu
            continue
        running = [_running(e, proc.started) for e in ends.values() if e]
        chosen = [t for t in running if group_of(t) in OUTLIVING] or running
        for test in chosen:
            tests[test] += proc.cpu / len(chosen)
    groups: collections.Counter[str] = collections.Counter()
    for test, cpu in tests.items():
        groups[test if test.startswith("<") else group_of(test)] += cpu
    return tests, groups, apart


def _acct(path: str | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(path.encode() if path else None) != 0:
        raise OSError(ctypes.get_errno(), "acct(2) failed: run as root")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="keep the log, the records and groups.json here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- and the suite's command")
    args = parser.parse_args(argv)
    command = [c for c in args.command if c != "--"] or [sys.executable, "-m", "pytest"]
    out = args.out or Path(tempfile.mkdtemp(prefix="suite-cpu-"))
    out.mkdir(parents=True, exist_ok=True)
    records, log = out / "acct.v3", out / "run.log"
    records.write_bytes(b"")
    _acct(str(records))
    try:
        env = {**os.environ, "PYTEST_ADDOPTS": f"{os.environ.get('PYTEST_ADDOPTS', '')} -v"}
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, text=True, errors="replace") as run, log.open("w") as f:  # fmt: skip
            assert run.stdout is not None
            for line in run.stdout:
                f.write(f"{time.time():.2f} {line}")
                sys.stdout.write(line)
    finally:
        _acct(None)
    procs = parse_records(records.read_bytes())
    started, ends = windows_of(log.read_text(errors="replace").splitlines())
    span = max((end for e in ends.values() for end, _ in e), default=started) - started
    tests, groups, apart = attribute(procs, started, ends, find_workers(procs, started, span))
    print(f"\n{sum(groups.values()):.0f} CPU-s charged to the tests; {apart:.0f} outside them")
    print("| group | CPU-s |\n|---|---|")
    for group, cpu in groups.most_common():
        print(f"| `{group}` | {cpu:.0f} |")
    print("\nThe 25 costliest tests (processes they started, in CPU-s):")
    for test, cpu in tests.most_common(25):
        print(f"{cpu:8.1f}  {test}")
    (out / "groups.json").write_text(json.dumps({"groups": groups, "tests": tests}, indent=1))
    sys.exit(run.returncode)


if __name__ == "__main__":
    main()
