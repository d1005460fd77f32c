"""Bounded Ray calls: every wait on a worker has a deadline, and failures name the worker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from weight_sync.errors import SyncTimeoutError, TransportError, WorkerFailedError


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
    collateral: list[int] = []  # lost the collective because another member failed
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
            cause = exc.cause if exc.cause is not None else exc
            if isinstance(cause, TransportError):
                collateral.append(index)
            else:
                failed[index] = _first_line(cause)
        except GetTimeoutError:
            late.append(index)
    if failed or collateral:
        detail = "; ".join(f"worker {i}: {why}" for i, why in sorted(failed.items()))
        if collateral:
            detail += f"{'; ' if detail else ''}worker(s) {collateral} lost the broadcast as a result"
        workers = sorted([*failed, *collateral])
        raise WorkerFailedError(f"{what} failed on {len(workers)} worker(s): {detail}", workers)
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
