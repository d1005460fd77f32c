"""The package's floors, read from its imports: a push reads downhill (a front -> send or
receive -> control, delta -> transport -> wire), and no floor imports one above it. Guards the layout of
docs/how-a-push-works.md ("Where each piece lives")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "weight_sync"


def imports_of(path: Path) -> set[str]:
    """Every ``weight_sync`` module ``path`` imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] == "weight_sync"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): imports_of(path) for path in sorted(PACKAGE.rglob("*.py"))}

# The fronts (each a way users reach a push) and the tools that run them.
FRONTS = ["weight_sync.actors", "weight_sync.adapters", "weight_sync.launch", "weight_sync.tools"]
# The parts of the sender below the two that run a push (the pusher; several senders' lanes).
SEND_PARTS = ["collectives", "formation", "roster", "routes", "sender", "sharded", "wire"]

# (the modules under a floor, the modules none of them may import)
FLOORS = [
    # What travels and its pure planning: the bottom floor.
    ("weight_sync.wire", ["weight_sync.send", "weight_sync.receive", "weight_sync.control",
                          "weight_sync.transport", "weight_sync.delta", *FRONTS]),
    # The data plane: of the control planes, only the bounded waits they share.
    ("weight_sync.transport", ["weight_sync.send", "weight_sync.receive", "weight_sync.delta",
                               "weight_sync.control.plane", "weight_sync.control.store",
                               "weight_sync.control.http", "weight_sync.control.lane_store",
                               *FRONTS]),
    ("weight_sync.delta", ["weight_sync.send", "weight_sync.receive", "weight_sync.control", *FRONTS]),
    ("weight_sync.control", ["weight_sync.send", *FRONTS]),
    ("weight_sync.receive", ["weight_sync.send", *FRONTS]),
    ("weight_sync.send", ["weight_sync.receive", *FRONTS]),
    *[(f"weight_sync.send.{part}", ["weight_sync.send.pusher", "weight_sync.send.senders"])
      for part in SEND_PARTS],
    ("weight_sync.send.pusher", ["weight_sync.send.senders"]),
    ("weight_sync.actors", ["weight_sync.adapters", "weight_sync.launch", "weight_sync.tools"]),
    ("weight_sync.launch", ["weight_sync.actors", "weight_sync.adapters", "weight_sync.tools"]),
    ("weight_sync.wire.planner", ["weight_sync.wire.packing"]),
    ("weight_sync.control.futures", ["weight_sync.control.plane", "weight_sync.send"]),
]  # fmt: skip


def under(module: str, floor: str) -> bool:
    return module == floor or module.startswith(floor + ".")


@pytest.mark.parametrize(("floor", "above"), FLOORS)
def test_no_floor_imports_one_above_it(floor: str, above: list[str]) -> None:
    upward = {
        module: sorted(name for name in imports if any(under(name, top) for top in above))
        for module, imports in MODULES.items()
        if under(module, floor)
    }
    assert upward and not any(upward.values()), {m: u for m, u in upward.items() if u}


def test_the_pusher_reaches_the_delta_layer_only_through_the_wire() -> None:
    delta = sorted(
        name for name in MODULES["weight_sync.send.pusher"] if under(name, "weight_sync.delta")
    )
    assert not delta
    reaching = sorted(
        module for module, imports in MODULES.items()
        if under(module, "weight_sync.send") and any(under(n, "weight_sync.delta") for n in imports)
    )  # fmt: skip
    assert reaching == ["weight_sync.send.wire"]
