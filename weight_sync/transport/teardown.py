"""Background teardowns that an exiting process waits for, within a stated bound.

Some steps of leaving a group block in C++ with the GIL released: ``ProcessGroupNCCL::abort``
runs ``abortComms`` under ``std::async`` and that future's destructor waits for
``ncclCommAbort`` (behind kernels still queued), and an abandoned ``ncclCommInitRank`` returns
when it returns. They run on background threads so that a leaving member never sits through
them. But such a thread must not come back from its call while the interpreter finalises:
CPython before 3.14 ends a thread that takes the GIL back then with ``pthread_exit``, and that
forced unwind through pybind11's ``gil_scoped_release`` destructor (``noexcept``) is
``std::terminate`` -- the process dies printing "terminate called without an active exception"
with status 134 (pytorch#38228, pybind11#2215). On an H100 that was a process exiting right
after a timed-out NCCL push; on a CPU, any ``TCPStore.wait`` that returns during finalisation
does the same (tests/distributed/test_exit.py shows both).

So such threads are started here (``start``), and an exit handler joins them for at most
``EXIT_WAIT_S`` in all before the interpreter finalises:

* every one done in time: the exit goes on as it would have, with its own status;
* one still inside its call: its name is logged (WARNING), logging's handlers and stdio are
  flushed, and the process ends at once through ``os._exit``, skipping the finalisation that
  would kill it mid-call. The status is then 1 if the process was ending on an uncaught
  exception, else 0: an exit handler cannot see the status a ``SystemExit`` carried.

The handler is registered when this module is first imported (with the transports), so that it
runs after every exit handler registered later -- Ray's shutdown, the user's own -- which gives
the teardowns their time too. The registry is process state, like the environment lock in
``nccl``: an exit is process-wide.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

EXIT_WAIT_S = 10.0  # the longest an exit waits for the teardowns still running, all together

_LOCK = threading.Lock()
_RUNNING: set[threading.Thread] = set()


def start(name: str, target: Callable[[], None]) -> threading.Thread:
    """Run ``target`` on a daemon thread that an exit waits for (see the module docstring).
    ``target`` should not raise: what it raises is logged and dropped."""

    def run() -> None:
        try:
            target()
        except Exception:
            logger.exception("background teardown %s failed", name)
        finally:
            with _LOCK:
                _RUNNING.discard(threading.current_thread())

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _LOCK:
        _RUNNING.add(thread)
    thread.start()
    return thread


def running() -> list[str]:
    """The names of the teardowns still running."""
    with _LOCK:
        return sorted(thread.name for thread in _RUNNING)


def join(timeout_s: float) -> list[str]:
    """Wait up to ``timeout_s`` in all for the running teardowns; the names of those still
    running then."""
    end = time.monotonic() + timeout_s
    with _LOCK:
        threads = list(_RUNNING)
    for thread in threads:
        thread.join(max(end - time.monotonic(), 0.0))
    return running()


def _at_exit() -> None:
    if not running():
        return
    started = time.monotonic()
    left = join(EXIT_WAIT_S)
    if not left:
        logger.debug("teardowns done %.2fs into the exit", time.monotonic() - started)
        return
    status = 1 if _ending_on_an_exception() else 0
    logger.warning(
        "exiting with teardowns still running after %.1fs: %s; ending the process now "
        "(status %d) rather than let the interpreter kill them inside a C++ call",
        EXIT_WAIT_S,
        ", ".join(left),
        status,
    )
    _flush()
    os._exit(status)


def _ending_on_an_exception() -> bool:
    """Whether the main thread is exiting on an uncaught exception: ``PyErr_Print`` records it
    in ``sys.last_exc`` (3.12+) / ``sys.last_value`` before the interpreter finalises."""
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return last is not None and not isinstance(last, SystemExit)


def _flush() -> None:
    """What a normal exit would have flushed: logging's handlers, then stdout and stderr."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a stream already closed: nothing more to write
            if stream is not None:
                stream.flush()


atexit.register(_at_exit)
