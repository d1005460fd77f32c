"""Bounded Ray calls, and who is to blame when some of them fail.

Every wait on a worker has a deadline. When calls fail, each worker is put in one of four
states: answered, raised (alive, but its call failed), lost the collective because another
member failed ("collateral", alive), or unreachable (its actor died, or it did not answer at
all: frozen). Unreachable workers are the ones the updater drops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from weight_sync.errors import SyncTimeoutError, TransportError, WeightSyncError, WorkerFailedError

_UNANSWERED = object()


@dataclass
class Outcomes:
    """What came of one call to each of several workers (indexed as the refs were)."""

    results: list[Any]
    raised: dict[int, str] = field(default_factory=dict)  # alive; its call failed
    collateral: list[int] = field(default_factory=list)  # alive; lost a collective to someone else
    died: dict[int, str] = field(default_factory=dict)
    late: list[int] = field(default_factory=list)  # no answer in time

    @property
    def ok(self) -> bool:
        return not (self.raised or self.collateral or self.died or self.late)

    @property
    def unreachable(self) -> list[int]:
        """Workers to give up on: dead, or silent while others answered. If nobody answered,
        nobody can be blamed (the fault is more likely here, or the timeout too short)."""
        answered = len(self.results) - len(self.late) - len(self.died)
        return sorted([*self.died, *(self.late if answered else [])])

    def error(self, what: str, timeout_s: float, dropped: Sequence[int] = ()) -> WeightSyncError:
        """The error to raise for these outcomes (which must not be ``ok``)."""
        blamed = {**self.raised, **self.died}
        blamed.update({
            index: f"no answer within {timeout_s:.1f}s (frozen?)"
            for index in self.unreachable if index not in self.died
        })  # fmt: skip
        if not blamed:
            if self.collateral and not self.late:
                return TransportError(
                    f"{what}: the sync group failed on worker(s) {self.collateral} with no "
                    "worker at fault; check the trainer's network and logs"
                )
            return SyncTimeoutError(
                f"{what}: worker(s) {sorted(self.late)} did not answer within {timeout_s:.1f}s; "
                "they may be frozen, overloaded or still starting -- raise the timeout in "
                "SyncConfig or check them"
            )
        detail = "; ".join(f"worker {i}: {why}" for i, why in sorted(blamed.items()))
        if self.collateral:
            detail += f"; worker(s) {self.collateral} lost the broadcast as a result"
        if dropped:
            detail += f"; dropped worker(s) {list(dropped)} from the updater"
        return WorkerFailedError(
            f"{what} failed on {len(blamed)} worker(s): {detail}", sorted(blamed), dropped
        )


def collect(refs: Sequence[ray.ObjectRef], timeout_s: float) -> Outcomes:
    """Wait up to ``timeout_s`` in total for every ref; never raises for a worker's failure."""
    outcomes = Outcomes(results=[_UNANSWERED] * len(refs))
    if not refs:
        return outcomes
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=max(timeout_s, 0.0))
    done = set(ready)
    for index, ref in enumerate(refs):
        if ref not in done:
            outcomes.late.append(index)
            continue
        try:
            outcomes.results[index] = ray.get(ref, timeout=0)
        except RayActorError as exc:
            outcomes.died[index] = f"actor died ({_first_line(exc)})"
        except RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            if isinstance(cause, (TransportError, SyncTimeoutError)):
                outcomes.collateral.append(index)
            else:
                outcomes.raised[index] = _first_line(cause)
        except GetTimeoutError:
            outcomes.late.append(index)
    return outcomes


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [line for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else text}"[:500]
