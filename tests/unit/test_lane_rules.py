"""The rules the senders of a push from many senders settle it by (pure): when it is called off
before any byte moves (the verdict after: test_blame.py); and a member's lanes' reports of one
push, as one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from weight_sync import SyncConfig
from weight_sync.receive.inbound import _together
from weight_sync.send.sharded import takes_host_tensors
from weight_sync.wire.lane_rules import (
    NOT_MINE,
    Share,
    called_off,
    config_disagreement,
    config_row,
    proposal,
    row_bytes,
    row_digest,
    row_words,
)
from weight_sync.wire.metadata import ReceiveReport

A, B = (1, 2, 3, 4), (5, 6, 7, 8)  # two layout digests, as four words


def row(refused: int = 0, proposal: int = 3, named: int = 0, digest: tuple = A) -> tuple:
    return (refused, proposal, named, *digest)


@pytest.mark.parametrize(
    ("rows", "reason"),
    [
        ([row(), row(proposal=5)], None),  # goes ahead, at the highest proposal
        ([row(named=7, proposal=7), row(named=7, proposal=7)], None),  # all name one version
        ([row(), row(refused=1)], "trainer rank(s) [1] refused"),
        ([row(), row(digest=B)], "state dicts differ"),
        ([row(named=7, proposal=7), row()], "named versions [0, 7]"),  # one named, one not
        ([row(named=2, proposal=5), row(named=2, proposal=5)], "version 2 is not past"),  # stale
    ],
)
def test_called_off_table(rows: list[tuple], reason: str | None) -> None:
    got = called_off(rows)
    assert (got is None) if reason is None else (got is not None and reason in got), got


@pytest.mark.parametrize(
    ("rows", "senders", "expected"),
    [
        ([row(), row(proposal=5)], 2, (None, 5)),
        # Receiving ranks' rows (zeros, the layout they hold) decide nothing.
        ([row(), row(proposal=5), row(refused=0, proposal=0, digest=B)], 2, (None, 5)),
        ([row(proposal=4), row(refused=1, proposal=9), row(proposal=0)], 2, ("refused", 9)),
    ],
)
def test_proposal_reads_the_senders_rows_only(
    rows: list[tuple], senders: int, expected: tuple[str | None, int]
) -> None:
    reason, version = proposal(rows, senders)
    assert version == expected[1]
    assert (reason is None) if expected[0] is None else (reason and expected[0] in reason)


def test_a_row_gives_back_the_digest_it_was_made_with() -> None:
    digest = bytes(range(32))
    assert row_digest(row_words(row_bytes([1, 2, 3], digest))) == digest.hex()
    assert row_words(row_bytes([-1, 2**40], digest))[:2] == (-1, 2**40)


def test_a_share_proposes_past_its_own_version_and_names_its_digest() -> None:
    values, digest = Share({}, None, None, 4).row(next_version=9)
    assert values == [0, 9, 4] and digest == bytes(32)
    values, _ = Share({}, None, ValueError("bad"), 0).row(next_version=2)
    assert values == [1, 2, 0]
    words = row_words(row_bytes([0, 1, 0], bytes(range(32))))[3:]
    assert words[0] == int.from_bytes(bytes(range(8)), "little")


@pytest.mark.parametrize(
    ("state", "options", "error", "says"),
    [
        (object(), {}, TypeError, "push their own state dict"),  # e.g. a ShardedSource
        ({}, {"fuse": True}, ValueError, r"unknown push option\(s\) \['fuse'\]"),
        ({}, {"partial": 1}, TypeError, "partial must be a bool"),
        ({}, {"version": 0}, ValueError, "version"),
    ],
)
def test_a_share_keeps_the_callers_mistake_to_raise_once_every_sender_agreed(
    state: object, options: dict, error: type, says: str
) -> None:
    """A sender's mistake is not raised where it is found -- the other senders would wait for
    it in the agreement -- but kept in the share, which says so in its row."""
    from weight_sync.wire.lane_rules import share_of

    share = share_of(state, options, 2, 0, SyncConfig())
    assert isinstance(share.error, error) and share.layout is None, share.error
    with pytest.raises(error, match=says):
        raise share.error
    assert share.row(1)[0][0] == 1


def test_options_given_as_none_are_not_given() -> None:
    from weight_sync.wire.lane_rules import share_of

    given = {"rename": None, "transform": None, "version": None, "partial": False}
    share = share_of({"w": torch.ones(4)}, given, 2, 0, SyncConfig())
    assert share.error is None and share.layout is not None and share.named == 0


@pytest.mark.parametrize(("senders", "sender"), [(1, 0), (2, 0), (2, 1)])
def test_a_transform_of_whole_tensors_runs_before_the_layout_then_rename(
    senders: int, sender: int
) -> None:
    """Every lane and every member speak the names (and shapes) the transform and then rename
    make: one sender's lane holds the whole push; several split its blocks."""
    from weight_sync.wire.lane_rules import share_of
    from weight_sync.wire.mapping import fuse

    state = {"a.q.w": torch.ones(2, 4), "a.k.w": torch.zeros(2, 4), "b": torch.ones(3)}
    options = {"transform": fuse(["q", "k"], into="qk"), "rename": lambda n: f"m.{n}"}
    share = share_of(state, options, senders, sender, SyncConfig())
    assert share.error is None and share.layout is not None, share.error
    assert {t.name: t.shape for t in share.layout.tensors} == {"m.a.qk.w": (4, 4), "m.b": (3,)}
    sent = sum(block.numel for block in share.layout.sent_by(sender))
    assert sent == (16 + 3 if senders == 1 else sum(t.numel() for t in share.lane.values()))
    if senders == 1:
        assert torch.equal(share.lane["m.a.qk.w"], torch.cat([torch.ones(2, 4), torch.zeros(2, 4)]))


