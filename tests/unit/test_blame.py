"""The rules of blame (``wire.blame``, pure: no Ray call, no group): who is blamed and who
dropped for a set of workers' outcomes; the senders' verdict on a push from many; what a member
raises for the lanes that did not commit on it; which servers a failed push over HTTP names. A
sender's death is said first, as a server's is."""

import pytest

from weight_sync import (
    SenderFailedError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
    WorkerFailedError,
)
from weight_sync.errors import ServerError
from weight_sync.wire.blame import (
    Outcomes,
    blame,
    blame_servers,
    excuse_followers,
    judge,
    lanes_failed,
)


def outcomes(n: int, **fields) -> Outcomes:
    return Outcomes(results=[None] * n, **fields)


@pytest.mark.parametrize(
    ("fields", "error", "blamed", "unreachable"),
    [
        # a dead worker is blamed and dropped; the others lost the broadcast because of it
        ({"died": {1: "actor died"}, "collateral": [0, 2]}, WorkerFailedError, [1], [1]),
        # a frozen worker: silent while the others answered
        ({"late": [2], "collateral": [0, 1]}, WorkerFailedError, [2], [2]),
        # a worker that raised is blamed but kept: it still answers
        ({"raised": {0: "ValueError: x"}}, WorkerFailedError, [0], []),
        # nobody answered: nobody can be blamed (the trainer or the timeout is suspect)
        ({"late": [0, 1, 2]}, SyncTimeoutError, None, []),
        # everyone lost the collective and nobody is at fault: the group itself failed
        ({"collateral": [0, 1, 2]}, TransportError, None, []),
        # dead and silent at once: both dropped
        ({"died": {0: "actor died"}, "late": [2]}, WorkerFailedError, [0, 2], [0, 2]),
    ],
)
def test_blame_table(
    fields: dict, error: type, blamed: list[int] | None, unreachable: list[int]
) -> None:
    result = outcomes(3, **fields)
    assert not result.ok
    assert result.unreachable == unreachable
    raised = result.error("receive", 5.0, dropped=unreachable)
    assert type(raised) is error
    if blamed is not None:
        assert isinstance(raised, WorkerFailedError)
        assert raised.workers == blamed and raised.dropped == unreachable
        for index in blamed:
            assert f"worker {index}:" in str(raised)


def test_all_answered_is_ok() -> None:
    assert outcomes(2).ok


@pytest.mark.parametrize(
    ("fields", "late", "collateral"),
    [
        # worker 0 relays to 1 and 2; it died joining: its followers, still dialling, are excused
        ({"died": {0: "actor died"}, "late": [1, 2]}, [], [1, 2]),
        # its relay lost the formation to someone else: the same
        ({"collateral": [0], "late": [2]}, [], [0, 2]),
        # its relay joined: a follower still silent is late, and dropped
        ({"late": [2]}, [2], []),
        # worker 3 relays nobody: its lateness is its own
        ({"raised": {0: "TransportError: x"}, "late": [3]}, [3], []),
    ],
)  # fmt: skip
def test_followers_of_a_relay_that_failed_to_join_are_not_blamed_for_it(
    fields: dict, late: list[int], collateral: list[int]
) -> None:
    got = outcomes(4, **fields)
    excuse_followers(got, {1: 0, 2: 0})
    assert (got.late, got.collateral) == (late, collateral)


LANDED = {"nbytes": 3, "buckets": 1, "wire": 3}
GONE = {"error": "its store closed on worker 0", "gone": True}
BROKEN = {"error": "TransportError: x", "broken": True}


