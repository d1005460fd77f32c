"""The senders' control group over ``OneRank`` (``weight_sync.send.collectives``): a trainer of
one process, no torch.distributed -- every collective answers with this rank's own word, as the
distributed tests' Gloo groups of two and three answer with every rank's (the same helpers)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from weight_sync.errors import TransportError
from weight_sync.send.collectives import (
    OneRank,
    any_rank,
    control_group,
    formed_everywhere,
    from_rank_0,
    gather_bytes,
    gather_rows,
    share_endpoints,
)


@pytest.mark.parametrize(
    ("values", "digest"),
    [([1, 2, 3], bytes(32)), ([-1, 0], bytes(range(32))), ([], b"\xff" * 32)],
)
def test_a_row_gathered_alone_is_its_own(values: list[int], digest: bytes) -> None:
    rows = gather_rows(values, digest, OneRank())
    assert len(rows) == 1 and list(rows[0][: len(values)]) == values
    assert len(rows[0]) == len(values) + 4  # the digest as four words


@pytest.mark.parametrize(
    ("mine", "size", "got"),
    [
        (b"abc", 8, b"abc"),
        (b"", 8, b""),
        (b"abcdefgh", 4, b"abcd"),
        (b"x" * 8192, 8193, b"x" * 8192),
    ],
)
def test_bytes_gathered_alone_are_their_own_cut_at_the_size(
    mine: bytes, size: int, got: bytes
) -> None:
    assert gather_bytes(mine, size, OneRank()) == [got]
    assert OneRank().all_gather(mine, size) == [got.ljust(size, b"\0")]  # a row of the size
    assert OneRank().broadcast(mine, size) == got.ljust(size, b"\0")


@pytest.mark.parametrize("value", [0, 7, -1, 2**40])
def test_rank_0s_word_is_its_own(value: int) -> None:
    assert from_rank_0(value, OneRank()) == value


@pytest.mark.parametrize("flag", [False, True])
def test_any_rank_is_this_ones_flag(flag: bool) -> None:
    assert any_rank(flag, OneRank()) is flag


def test_a_step_that_failed_alone_raises_its_own_failure() -> None:
    formed_everywhere(None, "form", OneRank())  # nothing failed: nothing raised
    with pytest.raises(KeyError, match="own"):
        formed_everywhere(KeyError("own"), "form", OneRank())


def test_a_lone_senders_endpoint_is_shared_and_its_failure_raised() -> None:
    assert share_endpoints(("127.0.0.1", 5), 1, OneRank()) == [("127.0.0.1", 5)]
    with pytest.raises(OSError, match="no port"):
        share_endpoints(OSError("no port"), 1, OneRank())
    with pytest.raises(TransportError, match="trainer rank 0 could not listen"):
        share_endpoints(None, 1, OneRank())


def test_one_rank_needs_no_torch_distributed_and_a_group_does() -> None:
    lone = OneRank()
    assert control_group(lone, 5.0, "WeightUpdater") is lone
    assert not dist.is_initialized(), "a unit test made a torch.distributed group here"
    with pytest.raises(ValueError, match="WeightUpdater needs .* call init_process_group"):
        control_group(None, 5.0, "WeightUpdater")
