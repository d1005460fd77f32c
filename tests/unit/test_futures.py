"""The futures every control plane shares (``weight_sync.control.futures``), and the store plane's
commit, which is over only when the client's own call is (vLLM labels its outputs there)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from weight_sync import SyncConfig
from weight_sync.control.futures import joined, resolve
from weight_sync.control.http import collect_answers
from weight_sync.control.store import ClientPlane
from weight_sync.errors import ServerError, WeightSyncError
from weight_sync.wire.blame import MemberGone
from weight_sync.wire.metadata import (
    GroupSpec,
    PrepareReply,
    PrepareRequest,
    PushReply,
    ReceiveReport,
    SyncStatus,
    TensorMeta,
    WorkerReply,
)
from weight_sync.wire.planner import make_plan


class Boom(Exception):
    pass


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        ("value", "other", "value"),  # the first's result; the second's is dropped
        ("value", Boom("second"), "second"),  # the second failed: its error
        (Boom("first"), "other", "first"),
        (Boom("first"), Boom("second"), "first"),  # the first's error wins
    ],
)  # fmt: skip
@pytest.mark.parametrize("order", ["first done first", "second done first"])
def test_a_joined_future_waits_for_both_and_keeps_the_first_outcome(
    first: object, second: object, expected: str, order: str
) -> None:
    a: Future[Any] = Future()
    b: Future[Any] = Future()
    both = joined(a, b)
    done = [(a, first), (b, second)]
    if order == "second done first":
        done.reverse()
    for future, outcome in done[:1]:
        _settle(future, outcome)
    assert not both.done()  # one of the two is not done yet
    for future, outcome in done[1:]:
        _settle(future, outcome)
    assert both.done()
    if isinstance(first, Exception) or isinstance(second, Exception):
        with pytest.raises(Boom, match=expected):
            both.result()
    else:
        assert both.result() == expected


def _settle(future: Future[Any], outcome: object) -> None:
    if isinstance(outcome, BaseException):
        resolve(future, error=outcome)
    else:
        resolve(future, result=outcome)


class _LabellingClient:
    """vLLM's client as the trainer sees it: ``finish_weight_update`` returns only once the
    engines' outputs carry the version (its ``update_weight_version`` call), held back here."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.labelled: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        pass

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        pass

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.release.wait(10)
        self.labelled = weight_version


@pytest.mark.timeout(60)
def test_a_commit_is_over_only_once_the_client_has_labelled_the_version() -> None:
    """The member's answer comes first (it commits inside vLLM's finish_weight_update); the
    push must not return before the client's call has set the label, or a caller generating
    at once reads the old one (seen in CI: 'default' where '1' was due)."""
    client = _LabellingClient()
    plane = ClientPlane(client, 1, SyncConfig())
    try:
        (committed,) = plane.commit(1, timeout_s=10)
        reply = WorkerReply(status=SyncStatus(version=1, dirty=False, phase="idle"))
        plane.post("committed/1/1", reply.model_dump_json())  # as StoreMember answers
        time.sleep(0.3)  # the store plane looks every 0.5-4 ms: the answer has been read
        assert not committed.done()
        client.release.set()
        assert committed.result(timeout=10) is None
        assert client.labelled == "1"
    finally:
        client.release.set()
        plane.close()


@pytest.mark.timeout(60)
def test_answers_a_member_never_gave_are_given_up_when_the_members_are_asked_again() -> None:
    """A push whose second member never answered (it died): once the trainer asks anew, that
    answer is nobody's to wait for, and the plane stops looking for it -- else each failed push
    would leave keys the plane polls for, under the lock every message takes, for good."""
    client = _LabellingClient()
    plane = ClientPlane(client, 2, SyncConfig())
    try:
        first, second = plane.receive(1, atomic=True, timeout_s=10)
        report = ReceiveReport(version=1, nbytes=0, buckets=0, seconds=0.0)
        status = SyncStatus(version=1, dirty=False, phase="idle")
        reply = WorkerReply(value=report.model_dump_json(), status=status)
        plane.post("received/1/1", reply.model_dump_json())  # member 1 answers; member 2 never
        assert first.result(timeout=10) == report
        plane.probe(timeout_s=10)
        with pytest.raises(WeightSyncError, match="asked to join afresh"):
            second.result(timeout=10)
        assert sorted(plane._mailbox._pending) == ["info/1/1", "info/1/2"]  # the new asks only
    finally:
        plane.close()


