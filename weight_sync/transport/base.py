"""The data plane's narrow interface: what sender and receiver need from a group, nothing more."""

from __future__ import annotations

from typing import Protocol

import torch


class Work(Protocol):
    """A collective in flight."""

    def wait(self) -> None:
        """Block until the collective is done; raise a ``WeightSyncError`` if it failed."""

    def after(self) -> None:
        """Order later work on this thread's current CUDA stream after the collective, without
        blocking the host (NCCL: a stream wait). Buffers the collective reads or writes may be
        reused by kernels queued after this call. Where there is no device stream to order (Gloo,
        the host ring), the same as ``wait`` -- but for a relay (``transport.relay``), whose
        buffer is still read, never written, until the next broadcast's ``after`` returns. A
        failure still surfaces in ``wait``."""


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

        ``timeout_s`` bounds this one collective (default: the group's collective timeout),
        counted from when it could start (a pipelined collective queued behind another is not
        charged that one's time). It binds the collective, not only the wait: one that runs past
        it tears the group down, so an abandoned collective cannot hold the group. (NCCL ignores
        per-op timeouts; ``TorchGroup`` enforces them in its own waits.)

        A transport may also say which devices it takes buffers from with ``takes(device) ->
        bool`` (``Fanout`` asks; without it, only its own ``device``).
        """

    def vote(self, code: int, timeout_s: float | None = None) -> int:
        """A collective in which every rank gives a small non-negative ``code`` and gets back
        the largest one given: how members agree without a round trip through the trainer's
        control plane (e.g. that every one of them has received a push). A rank that fails
        leaves the group, and the vote fails on the others."""

    # Whether ``tally`` already tells every rank the outcome (an all-reduce does).
    tally_is_final: bool

    def tally(self, code: int, timeout_s: float | None = None) -> int:
        """Rank 0's first half of ``vote``: the largest code of every rank, while they wait for
        ``announce`` (unless ``tally_is_final``). Split so that one trainer can vote across
        several groups (``Fanout``)."""

    def announce(self, code: int, timeout_s: float | None = None) -> int:
        """Rank 0's second half of ``vote``: the outcome, to every rank; returns it."""

    def close(self) -> None:
        """Leave the group and release its sockets. Idempotent."""
