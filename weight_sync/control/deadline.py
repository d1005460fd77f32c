"""A deadline that every wait of one push draws from, so the push as a whole stays bounded."""

from __future__ import annotations

import time

from weight_sync.errors import SyncTimeoutError


class Deadline:
    """``seconds`` from now. Each step asks for ``left(cap)``: its own timeout, cut to what remains."""

    def __init__(self, seconds: float, what: str, start: float | None = None) -> None:
        """``start``: when the clock started (``time.monotonic()``), if before now."""
        self._seconds = seconds
        self._what = what
        self._end = (time.monotonic() if start is None else start) + seconds

    @property
    def seconds(self) -> float:
        return self._seconds

    def remaining(self) -> float:
        return max(0.0, self._end - time.monotonic())

    def left(self, cap: float) -> float:
        """``min(cap, remaining)``; raises ``SyncTimeoutError`` once nothing remains."""
        remaining = self.remaining()
        if remaining <= 0:
            raise SyncTimeoutError(
                f"{self._what} ran past its {self._seconds}s budget; raise push_timeout_s in "
                "SyncConfig or look for a slow or frozen worker"
            )
        return min(cap, remaining)