@pytest.mark.timeout(60)
def test_the_specs_of_a_formation_go_two_formations_later() -> None:
    """Each formation (an epoch: the first push, each after a failure) posts every member's
    spec and the counter the members take slots from; those of the last two stay (a member
    still joining one finds its spec), older ones go -- a loop that forms its group again
    after each of many failures leaves no key behind."""
    client = _LabellingClient()
    plane = ClientPlane(client, 2, SyncConfig())
    store = plane._mailbox._store
    spec = GroupSpec(group_id="0" * 16, address="127.0.0.1", port=1, world_size=3, rank=1,
                     backend="gloo", mode="standalone", rendezvous_timeout_s=1,
                     collective_timeout_s=1)  # fmt: skip
    try:
        for epoch in range(1, 5):
            plane.probe(timeout_s=10)
            store.add(f"{epoch}/slots", 2)  # as two members take their slots
            plane.join([spec, spec.model_copy(update={"rank": 2})], 4096, timeout_s=10)
        # No member answers here: the answers awaited are given up (as the next round does),
        # and the poller, with none awaited, deletes what was forgotten.
        plane._mailbox.abandon("no member answers in this test")
        deadline = time.monotonic() + 10
        while True:
            held = [
                store.check([f"spec/{epoch}/1", f"spec/{epoch}/2", f"{epoch}/slots"])
                for epoch in range(1, 5)
            ]
            if held[:2] == [False, False] or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert held == [False, False, True, True]
        assert not any(store.check([f"spec/{epoch}/{s}"]) for epoch in (1, 2) for s in (1, 2))
    finally:
        plane.close()


@pytest.mark.parametrize("settle", [False, True])
def test_a_failed_server_call_ends_the_wait_unless_the_calls_must_settle(settle: bool) -> None:
    """One server refused at once, the other's call is still running: the caller hears the
    failure at once -- or, with ``settle`` (a pause it will undo), once the other call is done,
    so that nothing the call does lands after the undo."""
    refused: Future[Any] = Future()
    running: Future[Any] = Future()
    resolve(refused, error=ConnectionRefusedError("refused"))
    if settle:  # done a while later; without settle it is done only after the caller heard
        threading.Timer(0.3, resolve, args=(running,), kwargs={"result": {"ok": True}}).start()
    with pytest.raises(ServerError) as caught:
        collect_answers({"dead": refused, "live": running}, 30.0, "pause", settle=settle)
    assert list(caught.value.servers) == ["dead"]
    assert running.done() is settle
    resolve(running, result={"ok": True})


class _OneCallClient(_LabellingClient):
    """A sender's lane as its plane sees it: the members also take a push in one step."""

    def __init__(self) -> None:
        super().__init__()
        self.pushed = threading.Event()
        self.request: str | None = None
        self.calls: dict[int, Future[str | None]] = {}  # the step carried in calls on these

    def push_weight_update(self, request_json: str) -> dict[int, Future[str | None]]:
        self.request = request_json
        self.pushed.set()
        return self.calls


def _pushed(version: int) -> tuple[PushReply, str]:
    """A member's reply to a one-step push that committed it, and that reply as it travels."""
    report = ReceiveReport(version=version, nbytes=8, buckets=1, seconds=0.0)
    reply = PushReply(prepared=PrepareReply(accepted=True), received=report)
    status = SyncStatus(version=version, dirty=False, phase="idle")
    return reply, WorkerReply(value=reply.model_dump_json(), status=status).model_dump_json()


