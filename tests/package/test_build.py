"""The package as a user gets it: ``python -m build`` makes a wheel and an sdist; each installs
into a fresh virtual environment and runs the demo there, from outside this repository, with
the library imported from what was installed. The heavy dependencies (torch, Ray) come from
this environment through a path entry, so the test costs minutes, not a torch install; the
package's own files, metadata and entry point are the wheel's and the sdist's alone."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest

pytest.importorskip("build", reason="the package test needs `build` (the test extra)")

pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[2]
DEMO = ["demo", "--workers", "2", "--steps", "2", "--device", "cpu"]


def run(command: list[str], cwd: Path, timeout_s: float = 400) -> str:
    return run_both(command, cwd, timeout_s)[0]


def run_both(command: list[str], cwd: Path, timeout_s: float = 400) -> tuple[str, str]:
    # As a user's shell runs it: no PYTHONPATH (the session's Ray fixture points it at this
    # repository, which would shadow the installed package).
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                          check=False, env={**env, "RAY_USAGE_STATS_ENABLED": "0"})  # fmt: skip
    assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-5000:])
    return done.stdout, done.stderr


def working_tree(into: Path) -> Path:
    """The checkout's files as git sees them (tracked, and new ones not ignored), copied: built
    in place, setuptools leaves ``build/lib`` in the checkout and packs what it holds into the
    next wheel, so a module renamed since the last run was still in the wheel (and not in the
    sdist) -- this test failed in a contributor's checkout, never in CI's fresh clone."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout  # fmt: skip
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # a tracked file deleted but not yet committed is skipped
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    tree = working_tree(tmp_path_factory.mktemp("tree"))
    run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(tree)],
        cwd=tree)  # fmt: skip
    return out


def test_the_wheel_carries_the_license_the_type_hints_and_the_metadata(dist: Path) -> None:
    [wheel] = dist.glob("weight_sync-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
        fields = HeaderParser().parsestr(archive.read(metadata).decode())
    assert "weight_sync/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert fields["License-Expression"] == "Apache-2.0"
    assert "Typing :: Typed" in fields.get_all("Classifier")
    assert not any(n.startswith(("tests/", "benchmarks/", "docs/")) for n in names)
    description = fields.get_payload()
    assert "](docs/" not in description, "a relative link in the long description breaks off-repo"
    [sdist] = dist.glob("weight_sync-*.tar.gz")
    assert sdist.stat().st_size > 0


def package_files(archive_names: list[str]) -> set[str]:
    """The package's own files (pip also records the bytecode it compiles on install)."""
    return {n for n in archive_names if n.startswith("weight_sync/") and "__pycache__" not in n}


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_each_installs_into_a_fresh_venv_and_runs_the_demo(
    dist: Path, kind: str, tmp_path: Path
) -> None:
    """The wheel runs the demo; the sdist must install the very files the wheel holds (so the
    wheel's demo speaks for it too: a demo of its own cost CI another Ray cluster)."""
    [artifact] = dist.glob("weight_sync-*.whl" if kind == "wheel" else "weight_sync-*.tar.gz")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "--no-deps", "--quiet", str(artifact)],
        cwd=tmp_path)  # fmt: skip
    # torch, Ray and the rest from this environment, after the venv's own site-packages.
    ours = run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], cwd=tmp_path)
    Path(ours.strip(), "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    where = run([str(python), "-c", "import weight_sync; print(weight_sync.__file__)"],
                cwd=tmp_path)  # fmt: skip
    assert where.startswith(str(venv)), where  # the installed package, not this repository
    assert run([str(venv / "bin" / "weight-sync"), "--version"], cwd=tmp_path).strip() == (
        "weight-sync 0.1.0"
    )
    if kind == "sdist":
        installed = run([str(python), "-c", "from importlib.metadata import files; "
                         "print('\\n'.join(str(f) for f in files('weight_sync')))"], cwd=tmp_path)
        [wheel] = dist.glob("weight_sync-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            wheel_files = package_files(archive.namelist())
        assert package_files(installed.split()) == wheel_files
        assert len(wheel_files) > 50, wheel_files  # the whole package, not a stub
        return
    out, err = run_both([str(venv / "bin" / "weight-sync"), *DEMO], cwd=tmp_path)
    assert "verified: 2/2 workers hold version 2" in out and "-- OK" in out, out
    assert "Started a local Ray instance" not in out + err, err  # quiet: the demo's output only
