"""The ring protocol's fixed cost per chunk, on the CPU (no Ray, no GPU).

The trainer (this process) opens the host ring (``transport.shm.ShmWriter``) for 1 and for 3
readers (processes started with multiprocessing's ``spawn``, each a ``ShmReader``) and broadcasts
a fixed payload through the ring's own Transport API -- ``broadcast(buffer, src=0).wait()`` on
the writer, ``broadcast(out, src=0)`` on each reader -- once per slot size. The slot sizes range
from a page to a quarter of the payload, so the same bytes cross the ring in thousands of chunks
or in a handful; each chunk costs a READY and a DONE per reader on the ring's sockets, and the
process wake-ups behind them.

Each case is timed on the writer, from the start of ``broadcast`` until ``wait`` returns (every
reader has copied every chunk out), as the median of ``--repeats`` broadcasts after one warm-up.
Between two broadcasts, untimed, each reader compares what it received with the payload (which
it derives from the same seed) byte for byte, fills its buffer with the payload's complement (so
a chunk it misses cannot match by chance), and votes over the ring (0: bit exact); the writer
collects the votes, so every timed broadcast starts with every reader waiting for it.

The fit, per reader count: ``time = chunks * per_chunk + bytes / bandwidth``, by least squares
over the slot sizes on relative residuals (each run weighs the same whatever its length). With
one payload size the bytes term is also where any fixed cost per broadcast lands. As a cross
check the table also gives the two-point difference between the most and the fewest chunks.

The baseline, in the same run: one ``copy_`` of the payload inside this process (a memcpy), and
the same copy in slot-sized pieces (torch's own cost per piece, no protocol).

    python benchmarks/ring_chunks.py                      # 16 MiB; slots of 4 KiB .. 4 MiB
    python benchmarks/ring_chunks.py --quick --out DIR    # the CI smoke test's run

Prints a markdown table; ``--out DIR`` also writes ``ring_chunks.json`` and ``ring_chunks.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import secrets
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from weight_sync.wire.metadata import GroupSpec
from weight_sync.transport import shm

KIB, MIB = 1 << 10, 1 << 20
SEED = 20240542
POLL_S = 0.5  # how often an idle reader checks that the trainer is still alive


def payload(nbytes: int, seed: int) -> torch.Tensor:
    """The bytes every broadcast carries: random, the same for the writer and each reader."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def ring_spec(group_id: str, rank: int, readers: int, timeout_s: float) -> GroupSpec:
    return GroupSpec(
        group_id=group_id,
        address=shm.socket_name(group_id),
        port=0,
        transport="shm",
        world_size=readers + 1,
        rank=rank,
        backend="gloo",
        mode="standalone",
        rendezvous_timeout_s=timeout_s,
        collective_timeout_s=timeout_s,
    )


# -- readers -------------------------------------------------------------------------------------