class _Refusal(Exception):
    pass


@pytest.mark.parametrize(
    ("role", "rows", "refusal", "raises", "ahead"),
    [
        ("sender", [row(), row(proposal=5), row(proposal=0)], None, None, True),
        ("receiver", [row(), row(proposal=5), row(proposal=0)], None, None, True),
        # A sender's own mistake comes first, even where the members refused too.
        ("sender", [row(refused=1), row(), row(proposal=0)], "members", "own shard", False),
        ("sender", [row(), row(digest=B), row(proposal=0)], None, "state dicts differ", False),
        # A receiving rank did nothing wrong: the senders' word, as a runtime failure.
        ("receiver", [row(), row(digest=B), row(proposal=0)], "members", "called off by the senders",
         False),
        ("sender", [row(), row(), row(proposal=0)], "members", _Refusal, True),
        ("receiver", [row(), row(), row(proposal=0)], "members", _Refusal, True),
    ],
)  # fmt: skip
def test_every_rank_of_an_agreement_raises_in_one_order(
    role: str, rows: list[tuple], refusal: str | None, raises: object, ahead: bool
) -> None:
    """``send.senders.agree`` on a sender (its share; a share refused here raises its own
    error) and on a launched job's receiving rank (no share: its row is its own words and the
    layout it holds):
    the members' word is asked whether or not the push goes ahead (it is a collective), then
    the rank raises its own mistake, why the push is off, the members' refusal -- or returns the
    highest version any sender proposed."""
    from weight_sync.errors import WeightSyncError
    from weight_sync.send.senders import agree

    own = ValueError("this rank's own shard") if rows[0][0] else None
    share = Share({}, None, own, 0) if role == "sender" else None
    sent: list[tuple[list[int], bytes]] = []
    asked: list[tuple[bool, int]] = []

    def gather(values: list[int], digest: bytes) -> list[tuple]:
        sent.append((values, digest))
        return rows

    def refused(go: bool, version: int, _: object) -> Exception | None:
        asked.append((go, version))
        return _Refusal() if refusal else None

    held = ([1, 7, 0], "ab" * 32)  # a receiving rank's own words, and the layout it holds
    run = lambda: agree(share, 4, gather, 2, refused, held)
    if raises is None:
        assert run() == 5
    elif isinstance(raises, str):
        error = ValueError if role == "sender" else WeightSyncError
        with pytest.raises(error, match=raises):
            run()
    else:
        with pytest.raises(raises):  # type: ignore[call-overload]
            run()
    assert asked == [(ahead, max(r[1] for r in rows[:2]))]
    if role == "receiver":
        assert sent == [([1, 7, 0], bytes.fromhex(held[1]))]
    else:
        assert sent[0][0] == [int(own is not None), 4, 0]


@pytest.mark.parametrize(
    ("config", "host"),
    [("cpu:gloo,cuda:nccl", True), ("cpu:gloo,cuda:gloo", True), ("cuda:nccl", False),
     ("nccl", False), ("gloo", True), ("cuda:nccl-legacy", False)],
)  # fmt: skip
def test_control_tensors_live_on_the_host_wherever_the_group_takes_them(
    config: str, host: bool
) -> None:
    """A job's default group of "cpu:gloo,cuda:nccl" holds its control collectives on the host
    (a receiving rank may have no GPU); a group of NCCL alone, under any name, on the GPU."""
    assert takes_host_tensors(config) is host


