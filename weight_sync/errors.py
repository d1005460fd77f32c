"""Runtime failures of a push.

Callers' mistakes (bad config, bad state dict) raise ``ValueError``/``TypeError`` before anything
runs. What goes wrong while running raises a :class:`WeightSyncError`, so a training loop can
catch one type and decide whether to retry, replace workers or stop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class WeightSyncError(RuntimeError):
    """Base of every runtime failure raised by weight_sync."""


class PlanMismatchError(WeightSyncError):
    """Workers refused the plan before any data moved; no worker's weights or version changed.

    ``problems`` maps worker index -> what that worker could not accept.
    """

    def __init__(self, problems: Mapping[int, Sequence[str]]) -> None:
        self.problems = {index: list(items) for index, items in problems.items()}
        lines = []
        for index, items in sorted(self.problems.items()):
            shown = "; ".join(items[:5])
            more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
            lines.append(f"worker {index}: {shown}{more}")
        super().__init__(
            "workers refused the push before any broadcast (nothing changed on any worker). "
            "Check that the state dict's names, shapes and dtypes match the workers' models: "
            + " | ".join(lines)
        )

    def __reduce__(self) -> tuple:  # survive pickling across Ray actor boundaries
        return type(self), (self.problems,)


class SyncTimeoutError(WeightSyncError, TimeoutError):
    """A bounded wait ran out: rendezvous, a collective, or a control call."""


class WorkerFailedError(WeightSyncError):
    """One or more workers died or raised during a push. ``workers`` lists their indices."""

    def __init__(self, message: str, workers: Sequence[int]) -> None:
        self.workers = list(workers)
        super().__init__(message)

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.workers)


class TransportError(WeightSyncError):
    """The process group could not be formed or a collective failed."""
