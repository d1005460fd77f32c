"""The suite's CPU by test group (``benchmarks/suite_cpu.py``): accounting records parsed, test
windows read from a stamped ``-v`` log, and processes charged to the test that started them, an
orphan to the engine folder running then -- on records built here, as the kernel writes them."""

from __future__ import annotations

import struct

import pytest

from benchmarks.suite_cpu import attribute, find_workers, parse_records, windows_of

RECORD = struct.Struct("<BBHIIIIIIf8H16s")


def record(pid: int, ppid: int, started: int, elapsed_s: float, utime: int, comm: bytes) -> bytes:
    """One acct_v3 record: ``utime`` as a comp_t (ticks of 1/100 s), no system time."""
    return RECORD.pack(0, 3, 0, 0, 0, 0, pid, ppid, started, elapsed_s * 100, utime, 0,
                       0, 0, 0, 0, 0, 0, comm)  # fmt: skip


@pytest.mark.parametrize(
    ("comp", "seconds"),
    [(150, 1.5), (0x1FFF, 81.91), ((1 << 13) | 100, 8.0), ((2 << 13) | 3, 1.92)],
)
def test_cpu_is_read_from_comp_t(comp: int, seconds: float) -> None:
    (proc,) = parse_records(record(5, 1, 100, 2.0, comp, b"python"))
    assert (proc.pid, proc.ppid, proc.started, proc.comm) == (5, 1, 100, "python")
    assert proc.cpu == pytest.approx(seconds) and proc.elapsed == pytest.approx(2.0)


LOG = [
    "1000.00 ============================= test session starts ==============",
    "1010.00 [gw0] [  1%] PASSED tests/vllm/test_engine.py::test_a",
    "1012.00 [gw1] [  2%] PASSED tests/ray/test_push.py::test_b",
    "1030.00 [gw1] [  3%] FAILED tests/ray/test_push.py::test_c",
    "1040.00 [gw0] [  4%] PASSED tests/unit/test_x.py::test_d",
]


def test_each_process_goes_to_the_test_its_worker_ran_when_it_started() -> None:
    procs = parse_records(b"".join([
        record(10, 1, 999, 45, 300, b"python"),  # pytest's main process
        record(11, 10, 999, 44, 100, b"python"),  # gw0
        record(12, 10, 999, 44, 200, b"python"),  # gw1
        record(20, 11, 1005, 3, 400, b"ray::Worker"),  # gw0, during test_a
        record(21, 20, 1006, 2, 50, b"child"),  # its child: test_a too
        record(22, 12, 1020, 3, 700, b"rank"),  # gw1, during test_c
        record(23, 1, 1008, 9, 600, b"VLLM::Worker"),  # an orphan, while test_a ran
        record(24, 1, 1035, 1, 80, b"orphan"),  # an orphan while no engine folder ran
        record(25, 1, 900, 1, 90, b"pip"),  # before the session
    ]))  # fmt: skip
    started, ends = windows_of(LOG)
    assert started == 1000.0 and [n for _, n in ends["gw1"]] == [
        "tests/ray/test_push.py::test_b",
        "tests/ray/test_push.py::test_c",
    ]
    workers = find_workers(procs, started, 40)
    assert workers == {11: "gw0", 12: "gw1"}
    tests, groups, apart = attribute(procs, started, ends, workers)
    assert tests["tests/vllm/test_engine.py::test_a"] == pytest.approx(4 + 0.5 + 6)
    # No engine folder running: shared among what the workers ran then (gw0's test_d, gw1's
    # last, test_c).
    assert tests["tests/unit/test_x.py::test_d"] == pytest.approx(0.4)
    assert tests["tests/ray/test_push.py::test_c"] == pytest.approx(7 + 0.4)
    assert groups["vllm"] == pytest.approx(10.5) and groups["<gw1 itself>"] == pytest.approx(2)
    assert tests["<pytest's main process>"] == pytest.approx(3)
    assert apart == pytest.approx(0.9)
