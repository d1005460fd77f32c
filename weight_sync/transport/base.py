"""The data plane's narrow interface: what sender and receiver need from a group, nothing more."""

from __future__ import annotations

from typing import Protocol

import torch


class Work(Protocol):
    """A collective in flight."""

    def wait(self) -> None:
        """Block until the collective is done; raise a ``WeightSyncError`` if it failed."""


class Transport(Protocol):
    """A dedicated group over which rank ``src`` broadcasts flat uint8 buffers."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device:
        """Where buffers handed to :meth:`broadcast` must live."""

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> Work:
        """Start broadcasting ``tensor`` (a contiguous uint8 buffer) from ``src``; returns at once.

        ``timeout_s`` bounds this one collective (default: the group's collective timeout). It
        is the collective's own timeout, not only the wait's: a collective abandoned by its
        waiter would still hold the group until its own timeout ran out.
        """

    def close(self) -> None:
        """Leave the group and release its sockets. Idempotent."""