@pytest.mark.parametrize(
    ("config", "error", "says"),
    [
        ({"push_timeout_s": 5}, TypeError, "config must be a SyncConfig, got dict"),
        (None, ValueError, "needs the trainers' torch.distributed group"),  # none initialised
    ],
)
def test_senders_say_what_to_change_before_any_collective(
    config: object, error: type, says: str
) -> None:
    from weight_sync.adapters.vllm import VLLMServers

    with pytest.raises(error, match=says):
        VLLMServers(["http://127.0.0.1:8000"], config, senders=object())  # type: ignore[arg-type]


def test_the_ray_front_checks_its_workers_whatever_the_senders() -> None:
    from weight_sync.actors import WeightUpdater

    for senders in (None, object()):
        with pytest.raises(TypeError, match="not a Ray actor handle"):
            WeightUpdater([object()], senders=senders)  # type: ignore[arg-type, list-item]
    with pytest.raises(ValueError, match="one_group is for a push from many senders"):
        WeightUpdater([], one_group=True)


def test_sglang_fronts_refuse_many_senders_as_they_are_made() -> None:
    """SGLang's update routes load whole tensors from one source: a front given ``senders``
    says so at construction, before any server is called (none listens at this URL)."""
    from weight_sync.adapters.sglang import SGLangServers

    with pytest.raises(ValueError, match="cannot take a push from many senders"):
        SGLangServers(["http://127.0.0.1:9"], senders=object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "alone", "backend", "same_host"),
    [({}, False, "gloo", "shm"), ({"backend": "auto"}, False, "gloo", "shm"),
     ({"backend": "gloo"}, False, "gloo", "shm"), ({"same_host": "group"}, False, "gloo", "group"),
     ({"backend": "nccl"}, False, None, None),
     # The push's one sender: one lane, one communicator -- the backend given, as one sender's.
     ({}, True, "auto", "shm"), ({"backend": "nccl"}, True, "nccl", "shm"),
     ({"backend": "gloo", "same_host": "group"}, True, "gloo", "group")],
)  # fmt: skip
def test_lanes_run_over_gloo_in_groups_of_their_own(
    given: dict, alone: bool, backend: str | None, same_host: str | None
) -> None:
    """Each lane a standalone Gloo group, its sender's host's members on a ring of its own
    unless the sender's config says the group (``same_host``), as one sender's push; the lane
    of the push's one sender on the backend its config names."""
    from weight_sync import SyncConfig
    from weight_sync.send.senders import lane_config

    if backend is None:
        with pytest.raises(ValueError, match="lanes over Gloo"):
            lane_config(SyncConfig(**given))
        return
    config = lane_config(SyncConfig(**given), alone=alone)
    assert (config.backend, config.group_mode, config.same_host) == (
        backend,
        "standalone",
        same_host,
    )


def test_over_one_group_nccl_is_taken_and_the_lanes_vote_over_gloo() -> None:
    """Over one group every member takes the buckets from it: no lane's ring beside it."""
    from weight_sync import JobSync, SyncConfig
    from weight_sync.send.senders import lane_config

    config = lane_config(SyncConfig(backend="nccl"), one_group=True)
    assert (config.backend, config.same_host) == ("gloo", "group")
    with pytest.raises(ValueError, match="one_group is for several senders"):
        JobSync(one_group=True)  # refused before any group is made


@pytest.mark.parametrize(("replicas", "refused"), [(1, False), (2, True)])
def test_a_data_parallel_vllm_engine_refuses_a_push_from_many_senders(
    replicas: int, refused: bool
) -> None:
    """Its replicas' workers would take clashing slots: refused before any byte, by name, in
    the worker's answer to the push's check (in rank 0's store: here a store of its own)."""
    import json

    import torch
    import torch.distributed as dist

    from weight_sync.adapters.vllm.member import LaneMember
    from weight_sync.control.lane_store import CHECKED, Checks
    from weight_sync.receive.receiver import Receiver
    from weight_sync.wire.lane_rules import layout_of
    from weight_sync.wire.metadata import LaneCheck

    class Engine:  # the engine's loader takes every tensor; only its replicas differ
        data_parallel_size = replicas

        def check(self, plan: object, partial: bool) -> list[str]:
            return []

    layout = layout_of([("w", torch.zeros(4, 2))], range(2))
    store = dist.HashStore()
    checks = Checks(store)
    checks.post_layout(layout)
    check = LaneCheck(push=5, version=1, digest=layout.digest, max_metadata_bytes=10_000)
    LaneMember(Engine(), Receiver()).answer(checks, 1, check)  # type: ignore[arg-type]
    problems = json.loads(store.get(f"{CHECKED}5/1"))
    assert bool(problems) == refused
    assert not refused or "data_parallel_size=2" in problems[0]


