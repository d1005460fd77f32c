"""A sharded trainer pushing from every rank: ``JobSync(senders=K)`` over ranks started as
``mp.spawn`` starts them (forked by tests/forked.py) and real ``torchrun`` launches of
``sharded_job.py`` (FSDP2 over Gloo on the senders), each rank reporting what it saw."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from tests import forked
from tests.conftest import REPO
from tests.launch import sharded_job
from tests.launch.test_launchers import BIN, LAUNCH_S, _env, _join_all

pytestmark = pytest.mark.timeout(300)

DEATH = "trainer rank 1 died or left mid-push"  # what every survivor says first


def _reports(out: Path, ranks: range | tuple[int, ...]) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in ranks]


def _spawn(
    scenario: str, out: Path, senders: int, world_size: int, device: str = "cpu"
) -> mp.ProcessContext:
    return forked.start(
        sharded_job.spawned,
        (world_size, scenario, senders, str(out), str(out / "store"), device),
        world_size,
    )


def _assert_steps(reports: list[dict[str, Any]]) -> None:
    """Three pushes landed on every rank; after each, every receiving rank (the one putting
    whole tensors together for load_weights included) holds exactly the senders' full model."""
    senders = reports[0]
    assert len(senders["digests"]) == 3
    assert len(set(map(json.dumps, senders["digests"]))) == 3  # each step changed the weights
    for report in reports:
        assert report["errors"] == [] and report["versions"] == [1, 2, 3], report
        assert report["held"] == 3 and report["digests"] == senders["digests"]


# "+one_group": the lanes' buckets over one group of every rank, each receiving rank taking
# them in rounds (``JobSync(one_group=True)``), rather than over a Gloo group per lane.
ONE_GROUP_TOO = pytest.mark.parametrize("over", ["", "+one_group"], ids=["lanes", "one_group"])


@ONE_GROUP_TOO
def test_two_senders_to_two_receivers(tmp_path: Path, over: str) -> None:
    context = _spawn(f"steps{over}", tmp_path, senders=2, world_size=4)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * 4
    _assert_steps(_reports(tmp_path, range(4)))


def test_a_job_whose_senders_made_their_own_group_first(tmp_path: Path) -> None:
    """The senders' group made before ``JobSync`` (as a trainer sets FSDP2 up first): the
    receiving ranks are no members of it, so each rank holds a different count of groups when
    ``JobSync`` makes its own -- which must not name them apart (it hung until the bound)."""
    context = _spawn("group_first", tmp_path, senders=2, world_size=4)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * 4
    _assert_steps(_reports(tmp_path, range(4)))


@ONE_GROUP_TOO
def test_every_rank_may_give_its_own_value_of_the_fields_that_may_differ(
    tmp_path: Path, over: str
) -> None:
    """Each rank's ``SyncConfig`` differs from its neighbour's in every field the docs say may
    differ (``sharded_job.PER_RANK``: buckets, staging, checksums, delta, bounds, interface,
    ...): three pushes land bit-exact on every rank, as with one config."""
    context = _spawn(f"differ{over}", tmp_path, senders=2, world_size=4)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * 4
    _assert_steps(_reports(tmp_path, range(4)))


@ONE_GROUP_TOO
def test_the_fields_that_must_agree_are_checked_on_every_rank_first(
    tmp_path: Path, over: str
) -> None:
    """Sender 1 gives another ``cast_dtype`` (and, over one group, the last rank another
    backend): every rank's ``JobSync`` raises ``ValueError`` at once, naming the field and each
    rank's value -- rather than every push being called off as state dicts that differ, or the
    one group's ranks never meeting."""
    context = _spawn(f"disagree{over}", tmp_path, senders=2, world_size=4)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * 4
    for report in _reports(tmp_path, range(4)):
        raised = report["raised"]
        assert raised is not None and raised.startswith("ValueError: the ranks of a push"), raised
        assert "cast_dtype (rank 0: None, rank 1: 'bfloat16'" in raised, raised
        backends = "backend (rank 0: 'gloo', rank 1: 'gloo', rank 2: 'gloo', rank 3: 'nccl'"
        assert (backends in raised) == bool(over), raised


@ONE_GROUP_TOO
def test_fsdp_over_tensor_parallelism_four_senders(tmp_path: Path, over: str) -> None:
    """FSDP2 over tensor parallelism on a (2, 2) mesh: the column-parallel layer's rows are
    split by both mesh dimensions (``_StridedShard``), the row-parallel one's by one each; every
    sender pushes its own shards and both receiving ranks hold the gathered model."""
    context = _spawn(f"tp{over}", tmp_path, senders=4, world_size=6)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * 6
    reports = _reports(tmp_path, range(6))
    assert reports[0]["placements"] == {
        "0.weight": ["_StridedShard", "Shard"],
        "0.bias": ["_StridedShard", "Shard"],
        "2.weight": ["Shard", "Shard"],
        "2.bias": ["Shard", "Replicate"],
    }
    _assert_steps(reports)