@pytest.mark.timeout(60)
def test_a_push_in_one_step_is_announced_and_answered_through_the_store() -> None:
    """``ClientPlane.push`` (members that offered one-call pushes: a lane's): the client told,
    the request in what it tells the members, each member's answer read as a ``PushReply`` --
    also an answer given after the plane sat idle, its poller asleep with nothing awaited."""
    client = _OneCallClient()
    plane = ClientPlane(client, 1, SyncConfig())
    try:
        time.sleep(0.2)  # nothing awaited: the poller sleeps until a round is posted
        request = PrepareRequest(version=1, plan_digest="a" * 64, commit_on_receipt=True)
        (answer,) = plane.push(request, timeout_s=10)
        assert client.pushed.wait(10)
        assert client.request is not None  # what the command carries to the members
        assert PrepareRequest.model_validate_json(client.request) == request
        time.sleep(0.2)  # the poller looks, and looks again, for an answer not yet given
        reply, raw = _pushed(1)
        plane.post("pushed/1/1", raw)
        assert answer.result(timeout=10) == reply
        assert not plane._mailbox._pending  # read once (deleted once the poller idles)
    finally:
        plane.close()
    poller = plane._mailbox._thread
    assert poller is not None
    poller.join(timeout=5)
    assert not poller.is_alive()  # close wakes a poller asleep with nothing awaited


@pytest.mark.timeout(60)
def test_a_member_that_returns_its_reply_in_its_call_is_not_read_from_the_store() -> None:
    """Where the step went to members in calls of their own (rank 0's lane on Ray workers:
    ``Opening``), a member whose call returns its reply is answered by it, nothing of it in the
    store; a member whose call returns none (it did not commit, and answered in the store)
    is read from the store, as any other."""
    client = _OneCallClient()
    client.calls = {1: Future(), 2: Future()}
    plane = ClientPlane(client, 3, SyncConfig())
    try:
        request = PrepareRequest(version=1, plan_digest="a" * 64, commit_on_receipt=True)
        answers = plane.push(request, timeout_s=10)
        reply, raw = _pushed(1)
        resolve(client.calls[1], result=raw)
        assert answers[0].result(timeout=10) == reply
        resolve(client.calls[2], result=None)
        time.sleep(0.2)  # no reply in the call: this member's is looked for in the store
        assert not answers[1].done() and not answers[2].done()
        for slot in (2, 3):
            plane.post(f"pushed/1/{slot}", raw)
        assert [a.result(timeout=10) for a in answers[1:]] == [reply, reply]
        assert not plane._mailbox._store.check(["pushed/1/1"])  # never posted, never read
    finally:
        plane.close()


@pytest.mark.timeout(60)
def test_a_member_found_gone_fails_what_it_owes_the_push_now_and_in_its_later_rounds() -> None:
    """A member whose caller found it dead mid-push (``ClientPlane.gone``: rank 0's Ray call,
    or rank 0's word on another sender's lane): its answer awaited fails at once with
    ``MemberGone`` (judged dead, not silent at the bound), and so does its answer to a later
    round of the same push; the others' are read as ever; the next push asks it afresh."""
    plane = ClientPlane(_OneCallClient(), 2, SyncConfig())
    try:
        request = PrepareRequest(version=1, plan_digest="a" * 64, commit_on_receipt=True)
        answers = plane.push(request, timeout_s=10)
        time.sleep(0.1)  # awaited, looked for
        plane.gone(2, MemberGone("actor died (fault injection)"))
        with pytest.raises(MemberGone, match="fault injection"):
            answers[1].result(timeout=5)
        assert not answers[0].done()
        reply, raw = _pushed(1)
        plane.post("pushed/1/1", raw)
        assert answers[0].result(timeout=10) == reply
        later = plane.receive(1, atomic=False, timeout_s=10)  # a later round of the push
        with pytest.raises(MemberGone):
            later[1].result(timeout=5)
        again = plane.push(request.model_copy(update={"version": 2}), timeout_s=10)
        time.sleep(0.1)
        assert not any(answer.done() for answer in again)  # a new push: nobody known gone
        assert plane.fate(MemberGone("actor died"))[0] == "died"
    finally:
        plane.close()


