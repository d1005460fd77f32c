"""The SGLang pusher's calls to every engine (pausing, opening and closing the update session,
labelling, resuming -- each a step an engine takes alone) finish on every engine before a
failure is raised or the push goes on: one engine refusing at once must not leave another's
call in flight, to land after the next step (CI saw an ``end_weight_update`` land after the
push's ``begin_weight_update`` and end its session). Stand-in engines: the rule is the
pusher's, not SGLang's."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from weight_sync.adapters.sglang.pusher import SGLangPusher
from weight_sync.control.deadline import Deadline
from weight_sync.errors import ServerError


class StandIn:
    """An engine whose calls to ``route`` either fail at once or succeed ``delay_s`` later."""

    def __init__(self, name: str, route: str, refuses: bool, delay_s: float = 0.0) -> None:
        self.name, self._route, self._refuses, self._delay_s = name, route, refuses, delay_s
        self.answered = threading.Event()

    def call(self, route: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        assert route == self._route, route
        if self._refuses:
            raise ServerError(f"{self.name}: refused", {self.name: "refused"})
        time.sleep(self._delay_s)
        self.answered.set()
        return {"success": True}

    def checkpoint(self, timeout_s: float) -> Any:
        raise AssertionError("not asked here")


def engines(route: str) -> tuple[StandIn, StandIn]:
    return StandIn("a", route, refuses=True), StandIn("b", route, refuses=False, delay_s=0.5)


@pytest.mark.parametrize(
    "route",
    ["pause_generation", "begin_weight_update", "update_weight_version", "end_weight_update",
     "flush_cache", "continue_generation"],
)  # fmt: skip
def test_a_call_waits_for_every_engine_even_after_one_refused(route: str) -> None:
    refusing, slow = engines(route)
    with pytest.raises(ServerError) as raised:
        SGLangPusher([refusing, slow])._fan(route, {}, Deadline(10.0, route))
    assert list(raised.value.servers) == ["a"]
    assert slow.answered.is_set()  # before the push's next step could reach it


def test_a_quiet_call_waits_for_every_engine_and_raises_nothing() -> None:
    refusing, slow = engines("end_weight_update")
    SGLangPusher([refusing, slow])._quietly("end_weight_update", {}, 10.0)
    assert slow.answered.is_set()
