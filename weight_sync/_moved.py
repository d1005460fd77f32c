"""Old import paths kept working for one release after a module moved (0.1 -> 0.2).

A module that moved leaves a stub at its old path whose attributes forward to the new module
with a ``DeprecationWarning`` naming the new path, so that code written against the old layout
keeps running and says what to change.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

REMOVED_IN = "0.2"


def warn_moved(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(
        f"{old} moved to {new}: import from {new} (the old path goes in weight_sync {REMOVED_IN})",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def forward(old: str, new: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for the stub at ``old``."""

    def __getattr__(name: str) -> Any:
        if name == "__all__":  # ``from old import *``: the new module's names, each warning
            module = importlib.import_module(new)
            return getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")])
        if name.startswith("__"):  # import machinery, introspection: no warning, no forwarding
            raise AttributeError(name)
        warn_moved(old, new)
        return getattr(importlib.import_module(new), name)

    return __getattr__
