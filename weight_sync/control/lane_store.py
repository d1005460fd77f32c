"""The store side of a push from several senders: the keys of each sender's store, the commands
a sender posts there in order (``Commands``), and how the lanes of each push ended
(``Verdicts``, in rank 0's store).

A lane is one sender's ordinary push (``Pusher``) over the store plane (docs/many-senders.md):
``send.senders`` runs the senders' side, ``receive.inbound`` the members'; both read and write
what this module names.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from weight_sync.control.deadline import Deadline
from weight_sync.control.keys import (
    KEPT_PLANS,
    Retention,
    StoreGoneError,
    delete,
    read_bounded,
    wait_all,
    wait_one,
)
from weight_sync.control.store import PREFIX, Answers, ClientPlane
from weight_sync.errors import (
    PlanMismatchError,
    SenderFailedError,
    SyncTimeoutError,
    WorkerFailedError,
    first_line,
)
from weight_sync.transport import teardown
from weight_sync.transport.rendezvous import open_store
from weight_sync.wire.blame import MemberGone, judge
from weight_sync.wire.blocks import BlockLayout

logger = logging.getLogger(__name__)

COMMAND = "cmd/"  # + sequence number: the n-th step a sender asked of its members
BEGIN = f"{COMMAND}begin/"  # + push number: the sequence number of the push's ``begin``
CLOSE = "close"
VERDICTS = "lanes/"  # + push/sender: how each lane ended; + push/verdict: rank 0's verdict
# Beside the verdicts, each push's check before any byte moves (``Checks``):
LAYOUT = "layout/"  # + digest: a layout, posted once for every member that lacks it
CHECKED = "checked/"  # + push/slot: a member's problems with the push (JSON list; empty: none)
# In rank 0's lane's store, under the plane's prefix: + push/n, the n-th death of members that
# rank 0's calls found in push ``push`` (``Deaths``).
GONE = "gone/"
# A member's refusal of a push over one group it holds none of (it restarted, or lanes from
# other senders took its place): the senders form the group again before their next push.
NO_ONE_GROUP = "this worker holds no one group with these senders"


class Commands:
    """A sender's ``Client``: each call of a push becomes the next command in its store, which
    each of its members reads in order; their answers come back through ``ClientPlane``'s
    mailbox. Posted through the plane itself, so that commands and the protocol's messages keep
    one order; the plane calls a client from several threads, hence the lock."""

    def __init__(self) -> None:
        self.plane: ClientPlane | None = None  # the plane this client serves: set once it exists
        # Where a push's first step may go instead of the store (rank 0's call on the members,
        # see ``send.senders.Opening``): told the step's op and arg, it returns the calls that
        # carried it, by member slot, of which rank 0's may return replies -- None: not taken.
        self.carry: Callable[[str, dict[str, Any]], Answers | None] | None = None
        self._next = 0
        self._push: int | None = None  # the push the commands posted now belong to
        self._opening = False  # the next command is the first step of the push
        # The push's ``begin``, until a step of it goes in the store (``_frame``): a push whose
        # one step rank 0's call carried, and which landed, never puts any.
        self._unframed: dict[str, Any] | None = None
        self._carried = False  # the push's first step went in rank 0's call
        self._kept: Retention | None = None  # the commands of the last pushes, by push
        self._lock = threading.Lock()

    def post(self, op: str, arg: dict[str, Any], new_push: bool = False) -> Answers:
        """Post the next command; ``new_push``: it begins a push (``begin``, posted with the
        push's first step in the store: ``_frame``), and the commands of the pushes before the
        last ``KEPT_PUSHES`` go (``Retention``). A member asked for a push reads from its
        ``BEGIN``, whatever went before it -- after the push's first step, where ``carry`` took
        that one to it: then the calls that carried it (``Answers``; posted: none)."""
        with self._lock:
            if new_push:
                self._push, self._unframed = int(arg["push"]), {"op": op, "arg": arg}
                self._opening, self._carried = True, False
                return {}
            if self._opening:
                self._opening = False
                carried = self.carry(op, arg) if self.carry is not None else None
                if carried is not None:
                    self._carried = True
                    return carried
            self._frame()
            self._post(json.dumps({"op": op, "arg": arg}))
            return {}

    def landed(self, arg: dict[str, Any]) -> None:
        """The ``end`` of a push that landed -- none where rank 0's call carried all of it:
        every member then committed in that call, and none reads the store for it
        (``Inbound.receive``). A push that failed ends with ``post``."""
        with self._lock:
            if self._carried and self._unframed is not None:
                self._unframed = None
                return
        self.post("end", arg)

    def _frame(self) -> None:
        """Post the push's ``begin`` (the lock held), once, before its first step in the store:
        ``BEGIN`` names its number."""
        if self._unframed is None:
            return
        assert self._push is not None, "a push began"
        self._retained().post(self._push, f"{BEGIN}{self._push}", str(self._next))
        self._post(json.dumps(self._unframed))
        self._unframed = None

    def _post(self, command: str) -> None:
        """Post ``command`` as the next (the lock held)."""
        assert self.plane is not None, "the plane comes first"
        if self._push is None:  # before the first push (joining): kept for good
            self.plane.post(f"{COMMAND}{self._next}", command)
        else:
            self._retained().post(self._push, f"{COMMAND}{self._next}", command)
        self._next += 1

    def _retained(self) -> Retention:
        """The commands of the last pushes, by push (made once the plane is there)."""
        if self._kept is None:
            assert self.plane is not None, "the plane comes first"
            self._kept = Retention(self.plane.post, self.plane.forget)
        return self._kept

    def unopened(self) -> bool:
        """Whether the push begun last has had no step yet (then it has none: it is over);
        asked once, as it ends."""
        with self._lock:
            unopened, self._opening = self._opening, False
            return unopened

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post(
            "init",
            {
                k: init_info[k]
                for k in ("address", "port", "epoch", "timeout_s", "max_metadata_bytes")
            },
        )

    def start_weight_update(self) -> None:
        self.post("start", {})

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.post("update", {"version": int(update_info["version"])})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.post("finish", {})

    def push_weight_update(self, request_json: str) -> Answers:
        return self.post("push", {"request": request_json})

    def shutdown_weight_transfer_engine(self) -> None:
        self.post("shutdown", {})


class Verdicts:
    """How the lanes of each push ended, in rank 0's store (``store``: a prefix of it): every
    sender reports its own, rank 0 judges them all and posts the verdict, which the others read.
    Bounded by the push's deadline; a sender that never reports is named as dead or hung."""

    def __init__(self, store: Any, senders: int) -> None:
        self._store = store
        self._senders = senders
        self._kept = Retention.in_store(store)  # rank 0's

    def settle(
        self,
        push: int,
        sender: int,
        outcome: dict[str, Any],
        deadline: Deadline,
    ) -> dict[str, Any]:
        """Report ``outcome`` (``{"error": ...}``, or the lane's nbytes, buckets and wire
        bytes), then the verdict: judged here on rank 0, read elsewhere (a lone sender's judged
        from its own report, nothing stored: nobody else reads it). Raises
        ``SenderFailedError`` when a lane did not land, ``PlanMismatchError`` where the members
        refused every lane that failed and none landed; else returns every lane's sums."""
        if self._senders == 1:  # no other sender reads it, nobody reports for rank 0
            verdict = judge({0: outcome})
        else:
            self._store.set(f"{push}/{sender}", json.dumps(outcome))
            key = f"{push}/verdict"
            verdict = self._judged(push, deadline) if sender == 0 else self._wait(key, deadline)
        if "refused" in verdict:
            raise PlanMismatchError({int(k): v for k, v in verdict["refused"].items()})
        if "failed" in verdict:
            if outcome.get("broken") and verdict["dead"]:
                # Workers died or froze mid-push: every lane has them, this one too, which
                # broke naming no one (from here, the death had not been seen yet).
                raise WorkerFailedError(
                    f"worker(s) {verdict['dead']} died or stopped answering mid-push, which "
                    f"broke this lane too: {verdict['failed']}",
                    verdict["dead"],
                )
            raise SenderFailedError(verdict["failed"], verdict["senders"])
        return verdict

    def _judged(self, push: int, deadline: Deadline) -> dict[str, Any]:
        """Rank 0: every sender's report of push ``push`` (by the deadline: the missing never
        reported), judged, the verdict posted for the others."""
        keys = [f"{push}/{rank}" for rank in range(self._senders)]
        self._kept.posted(push, keys)  # every sender read the older pushes' verdicts
        found = wait_all(self._store, keys, deadline)
        reports = {
            rank: json.loads(found[key]) if key in found else None for rank, key in enumerate(keys)
        }
        verdict = judge(reports)
        self._kept.post(push, f"{push}/verdict", json.dumps(verdict))
        return verdict

    def begin(self, push: int) -> None:
        """Rank 0, as push ``push`` begins, before the agreement's first collective: the
        receiving ranks of a launched job wait for this (``begun``), bounded by their receive's
        own ``timeout_s``, rather than in that collective, bounded by the group's."""
        self._kept.post(push, f"{push}/begin", "1")

    def begun(self, push: int, deadline: Deadline) -> None:
        """Wait until rank 0 began push ``push`` (``begin``): ``SyncTimeoutError`` at the
        deadline, ``SenderFailedError`` naming rank 0 if its store is gone."""
        self._from_rank_0(f"{push}/begin", deadline, f": push {push} will not begin")

    def report_for(self, push: int, sender: int, why: str) -> None:
        """A member saw ``sender``'s store close mid-push: its process is gone and will never
        report. Said for it (unless it reported first), so that rank 0's verdict comes now
        rather than at the push's deadline."""
        try:
            report = json.dumps({"error": why, "gone": True})
            self._store.compare_set(f"{push}/{sender}", "", report)
        except RuntimeError as exc:  # rank 0 is gone too: nobody to tell
            logger.debug("cannot report sender %d's death: %s", sender, exc)

    def _wait(self, key: str, deadline: Deadline) -> dict[str, Any]:
        try:
            gone = " before its verdict; no member claims the push"
            return dict(json.loads(self._from_rank_0(key, deadline, gone)))
        except SyncTimeoutError as exc:
            raise SyncTimeoutError(f"rank 0 gave no verdict ({key}) in time") from exc

    def _from_rank_0(self, key: str, deadline: Deadline, gone: str) -> bytes:
        """``key``, which rank 0 posts, once it is there (``keys.wait_one``); its store gone,
        ``SenderFailedError`` naming rank 0, ``gone`` saying what that means here."""
        try:
            return wait_one(self._store, key, deadline)
        except StoreGoneError as exc:
            raise SenderFailedError(
                f"trainer rank 0 died or left{gone} ({first_line(exc)})", [0]
            ) from exc


class Deaths:
    """Members that rank 0's calls found dead mid-push (a Ray worker's actor call, a ``vllm
    serve`` server's ``update_weights``: only rank 0 calls them), told to every sender's lane:
    rank 0's own at once, the others' through rank 0's store.
    Another sender has no way of its own to learn it -- its store cannot tell a member's closed
    connection from a slow one -- and its lane would wait for the dead member's answers until
    its bound while rank 0 waits for its report.

    Rank 0 posts each death in its lane's store (``tell``, from whichever thread saw the call
    fail; kept for the last pushes, ``Retention``). Every other sender watches the push under
    way (``watch``) from a thread of its own, on a client of its own to rank 0's store (a
    client serves one call at a time, and the verdicts' client waits in rank 0's store), and
    fails what each member told dead owes its lane (``ClientPlane.gone``). It looks every
    ``_DEATHS_S`` rather than waiting in the store: a store wait that times out logs a warning of
    torch's own each time."""

    def __init__(
        self, plane: ClientPlane, rank_0: tuple[str, int] | None = None, timeout_s: float = 60.0
    ) -> None:
        """``plane``: this sender's lane's. ``rank_0``: where rank 0's store listens, on every
        other sender (None: rank 0 itself), dialled within ``timeout_s``."""
        self._plane = plane
        self._lock = threading.Condition()
        self._told = (0, 0)  # rank 0: the last push a death was told of, and how many
        self._kept = Retention(plane.post, plane.forget)  # rank 0's, by push
        self._push: int | None = None  # another sender: the push watched (None: between)
        self._closed = False
        self._store: Any = None
        if rank_0 is not None:
            self._store = dist.PrefixStore(PREFIX, open_store(*rank_0, 1, timeout_s, None))
            teardown.start("weight-sync-deaths", self._watch, self.close)

    def tell(self, push: int, slots: Sequence[int], why: str) -> None:
        """Rank 0: members ``slots`` died during push ``push``, as its call on them found."""
        error = MemberGone(why)
        for slot in slots:
            self._plane.gone(slot, error)
        told = json.dumps({"slots": list(slots), "why": why[:_MOST_WHY]})
        with self._lock:
            number = self._told[1] if self._told[0] == push else 0
            self._told = (push, number + 1)
            self._kept.post(push, f"{GONE}{push}/{number}", told)

    def watch(self, push: int | None) -> None:
        """Another sender: watch push ``push`` from now (None: none, between pushes)."""
        with self._lock:
            self._push = push
            self._lock.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def _watch(self) -> None:
        """Another sender's thread: each death rank 0 tells of the push watched, in order,
        until closed or rank 0's store is gone (its lane's members then say so)."""
        push, read = None, 0  # the push watched, and how many of its deaths were read
        try:
            while (watched := self._watched()) is not None:
                if watched != push:
                    push, read = watched, 0
                key = f"{GONE}{push}/{read}"
                if self._store.check([key]):
                    read += 1
                    self._heard(push, self._store.get(key))
                else:
                    time.sleep(_DEATHS_S)
        except RuntimeError:  # rank 0's store is gone: its lane's members say so
            pass
        finally:
            self._store = None

    def _watched(self) -> int | None:
        """The push to watch, once there is one; None once closed."""
        with self._lock:
            while self._push is None and not self._closed:
                self._lock.wait()
            return None if self._closed else self._push

    def _heard(self, push: int, raw: bytes) -> None:
        """Fail what the members a death of push ``push`` names owe this lane, if it is still
        the push under way."""
        try:
            told = json.loads(raw[: 2 * _MOST_WHY])
            slots, why = [int(slot) for slot in told["slots"]], str(told["why"])
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("a death rank 0 told cannot be read: %s", exc)
            return
        with self._lock:
            if self._push != push:  # that push is over
                return
        for slot in slots:
            self._plane.gone(slot, MemberGone(why))


_MOST_WHY = 1000  # characters of why a member died, as rank 0 tells the other senders
_DEATHS_S = 0.05  # another sender looks this often for the deaths rank 0 told mid-push


class Checks:
    """The members' check of each push before any byte moves, in rank 0's store (``store``: the
    prefix the verdicts share): rank 0 posts the layout once by digest, and every member reads
    it there if it lacks it. Where rank 0 asks the members before the lanes open (``vllm
    serve``'s workers, told to check by an HTTP call), each answers there with what of the push
    it cannot take; where rank 0's call carries the lanes too (Ray workers, vLLM engines on Ray)
    the members refuse on the lanes themselves (``receive.member.Member.take``)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._layouts = Retention.in_store(store, KEPT_PLANS)  # rank 0's, by digest
        # Every slot's answer key, by push: one a member sets after rank 0 stopped looking
        # (it was late, and blamed) goes with its push's generation, not with the store.
        self._answers = Retention.in_store(store)

    # -- rank 0 ------------------------------------------------------------------------------

    def post_layout(self, layout: BlockLayout) -> None:
        """Make ``layout`` readable by every member that lacks it (posted once per digest)."""
        if layout.digest not in self._layouts:
            self._layouts.post(layout.digest, f"{LAYOUT}{layout.digest}", layout.wire)

    def answers(
        self,
        push: int,
        members: int,
        deadline: Deadline,
        ended: Callable[[], bool] = lambda: False,
    ) -> list[list[str] | None]:
        """Each member's problems with push ``push`` (members by slot, 1..``members``), read
        once; None for a member that gave none by ``deadline`` -- or by the moment ``ended()``
        says a member's call ended before answering (it failed: its caller says how)."""
        keys = [f"{CHECKED}{push}/{slot}" for slot in range(1, members + 1)]
        found: dict[str, bytes] = {}
        while len(found) < len(keys) and deadline.remaining() > 0:
            missing = [key for key in keys if key not in found]
            look = Deadline(min(_LOOK_S, deadline.remaining()), "a look for the members' checks")
            found.update(wait_all(self._store, missing, look))
            if len(found) < len(keys) and ended():  # one last look: it may have answered first
                last = Deadline(0.0, "a last look for the members' checks")
                found.update(wait_all(self._store, [k for k in keys if k not in found], last))
                break
        delete(self._store, list(found))  # read once; one set later goes with its push
        self._answers.posted(push, [key for key in keys if key not in found])
        return [_problems(found[key]) if key in found else None for key in keys]

    # -- a member ----------------------------------------------------------------------------

    def layout(self, digest: str, limit: int) -> str:
        """The layout ``digest`` names, as rank 0 posted it (bounded by ``limit`` bytes)."""
        return read_bounded(self._store, f"{LAYOUT}{digest}", limit)

    def answer(self, push: int, slot: int, problems: list[str]) -> None:
        """Member ``slot``'s problems with push ``push`` (empty: it takes all of it)."""
        try:
            self._store.set(f"{CHECKED}{push}/{slot}", json.dumps(problems))
        except RuntimeError as exc:
            raise _rank_0_gone(push, StoreGoneError(first_line(exc))) from exc


def _rank_0_gone(push: int, exc: StoreGoneError) -> SenderFailedError:
    return SenderFailedError(
        f"trainer rank 0 died or left before push {push} began ({first_line(exc)}); nothing "
        "was sent",
        [0],
    )


_LOOK_S = 0.25  # rank 0 looks this often whether a member's call ended before it answered


def _problems(raw: bytes) -> list[str]:
    """A member's answer as problems (one that cannot be read is one)."""
    try:
        problems = json.loads(raw)
    except ValueError:
        problems = None
    if not isinstance(problems, list):
        return [f"an answer that is no list of problems: {raw[:200]!r}"]
    return [str(problem) for problem in problems]
