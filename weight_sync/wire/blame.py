"""The rules of blame: whom a failed push names, and what it says first (pure).

Every front raises from these rules, whatever plane carried the answers:

* the members of a push from one sender (``Outcomes``): the trainer's calls to its members end
  in answers, deaths, silence, raised errors, or a collective lost to another member's failure;
  a member dead or silent while others answered is blamed and dropped, one that raised is
  blamed and kept, one that lost a collective to another is not blamed;
* the senders of a push from many (``judge``): each sender reports how its lane ended, and rank
  0 names the senders that died or went silent first -- over one group their death fails the
  other lanes too, which are not to blame -- then those whose lane failed naming a cause;
* a member of a push from many (``lanes_failed``): the lanes that did not commit on it, under
  the same rule, with a sender whose store closed named as dead;
* the servers behind a failed push over HTTP (``blame_servers``): those that cannot be reached
  after it are named first, as the dead are, else those whose calls failed.

A sender's death is said first, as what happened ("trainer rank 1 died or left mid-push"), and
the symptoms each survivor saw (a store that closed, a collective that failed) follow as the
reasons. The group's own formation verdicts (a duplicate GPU, skewed NCCL settings) stay with
the NCCL transport, which alone can see them (``transport.nccl.judge``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from weight_sync.errors import (
    SenderFailedError,
    ServerError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
    WorkerFailedError,
    first_line,
)

# How a member's failed call ended: its process is gone; it lost a collective because another
# member failed (alive, not at fault); or it raised (alive, at fault).
Fate = Literal["died", "collateral", "raised"]


class MemberGone(WeightSyncError):
    """What a member's answers in a store fail with where a call of its own (a Ray actor call
    that carries its push) found its process gone: the answers it owed never come, and it is
    judged dead at once (``Fate`` "died") rather than silent at the bound."""


@dataclass
class Outcomes:
    """What came of one call to each of several members (indexed as the calls were)."""

    results: list[Any]
    raised: dict[int, str] = field(default_factory=dict)  # alive; its call failed
    collateral: list[int] = field(default_factory=list)  # alive; lost a collective to someone else
    died: dict[int, str] = field(default_factory=dict)
    late: list[int] = field(default_factory=list)  # no answer in time

    @property
    def ok(self) -> bool:
        return not (self.raised or self.collateral or self.died or self.late)

    @property
    def unreachable(self) -> list[int]:
        """Members to give up on: dead, or silent while others answered. If nobody answered,
        nobody can be blamed (the fault is more likely here, or the timeout too short)."""
        answered = len(self.results) - len(self.late) - len(self.died)
        return sorted([*self.died, *(self.late if answered else [])])

    def error(self, what: str, timeout_s: float, dropped: Sequence[int] = ()) -> WeightSyncError:
        """The error to raise for these outcomes (which must not be ``ok``)."""
        blamed = {**self.raised, **self.died}
        blamed.update(
            {
                index: f"no answer within {timeout_s:.1f}s (frozen?)"
                for index in self.unreachable
                if index not in self.died
            }
        )
        if not blamed:
            if self.collateral and not self.late:
                return TransportError(
                    f"{what}: the sync group failed on worker(s) {self.collateral} with no "
                    "worker at fault; check the trainer's network and logs"
                )
            return SyncTimeoutError(
                f"{what}: worker(s) {sorted(self.late)} did not answer within {timeout_s:.1f}s; "
                "they may be frozen, overloaded or still starting -- raise the timeout in "
                "SyncConfig or check them"
            )
        detail = "; ".join(f"worker {i}: {why}" for i, why in sorted(blamed.items()))
        if self.collateral:
            detail += f"; worker(s) {self.collateral} lost the broadcast as a result"
        if dropped:
            detail += f"; dropped worker(s) {list(dropped)} from the updater"
        return WorkerFailedError(
            f"{what} failed on {len(blamed)} worker(s): {detail}", sorted(blamed), dropped
        )


class CalledOff(WeightSyncError):
    """What a member of a sender's lane raises where the sender ended the push before it
    committed there: it lost the push to a failure elsewhere (the sender's error says which),
    so it is not to blame (``is_collateral``)."""


def is_collateral(error: BaseException) -> bool:
    """Whether a member's own error says it lost the push to another's failure: a collective
    that failed under it, or a lane its sender called off."""
    return isinstance(error, TransportError | SyncTimeoutError | CalledOff)


def excuse_followers(outcomes: Outcomes, leaders: Mapping[int, int]) -> None:
    """A relay's follower dials its ring until the relay opens it: one still dialling when the
    relay itself failed to join (or is as late) is no more at fault than any member that lost
    the formation to another -- collateral, not late (a late member is dropped). ``leaders``:
    follower -> the member it relays through."""
    failed = {*outcomes.raised, *outcomes.died, *outcomes.collateral, *outcomes.late}
    excused = [i for i in outcomes.late if i in leaders and leaders[i] in failed]
    outcomes.late = [i for i in outcomes.late if i not in excused]
    outcomes.collateral = sorted([*outcomes.collateral, *excused])


def judge(reports: Mapping[int, dict[str, Any] | None]) -> dict[str, Any]:
    """Rank 0's verdict on a push from many senders, from every sender's report (None: it
    sent none in time -- it died or hung; ``"gone"``: a member saw its process go;
    ``"broken"``: the lane's transport broke and named no one; ``"dead"``: the workers the lane
    found dead or frozen). Blamed: the senders gone or silent where there are any -- over one
    group their death fails the other lanes too, which are not to blame -- else those whose
    lane failed naming a cause (a worker, a refusal) where there are any -- over one group a
    member failing one lane aborts the others under it -- else every sender whose lane failed.
    The verdict's ``"dead"``: the workers the blamed lanes found dead (each is in every lane:
    their death broke the lanes that named no one too). Where every lane that failed was
    refused (``"refused"``: the members' problems, by member) and none landed, the verdict is
    that refusal, every member's problems together: nothing moved anywhere."""
    failed = {
        rank: "no report in time" if report is None else report["error"]
        for rank, report in reports.items()
        if report is None or "error" in report
    }
    refusals = [report["refused"] for report in reports.values() if report and "refused" in report]
    landed_any = any(report and report.get("lane") for report in reports.values())
    if failed and len(refusals) == len(failed) and not landed_any:
        problems: dict[str, list[str]] = {}
        for refusal in refusals:
            for member, said in refusal.items():
                problems[member] = list(dict.fromkeys([*problems.get(member, []), *said]))
        return {"refused": problems}
    if failed:
        gone = sorted(rank for rank, report in reports.items() if report and report.get("gone"))
        silent = sorted(rank for rank, report in reports.items() if report is None)
        named = [rank for rank, report in reports.items() if report and "error" in report
                 and not report.get("broken")]  # fmt: skip
        blamed, why = blame(failed, gone + silent or named)
        dead = {worker for rank in blamed for worker in (reports[rank] or {}).get("dead", ())}
        lead = deaths(gone, silent) or f"{_trainer_ranks(blamed)} did not land {_lanes(blamed)}"
        return {
            "failed": f"{lead}; no member claims the push{why}",
            "senders": blamed,
            "dead": sorted(dead),
        }
    landed = [report for report in reports.values() if report is not None]
    return {key: sum(report[key] for report in landed) for key in ("nbytes", "buckets", "wire")}


def lanes_failed(
    member: str, failed: Mapping[int, BaseException], lanes: int, gone: Sequence[int]
) -> BaseException:
    """What ``member`` raises when the lanes of senders ``failed`` (sender -> its lane's error)
    did not commit on it, of ``lanes`` it took; ``gone``: the senders whose store closed
    mid-push (their process died or left). The lanes' common error where every lane failed
    alike and no sender is gone (a refusal, a push called off); ``TransportError`` where every
    lane's collective failed with every sender alive (a member of the lanes' groups died: the
    senders name it); else ``SenderFailedError`` blaming the gone senders, or every failed one."""
    same = len({str(error) for error in failed.values()}) == 1
    if not gone and len(failed) == lanes and same:
        return next(iter(failed.values()))
    reasons = {sender: first_line(error) for sender, error in failed.items()}
    blamed, tail = blame(reasons, gone)
    if gone:  # a death is said first
        why = f"{deaths(sorted(gone))}: {member} holds no version{tail}"
    else:
        why = f"{member} holds no version: {_trainer_ranks(blamed)} did not commit "
        why += f"{_lanes(blamed)} here{tail}"
    if not gone and all(isinstance(error, TransportError) for error in failed.values()):
        return TransportError(f"{why} (a receiving rank left mid-push?)")
    return SenderFailedError(why, blamed)


def deaths(gone: Sequence[int], silent: Sequence[int] = ()) -> str:
    """The lead of a message about senders that died (``gone``: a survivor saw their process
    go) or went silent, said as what happened; empty where none did."""
    said = []
    if gone:
        said.append(f"{_trainer_ranks(gone)} died or left mid-push")
    if silent:
        them = "it" if len(silent) == 1 else "them"
        said.append(
            f"{_trainer_ranks(silent)} sent no report in time: died or hung -- check {them}"
        )
    return "; ".join(said)


def blame(failed: Mapping[int, str], culprits: Sequence[int]) -> tuple[list[int], str]:
    """Who is to blame for the lanes that ``failed`` (sender -> why): the ``culprits`` where
    there are any (a gone sender, over one group, fails the other lanes too, which are not to
    blame) else every failed one; and the tail of a message saying so, with each lane's
    reason, the blamed ones' first (a reason is cut at 500 characters, a Gloo error alone takes
    300 of them)."""
    assert set(culprits) <= set(failed), (culprits, failed)
    blamed = sorted(culprits) if culprits else sorted(failed)
    others = sorted(set(failed) - set(blamed))
    reasons = "; ".join(f"rank {rank}: {failed[rank]}" for rank in blamed + others)
    return blamed, (f" (those of {others} failed with them)" if others else "") + f" -- {reasons}"


def _trainer_ranks(ranks: Sequence[int]) -> str:
    return f"trainer rank {ranks[0]}" if len(ranks) == 1 else f"trainer ranks {list(ranks)}"


def _lanes(ranks: Sequence[int]) -> str:
    return "its lane" if len(ranks) == 1 else "their lanes"


def blame_servers(
    error: BaseException,
    failed: Mapping[str, str],
    unreachable: Mapping[str, str],
    servers: str,
) -> BaseException:
    """A failed push's ``error`` as a ``ServerError`` naming the servers to blame (``servers``
    says what they are: "server(s)", "SGLang engine(s)"): those ``unreachable`` after it (dead),
    else those whose calls ``failed`` -- a server whose part of the group was lost to another's
    death answers with an error too, so the dead are named first. ``error`` itself where it
    already names them all, or names nothing a server did (a caller's mistake)."""
    if not isinstance(error, WeightSyncError):
        return error
    blamed, how = (unreachable, "unreachable") if unreachable else (failed, "failed")
    if not blamed or (isinstance(error, ServerError) and set(blamed) <= set(error.servers)):
        return error
    detail = "; ".join(f"{name}: {reason}" for name, reason in blamed.items())
    workers = getattr(error, "workers", ())
    dropped = getattr(error, "dropped", ())
    return ServerError(f"{error} [{how} {servers}: {detail}]", blamed, workers, dropped)
