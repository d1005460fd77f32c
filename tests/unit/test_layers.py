"""The package's floors, read from its imports: a push reads downhill (protocol -> send ->
packing/delta -> transport), and no floor imports one above it. Guards the layout of
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

# (the modules under a floor, the modules none of them may import)
FLOORS = [
    ("weight_sync.send", ["weight_sync.protocol", "weight_sync.actors", "weight_sync.adapters"]),
    ("weight_sync.delta", ["weight_sync.protocol", "weight_sync.send", "weight_sync.receiver"]),
    ("weight_sync.transport", ["weight_sync.protocol", "weight_sync.send", "weight_sync.delta",
                               "weight_sync.receive", "weight_sync.receiver"]),
    ("weight_sync.receive", ["weight_sync.protocol", "weight_sync.send", "weight_sync.receiver"]),
    ("weight_sync.packing", ["weight_sync.protocol", "weight_sync.send", "weight_sync.delta",
                             "weight_sync.transport"]),
    ("weight_sync.planner", ["weight_sync.protocol", "weight_sync.send", "weight_sync.packing"]),
    ("weight_sync.futures", ["weight_sync.control", "weight_sync.protocol", "weight_sync.send"]),
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
        name for name in MODULES["weight_sync.protocol"] if under(name, "weight_sync.delta")
    )
    assert not delta
    reaching = sorted(
        module for module, imports in MODULES.items()
        if under(module, "weight_sync.send") and any(under(n, "weight_sync.delta") for n in imports)
    )  # fmt: skip
    assert reaching == ["weight_sync.send.wire"]