@pytest.mark.timeout(60)
def test_keys_forgotten_go_between_rounds_and_a_key_posted_again_stays() -> None:
    """An old push's keys (``Retention``) are deleted by the poller while no answer is awaited
    -- not on the round trip of the post that made them old -- and a key posted again before
    its deletion keeps its new value."""
    plane = ClientPlane(_OneCallClient(), 1, SyncConfig())
    store = plane._mailbox._store
    try:
        for key in ("old/1", "old/2", "again"):
            plane.post(key, "x")
        request = PrepareRequest(version=1, plan_digest="a" * 64, commit_on_receipt=True)
        (answer,) = plane.push(request, timeout_s=10)  # an answer awaited from now
        plane.forget(["old/1", "old/2", "again"])
        plane.post("again", "y")
        time.sleep(0.2)
        assert store.check(["old/1", "old/2"])  # not while a round waits for its answers
        plane.post("pushed/1/1", _pushed(1)[1])
        answer.result(timeout=10)
        deadline = time.monotonic() + 10
        while store.check(["old/1"]) or store.check(["old/2"]):
            assert time.monotonic() < deadline, "the keys forgotten were never deleted"
            time.sleep(0.01)
        assert store.get("again") == b"y"
    finally:
        plane.close()


class _StartClient(_OneCallClient):
    """Sees, as each prepare is asked of the members, whether an answer to it is there already."""

    def __init__(self) -> None:
        super().__init__()
        self.store: Any = None
        self.there: list[bool] = []

    def start_weight_update(self) -> None:
        self.there.append(bool(self.store.check(["prepared/1/1"])))


@pytest.mark.timeout(60)
def test_a_prepare_asked_again_reads_only_its_own_answers() -> None:
    """A delta some member cannot take is asked again, dense, under the same version: the
    first ask's answers are gone before the second is asked -- read as the second's, they said
    "need dense" again (the push refused, naming no problem); deleted once read, they could
    take the second's with them (a wait to the push's bound)."""
    client = _StartClient()
    plane = ClientPlane(client, 1, SyncConfig())
    store = client.store = plane._mailbox._store
    plan = make_plan([TensorMeta.of("w", torch.zeros(2))], 1024, 64)
    status = SyncStatus(version=None, dirty=False, phase="idle")

    def answer(reply: PrepareReply) -> None:
        store.set(
            "prepared/1/1",
            WorkerReply(value=reply.model_dump_json(), status=status).model_dump_json(),
        )

    try:
        request = PrepareRequest(version=1, plan_digest=plan.digest)  # as the dense ask is
        (first,) = plane.prepare(request, plan, [0], [False], timeout_s=10)
        # The poller, which hands the answer on, is slow to come back (a busy host): the
        # second ask is made before it deletes what it read.
        first.add_done_callback(lambda _: time.sleep(0.5))
        answer(PrepareReply(accepted=False, need_dense=True))
        assert first.result(timeout=10).need_dense
        (second,) = plane.prepare(request, plan, [0], [False], timeout_s=10)
        time.sleep(0.2)
        assert not second.done(), second.result()  # the first ask's answer is not this one's
        assert client.there == [False, False]  # gone before the second ask
        answer(PrepareReply(accepted=True))
        assert second.result(timeout=10).accepted
    finally:
        plane.close()


class _SessionClient(_OneCallClient):
    """Counts the sessions the plane ends (``finish_weight_update`` without a version)."""

    def __init__(self) -> None:
        super().__init__()
        self.release.set()
        self.finished = 0

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.finished += 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_receipt", [False, True], ids=["vllm_session", "committed_on_receipt"])
def test_a_push_committed_on_receipt_opens_no_session_to_end(on_receipt: bool) -> None:
    """A prepared push that failed is ended as the members leave: with vLLM's workers, its
    session (a ``finish`` after a cancel verdict, or vLLM refuses to release an engine). A push
    its members commit on receipt (a lane's) opens none: a ``finish`` would have each member
    wait on a verdict never posted -- for its store's timeout (a review found it)."""
    client = _SessionClient()
    plane = ClientPlane(client, 1, SyncConfig())
    try:
        plan = make_plan([TensorMeta.of("w", torch.zeros(4))], 1024, 64)
        request = PrepareRequest(
            version=1, plan_digest=plan.digest, plan=plan, commit_on_receipt=on_receipt
        )
        plane.prepare(request, plan, [0], [True], timeout_s=10)
        for left in plane.leave(timeout_s=10):  # the push failed: the members leave
            left.result(timeout=10)
        assert client.finished == (0 if on_receipt else 1)
        verdict = plane._mailbox._store.check(["verdict/1"])
        assert verdict == (not on_receipt)  # the cancel verdict a session's finish reads
    finally:
        plane.close()