@pytest.mark.parametrize(
    ("reports", "failed", "dead", "lead"),
    [
        ({0: LANDED, 1: {"nbytes": 5, "buckets": 2, "wire": 5}}, None, None, None),
        ({0: LANDED, 1: None}, [1], [],
         "trainer rank 1 sent no report in time: died or hung -- check it; no member claims"),
        ({0: {"error": "WorkerFailedError: worker 1"}, 1: {"error": "x"}}, [0, 1], [],
         "trainer ranks [0, 1] did not land their lanes; no member claims the push -- rank 0: "),
        # Over one group a dead sender's rounds fail the other lane too: the dead one is blamed,
        # its death said first.
        ({0: {"error": "TransportError: x"}, 1: GONE}, [1], [],
         ("trainer rank 1 died or left mid-push; no member claims the push (those of [0] failed "
          "with them) -- rank 1: its store closed on worker 0; rank 0: TransportError: x")),
        ({0: {"error": "TransportError: x"}, 1: None, 2: LANDED}, [1], [],
         "trainer rank 1 sent no report in time"),
        ({0: LANDED, 1: GONE, 2: None}, [1, 2], [],
         ("trainer rank 1 died or left mid-push; trainer rank 2 sent no report in time: died or "
          "hung -- check it; no member claims")),
        # Over one group a worker failing lane 1 aborts lane 0 under it: lane 1 names a cause.
        ({0: BROKEN, 1: {"error": "WorkerFailedError: w"}}, [1], [],
         "trainer rank 1 did not land its lane; no member claims"),
        # Every lane broke naming no one: none is more to blame than the others.
        ({0: BROKEN, 1: {"error": "TransportError: y", "broken": True}}, [0, 1], [],
         "trainer ranks [0, 1] did not land their lanes"),
        # A silent sender outranks a lane that named a cause.
        ({0: {"error": "WorkerFailedError: w", "dead": [2]}, 1: None}, [1], [],
         "trainer rank 1 sent no report"),
        # A worker died: lane 0 found it dead, lane 1 broke before it saw the death; the verdict
        # names the dead worker for the broken lane to raise (the lanes that found it agree).
        ({0: {"error": "WorkerFailedError: worker 1", "dead": [1]},
          1: {"error": "TransportError: x", "broken": True, "dead": []},
          2: {"error": "WorkerFailedError: worker 1, 2", "dead": [2, 1]}}, [0, 2], [1, 2],
         "trainer ranks [0, 2] did not land their lanes"),
    ],
)  # fmt: skip
def test_judge_table(
    reports: dict, failed: list[int] | None, dead: list[int] | None, lead: str | None
) -> None:
    verdict = judge(reports)
    if failed is None:
        assert verdict == {"nbytes": 8, "buckets": 3, "wire": 8}
    else:
        assert verdict["senders"] == failed and verdict["dead"] == dead
        assert verdict["failed"].startswith(lead), verdict["failed"]


NO_BLOCKS = {"nbytes": 0, "buckets": 0, "wire": 0, "lane": False}


@pytest.mark.parametrize(
    ("reports", "refused"),
    [
        # Every lane refused (each member refuses every lane alike): the members' problems.
        ({0: {"error": "PlanMismatchError: x", "refused": {"0": ["a"]}},
          1: {"error": "PlanMismatchError: x", "refused": {"0": ["a"], "1": ["b"]}}},
         {"0": ["a"], "1": ["b"]}),
        # A sender with no block refuses nothing and lands nothing: still the refusal.
        ({0: {"error": "PlanMismatchError: x", "refused": {"1": ["b"]}}, 1: NO_BLOCKS},
         {"1": ["b"]}),
        # A lane landed beside a refused one: bytes moved -- a failed lane, not a refusal.
        ({0: {"error": "PlanMismatchError: x", "refused": {"1": ["b"]}}, 1: {**LANDED, "lane": True}},
         None),
        # A lane refused beside one that failed otherwise: the failure.
        ({0: {"error": "PlanMismatchError: x", "refused": {"1": ["b"]}}, 1: {"error": "y"}}, None),
        ({0: {"error": "PlanMismatchError: x", "refused": {"1": ["b"]}}, 1: None}, None),
    ],
)  # fmt: skip
def test_judge_refusals(reports: dict, refused: dict | None) -> None:
    verdict = judge(reports)
    if refused is None:
        assert "failed" in verdict and "refused" not in verdict, verdict
    else:
        assert verdict == {"refused": refused}


@pytest.mark.parametrize(
    ("failed", "culprits", "blamed", "tail"),
    [
        ({0: "a", 1: "b"}, [], [0, 1], " -- rank 0: a; rank 1: b"),
        # The gone lead, even past a long reason of a lane that failed with them.
        ({0: "x" * 600, 1: "gone"}, [1], [1], f" (those of [0] failed with them) -- rank 1: gone; rank 0: {'x' * 600}"),
        ({2: "gone", 0: "b"}, [2], [2], " (those of [0] failed with them) -- rank 2: gone; rank 0: b"),
    ],
)  # fmt: skip
def test_senders_blame_table(
    failed: dict, culprits: list[int], blamed: list[int], tail: str
) -> None:
    assert blame(failed, culprits) == (blamed, tail)


REFUSED = WeightSyncError("refused: unknown tensor")


