"""One push over several transports at once: the trainer's end of a mixed group.

Members take the broadcast group, the host ring or the CUDA ring (see ``weight_sync.send.routes``);
each broadcast goes out on every part from the same packed bytes, and is done when every part
is. The group's broadcast is started first: Gloo and NCCL send from their own threads or
streams, so the network hops run while this thread copies into the rings.

The parts need not keep their buffers in one place: a ring copies from wherever it is handed
bytes (host memory, or any GPU by a device-to-host copy), so an NCCL group on ``cuda:0`` and a
host ring fed from ``cuda:0`` make one push. A part says which devices it takes with an
optional ``takes(device) -> bool``; a part without one takes only its own ``device``.
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

    def after(self) -> None:
        for work in self._works:
            work.after()


def takes(part: Transport, device: torch.device) -> bool:
    """Whether ``part`` can broadcast buffers that live on ``device``."""
    check = getattr(part, "takes", None)
    return part.device == device if check is None else bool(check(device))


class Fanout:
    """Rank 0 of every part (implements ``Transport``); the world is all their members."""

    def __init__(self, parts: Sequence[Transport], device: torch.device | None = None) -> None:
        """``device`` is where the sender's buffers live (default: the first part's device);
        every part must take buffers there (``ValueError`` otherwise)."""
        if not parts or any(part.rank != 0 for part in parts):
            raise ValueError("a Fanout is the trainer's end (rank 0) of one or more parts")
        self._device = parts[0].device if device is None else torch.device(device)
        refusing = [type(part).__name__ for part in parts if not takes(part, self._device)]
        if refusing:
            raise ValueError(
                f"parts {refusing} cannot send buffers on {self._device}: stage the push where "
                "every part can read it"
            )
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
        return self._device

    def takes(self, device: torch.device) -> bool:
        return all(takes(part, device) for part in self._parts)

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
        """Close every part, even after one fails to close (the first failure is raised)."""
        failure: BaseException | None = None
        for part in self._parts:
            try:
                part.close()
            except BaseException as exc:  # the others must still close
                failure = failure or exc
        if failure is not None:
            raise failure
