"""The senders' control group: the few small collectives by which every rank of a push learns
the same word before and after the bytes (the agreement's rows, rank 0's word, who failed to
form, the senders' store addresses), behind one seam.

Over a torch.distributed group of the trainer's ranks (``TorchControl``: Gloo, on the host),
or, for a trainer of one process, no group at all (``OneRank``): every collective's answer is
then this rank's own, so a trainer that never called ``init_process_group`` pushes through the
same protocol as a sharded one, as its K = 1 case. The seam speaks bytes and ints, not tensors:
a rank alone makes none (a small tensor made and read back twice a push was a tenth of that
push's own work on rank 0). Fixed-size rows: nothing here unpickles what another rank sent.
"""

from __future__ import annotations

import datetime
import json
import struct
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from weight_sync.errors import TransportError, first_line
from weight_sync.wire.lane_rules import row_bytes, row_words

_ENDPOINT_BYTES = 256  # a sender's store address, as JSON, in one fixed-size all-gather


class ControlGroup(Protocol):
    """What the senders' agreement runs over. Each collective is made by every rank at once;
    ``TransportError`` where a rank is gone (nothing sent yet)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def all_gather(self, mine: bytes, size: int) -> list[bytes]:
        """Every rank's ``mine`` (at most ``size`` bytes: cut there, padded with zeros to it),
        in rank order."""
        ...

    def broadcast(self, mine: bytes, size: int) -> bytes:
        """Rank 0's ``mine`` (at most ``size`` bytes: cut there, padded with zeros to it), on
        every rank; what the others give is ignored."""
        ...

    def all_sum(self, mine: list[int]) -> list[int]:
        """Every rank's ``mine`` (int64s, as many on every rank), summed element by element."""
        ...


class OneRank:
    """The control group of a trainer of one process (or of a group of one rank): no
    torch.distributed, every word its own."""

    rank = 0
    size = 1

    def all_gather(self, mine: bytes, size: int) -> list[bytes]:
        return [mine[:size].ljust(size, b"\0")]

    def broadcast(self, mine: bytes, size: int) -> bytes:
        return mine[:size].ljust(size, b"\0")

    def all_sum(self, mine: list[int]) -> list[int]:
        return list(mine)


class TorchControl:
    """A Gloo group of two or more of the trainer's ranks (``control_group`` makes it)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0)

    def all_gather(self, mine: bytes, size: int) -> list[bytes]:
        row = _row(mine, size)
        rows = [torch.empty_like(row) for _ in range(self.size)]
        before_any_byte(lambda: dist.all_gather(rows, row, group=self._group))
        return [r.numpy().tobytes() for r in rows]

    def broadcast(self, mine: bytes, size: int) -> bytes:
        row = _row(mine, size)
        before_any_byte(lambda: dist.broadcast(row, src=self._root, group=self._group))
        return row.numpy().tobytes()

    def all_sum(self, mine: list[int]) -> list[int]:
        summed = torch.tensor(mine, dtype=torch.int64)
        before_any_byte(lambda: dist.all_reduce(summed, group=self._group))
        return [int(value) for value in summed.tolist()]


def _row(mine: bytes, size: int) -> torch.Tensor:
    """``mine`` in a row of ``size`` bytes (cut there, padded with zeros)."""
    row = torch.zeros(size, dtype=torch.uint8)
    if mine := mine[:size]:
        row[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    return row


def control_group(
    group: dist.ProcessGroup | OneRank | None, timeout_s: float, owner: str
) -> TorchControl | OneRank:
    """The control group of the ranks of ``group`` (the trainers' torch.distributed group;
    None: the default group), made by all of them at once -- ``OneRank`` where that is one
    rank, or given. ``owner`` names the caller's class in what it tells a caller to change."""
    if isinstance(group, OneRank):
        return group
    if not dist.is_initialized():
        raise ValueError(
            f"a {owner} needs the trainers' torch.distributed group; call "
            "init_process_group on every trainer rank first"
        )
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    if len(ranks if ranks is not None else range(dist.get_world_size())) == 1:
        return OneRank()  # no other rank to make a group with, or to wait for
    # Where only some of the world makes it -- one replica of a hybrid-sharded trainer
    # pushing -- it is named from its ranks (use_local_synchronization): a count of groups
    # advanced here only would name the groups the whole world makes later apart (they would
    # hang). Where the whole world makes it (a launched job; a trainer of every rank) it is
    # named as any group of the world is, from the world's count: torch names a group of ranks
    # from the groups alive on each rank too, and those differ where the senders made a group
    # of their own first (FSDP2's mesh, which the receiving ranks are no members of) -- the
    # ranks then waited for each other under two names until the bound.
    whole = ranks is None or len(ranks) == dist.get_world_size()
    made = dist.new_group(
        ranks,
        backend="gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
        use_local_synchronization=not whole,
    )
    assert made is not None, "every rank of the group is a member of it"
    return TorchControl(made)