def report(nbytes: int, buckets: int, seconds: float, checksums: tuple | None = None) -> Any:
    return ReceiveReport(
        version=3, nbytes=nbytes, buckets=buckets, seconds=seconds, checksums=checksums
    )


@pytest.mark.parametrize(
    ("reports", "want"),
    [
        ([report(10, 1, 0.5), report(20, 2, 0.25)], report(30, 3, 0.5)),  # the slowest lane
        ([report(10, 1, 0.1, (7,)), report(20, 2, 0.2, (8, 9))], report(30, 3, 0.2, (7, 8, 9))),
        ([report(10, 1, 0.1, (7,)), report(20, 2, 0.2)], report(30, 3, 0.2)),  # one kept none
        ([report(10, 1, 0.1), None], None),  # a lane that received no push in full
        ([], None),
    ],
)
def test_a_members_lanes_report_one_push_together(reports: list, want: Any) -> None:
    assert _together(reports) == want


@pytest.mark.parametrize(
    ("configs", "one_group", "said"),
    [
        # Everything but cast_dtype (and, over one group, the backend) may differ.
        ([SyncConfig(), SyncConfig(bucket_bytes=4096, staging="atomic", checksum=True,
                                   delta="always", interface="lo", push_timeout_s=99)],
         True, None),
        ([SyncConfig(), SyncConfig(cast_dtype="bfloat16")], False,
         "cast_dtype (rank 0: None, rank 1: 'bfloat16'; the wire dtypes are part of the layout)"),
        # "auto" forms the one group on Gloo where no rank asks for NCCL: no difference.
        ([SyncConfig(backend="auto"), SyncConfig(backend="gloo")], True, None),
        ([SyncConfig(), SyncConfig(backend="nccl")], True,
         "backend (rank 0: 'gloo', rank 1: 'nccl'; the one group forms on it)"),
        ([SyncConfig(), SyncConfig(backend="nccl")], False, None),  # each lane over Gloo
    ],
)  # fmt: skip
def test_config_disagreement_table(
    configs: list[SyncConfig], one_group: bool, said: str | None
) -> None:
    rows = [config_row(config, True, one_group) for config in configs]
    got = config_disagreement(rows)
    if said is None:
        assert got is None, got
    else:
        assert got is not None and said in got and "pass one value on every rank" in got, got


def test_a_receiving_rank_has_no_word_on_the_cast() -> None:
    rows = [
        config_row(SyncConfig(), True, False),
        config_row(SyncConfig(cast_dtype="float16"), False, False),  # not a sender: unused
    ]
    assert rows[1][0] == NOT_MINE and config_disagreement(rows) is None


_BASE: dict[str, Any] = {"entries": [("w", torch.zeros(4, 2)), ("b", torch.zeros(3))]}


@pytest.mark.parametrize(
    ("change", "kept"),
    [
        ({}, True),  # a training loop's next step: the same names, dtypes and shapes
        ({"entries": [("w", torch.ones(4, 2)), ("b", torch.ones(3))]}, True),  # new values
        ({"entries": [("w", torch.zeros(4, 2)), ("c", torch.zeros(3))]}, False),  # a name
        ({"entries": [("w", torch.zeros(2, 4)), ("b", torch.zeros(3))]}, False),  # a shape
        ({"entries": [("w", torch.zeros(4, 2, dtype=torch.bfloat16)), ("b", torch.zeros(3))]},
         False),  # a dtype
        ({"entries": [("b", torch.zeros(3)), ("w", torch.zeros(4, 2))]}, False),  # the order
        ({"cast": "bfloat16"}, False),  # the wire dtypes
        ({"partial": True}, False),
        ({"senders": 3}, False),
    ],
)  # fmt: skip
def test_a_fronts_layouts_reuse_the_last_while_the_entries_are_unchanged(
    change: dict[str, Any], kept: bool
) -> None:
    """``Layouts`` keeps the last layout (the same object: no layout or digest rebuilt) while
    what it is made of -- names, dtypes, shapes, placements, senders, casting, partial -- stays;
    anything else is a layout of its own, equal to one made afresh."""
    from weight_sync.wire.lane_rules import Layouts, layout_of

    def args(given: dict[str, Any]) -> tuple[Any, ...]:
        given = {**_BASE, **given}
        return (given["entries"], range(given.get("senders", 2)), given.get("cast"),
                given.get("partial", False))  # fmt: skip

    layouts = Layouts()
    first = layouts.layout_of(*args({}))
    second = layouts.layout_of(*args(change))
    assert (second is first) is kept
    assert second == layout_of(*args(change))
    assert (second.digest == first.digest) is kept
