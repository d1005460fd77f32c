"""Background teardowns that an exiting process waits for, within a stated bound.

Some steps of leaving a group block in C++ with the GIL released: ``ProcessGroupNCCL::abort``
runs ``abortComms`` under ``std::async`` and that future's destructor waits for
``ncclCommAbort`` (behind kernels still queued), and an abandoned ``ncclCommInitRank`` returns
when it returns. They run on background threads so that a leaving member never sits through
them. But such a thread must not come back from its call while the interpreter finalises:
CPython before 3.14 ends a thread that takes the GIL back then with ``pthread_exit``
(``take_gil`` -> ``PyThread_exit_thread``), and that forced unwind through pybind11's
``gil_scoped_release`` destructor (``noexcept``) is ``std::terminate`` -- the process dies
printing "terminate called without an active exception" with status 134 (pytorch#38228,
pybind11#2215). On an H100 that was a process exiting right after a timed-out NCCL push; on a
CPU, any ``TCPStore.wait`` that returns during finalisation does the same
(tests/distributed/test_exit.py shows both).

So such threads are started here (``start``), and an exit handler joins them for at most
``EXIT_WAIT_S`` in all. A thread that loops over short calls until told to stop (the store plane's
poll for answers, in ``Store.check`` most of its life) is started here too, with its ``stop``: the
exit handler stops it first, then joins it with the others. It runs among the ``atexit`` handlers,
which CPython calls before it marks itself finalising (``Py_FinalizeEx``:
``wait_for_thread_shutdown``, ``_PyAtExit_Call``, then ``_PyRuntimeState_SetFinalizing``), so the
threads may still return safely meanwhile:

* every one done in time: the exit goes on as it would have, with its own status;
* one still inside its call: its name is logged (WARNING) and the process ends at once through
  ``os._exit(FORCED_EXIT_STATUS)``, skipping the finalisation that would kill it mid-call. An
  exit handler cannot read the status the process was exiting with (CPython keeps a
  ``SystemExit``'s code on its C stack), so the status says what happened instead: not 0, since
  a push failed and its teardown hung. What the skipped finalisation would have done that
  matters is done first (``_finish``): ``weakref.finalize`` callbacks, ``multiprocessing``'s
  exit function, ``ray.shutdown()`` if Ray is initialised, every open file flushed, logging
  shut down, stdio flushed. (``atexit`` handlers registered before this module was imported
  run after this one and are otherwise skipped: CPython offers no way to run them.)

The registry is process state, like the environment lock in ``nccl``: an exit is process-wide.
A forked child starts with an empty registry (its copies of the threads do not run).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable

logger = logging.getLogger(__name__)

EXIT_WAIT_S = 10.0  # the longest an exit waits for the teardowns still running, all together
FORCED_EXIT_STATUS = 70  # EX_SOFTWARE: the process ended with a teardown still running

_LOCK = threading.Lock()
_RUNNING: set[threading.Thread] = set()
_STOPS: dict[threading.Thread, Callable[[], None]] = {}  # how to end the loops among them


def start(
    name: str, target: Callable[[], None], stop: Callable[[], None] | None = None
) -> threading.Thread:
    """Run ``target`` on a daemon thread that an exit waits for (see the module docstring).
    ``target`` should not raise: what it raises is logged and dropped. ``stop``: what makes a
    ``target`` that loops return soon; an exit calls it before it waits."""

    def run() -> None:
        try:
            target()
        except Exception:
            logger.exception("background teardown %s failed", name)
        finally:
            with _LOCK:
                _RUNNING.discard(threading.current_thread())
                _STOPS.pop(threading.current_thread(), None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _LOCK:
        _RUNNING.add(thread)
        if stop is not None:
            _STOPS[thread] = stop
    try:
        thread.start()
    except BaseException:  # no thread could be had (a limit, or the interpreter shutting down)
        with _LOCK:
            _RUNNING.discard(thread)
            _STOPS.pop(thread, None)
        raise
    return thread


def running() -> list[str]:
    """The names of the teardowns still running."""
    with _LOCK:
        return sorted(thread.name for thread in _RUNNING if thread.is_alive())


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
    with _LOCK:
        stops = list(_STOPS.values())
    for stop in stops:
        with contextlib.suppress(Exception):  # stopping one must not keep the others running
            stop()
    started = time.monotonic()
    left = join(EXIT_WAIT_S)
    waited = time.monotonic() - started
    if not left:
        logger.debug("teardowns done %.2fs into the exit", waited)
        return
    logger.warning(
        "exiting with teardowns still running after %.1fs: %s; ending the process now with "
        "status %d rather than let the interpreter kill them inside a C++ call",
        waited,
        ", ".join(left),
        FORCED_EXIT_STATUS,
    )
    _finish()
    os._exit(FORCED_EXIT_STATUS)


def _finish() -> None:
    """What the finalisation ``os._exit`` skips would have done that a user would miss, each
    step on its own (one that fails must not keep the others from running)."""
    steps: list[Callable[[], object]] = [weakref.finalize._exitfunc]  # type: ignore[attr-defined]
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        steps.append(util._exit_function)
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        steps.append(ray.shutdown)
    steps += [_flush_open_files, logging.shutdown]
    for step in steps:
        with contextlib.suppress(Exception):
            step()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a stream already closed: nothing more to write
            if stream is not None:
                stream.flush()


def _flush_open_files() -> None:
    """Flush every open file object: finalisation would have, as it collected them."""
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()


def _forget_in_child() -> None:
    """A forked child: the parent's teardown threads do not run here."""
    global _LOCK
    _LOCK = threading.Lock()
    _RUNNING.clear()
    _STOPS.clear()


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)
