"""The ``vllm serve`` pusher's calls that each server answers alone (opening and closing an update
session, resuming) finish on every server before a failure is raised: one server refusing at
once must not leave another's call in flight, to land after the release or the next push that
follows (the race CI drew for SGLang's quiet calls: tests/unit/test_sglang_quiet_calls.py).
Stand-in servers over real HTTP on loopback: the rule is the pusher's, not vLLM's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from weight_sync.adapters.vllm.servers import ServersClient, resume
from weight_sync.errors import ServerError

SLOW_S = 0.5


class StandIn:
    """A server on port 0 that refuses every call at once (HTTP 500), or answers it ``delay_s``
    later; ``answered`` is set once a slow answer has been written."""

    def __init__(self, refuses: bool, delay_s: float = 0.0) -> None:
        self.answered = threading.Event()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if refuses:
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b"refused")
                    return
                time.sleep(delay_s)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")
                stand_in.answered.set()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers() -> Iterator[tuple[StandIn, StandIn]]:
    refusing, slow = StandIn(refuses=True), StandIn(refuses=False, delay_s=SLOW_S)
    try:
        yield refusing, slow
    finally:
        refusing.close()
        slow.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "step",
    [
        lambda client: client.start_weight_update(),
        lambda client: client.finish_weight_update("3"),
        lambda client: client.shutdown_weight_transfer_engine(),
    ],
    ids=["start_weight_update", "finish_weight_update", "shutdown_weight_transfer_engine"],
)
def test_a_session_step_waits_for_every_server_even_after_one_refused(
    servers: tuple[StandIn, StandIn], step: Callable[[ServersClient], None]
) -> None:
    refusing, slow = servers
    client = ServersClient([refusing.url, slow.url], timeout_s=10.0)
    with pytest.raises(ServerError) as raised:
        step(client)
    assert list(raised.value.servers) == [refusing.url]
    assert slow.answered.is_set()  # before the release that follows could reach it


@pytest.mark.timeout(30)
def test_a_quiet_resume_waits_for_every_server_even_after_one_refused(
    servers: tuple[StandIn, StandIn],
) -> None:
    refusing, slow = servers
    resume([refusing.url, slow.url], quiet=True)  # logs the refusal, raises nothing
    assert slow.answered.is_set()  # before the next push's pause could reach it


class Cut(BaseHTTPRequestHandler):
    """Answers each call as its server's ``how`` says: an HTTP error, or no answer at all."""

    how = "refuses"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.how == "refuses":
            self.send_response(500)
            self.end_headers()
        self.close_connection = True  # "hangs up": closed with no answer at all

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("how", "lost"),
    [("refuses", False), ("hangs up", True), ("is gone", True)],
)
def test_an_update_call_tells_of_a_server_that_never_answered(how: str, lost: bool) -> None:
    """``update_weights``' ``lost`` hears of a server whose call ended with no answer -- the
    connection closed, nobody listening: its process gone -- and not of
    one that answered with an HTTP error (alive); either way the call raises ``ServerError``
    naming it."""
    handler = type("Handler", (Cut,), {"how": how})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    if how == "is gone":
        server.shutdown()
        server.server_close()
    told: list[str] = []
    try:
        with pytest.raises(ServerError) as raised:
            ServersClient([url], 5.0).update_weights({}, lambda url, why: told.append(url))
    finally:
        if how != "is gone":
            server.shutdown()
            server.server_close()
    assert list(raised.value.servers) == [url]
    assert told == ([url] if lost else []), raised.value
