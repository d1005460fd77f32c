"""Futures, and waiting on them within a bound: the helpers every control plane shares.

A member's call runs on a thread of its own (``in_thread``): a stuck peer may never return, and
the caller bounds its wait on the future instead (``gather``, the one bounded wait on a set of
calls). Where there is nothing to wait on but a question asked again and again (a store key, a
CUDA event, a health check), ``Backoff`` is the one policy for how often to ask.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, wait
from typing import Any


def resolve(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless something else already did (two sources may race to)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def in_thread(
    call: Callable[[], Any], name: str = "weight-sync-call", exit_waits: bool = False
) -> Future[Any]:
    """Run a blocking call on a daemon thread of its own: a stuck peer may never return, and must
    not hold up anything else (the caller bounds its wait on the future).

    ``exit_waits``: the call blocks in C++ with the GIL released (an NCCL communicator's
    creation, an NCCL wait), so an exit waits for it, within a bound, rather than let the
    interpreter kill it inside the call (see ``transport.teardown``)."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            resolve(future, result=call())
        except BaseException as exc:
            resolve(future, error=exc)

    if exit_waits:
        # Imported here: the transports use this module, and importing any of them imports all.
        from weight_sync.transport import teardown

        teardown.start(name, run)
    else:
        threading.Thread(target=run, name=name, daemon=True).start()
    return future


def then(future: Future[Any], step: Callable[[Any], Any]) -> Future[Any]:
    """A future of ``step(result)``, resolved only once ``step`` has run; an error, of ``future``
    or of ``step``, passes through."""
    outer: Future[Any] = Future()

    def chain(inner: Future[Any]) -> None:
        try:
            outer.set_result(step(inner.result()))
        except BaseException as error:
            outer.set_exception(error)

    future.add_done_callback(chain)
    return outer


def joined(future: Future[Any], also: Future[Any]) -> Future[Any]:
    """``future``'s outcome, delivered only once ``also`` is done too: ``also``'s error where
    ``future`` succeeded (a step that is over only when two things are)."""
    outer: Future[Any] = Future()

    def settle(_: Future[Any]) -> None:
        if not (future.done() and also.done()):
            return
        error = future.exception() or also.exception()
        resolve(outer, result=None if error else future.result(), error=error)

    future.add_done_callback(settle)
    also.add_done_callback(settle)
    return outer


def gather(
    calls: Collection[Future[Any]],
    timeout_s: float,
    until: Callable[[], bool] | None = None,
) -> bool:
    """Wait up to ``timeout_s`` for every one of ``calls`` to be done -- or, given ``until``, for
    ``until()`` to hold, looked at again each time one of them completes (an early end: the
    first failure, say). Returns whether that happened in time; never raises for a call's
    error, and leaves the calls that are not done running."""
    done = until or (lambda: all(call.done() for call in calls))
    end = time.monotonic() + max(timeout_s, 0.0)
    pending = {call for call in calls if not call.done()}
    while not done():
        left = end - time.monotonic()
        if left <= 0 or not pending:
            return done()
        # wait() refuses timeouts past the platform's limit; a bound that long is "no bound".
        timeout = min(left, threading.TIMEOUT_MAX)
        _, pending = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
    return True


class Backoff:
    """How often to look again at something that has no future to wait on: first after
    ``first_s``, then twice as long each time up to ``longest_s`` -- quick when the answer is
    near (a copy that takes microseconds), cheap when it is not (a server starting)."""

    def __init__(self, first_s: float, longest_s: float) -> None:
        assert 0 < first_s <= longest_s, (first_s, longest_s)
        self._pause = first_s
        self._longest = longest_s

    def sleep(self, at_most_s: float = float("inf")) -> None:
        """Pause before the next look (never longer than ``at_most_s``)."""
        time.sleep(max(0.0, min(self._pause, at_most_s)))
        self._pause = min(2 * self._pause, self._longest)