class _SlowEndClient(_SessionClient):
    """A client whose session ends slowly, and which refuses to open one while another is open
    (vLLM's "a weight update is already active")."""

    def __init__(self) -> None:
        super().__init__()
        self.open = False
        self.refused = 0

    def start_weight_update(self) -> None:
        if self.open:
            self.refused += 1
        self.open = True

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        time.sleep(0.5)
        super().finish_weight_update(weight_version)
        self.open = False


@pytest.mark.timeout(60)
def test_a_refused_push_s_session_ends_before_the_next_one_opens() -> None:
    """Every member refused a push: nobody waits for its session to end (the cancel asks no
    member), so the next push's session must wait for it, or vLLM refuses to open it."""
    client = _SlowEndClient()
    plane = ClientPlane(client, 1, SyncConfig())
    try:
        plan = make_plan([TensorMeta.of("w", torch.zeros(4))], 1024, 64)
        for version in (1, 2):
            request = PrepareRequest(version=version, plan_digest=plan.digest, plan=plan)
            plane.prepare(request, plan, [0], [True], timeout_s=10)
            time.sleep(0.1)  # the client's call opened the session
            assert plane.cancel(version, [], timeout_s=10) == []  # refused by every member
        assert (client.finished, client.refused) == (1, 0)
    finally:
        plane.close()


class _AskedAgainReceiver:
    """A member's receiver whose every answer to a push is ``reply`` (a pure unit test's fake:
    ``StoreMember`` only relays what it says)."""

    version = None
    max_metadata_bytes = 1 << 20

    def __init__(self, reply: PrepareReply) -> None:
        self.reply = reply

    def prepare(self, request_json: str, check: Any, destinations: Any) -> PrepareReply:
        return self.reply

    def push(self, request_json: str, check: Any, loader: Any, destinations: Any) -> PushReply:
        return PushReply(prepared=self.reply)

    def or_leave(self, hook: Any) -> Any:
        return hook()

    def status(self) -> SyncStatus:
        return SyncStatus(version=None, dirty=False, phase="idle")


@pytest.mark.parametrize("step", ["start", "push"])
@pytest.mark.parametrize(
    ("reply", "kept"),
    [
        (PrepareReply(accepted=True), True),
        (PrepareReply(accepted=False, problems=["'w': sent float64[4], model has float32[4]"]),
         True),
        (PrepareReply(accepted=False, need_dense=True), False),  # sent again dense
        (PrepareReply(accepted=False, need_plan=True), False),  # sent again with its plan
    ],
    ids=["accepted", "refused", "needs-dense", "needs-plan"],
)  # fmt: skip
def test_a_member_keeps_as_its_verdict_only_a_reply_that_is_one(
    step: str, reply: PrepareReply, kept: bool
) -> None:
    """What a store-plane member answered of a push is kept as its verdict (a refusal is raised
    as ``PlanMismatchError`` if the push then ends here uncommitted) -- unless the member is to be
    asked again within the push: then a sender that fails meanwhile is reported as the failure,
    not as a refusal naming no problem. Both ways a push reaches a member, in steps or in one."""
    from torch.distributed import HashStore, PrefixStore

    from weight_sync.control.store import PREFIX, StoreMember

    member = StoreMember(_AskedAgainReceiver(reply), check=lambda plan: [], loader=lambda: None)  # type: ignore[arg-type]
    member._store = PrefixStore(PREFIX, HashStore())
    plan = make_plan([TensorMeta.of("w", torch.zeros(4))], 1024, 64)
    request = PrepareRequest(version=1, plan_digest=plan.digest).model_dump_json()
    member._store.set("prepare/0", request)  # announced in the store for steps; in the command
    member._store.set(f"plan/{plan.digest}", plan.model_dump_json())  # itself for one
    if step == "start":
        member.start()
    else:
        member.push(request)
    assert member.pushing == 1
    assert member.prepared == (reply if kept else None)
