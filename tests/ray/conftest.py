"""Fixtures of the Ray tests: actors a module starts once and its tests reuse (``pool.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ray.pool import Lease, Reused


@pytest.fixture(scope="module")
def reused() -> Iterator[Reused]:
    """The module's idle actors, killed when it is done."""
    held = Reused()
    try:
        yield held
    finally:
        held.close()


@pytest.fixture
def take(request: pytest.FixtureRequest, reused: Reused) -> Iterator[Lease]:
    """``take(actor_class, inits)``: actors from the module's ``reused`` for this test (a
    ``Lease``), given back if it passed, killed if it failed."""
    lease = Lease(reused)
    failed = request.session.testsfailed
    try:
        yield lease
    finally:
        lease.settle(passed=request.session.testsfailed == failed)