def test_partial_pushes_complete_the_version_held(tmp_path: Path) -> None:
    """``push(subset, partial=True)`` from every sender: refused everywhere before any byte
    moves while the receiving ranks hold no version to complete; once they hold one, a subset
    of nothing moves nothing and every rank keeps the version, and the last layer alone lands
    -- theirs now the senders', the first layer still the full push's."""
    context = _spawn("partial", tmp_path, senders=2, world_size=4)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * 4
    reports = _reports(tmp_path, range(4))
    senders, receivers = reports[:2], reports[2:]
    for report in senders:
        assert report["versions"] == [None, 1, 1, 2], report
        assert report["errors"][0].startswith("PlanMismatchError"), report
    full, after = senders[0]["digests"][1], senders[0]["digests"][3]
    assert all(full[name] != after[name] for name in full if name != "scale")  # every parameter
    for report in receivers:
        assert report["versions"] == [None, 1, 1, 2], report
        assert "push the full state dict first" in report["errors"][0], report
        assert report["digests"][2] == report["digests"][1]  # the empty push changed nothing
        held = report["digests"][3]
        assert {name: held[name] for name in ("2.weight", "2.bias")} == {
            name: after[name] for name in ("2.weight", "2.bias")
        }
        assert {name: held[name] for name in ("0.weight", "0.bias", "scale")} == {
            name: full[name] for name in ("0.weight", "0.bias", "scale")
        }


def test_renamed_to_the_receivers_names(tmp_path: Path) -> None:
    """``push(..., rename=...)`` on every sender: the layout and every lane speak the receivers'
    names (a rank loading by name included)."""
    context = _spawn("rename", tmp_path, senders=2, world_size=4)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * 4
    _assert_steps(_reports(tmp_path, range(4)))


def test_cast_to_the_receivers_dtype(tmp_path: Path) -> None:
    """``cast_dtype="bfloat16"``: each sender casts its own fp32 shards; the layout describes
    the tensors as they travel, so bf16 receivers accept it and hold the senders' model, cast."""
    context = _spawn("cast", tmp_path, senders=2, world_size=4)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * 4
    _assert_steps(_reports(tmp_path, range(4)))


@pytest.mark.parametrize(
    ("ranks", "senders", "tp"),
    [(5, 3, 1), (6, 4, 2)],  # FSDP2 over three ranks; FSDP2 over tensor parallelism (2 x 2)
)
def test_the_fsdp_example_under_torchrun(ranks: int, senders: int, tp: int) -> None:
    """``examples/fsdp_many_senders.py`` as a user runs it: Adam steps, every trainer rank
    pushing its shards; the serving ranks hold the trainer's gathered model. With ``--tp 2`` the
    embedding is FSDP2's alone (each sender sees only its own "dp" slice of the mesh) and the
    first linear layer's rows are split by both mesh dimensions (``_StridedShard``)."""
    done = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(ranks),
         "examples/fsdp_many_senders.py", "--senders", str(senders), "--tp", str(tp)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=LAUNCH_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    pushed = re.findall(rf"pushed version (\d+) from {senders} ranks: ([\d.]+) MB", done.stdout)
    assert [version for version, _ in pushed] == ["1", "2", "3"], done.stdout
    serving = ranks - senders
    assert f"{serving} serving ranks hold version 3, bit for bit: True" in done.stdout, done.stdout


@ONE_GROUP_TOO
def test_refusals_before_any_byte_then_pushes_land(tmp_path: Path, over: str) -> None:
    """A sender refusing its own shards, then a receiver refusing the layout: each raises on
    every rank before any byte moves (no rank holds a version), and the next pushes land."""
    context = _spawn(f"refuse{over}", tmp_path, senders=2, world_size=4)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * 4
    reports = _reports(tmp_path, range(4))
    first, second, third = zip(*(report["refused"] for report in reports), strict=True)
    assert first[1].startswith("TypeError: 'scale'")  # the sender that refused says why
    assert first[0].startswith("ValueError: trainer rank(s) [1] refused")
    assert all(text.startswith("WeightSyncError: the push was called off by the senders") for text in first[2:])
    misfit = "'2.weight': sent float32[7, 50], model has float32[8, 50]"
    assert misfit in second[2]
    # The senders name the rank that refused and what it could not take, as one sender does.
    assert all(t.startswith("PlanMismatchError") and f"worker 0: {misfit}" in t for t in second[:2])
    assert second[3].startswith("WeightSyncError: ranks [2] refused the push before any byte")
    assert all(text.startswith("ValueError: transform takes whole tensors") for text in third[:2])
    assert all(text.startswith("WeightSyncError: the push was called off by the senders") for text in third[2:])
    assert all(report["after_refusals"] is None for report in reports)
    _assert_steps(reports)


