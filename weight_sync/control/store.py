"""A control plane over a store: the trainer posts each step of a push, its members answer.

The trainer listens (a ``TCPStore`` on a socket it bound: loopback unless ``SyncConfig`` names an
address); every member dials it, takes a slot, and answers each step of a push under
``step/key/slot`` with a ``WorkerReply`` -- the step's result or its typed error. What *tells* the
members to run a step is a ``Client``, the five calls of vLLM's weight-transfer API -- each a
command in the same store (``control.lane_store.Commands``), which every member of a sender's
lane reads in order (``receive.inbound.Inbound``, driving a ``StoreMember``), whatever front
carries the lanes (Ray calls, vLLM's weight-transfer API over HTTP or Ray, a launched job).

``ClientPlane`` is the trainer's ``ControlPlane`` over any of them; ``StoreMember`` the member's
end. Only JSON crosses the store, bounded in size; nothing is unpickled.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from weight_sync.config import SyncConfig
from weight_sync.control.futures import Backoff, in_thread, joined, resolve, then
from weight_sync.control.keys import KEPT_PLANS, Retention, delete, read_bounded
from weight_sync.errors import WeightSyncError, first_line
from weight_sync.receive.receiver import Check, Loader, Receiver
from weight_sync.transport import teardown
from weight_sync.transport.rendezvous import bind_listener, listen_address, open_store
from weight_sync.wire.blame import CalledOff, Fate, MemberGone, is_collateral
from weight_sync.wire.metadata import (
    GroupSpec,
    MemberInfo,
    PrepareReply,
    PrepareRequest,
    PushReply,
    ReceiveReport,
    SyncPlan,
    SyncStatus,
    WorkerReply,
)

logger = logging.getLogger(__name__)

PREFIX = "weight_sync/control/plane/"
# The first and the longest pause between looks for answers awaited; none awaited, no looks.
_POLL_S = (0.0005, 0.004)
_COMMIT, _CANCEL = "commit", "cancel"
_UNFORMED = "!"  # a member's spec, where the trainer formed no group (no spec is JSON with it)
MAX_REPLY_CHARS = 1 << 20
_MOST_DOOMED = 1024  # keys that may wait for the poller to delete them
# How long the store is not looked at for a reply a member's call may return (``Answers``): in
# the steady state the call returns it first; a member that did not commit (a refusal, the long
# way) answers in the store instead, read from then on.
_RETURNED_S = 0.05


class Client(Protocol):
    """How the trainer tells every member to run one step (vLLM's ``VLLMWeightSyncClient``)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


# The replies to a step that a client carried to members in calls of its own, by member slot:
# each call's result is the member's reply (a ``WorkerReply``, JSON) where it answered there,
# else None (it answered in the store, as every member not named here does).
Answers = Mapping[int, "Future[str | None]"]


class OneCallClient(Client, Protocol):
    """A client whose members also take a whole push in one step (``StoreMember.push``): a
    sender's lane (``control.lane_store.Commands``), the client every plane has."""

    def push_weight_update(self, request_json: str) -> Answers:
        """Have every member take the push ``request_json`` (a ``PrepareRequest``) in one step;
        the request travels in the command itself (one read fewer a member), or in a call on
        each member (rank 0's on Ray workers: ``send.senders.Opening``), which may return the
        member's reply: those calls, by slot."""


# -- the member's end ------------------------------------------------------------------------------


class StoreMember:
    """One member answering a ``ClientPlane`` through its store: each method is one step, run
    when the member's client call (or command) arrives.

    ``check`` is the member's check of a plan before any byte moves; ``loader`` makes the
    ``Loader`` a receive and a commit hand their tensors to; ``destinations`` the tensors bytes
    may land in directly (see ``Receiver.receive``). Each step writes its result or error for
    the trainer and raises the error again (vLLM then ends its update session)."""

    def __init__(
        self,
        receiver: Receiver,
        check: Check,
        loader: Callable[[], Loader],
        destinations: Callable[[], Mapping[str, torch.Tensor] | None] = lambda: None,
        one_call: bool = False,
        concurrent: bool = False,
    ) -> None:
        """``one_call``: this member offers the whole push in one step (``push``; its client
        posts it, ``OneCallClient``), which ends in the commit: a round, not three.
        ``concurrent``: it receives beside its own use of its weights (``MemberInfo``)."""
        self.receiver = receiver
        self.retarget(check, loader, destinations)
        self._one_call, self._concurrent = one_call, concurrent
        self._store: Any = None
        self._slot = 0
        self._epoch = 0
        self.pushing: int | None = None  # the version this member prepared
        self.prepared: PrepareReply | None = None  # its verdict on that push

    def retarget(
        self,
        check: Check,
        loader: Callable[[], Loader],
        destinations: Callable[[], Mapping[str, torch.Tensor] | None] = lambda: None,
    ) -> None:
        """Where the next push lands (a job's rank may receive into another model each time)."""
        self._check, self._loader, self._destinations = check, loader, destinations

    def init(
        self,
        address: str,
        port: int,
        epoch: int,
        timeout_s: float,
        max_metadata_bytes: int,
        slot: int | None = None,
    ) -> None:
        """Dial the trainer's store, answer its probe, and join the group it then describes.
        ``slot``: this member's place (1-based) where it is fixed (a job's rank), else the order
        of arrival."""
        self.shutdown()
        from torch.distributed import PrefixStore

        self._store = PrefixStore(PREFIX, open_store(address, port, 1, timeout_s, None))
        self._epoch = epoch
        self._slot = slot if slot is not None else int(self._store.add(f"{epoch}/slots", 1))
        info = self.receiver.info(self._concurrent, self._one_call)
        self._answer(f"info/{epoch}/{self._slot}", info.model_dump_json)

        def join() -> None:
            spec_json = read_bounded(self._store, f"spec/{epoch}/{self._slot}", max_metadata_bytes)
            if spec_json.startswith(_UNFORMED):
                raise CalledOff(f"the trainer formed no group: {spec_json[len(_UNFORMED) :]}")
            self.receiver.join_json(spec_json, max_metadata_bytes)

        self._answer(f"joined/{epoch}/{self._slot}", join)

    def start(self) -> None:
        """Check the push the trainer announced (fetching its plan from the store if this member
        does not hold it)."""
        request_json = read_bounded(self._store, f"prepare/{self._epoch}", MAX_REPLY_CHARS)
        request = self._announced(request_json)

        def prepare() -> str:
            # With its destinations, a member whose weights take every byte in place offers to
            # take deltas (PrepareReply.in_place): without them, a job never pushed one.
            reply = self.receiver.prepare(request_json, self._check, self._destinations)
            if reply.need_plan:
                limit = self.receiver.max_metadata_bytes or MAX_REPLY_CHARS
                plan_json = read_bounded(self._store, f"plan/{request.plan_digest}", limit)
                whole = request.model_copy(update={"plan": SyncPlan.model_validate_json(plan_json)})
                reply = self.receiver.prepare(
                    whole.model_dump_json(), self._check, self._destinations
                )
            self.prepared = _as_verdict(reply)
            return reply.model_dump_json()

        self._answer(_prepared(request.version, self._slot), prepare)

    def receive(self, version: int) -> bool:
        """Take the push's bytes; returns whether that committed it too (a member that offered
        one-call pushes is asked to commit on receipt: no ``finish`` follows)."""

        def receive() -> str:
            loader, destinations = self._landing()
            return self.receiver.receive(version, loader, destinations).model_dump_json()

        self._answer(f"received/{version}/{self._slot}", receive)
        return self._committed(version)

    def push(self, request_json: str, answer: Callable[[str], None] | None = None) -> bool:
        """The whole push ``request_json`` in one step (``Receiver.push``: the check, a vote of
        every member before any byte, the bytes, the commit on receipt), for a member that holds
        its plan; one that does not answers so, and the trainer takes the long way (``start``,
        ``receive``). Returns whether the push committed here. ``answer``: where the push
        committed, its reply (a ``WorkerReply``, JSON) goes there -- the call that carried the
        step returns it -- rather than into the store; any other reply is posted, as the trainer
        goes on (the long way, or the push's end) only once it has it."""
        request = self._announced(request_json)

        def push() -> str:
            loader, destinations = self._landing()
            reply = self.receiver.push(request_json, self._check, loader, destinations)
            self.prepared = _as_verdict(reply.prepared)
            return reply.model_dump_json()

        reply, error = WorkerReply.of(push, self.receiver.status)
        committed = error is None and self._committed(request.version)
        if answer is not None and committed:
            answer(reply.model_dump_json())
        else:
            self._store.set(f"pushed/{request.version}/{self._slot}", reply.model_dump_json())
        if error is not None:
            raise error
        return committed

    def _announced(self, request_json: str) -> PrepareRequest:
        """The push the trainer announced (in the store for steps, in the command for one),
        now this member's."""
        request = PrepareRequest.model_validate_json(request_json)
        self.pushing, self.prepared = request.version, None
        return request

    def _landing(self) -> tuple[Loader, Mapping[str, torch.Tensor] | None]:
        """Where the bytes about to flow land (``Receiver.or_leave``: leaving if that fails)."""
        return self.receiver.or_leave(lambda: (self._loader(), self._destinations()))

    def _committed(self, version: int) -> bool:
        """Whether push ``version`` committed here on receipt (then nothing more of it comes)."""
        if self.receiver.version != version:
            return False
        self.pushing = None
        return True

    def finish(self) -> bool:
        """Commit the push, or drop it: the trainer's verdict, once every member received it.
        Returns whether it committed. Never raises for a failed commit (vLLM would keep its
        update session open, refusing every later one): that reaches the trainer through the
        store, and the member reports no version."""
        version, self.pushing = self.pushing, None
        if version is None:
            return False
        if read_bounded(self._store, f"verdict/{version}", 16) != _COMMIT:
            self.receiver.cancel(version)
            return False
        destinations = self._destinations() if self.receiver.staged else None
        self._answer(
            f"committed/{version}/{self._slot}",
            lambda: self.receiver.commit(version, self._loader(), destinations),
            reraise=False,
        )
        return self.receiver.version == version

    def shutdown(self) -> None:
        self.receiver.leave()
        self._store = None

    def _answer(self, key: str, step: Callable[[], Any], reraise: bool = True) -> None:
        """Run ``step`` and write its result or its error to ``key`` for the trainer; an error
        is raised again here too (``reraise``)."""
        reply, error = WorkerReply.of(step, self.receiver.status)
        self._store.set(key, reply.model_dump_json())
        if error is not None and reraise:
            raise error


def refuse_unjoined(
    endpoint: Sequence[Any],
    version: int,
    slot: int,
    problems: list[str],
    status: SyncStatus,
    timeout_s: float,
) -> None:
    """Refuse push ``version`` as member ``slot`` of the sender whose store is at ``endpoint``,
    where this member follows no lane of that sender's to answer through (it lost the one group
    the lane moves over: restarted, or lanes from other senders took its place): the answer the
    sender's prepare round waits for, so it raises the refusal at once."""
    from torch.distributed import PrefixStore

    address, port = str(endpoint[0]), int(endpoint[1])
    store = PrefixStore(PREFIX, open_store(address, port, 1, timeout_s, None))
    reply = PrepareReply(accepted=False, problems=tuple(problems)).model_dump_json()
    store.set(_prepared(version, slot), WorkerReply(value=reply, status=status).model_dump_json())


def _prepared(version: int, slot: int) -> str:
    """Where member ``slot`` answers the prepare of push ``version``."""
    return f"prepared/{version}/{slot}"


def _as_verdict(reply: PrepareReply) -> PrepareReply | None:
    """``reply`` as this member's verdict on the push, or None where it is none yet: lacking
    the plan or a delta's base, the member is asked again (the plan sent, or the push dense)
    within the same push -- and a sender that fails before then must be reported as such,
    not as a refusal that names no problem (``Inbound._ended``)."""
    return None if reply.need_plan or reply.need_dense else reply


# -- the trainer's end -----------------------------------------------------------------------------


class ClientPlane:
    """``ControlPlane`` over a ``OneCallClient`` (see the module doc). Members are the processes
    that answer, in the order they took their slots."""

    def __init__(self, client: OneCallClient, workers: int, config: SyncConfig) -> None:
        from torch.distributed import PrefixStore

        self._client = client
        self._workers = workers
        self._timeout_s = config.rendezvous_timeout_s
        self._max_metadata_bytes = config.max_metadata_bytes
        address = listen_address(config.master_addr, config.interface)
        listener = bind_listener(address)
        self._address, self._port = address, listener.getsockname()[1]
        self._mailbox = _Mailbox(
            PrefixStore(PREFIX, open_store(address, self._port, 1, self._timeout_s, listener))
        )
        self._epoch = 0
        self._plans = Retention(self._mailbox.post, self._mailbox.forget, KEPT_PLANS)  # by digest
        self._verdicts = Retention(self._mailbox.post, self._mailbox.forget)  # by version
        # Each formation's specs and slot counter, by epoch: a member joins the latest only.
        self._specs = Retention(self._mailbox.post, self._mailbox.forget)
        self._joining: Future[Any] | None = None
        self._pushing: int | None = None  # prepared, neither committed nor cancelled
        self._ending: Future[None] | None = None  # a cancelled push's session, being ended
        self._asked: int | None = None  # the version whose prepare was asked last
        self._dead: dict[int, MemberGone] = {}  # members found gone in the push under way

    def __len__(self) -> int:
        return self._workers

    def recount(self, workers: int) -> None:
        """The members are now ``workers`` (slots ``1..workers``): some were dropped or added,
        and the next probe asks them to join afresh."""
        self._workers = workers

    @property
    def address(self) -> tuple[str, int]:
        """Where the members dial the trainer's store."""
        return self._address, self._port

    def probe(self, timeout_s: float) -> list[Future[MemberInfo]]:
        self._begin("the members were asked to join afresh")
        self._epoch += 1
        info = {
            "address": self._address,
            "port": self._port,
            "epoch": self._epoch,
            "timeout_s": self._timeout_s,
            "max_metadata_bytes": self._max_metadata_bytes,
        }
        self._joining = in_thread(lambda: self._client.init_weight_transfer_engine(info))
        return self._round("info", self._epoch, self._joining, MemberInfo)

    def join(
        self, specs: Sequence[GroupSpec], max_metadata_bytes: int, timeout_s: float
    ) -> list[Future[None]]:
        assert self._joining is not None, "probe first"
        self._specs.posted(self._epoch, [f"{self._epoch}/slots"])  # the members' counter
        for slot, spec in enumerate(specs, start=1):
            self._specs.post(self._epoch, f"spec/{self._epoch}/{slot}", spec.model_dump_json())
        return self._round("joined", self._epoch, self._joining, None)

    def unformed(self, why: str) -> None:
        """Each member's place, where it reads its spec, says there is no group: its join (begun
        with its answer to the probe, ``StoreMember.init``) fails at once rather than at the
        store's bound."""
        for slot in range(1, self._workers + 1):
            self._specs.post(self._epoch, f"spec/{self._epoch}/{slot}", _UNFORMED + why)

    def prepare(
        self,
        request: PrepareRequest,
        plan: SyncPlan,
        members: Sequence[int],
        send_plan: Sequence[bool],
        timeout_s: float,
    ) -> list[Future[PrepareReply]]:
        # Workers fetch the plan from the store when they lack it, so none asks for it.
        assert list(members) == list(range(self._workers)), "every worker prepares at once"
        if self._asked == request.version:  # again (dense, after a delta some member refused)
            # The answers to the first ask go before anyone is asked again: under the same
            # keys, they would be read as this round's -- or, deleted once read, take this
            # round's with them where a member answered before the deletion (a wait to the
            # push's bound).
            self._mailbox.purge([_prepared(request.version, s) for s in range(1, len(self) + 1)])
        self._asked = request.version
        self._begin("a later push began")
        if plan.digest not in self._plans:
            self._plans.post(plan.digest, f"plan/{plan.digest}", plan.wire)
        self._mailbox.post(f"prepare/{self._epoch}", request.model_dump_json())
        # A push its members commit on receipt (a lane's) opens no session to finish or cancel:
        # a ``finish`` for it would have them wait on a verdict never posted; the lane's ``end``
        # drops what a member prepared.
        self._pushing = None if request.commit_on_receipt else request.version
        self._ended(timeout_s)
        call = in_thread(self._client.start_weight_update)
        return self._round("prepared", request.version, call, PrepareReply)

    def cancel(self, version: int, members: Sequence[int], timeout_s: float) -> list[Future[None]]:
        ending = self._take_session()  # now, not in the thread: the next push may begin before
        self._ending = in_thread(lambda: self._end_session(ending))
        return [self._ending] * len(members)

    def push(self, request: PrepareRequest, timeout_s: float) -> list[Future[PushReply]]:
        client = self._client
        self._begin("a later push began")
        posted: Future[None] = Future()  # the client posts to its own store: no thread for it
        answers: Answers = {}
        try:
            answers = client.push_weight_update(request.model_dump_json())
            resolve(posted, result=None)
        except Exception as exc:
            resolve(posted, error=exc)
        return self._round("pushed", request.version, posted, PushReply, answers)

    def receive(self, version: int, atomic: bool, timeout_s: float) -> list[Future[ReceiveReport]]:
        call = in_thread(lambda: self._client.update_weights({"version": version}))
        return self._round("received", version, call, ReceiveReport)

    def commit(self, version: int, timeout_s: float) -> list[Future[None]]:
        self._pushing = None
        self._verdict(version, _COMMIT)
        call = in_thread(lambda: self._client.finish_weight_update(str(version)))
        # The client labels the engines' outputs with the version only after the members have
        # committed (vLLM's finish_weight_update, then update_weight_version): the commit is
        # over when that call returns too, or a caller generating at once reads the old label.
        return [joined(answer, call) for answer in self._round("committed", version, call, None)]

    def leave(self, timeout_s: float) -> list[Future[None]]:
        """End any update session still open (vLLM refuses to release an engine inside one),
        then release the engines from the group."""
        shutdown = getattr(self._client, "shutdown_weight_transfer_engine", lambda: None)
        ending = self._take_session()

        def leave() -> None:
            try:
                self._end_session(ending)
            except Exception as exc:  # a worker whose update already failed has no session
                logger.debug("ending the update session: %s", exc)
            shutdown()

        return [in_thread(leave)] * self._workers

    def drop(self, members: Sequence[int]) -> None:
        """The members stay: their count is whoever made this plane's (a lane's front renews
        it, ``recount``), so pushes fail until that changes."""
        logger.warning(
            "member(s) %s failed; they are called until whoever counts them renews the count",
            list(members),
        )

    def gone(self, slot: int, error: MemberGone) -> None:
        """Member ``slot`` is gone, as a call of whoever calls it found (rank 0's Ray call on a
        worker that died; on another sender's lane, rank 0's word: ``lane_store.Deaths``): what
        it owes the push under way -- the answers awaited now and those of the push's later
        rounds -- fails with ``error`` at once, so that it is judged dead now rather than silent
        at the bound. From any thread; forgotten as the next push begins."""
        self._dead[slot] = error
        self._mailbox.fail(f"/{slot}", error)

    def fate(self, error: BaseException) -> tuple[Fate, str]:
        if isinstance(error, MemberGone):
            return "died", str(error)
        return ("collateral" if is_collateral(error) else "raised"), first_line(error)

    def post(self, key: str, value: str) -> None:
        """Write ``key`` in the control store, in order with every message of the push protocol
        (one connection, one lock): a launched job's commands go this way."""
        self._mailbox.post(key, value)

    def forget(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` (posted with ``post``) from the control store."""
        self._mailbox.forget(keys)

    def close(self) -> None:
        self._mailbox.close()

    def _begin(self, why: str) -> None:
        """A new push or probe: the answers still awaited are nobody's (``abandon``), and no
        member is known gone."""
        self._mailbox.abandon(why)
        self._dead = {}

    def _verdict(self, version: int, word: str) -> None:
        """Post the verdict on push ``version`` (every member reads it during its push: the
        older ones go, see ``Retention``)."""
        self._verdicts.post(version, f"verdict/{version}", word)

    def _ended(self, timeout_s: float) -> None:
        """Wait (within ``timeout_s``) for the session of a cancelled push to end before the
        next one opens: where no member had accepted it, nobody waited for its end, and a
        session opened before it ended is refused by vLLM ("a weight update is already
        active"; seen in CI on a loaded host). Its failure is the push's that ended it."""
        ending, self._ending = self._ending, None
        if ending is None:
            return
        try:
            ending.result(timeout=timeout_s)
        except Exception as exc:  # that push raised already; this one goes on
            logger.debug("ending the last update session: %s", exc)

    def _take_session(self) -> int | None:
        version, self._pushing = self._pushing, None
        return version

    def _end_session(self, version: int | None) -> None:
        """``finish_weight_update`` with a verdict to drop push ``version``, if one is open."""
        if version is not None:
            self._verdict(version, _CANCEL)
            self._client.finish_weight_update()

    def _round(
        self,
        step: str,
        key: int,
        call: Future[Any],
        kind: type | None,
        given: Answers | None = None,
    ) -> list[Future[Any]]:
        """One future per worker: its answer under ``step/key/slot``, or the client call's error
        if that call fails before the worker answered -- or, for a worker ``given`` names, the
        reply its own call returned, if it did (the store is then not read for it); a worker
        found gone in this push (``gone``) fails at once."""
        given = given or {}
        answers = [
            self._mailbox.expect(f"{step}/{key}/{slot}", _RETURNED_S if slot in given else 0.0)
            for slot in range(1, self._workers + 1)
        ]

        def failed(done: Future[Any]) -> None:
            if done.exception() is not None:
                for answer in answers:
                    resolve(answer, error=done.exception())

        call.add_done_callback(failed)
        for slot, error in list(self._dead.items()):  # (``gone`` fails those awaited already)
            if slot <= len(answers):
                resolve(answers[slot - 1], error=error)
        for slot, returned in given.items():
            returned.add_done_callback(functools.partial(_returned, answers[slot - 1]))
        return [then(answer, lambda raw: _parse(raw, kind)) for answer in answers]


class _Mailbox:
    """The trainer's end of the control store: it posts messages, and gets futures for the keys
    workers will answer under, resolved by one thread that polls for them (a store's blocking
    ``wait`` would hold up every other use of it). One lock guards every use of the store;
    another the answers awaited, so that awaiting one never waits on a store round trip.

    Keys are deleted by that thread while no answer is awaited -- those it is told to forget
    (an old push's, ``Retention``) and the answers it read -- between pushes rather than on the
    way of the next step, where a store round trip each was a tenth of a small push (the K = 1
    push of W5 from many senders). A key posted again before its deletion is not deleted."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()  # the store, ``_closed`` and ``_doomed``
        self._closed = False
        self._doomed: dict[str, None] = {}  # to delete, in order
        self._waiting = threading.Lock()  # ``_pending`` and ``_thread``
        self._pending: dict[str, tuple[Future[str], float]] = {}  # with its first look's time
        self._thread: threading.Thread | None = None
        # Set by expect, forget and close: the poller looks (or deletes) at once.
        self._awaited = threading.Event()

    def post(self, key: str, value: str) -> None:
        with self._lock:
            self._doomed.pop(key, None)
            self._store.set(key, value)

    def forget(self, keys: Sequence[str]) -> None:
        with self._lock:
            if self._closed:
                return
            self._doom(keys)
        self._awaited.set()

    def expect(self, key: str, after_s: float = 0.0) -> Future[str]:
        """The answer under ``key``, looked for from ``after_s`` on (where it may come another
        way first: a reply a member's call returns, ``ClientPlane._round``)."""
        future: Future[str] = Future()
        with self._waiting:
            self._pending[key] = (future, time.monotonic() + after_s)
            if self._thread is None:
                # Inside Store.check most of its life: an exit stops it before finalising,
                # or it would come back from that call into a finalising interpreter
                # (std::terminate: see transport.teardown).
                self._thread = teardown.start("weight-sync-replies", self._poll, self.close)
        self._awaited.set()
        return future

    def fail(self, suffix: str, error: BaseException) -> None:
        """Fail every answer awaited under a key ending in ``suffix`` (one member's) with
        ``error``: the poller drops them as it finds them done."""
        with self._waiting:
            failing = [future for key, (future, _) in self._pending.items() if key.endswith(suffix)]
        for future in failing:
            resolve(future, error=error)
        self._awaited.set()

    def purge(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` now, whether read or not, and not again later: answers of an earlier
        round under the keys of the next, before that round is asked."""
        with self._lock:
            if self._closed:
                return
            for key in keys:
                self._doomed.pop(key, None)
            delete(self._store, keys)

    def abandon(self, why: str) -> None:
        """Give up on every answer still awaited: a push begins only once the last one ended,
        so an answer a member never gave (it died, the push failed elsewhere) is nobody's to
        wait for, and the poller would look for it, forever."""
        with self._waiting:
            self._give_up(why)

    def close(self) -> None:
        """Stop polling and drop the store (the trainer's listening socket goes with it)."""
        with self._lock:
            self._closed, self._store = True, None
        with self._waiting:
            self._give_up("the weight-transfer engine was shut down")
        self._awaited.set()

    def _give_up(self, why: str) -> None:
        for future, _ in self._pending.values():
            resolve(future, error=WeightSyncError(why))
        self._pending.clear()

    def _doom(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` once the poller idles (the store's lock held). Where there is no
        poller, or it never idles (answers that never come, push after push), now: the store
        stays bounded whatever happens."""
        self._doomed.update(dict.fromkeys(keys))
        if self._thread is None or len(self._doomed) > _MOST_DOOMED:
            delete(self._store, list(self._doomed))
            self._doomed.clear()

    def _delete_doomed(self) -> bool:
        """Delete the keys doomed, one a hold of the lock (a post waits for one deletion at
        most), until an answer is awaited. Returns whether it stopped with keys left."""
        while True:
            with self._waiting:
                if self._pending:
                    return True
            with self._lock:
                if self._closed or not self._doomed:
                    return False
                key = next(iter(self._doomed))
                del self._doomed[key]
                self._store.delete_key(key)

    def _look(self, key: str) -> str | None:
        """The answer under ``key`` if it is there (read once: deleted later); None if not, or
        the mailbox is closed."""
        with self._lock:
            if self._closed or not self._store.check([key]):
                return None
            value = self._store.get(key).decode()
            self._doom([key])
            return str(value)

    def _poll(self) -> None:
        """Look for the answers awaited, more slowly the longer none comes; with none awaited,
        delete what is doomed, then sleep until an answer is awaited (``expect``): a round's
        first look comes half a millisecond after it was posted, not after whatever pause the
        last round's looks had reached."""
        backoff = Backoff(*_POLL_S)
        while not self._closed:
            with self._waiting:
                awaited = list(self._pending.items())
            now, soonest = time.monotonic(), float("inf")
            over: list[tuple[str, Future[str]]] = []  # failed with the client call, or given
            arrived: list[tuple[str, Future[str], str]] = []
            for key, (future, due) in awaited:
                if future.done():
                    over.append((key, future))
                elif due > now:
                    soonest = min(soonest, due)
                elif (value := self._look(key)) is not None:
                    arrived.append((key, future, value))
            with self._waiting:
                for key, future in [*over, *((key, future) for key, future, _ in arrived)]:
                    if self._pending.get(key, (None, 0.0))[0] is future:
                        del self._pending[key]
                idle = not self._pending
            for _, future, value in arrived:
                resolve(future, result=value)
            if idle and not self._delete_doomed():
                self._awaited.wait()
                self._awaited.clear()
            if arrived or idle:  # the next answer is likely near: look again soon
                backoff = Backoff(*_POLL_S)
            backoff.sleep(soonest - time.monotonic())


def _returned(answer: Future[str], call: Future[str | None]) -> None:
    """A member's reply where its call returned it (the poller then stops looking for it). A
    call that returned none, or failed, leaves the answer to the store (or to the failure of
    the client call, or to ``ClientPlane.gone``): a member that did not commit answers there
    (``StoreMember.push``), and one that raised may have answered there first (a refusal)."""
    if call.exception() is None and (reply := call.result()) is not None:
        resolve(answer, result=reply)


def _parse(raw: str, kind: type | None) -> Any:
    if len(raw) > MAX_REPLY_CHARS:
        raise WeightSyncError(f"a worker's reply of {len(raw)} bytes exceeds {MAX_REPLY_CHARS}")
    value = WorkerReply.model_validate_json(raw).unwrap()
    return kind.model_validate_json(value) if kind is not None and value is not None else None  # type: ignore[attr-defined]