def before_any_byte(run: Callable[[], object]) -> None:
    """Run one collective of an agreement; ``TransportError`` if a rank is gone (Gloo raises
    a bare RuntimeError), nothing having been sent."""
    try:
        run()
    except RuntimeError as exc:
        raise TransportError(
            f"a rank left before the push began ({first_line(exc)}); nothing was sent"
        ) from exc


def from_rank_0(value: int, control: ControlGroup) -> int:
    """Rank 0's ``value`` (an int64) on every rank; what the others give is ignored."""
    (word,) = struct.unpack("<q", control.broadcast(struct.pack("<q", value), 8))
    return int(word)


def gather_rows(values: list[int], digest: bytes, control: ControlGroup) -> list[tuple[int, ...]]:
    """Every rank's row of an agreement (``values``, as many on every rank, then a layout
    digest: ``lane_rules.row_bytes``), on every rank, as words."""
    mine = row_bytes(values, digest)
    return [row_words(row) for row in control.all_gather(mine, len(mine))]


def gather_bytes(mine: bytes, size: int, control: ControlGroup) -> list[bytes]:
    """Every rank's ``mine`` (at most ``size`` bytes, cut there; empty: nothing to say), on
    every rank: one all-gather of fixed-size byte rows, read back up to the padding."""
    return [row.rstrip(b"\0") for row in control.all_gather(mine, size)]


def any_rank(flag: bool, control: ControlGroup) -> bool:
    """Whether any rank says ``flag``."""
    return control.all_sum([int(flag)])[0] > 0


def formed_everywhere(failure: Exception | None, what: str, control: ControlGroup) -> None:
    """Every rank at once, after a step each took on its own (``what``, as the others' error
    words it): a rank whose step failed gives its ``failure``, which it raises once the others
    know; they raise ``TransportError`` naming it, rather than wait for it at their next
    collective's bound."""
    mine = [0] * control.size
    mine[control.rank] = int(failure is not None)
    failed = control.all_sum(mine)
    if failure is not None:
        raise failure
    ranks = [rank for rank, count in enumerate(failed) if count]
    if ranks:
        raise TransportError(
            f"rank(s) {ranks} could not {what} (see their errors); nothing was sent"
        )


def share_endpoints(
    endpoint: tuple[str, int] | Exception | None, senders: int, control: ControlGroup
) -> list[tuple[str, int]]:
    """The senders' store addresses, on every rank (ranks ``0..senders-1`` being the
    senders): each rank gives its own (a sender) or None, all gathered as JSON. A sender that
    could not listen gives its error instead, which it raises once the others know: they raise
    ``TransportError`` at once rather than wait for it at their bound."""
    raw = json.dumps(list(endpoint)).encode() if isinstance(endpoint, tuple) else b""
    rows = gather_bytes(raw, _ENDPOINT_BYTES, control)
    if isinstance(endpoint, Exception):
        raise endpoint
    endpoints = []
    for sender, raw in enumerate(rows[:senders]):
        if not raw:
            raise TransportError(
                f"trainer rank {sender} could not listen for its lane (see its error); nothing "
                "was sent"
            )
        address, port = json.loads(raw.decode())
        endpoints.append((str(address), int(port)))
    return endpoints
