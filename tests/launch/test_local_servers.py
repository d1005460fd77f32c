"""Local servers (``weight_sync.adapters.local_servers``) started and stopped together: real processes,
each a stand-in that drains for a while on SIGTERM, as an SGLang server does (it looks for the
signal every 5 s)."""

from __future__ import annotations

import sys
import time

import pytest

from weight_sync.adapters.local_servers import LocalServer, start_together, stop_together

pytestmark = pytest.mark.timeout(120)
DRAIN_S = 2.0
SERVER = f"""
import http.server, signal, sys, time

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

def drain(*_):
    time.sleep({DRAIN_S})
    sys.exit(0)

signal.signal(signal.SIGTERM, drain)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class Draining(LocalServer):
    binds_port_zero = False  # handed a held port, as SGLang's servers are

    def __init__(self) -> None:
        super().__init__(lambda port: [sys.executable, "-c", SERVER, str(port)], name="draining",
                         ready_timeout_s=60)  # fmt: skip


def test_servers_started_together_are_stopped_together() -> None:
    """Three servers draining 2 s each stop in about 2 s, not 6, on the way out of
    ``start_together`` (its ``stop_together``); each exits by its own SIGTERM handler."""
    with start_together(3, lambda _: Draining()) as servers:
        assert len({server.port for server in servers}) == 3
        assert all(server.alive() for server in servers)
        leaving = time.monotonic()
    took = time.monotonic() - leaving
    assert not any(server.alive() for server in servers)
    assert DRAIN_S <= took < 2 * DRAIN_S, f"stopping took {took:.1f}s"
    assert [server.stop() for server in servers] == [0, 0, 0]  # idempotent: the exit codes


def test_stop_together_of_none_is_a_no_op() -> None:
    stop_together([])
