"""Actors a test module starts once and its tests reuse, each started over in place first.

A Ray actor's start costs ~1.5 CPU-seconds of the 2 cores before its first line (0.4 Ray's own
worker, ~1 importing torch; measured 2026-12-04), most of a short test; the suite started ~200.
A test takes its actors from the module's ``Reused`` instead: each is started over in its own
process (``renew(**init)``, which every pooled class defines to do what its ``__init__`` would
in a new actor, after letting go of its group or updater), so the test sees new actors in all
but pid. What a failed test took is killed, never handed on, and so is what a passing test
struck -- killed, stopped, left hanging -- which it names (``Lease.spoil``).
"""

from __future__ import annotations

from typing import Any

import ray

RENEW_S = 30  # a renewal past this (a process wedged by the test before) is replaced instead


def start_over(actor: Any, *args: Any, **kwargs: Any) -> None:
    """Make ``actor`` (the object inside an actor process) what ``__init__(*args, **kwargs)``
    makes of a new one; its ``renew`` lets go of groups and updaters first."""
    actor.__dict__.clear()
    actor.__init__(*args, **kwargs)


class Reused:
    """Idle actors by class; ``take`` hands out as many as asked, renewed or new."""

    def __init__(self) -> None:
        self._idle: dict[Any, list] = {}

    def take(self, actor_class: Any, inits: list[dict[str, Any]]) -> list:
        """Actors as ``[actor_class.remote(**init) for init in inits]`` would be."""
        idle = self._idle.setdefault(actor_class, [])
        taken = [idle.pop() if idle else None for _ in inits]
        renewing = [None if a is None else a.renew.remote(**i) for a, i in zip(taken, inits)]
        for index, done in enumerate(renewing):
            if done is not None:
                try:
                    ray.get(done, timeout=RENEW_S)
                except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                    ray.kill(taken[index])
                    taken[index] = None
        return [actor_class.remote(**i) if a is None else a for a, i in zip(taken, inits)]

    def give_back(self, actor_class: Any, actors: list) -> None:
        self._idle.setdefault(actor_class, []).extend(actors)

    def close(self) -> None:
        for actors in self._idle.values():
            for actor in actors:
                ray.kill(actor)
        self._idle.clear()


class Lease:
    """What one test took from the module's ``Reused``: handed back for the next test if the
    test passed, less what it harmed; all of it killed if it failed."""

    def __init__(self, reused: Reused) -> None:
        self._reused = reused
        self._taken: list[tuple[Any, list]] = []
        self._spoiled: list = []

    def __call__(self, actor_class: Any, inits: list[dict[str, Any]]) -> list:
        """``Reused.take``, remembered."""
        actors = self._reused.take(actor_class, inits)
        self._taken.append((actor_class, list(actors)))  # the caller may extend its list
        return actors

    def spoil(self, actor: Any) -> None:
        """Never hand ``actor`` on: the test killed, stopped or wedged it."""
        self._spoiled.append(actor)

    def settle(self, passed: bool) -> None:
        for actor_class, actors in self._taken:
            kept = [a for a in actors if passed and a not in self._spoiled]
            self._reused.give_back(actor_class, kept)
            for actor in actors:
                if actor not in kept:
                    ray.kill(actor)
