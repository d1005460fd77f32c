"""The version rules, in one place (pure): which version a push takes, and how serving engines
label their outputs with it.

Rollouts are filtered by the version that made them, so a version must name one set of weights
for the life of the engines: a push takes a version past every version any of its engines ever
served (or was sent), whatever happened before it -- a new trainer, a failed push and its repair,
an engine that restarted. docs/guarantees.md ("Versions") states the rules for every pusher.

Serving engines (vLLM, SGLang) put a string label on every output: the committed version, or,
while they hold none (a push under way, or one that failed part-way), ``"none"`` -- which
SGLang servers write as ``"none (past N)"``, so that the label itself keeps the highest version
they were ever pushed (``N``) where nothing else on the server would.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

NO_VERSION = "none"
_UNLABELLED = frozenset({NO_VERSION, "default"})  # "default": the engines' own, before any push
_PAST = re.compile(r"none \(past (\d+)\)")


def label_version(label: str) -> int | None:
    """The version an engine's label names: None for no version (``"none"``, ``"none (past
    N)"``, SGLang's ``"default"``), or a label that is not one of ours (set by someone else)."""
    if label in _UNLABELLED or label.startswith(NO_VERSION):
        return None
    try:
        return int(label)
    except ValueError:
        return None


def label_past(label: str) -> int:
    """The highest version a label says its engine was ever pushed: the version it names, the
    ``N`` of ``"none (past N)"``, else 0."""
    past = _PAST.fullmatch(label)
    if past is not None:
        return int(past.group(1))
    return label_version(label) or 0


def unlabelled(past: int) -> str:
    """The label of an engine that holds no version but was pushed up to ``past`` (0: never)."""
    return f"{NO_VERSION} (past {past})" if past > 0 else NO_VERSION


def check_version(version: object) -> None:
    """Refuse, before anything else happens, a ``version=`` that cannot be one."""
    if version is None:
        return
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version must be an int (an RL loop's step, say), got {version!r}")
    if version < 1:
        raise ValueError(f"version must be >= 1, got {version}")


def choose_version(named: int | None, lowest: int, who: str = "workers") -> int:
    """The version a push takes: ``named`` if the caller named one, else ``lowest``, the lowest
    version past everything its ``who`` served or were sent. A named version below that is
    refused, saying which are free (``ValueError``: nothing has moved yet)."""
    if named is None:
        return lowest
    if named < lowest:
        raise ValueError(_stale(named, lowest, who))
    return named


def proposed_version(named: int, lowest: int) -> int:
    """A sender's proposal for a push from K senders: the version it was given (``named``; 0:
    none), or its ``lowest`` free one where that is higher -- so that a stale given version
    raises the proposal past it, and ``agreed_version`` calls the push off."""
    return max(named, lowest)


def agreed_version(proposed: Sequence[int], named: Sequence[int]) -> tuple[int, str | None]:
    """``choose_version`` for a push from K senders (one or many), each of which proposed a
    version (the one it was given, else its lowest free one) and says the one it was given (0:
    none): the push takes the highest proposed; where the senders were not all given one
    version, or were given one that is not past every sender's, also why it cannot (the push
    is then called off)."""
    version, given = max(proposed), set(named)
    if len(given) > 1:
        return version, (
            f"the senders named versions {sorted(given)}; they must all name one version, past "
            f"every sender's ({version})"
        )
    (one,) = given
    return version, _stale(one, version, "workers") if one not in (0, version) else None


def _stale(named: int, lowest: int, who: str) -> str:
    return (
        f"version {named} is not past what these {who} were already pushed (up to "
        f"{lowest - 1}): a version names one set of weights for the life of the {who}. "
        f"Name a version of at least {lowest}, or leave version out to continue the count"
    )


def past_sent(version: int, sent: int) -> list[str]:
    """A member's problem with a push's ``version`` when it is not past ``sent``, the highest
    version the member was ever sent (by one sender or many)."""
    if version > sent:
        return []
    why = f"version {version} is not past {sent}, which this worker was already sent"
    return [f"{why}: push with version={sent + 1} or higher"]


def held_across_lanes(versions: Sequence[int | None]) -> int | None:
    """The version a member holds across its lanes: theirs when every lane committed the same
    one, else none (a push that landed on some lanes only is not held)."""
    first = versions[0] if versions else None
    return first if all(v == first for v in versions) else None
