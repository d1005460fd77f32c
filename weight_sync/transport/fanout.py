"""One push over several transports at once: the trainer's end of a mixed group.

Workers on the trainer's host take the shared-memory ring, the others the broadcast group; each
broadcast goes out on every part from the same packed bytes, and is done when every part is.
The group's broadcast is started first: Gloo sends from its own threads, so the network hops
run while this thread copies into the ring.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weight_sync.transport.base import Transport, Work


class _All:
    def __init__(self, works: list[Work]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


class Fanout:
    """Rank 0 of every part (implements ``Transport``); the world is all their members."""

    def __init__(self, parts: Sequence[Transport]) -> None:
        assert parts and all(part.rank == 0 for part in parts), "the trainer sends on every part"
        assert len({part.device for part in parts}) == 1, "every part sends from the same buffers"
        self._parts = list(parts)

    @property
    def parts(self) -> list[Transport]:
        return list(self._parts)

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1 + sum(part.world_size - 1 for part in self._parts)

    @property
    def device(self) -> torch.device:
        return self._parts[0].device

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> Work:
        return _All([part.broadcast(tensor, src, timeout_s) for part in self._parts])

    tally_is_final = False

    def vote(self, code: int, timeout_s: float | None = None) -> int:
        return self.announce(self.tally(code, timeout_s), timeout_s)

    def tally(self, code: int, timeout_s: float | None = None) -> int:
        """Parts whose tally tells their ranks the outcome (an all-reduce) go last, so that
        what they tell includes every other part's codes; the rest hear it in ``announce``."""
        for part in sorted(self._parts, key=lambda part: part.tally_is_final):
            code = max(code, part.tally(code, timeout_s))
        return code

    def announce(self, code: int, timeout_s: float | None = None) -> int:
        for part in self._parts:
            part.announce(code, timeout_s)
        return code

    def close(self) -> None:
        for part in self._parts:
            part.close()