@pytest.mark.parametrize(
    ("failed", "lanes", "gone", "raised", "senders", "lead"),
    [
        # Every lane failed alike, no sender gone (a refusal, a push called off): that error.
        ({0: REFUSED, 1: REFUSED}, 2, [], WeightSyncError, None, "refused: unknown tensor"),
        # Rank 1's store closed: its death first, whatever rank 0's lane saw with it.
        ({0: TransportError("a collective failed"), 1: TransportError("store closed")}, 2, [1],
         SenderFailedError, [1],
         ("trainer rank 1 died or left mid-push: worker 0 holds no version (those of [0] failed "
          "with them) -- rank 1: TransportError: store closed")),
        # A lone sender's death (K = 1): said first, the symptom its lane saw after it.
        ({0: TransportError("a collective failed")}, 1, [0], SenderFailedError, [0],
         "trainer rank 0 died or left mid-push: worker 0 holds no version -- rank 0: "
         "TransportError: a collective failed"),
        # Every sender alive, every lane's collective failed: a receiving rank, not a sender.
        ({0: TransportError("a"), 1: TransportError("b")}, 2, [], TransportError, None,
         "worker 0 holds no version: trainer ranks [0, 1] did not commit their lanes here"),
        ({1: WeightSyncError("checksum")}, 2, [], SenderFailedError, [1],
         "worker 0 holds no version: trainer rank 1 did not commit its lane here -- rank 1: "),
        ({0: WeightSyncError("a"), 1: TransportError("b")}, 2, [], SenderFailedError, [0, 1],
         "worker 0 holds no version: trainer ranks [0, 1] did not commit their lanes here"),
    ],
)  # fmt: skip
def test_lanes_failed_table(
    failed: dict,
    lanes: int,
    gone: list[int],
    raised: type,
    senders: list[int] | None,
    lead: str,
) -> None:
    error = lanes_failed("worker 0", failed, lanes, gone)
    assert type(error) is raised and str(error).startswith(lead), error
    if senders is not None:
        assert isinstance(error, SenderFailedError) and error.senders == senders


@pytest.mark.parametrize(
    ("words", "blamed", "said"),
    [
        ([{"version": 4}, {"version": 4}], [], []),
        # a worker whose engine did not load the lanes: blamed with its reason, kept
        ([{"version": 4}, {"error": "out of memory"}], [1], ["worker 1: out of memory"]),
        # a worker that wrote no word (its update call returned without one)
        ([{}, {"version": 4}], [0], ["worker 0: gave no word on the push"]),
        ([{"error": "a"}, {"error": "b"}], [0, 1], ["worker 0: a", "worker 1: b"]),
    ],
)
def test_vllm_workers_words_on_a_push_from_many_senders_are_blamed_by_the_same_rules(
    words: list[dict], blamed: list[int], said: list[str]
) -> None:
    """``vllm serve``'s workers answer a push from many senders in rank 0's store, not as
    calls; their words become ``Outcomes`` and its ``error``, as one sender's members' do."""
    from weight_sync.adapters.vllm.lanes import load_outcomes

    result = load_outcomes(words)
    assert result.ok == (not blamed)
    if blamed:
        error = result.error("loading the push", 5.0)
        assert type(error) is WorkerFailedError and error.workers == blamed
        assert error.dropped == [] and all(part in str(error) for part in said)


DEAD = {"http://a": "URLError: refused"}
FAILED = {"http://b": "HTTPError: 500"}


@pytest.mark.parametrize(
    ("error", "failed", "unreachable", "named", "says"),
    [
        # a server dead after the push is named first; one that failed beside it is collateral
        (WorkerFailedError("lost", [1], [1]), FAILED, DEAD, DEAD, "[unreachable server(s): "),
        # none dead: the servers whose calls failed
        (WeightSyncError("push failed"), FAILED, {}, FAILED, "[failed server(s): "),
        # an error naming every server to blame already stands as it is
        (ServerError("b failed", FAILED), FAILED, {}, None, None),
        # ... one naming some: the rest are named with it
        (ServerError("b failed", FAILED), FAILED, DEAD, DEAD, "[unreachable server(s): "),
        # nothing to name: the error as it came
        (WeightSyncError("push failed"), {}, {}, None, None),
        # a caller's mistake is not a server's failure
        (ValueError("bad state dict"), FAILED, DEAD, None, None),
    ],
)
def test_blame_servers_table(
    error: BaseException,
    failed: dict[str, str],
    unreachable: dict[str, str],
    named: dict[str, str] | None,
    says: str | None,
) -> None:
    blamed = blame_servers(error, failed, unreachable, "server(s)")
    if named is None:
        assert blamed is error
        return
    assert isinstance(blamed, ServerError)
    assert blamed.servers == named
    assert str(blamed).startswith(f"{error} {says}")
    assert (blamed.workers, blamed.dropped) == (
        getattr(error, "workers", []),
        getattr(error, "dropped", []),
    )
