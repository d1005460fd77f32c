"""Bounded Ray calls: every wait on a worker has a deadline, and failures name the worker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from weight_sync.errors import SyncTimeoutError, WorkerFailedError


def gather(refs: Sequence[ray.ObjectRef], what: str, timeout_s: float) -> list[Any]:
    """``ray.get`` every ref within ``timeout_s`` in total.

    Raises ``WorkerFailedError`` naming the workers (by position in ``refs``) whose call raised or
    whose actor died, else ``SyncTimeoutError`` naming those that did not answer in time.
    """
    if not refs:
        return []
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    results: list[Any] = [None] * len(refs)
    failed: dict[int, str] = {}
    late: list[int] = []
    for index, ref in enumerate(refs):
        if ref not in done:
            late.append(index)
            continue
        try:
            results[index] = ray.get(ref, timeout=0)
        except RayActorError as exc:
            failed[index] = f"actor died ({_first_line(exc)})"
        except RayTaskError as exc:
            failed[index] = _first_line(exc.cause if exc.cause is not None else exc)
        except GetTimeoutError:
            late.append(index)
    if failed:
        detail = "; ".join(f"worker {i}: {why}" for i, why in sorted(failed.items()))
        raise WorkerFailedError(f"{what} failed on {len(failed)} worker(s): {detail}", sorted(failed))
    if late:
        raise SyncTimeoutError(
            f"{what}: worker(s) {late} did not answer within {timeout_s}s; they may be frozen, "
            "overloaded or still starting -- raise the timeout in SyncConfig or check them"
        )
    return results


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [line for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else text}"[:500]
