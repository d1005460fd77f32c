"""Which base a member's weights are: the rule both ends of a push apply, so they agree.

A *base* names the exact bytes of every tensor the trainer keeps a copy of (see
``weight_sync.delta.baseline``): ``"<trainer token>:<version>"``. A member that holds the
trainer's current base may be sent a delta against it; any other gets dense bytes. Both the
trainer (for itself and its picture of each member) and each member apply ``next_base`` when a
push commits, so a delta is offered only where it will apply -- and a member still checks before
accepting one.
"""

from __future__ import annotations


def next_base(held: str | None, built_on: str | None, new: str | None, full: bool) -> str | None:
    """The base a member holds after committing a push.

    ``held``: its base before; ``built_on``: the trainer's base when it sent the push (what a
    delta was computed against, and what a partial push leaves in place for the tensors it does
    not cover); ``new``: the base the push creates (None when the trainer keeps no copy). A full
    push defines every tensor. A partial one (and a delta) yields the new base only on top of the
    one it was built on; anything else leaves tensors the trainer's copy does not describe.
    """
    if new is None:
        return None
    if full:
        return new
    return new if held is not None and held == built_on else None


def base_name(token: str, version: int) -> str:
    return f"{token}:{version}"