@ONE_GROUP_TOO
def test_a_push_that_failed_on_a_receiving_rank_is_followed_by_one_that_lands(
    tmp_path: Path, over: str
) -> None:
    """The last rank's load_weights raises as the second push's bytes land: every rank raises
    (over one group the failure aborts it), none holds version 2, and the third push lands on
    every rank bit for bit: over one group, every rank forms the group again first."""
    context = _spawn(f"fail_load{over}", tmp_path, senders=2, world_size=4)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0] * 4
    reports = _reports(tmp_path, range(4))
    for report in reports:
        (error,) = report["errors"]
        assert error["step"] == 1 and error["seconds"] < sharded_job.TIMEOUT_S, report
        assert report["versions"] == [1, None, 3] and report["held"] == 3, report
        assert report["digests"][2] == reports[0]["digests"][2], report
    assert "cannot load its weights" in reports[3]["errors"][0]["message"], reports[3]


def test_a_sender_killed_mid_push(tmp_path: Path) -> None:
    """Sender 1 dies once a receiver has put a first tensor together: rank 0 names it within
    the push's bound, and no receiving rank claims the version (the other lane landed)."""
    context = _spawn("kill_sender", tmp_path, senders=2, world_size=4)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0, 9, 0, 0]
    assert (tmp_path / "landed").exists()
    trainer, *receivers = _reports(tmp_path, (0, 2, 3))
    (error,) = trainer["errors"]
    assert error["type"] == "SenderFailedError" and error["senders"] == [1], error
    assert error["message"].startswith(DEATH), error
    assert error["seconds"] < sharded_job.KILLED_TIMEOUT_S + 5
    assert trainer["versions"] == [1, None] and trainer["held"] == 1
    for report in receivers:
        (lost,) = report["errors"]
        assert lost["type"] == "SenderFailedError" and lost["senders"] == [1], lost
        assert lost["message"].startswith(DEATH), lost
        assert lost["seconds"] < sharded_job.KILLED_TIMEOUT_S + 5
        assert report["versions"] == [1, None] and report["held"] is None
        assert report["now"] != report["at"]["1"]  # lane 0's blocks of version 2 landed


def test_a_receiving_rank_killed_mid_push(tmp_path: Path) -> None:
    """The last rank dies once it put a first tensor of the second push together: every sender
    raises within the push's bound, naming it, and the other receiving rank claims no
    version."""
    context = _spawn("kill_receiver", tmp_path, senders=2, world_size=4)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0, 0, 0, 9]
    *senders, survivor = _reports(tmp_path, (0, 1, 2))
    for report in senders:
        (error,) = report["errors"]
        assert error["type"] == "WorkerFailedError" and "worker 1" in error["message"], error
        assert error["seconds"] < sharded_job.KILLED_TIMEOUT_S + 5
        assert report["versions"] == [1, None] and report["held"] == 1
    (lost,) = survivor["errors"]
    assert lost["type"] == "TransportError" and lost["senders"] is None, lost  # no sender blamed
    assert lost["seconds"] < sharded_job.KILLED_TIMEOUT_S + 5
    assert survivor["versions"] == [1, None] and survivor["held"] is None


def test_a_sender_killed_mid_push_over_one_group(tmp_path: Path) -> None:
    """Over one group a round holds every lane's bucket, so sender 1's death fails the other
    lane's rounds too: still every surviving rank names rank 1 alone within the push's bound,
    and no receiving rank claims version 2."""
    context = _spawn("kill_sender+one_group", tmp_path, senders=2, world_size=4)
    _join_all(context, LAUNCH_S)
    assert [p.exitcode for p in context.processes] == [0, 9, 0, 0]
    for report in _reports(tmp_path, (0, 2, 3)):
        (error,) = report["errors"]
        assert error["type"] == "SenderFailedError" and error["senders"] == [1], error
        assert error["message"].startswith(DEATH), error
        assert error["seconds"] < sharded_job.KILLED_TIMEOUT_S + 5, error
        assert report["versions"] == [1, None], report
        assert report["held"] == (1 if report["rank"] == 0 else None), report
