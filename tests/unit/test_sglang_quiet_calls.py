"""The SGLang pusher's quiet calls (ending a session no one may hold, leaving a group no one may
be in) finish on every engine before the push goes on: one engine refusing at once must not
leave another's call in flight, to land after the next step (CI saw an ``end_weight_update``
land after the push's ``begin_weight_update`` and end its session). Stand-in engines: the rule
is the pusher's, not SGLang's."""

from __future__ import annotations

import threading
import time
from typing import Any

from weight_sync.adapters.sglang.pusher import SGLangPusher
from weight_sync.control.http import ServerError


class StandIn:
    """An engine whose ``end_weight_update`` either fails at once or succeeds ``delay_s`` later."""

    def __init__(self, name: str, refuses: bool, delay_s: float = 0.0) -> None:
        self.name, self._refuses, self._delay_s = name, refuses, delay_s
        self.ended = threading.Event()

    def call(self, route: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        assert route == "end_weight_update", route
        if self._refuses:
            raise ServerError(f"{self.name}: no session to end", {self.name: "no session"})
        time.sleep(self._delay_s)
        self.ended.set()
        return {"success": True}

    def checkpoint(self, timeout_s: float) -> Any:
        raise AssertionError("not asked here")


def test_a_quiet_call_waits_for_every_engine_even_after_one_refused() -> None:
    refusing, slow = StandIn("a", refuses=True), StandIn("b", refuses=False, delay_s=0.5)
    pusher = SGLangPusher([refusing, slow])
    pusher._quietly("end_weight_update", {}, 10.0)
    assert slow.ended.is_set()  # before the push's next call could reach it
