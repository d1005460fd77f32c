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
    """Workers died, froze or raised during a push.

    ``workers`` lists them by their index in ``WeightUpdater.workers`` as it was when the push
    began; ``dropped`` is the subset the updater removed because they died or stopped answering
    (the next push forms a group without them; ``add_workers`` brings in replacements). Workers
    that raised but still answer are kept: they are dirty until the next full push.
    """

    def __init__(self, message: str, workers: Sequence[int], dropped: Sequence[int] = ()) -> None:
        self.workers = list(workers)
        self.dropped = list(dropped)
        super().__init__(message)

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.workers, self.dropped)


class ServerError(WorkerFailedError):
    """One or more inference servers failed: refused the connection, answered with an HTTP
    error, timed out, or reported a failure. ``servers`` maps each server's base URL (or an
    engine's name) to the reason.

    A ``WorkerFailedError``, so a loop that handles failed workers handles failed servers too;
    ``workers`` lists the sync-group members blamed, when a push got that far."""

    def __init__(
        self,
        message: str,
        servers: Mapping[str, str],
        workers: Sequence[int] = (),
        dropped: Sequence[int] = (),
    ) -> None:
        self.servers = dict(servers)
        super().__init__(message, workers, dropped)

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.servers, self.workers, self.dropped)


class ChecksumMismatchError(WorkerFailedError):
    """Bytes a worker received differ from those sent (``SyncConfig(checksum=True)``); nothing
    was committed, and those workers are dirty (streaming) or unchanged (atomic staging)."""


class TransportError(WeightSyncError):
    """The process group could not be formed or a collective failed."""


class GroupFormationError(TransportError):
    """The sync group could not be formed: a member never arrived, or its communicator failed
    to initialise (a duplicate GPU, out of memory, mismatched NCCL settings or versions).

    ``ranks`` are the group ranks to blame (empty when none in particular is).
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        self.ranks = list(ranks)
        super().__init__(message)

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.ranks)


class SenderFailedError(WeightSyncError):
    """Trainer ranks of a push over lanes -- many senders (``WeightUpdater``/``VLLMServers``
    with ``senders``, ``JobSync(senders=K)``) or a launched job's one -- failed to send their
    share, or died: no member claims the push's version (the lanes that did land leave them
    holding blocks of two versions, reported as no version, until a push repairs them).

    ``senders`` are the trainer ranks to blame.
    """

    def __init__(self, message: str, senders: Sequence[int] = ()) -> None:
        self.senders = list(senders)
        super().__init__(message)

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.senders)


def first_line(error: BaseException) -> str:
    """``Type: last non-empty line of the message``, bounded: a reason for an error message."""
    text = str(error).strip() or type(error).__name__
    lines = [line for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else text}"[:500]