def reader_main(index: int, commands: Any, results: Any) -> None:
    """One reader process: joins each ring it is told of, receives its broadcasts, verifies each
    one and votes; exits on ``None`` or once the trainer is gone."""
    torch.set_num_threads(1)
    parent = mp.parent_process()
    results.put((index, True, "started"))  # imports done: the trainer need not wait blind
    expected: dict[tuple[int, int], torch.Tensor] = {}
    while True:
        try:
            command = commands.get(timeout=POLL_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if command is None:
            return
        group_id, rank, readers, nbytes, rounds, timeout_s = command
        try:
            key = (nbytes, SEED)
            if key not in expected:
                expected = {key: payload(nbytes, SEED)}
            want = expected[key]
            out = torch.empty_like(want)
            reader = shm.ShmReader.join(ring_spec(group_id, rank, readers, timeout_s))
            exact = 0
            try:
                torch.bitwise_not(want, out=out)
                for _ in range(rounds):
                    reader.broadcast(out, src=0).wait()
                    same = torch.equal(out, want)
                    exact += same
                    torch.bitwise_not(want, out=out)  # armed for the next one, before the vote
                    reader.vote(0 if same else 1)
            finally:
                reader.close()
            results.put((index, True, {"rounds": rounds, "bit_exact_rounds": exact}))
        except BaseException:
            results.put((index, False, traceback.format_exc()))


class Readers:
    """``count`` reader processes, started once and reused for every ring."""

    def __init__(self, count: int, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(count)]
        self.procs = [
            ctx.Process(target=reader_main, args=(i, self.commands[i], self.results), daemon=True)
            for i in range(count)
        ]
        for proc in self.procs:
            proc.start()
        try:
            self._started()
        except BaseException:
            self.close()
            raise

    def _started(self) -> None:
        """Every reader has imported what it needs; one that died doing so fails this at once
        (its traceback is on stderr) rather than at the end of the first ring's ``accept``."""
        started: set[int] = set()
        deadline = time.monotonic() + self.timeout_s
        while len(started) < len(self.procs):
            try:
                index, _, _ = self.results.get(timeout=POLL_S)
                started.add(index)
                continue
            except queue.Empty:
                pass
            dead = [
                i + 1 for i, p in enumerate(self.procs) if i not in started and not p.is_alive()
            ]
            if dead:
                raise RuntimeError(f"readers {dead} died while starting (see stderr)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"readers did not start within {self.timeout_s}s")

    def collect(self, count: int) -> list[dict[str, Any]]:
        """The reports of readers ``0..count-1`` on the ring just used, each within the bound."""
        reports: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(reports) < count:
            try:
                index, ok, value = self.results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                missing = sorted(set(range(count)) - set(reports))
                raise RuntimeError(
                    f"readers {missing} did not report within {self.timeout_s}s"
                ) from None
            if not ok:
                raise RuntimeError(f"reader {index + 1} failed:\n{value}")
            reports[index] = value
        return [reports[i] for i in range(count)]

    def close(self) -> None:
        for commands in self.commands:
            try:
                commands.put(None)
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


# -- the trainer ---------------------------------------------------------------------------------


def ring_case(
    pool: Readers, readers: int, slot_bytes: int, data: torch.Tensor, repeats: int
) -> dict[str, Any]:
    """Broadcast ``data`` over a ring of ``slot_bytes`` slots to ``readers`` readers."""
    timeout_s = pool.timeout_s
    group_id = secrets.token_hex(8)  # names the ring's abstract socket: unique per ring
    rounds = 1 + repeats  # one warm-up
    writer = shm.ShmWriter(group_id, readers, slot_bytes, timeout_s)
    seconds: list[float] = []
    votes: list[int] = []
    try:
        for index in range(readers):
            command = (group_id, index + 1, readers, data.numel(), rounds, timeout_s)
            pool.commands[index].put(command)
        writer.accept(timeout_s)
        for _ in range(rounds):
            start = time.perf_counter()
            writer.broadcast(data, src=0, timeout_s=timeout_s).wait()
            seconds.append(time.perf_counter() - start)
            votes.append(writer.vote(0, timeout_s=timeout_s))  # 0: every reader got it exactly
    finally:
        writer.close()  # a reader still waiting fails at once (EOF), and reports it
    reports = pool.collect(readers)
    chunks = -(-data.numel() // slot_bytes)
    median = statistics.median(seconds[1:])
    exact = all(v == 0 for v in votes) and all(
        r["bit_exact_rounds"] == r["rounds"] == rounds for r in reports
    )
    return {
        "readers": readers,
        "slot_bytes": slot_bytes,
        "chunks": chunks,
        "bytes": data.numel(),
        "seconds": seconds[1:],
        "median_s": median,
        "us_per_chunk": median / chunks * 1e6,
        "gb_per_s": data.numel() / median / 1e9,
        "bit_exact": exact,
        "verified_broadcasts": sum(r["bit_exact_rounds"] for r in reports),
    }


def copy_baseline(data: torch.Tensor, slot_bytes: int | None, repeats: int) -> float:
    """Median seconds of copying ``data`` in this process, whole or in slot-sized pieces."""
    out = torch.empty_like(data)
    pieces = (
        [(data, out)]
        if slot_bytes is None
        else list(zip(data.split(slot_bytes), out.split(slot_bytes), strict=True))
    )
    runs = []
    for _ in range(1 + repeats):
        start = time.perf_counter()
        for source, target in pieces:
            target.copy_(source)
        runs.append(time.perf_counter() - start)
    assert torch.equal(out, data)
    return statistics.median(runs[1:])


def fit(cases: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares of ``median_s = chunks * per_chunk + bytes * per_byte`` on relative
    residuals (each row divided by its time); plus the two-point difference as a cross check."""
    rows = torch.tensor([[c["chunks"], c["bytes"]] for c in cases], dtype=torch.float64)
    times = torch.tensor([c["median_s"] for c in cases], dtype=torch.float64)
    weights = 1.0 / times
    solution = torch.linalg.lstsq(rows * weights[:, None], (times * weights)[:, None]).solution
    per_chunk, per_byte = solution[:, 0].tolist()
    most = max(cases, key=lambda c: c["chunks"])
    fewest = min(cases, key=lambda c: c["chunks"])
    diff = (most["median_s"] - fewest["median_s"]) / (most["chunks"] - fewest["chunks"])
    predicted = rows @ solution[:, 0]
    worst = float(((predicted - times).abs() / times).max())
    return {
        "per_chunk_us": per_chunk * 1e6,
        "bandwidth_gb_per_s": 1 / per_byte / 1e9 if per_byte > 0 else math.inf,
        "per_chunk_us_two_point": diff * 1e6,
        "worst_fit_error": worst,
    }


def report(result: dict[str, Any]) -> str:
    memcpy = result["memcpy_s"]
    lines = [
        (
            "| readers | slot | chunks | median | GB/s | us/chunk (all) | x memcpy | "
            "1-process chunked copy | bit exact |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in result["cases"]:
        slot = case["slot_bytes"]
        size = f"{slot // MIB} MiB" if slot >= MIB else f"{slot // KIB} KiB"
        chunked = result["chunked_copy_s"][str(slot)]
        lines.append(
            f"| {case['readers']} | {size} | {case['chunks']} | {case['median_s'] * 1e3:.2f} ms | "
            f"{case['gb_per_s']:.2f} | {case['us_per_chunk']:.1f} | "
            f"{case['median_s'] / memcpy:.1f}x | {chunked * 1e3:.2f} ms | "
            f"{'yes' if case['bit_exact'] else 'NO'} |"
        )
    lines += [
        "",
        (
            f"memcpy of {result['bytes'] / MIB:.0f} MiB in one process: {memcpy * 1e3:.2f} ms "
            f"({result['bytes'] / memcpy / 1e9:.2f} GB/s)"
        ),
        "",
        (
            "| readers | per chunk (fit) | bandwidth (fit) | x memcpy GB/s | "
            "per chunk (two-point) | worst fit error |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for readers, f in result["fit"].items():
        lines.append(
            f"| {readers} | {f['per_chunk_us']:.1f} us | {f['bandwidth_gb_per_s']:.2f} GB/s | "
            f"{f['bandwidth_gb_per_s'] / (result['bytes'] / memcpy / 1e9):.2f} | "
            f"{f['per_chunk_us_two_point']:.1f} us | {f['worst_fit_error'] * 100:.0f}% |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16, help="payload of each broadcast, MiB")
    parser.add_argument(
        "--slots",
        default="4,16,64,1024,4096",
        help="slot sizes in KiB, comma-separated (a multiple of 4 KiB each)",
    )
    parser.add_argument("--readers", default="1,3", help="reader counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=9, help="timed broadcasts per case")
    parser.add_argument("--timeout", type=float, default=60.0, help="bound on every wait, s")
    parser.add_argument("--quick", action="store_true", help="4 MiB, 3 slot sizes, 5 repeats")
    parser.add_argument("--out", type=Path, default=None, help="writes ring_chunks.json/.md")
    args = parser.parse_args()
    if args.quick:
        args.mib, args.slots, args.repeats = 4, "4,64,1024", 5
    slots = [int(s) * KIB for s in args.slots.split(",")]
    reader_counts = [int(r) for r in args.readers.split(",")]
    if not shm.available():
        print("the host ring needs Linux (memfd and fd passing)", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    began = time.monotonic()
    data = payload(args.mib * MIB, SEED)
    result: dict[str, Any] = {
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "bytes": data.numel(),
        "repeats": args.repeats,
        "slots": 4,
        "fit_method": "least squares, relative residuals, time = chunks*c + bytes/bw",
        "memcpy_s": copy_baseline(data, None, max(args.repeats, 5)),
        "chunked_copy_s": {str(s): copy_baseline(data, s, args.repeats) for s in slots},
        "cases": [],
        "fit": {},
    }
    pool = Readers(max(reader_counts), args.timeout)
    try:
        for readers in reader_counts:
            cases = []
            for slot in slots:
                case = ring_case(pool, readers, slot, data, args.repeats)
                print(json.dumps({k: v for k, v in case.items() if k != "seconds"}), flush=True)
                cases.append(case)
            result["cases"] += cases
            result["fit"][str(readers)] = fit(cases)
    finally:
        pool.close()
    result["bit_exact"] = all(case["bit_exact"] for case in result["cases"])
    result["wall_s"] = time.monotonic() - began
    table = report(result)
    print(table)
    print(f"wall {result['wall_s']:.1f} s; bit exact: {result['bit_exact']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ring_chunks.json").write_text(json.dumps(result, indent=2))
        (args.out / "ring_chunks.md").write_text(
            f"# Ring protocol: cost per chunk (host ring, CPU)\n\n{result['host']}; "
            f"{result['bytes'] / MIB:.0f} MiB per broadcast, median of {args.repeats} after one "
            f"warm-up; fit: {result['fit_method']}.\n\n{table}"
        )
    return 0 if result["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
