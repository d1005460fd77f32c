"""How the suite is spread over pytest-xdist's workers (``pyproject.toml`` runs it with ``-n``).

The suite is CPU-bound on 2 cores, not idle: most of its time goes to starting processes
(engines, servers, Ray actors, spawned ranks), each importing torch. Workers beside each other
keep both cores busy through the waits (rendezvous, bounds, HTTP round trips) that one process
alone would sit out. Three rules decide who runs what:

* **Groups.** Tests that share processes started once -- a folder's engines or servers, the
  namespace clusters -- are one group, run by one worker; every other module is a group of its
  own (its module-scoped fixtures are then made once). A test that kills or times something runs
  inside its module's group, never split from it.
* **Longest first.** A run lasts as long as its busiest worker, so groups are handed out by the
  seconds they took in a measured run (``SECONDS``), longest first.
* **Memory.** Engine groups each hold several GB (a vLLM engine is three processes of ~0.7 GB,
  an SGLang server ~2 GB); at most ``MAX_ENGINE_GROUPS`` of them run at once, which keeps the
  suite inside 24 GiB. (Four workers that ran all of them at once reached 95% of memory and Ray
  killed engine actors.)

``pick`` is the pure rule, tested as a table (tests/unit/test_scheduling.py); ``make_scheduler``
puts it into xdist's scope scheduler.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import PurePath
from typing import Any

# Folders whose tests share processes started once for the folder: one group each.
SHARED_FOLDERS = ("vllm", "vllm_serve", "sglang", "deploy", "no_ray")
# Groups that start inference engines (GBs each; all but the namespace clusters): at most
# MAX_ENGINE_GROUPS at once.
ENGINE_GROUPS = frozenset(SHARED_FOLDERS) - {"deploy"}
MAX_ENGINE_GROUPS = 2
# Seconds each group took in one run on one process (2026-12-02, ``-n 0``; vllm, test_lanes,
# test_faults, test_groups and test_group_abort measured again after their cuts); only their
# order matters. A group not listed counts as DEFAULT_SECONDS.
SECONDS = {
    "vllm_serve": 135, "sglang": 144, "tests/ray/test_faults.py": 134, "vllm": 105,
    "deploy": 86, "tests/ray/test_lanes.py": 47, "tests/launch/test_launchers.py": 65,
    "no_ray": 59, "tests/launch/test_many_senders.py": 57,
    "tests/distributed/test_group_abort.py": 41, "tests/distributed/test_exit.py": 29,
    "tests/package/test_build.py": 27, "tests/ray/test_delta.py": 26, "tests/ray/test_push.py": 27,
    "tests/distributed/test_groups.py": 11, "tests/distributed/test_gpu_bench_harness.py": 12,
    "tests/ray/test_rlhf.py": 14, "tests/ray/test_bench.py": 11, "tests/ray/test_demo.py": 9,
    "tests/distributed/test_rounds.py": 8, "tests/ray/test_sharded.py": 10,
}  # fmt: skip
DEFAULT_SECONDS = 5


def group_of(path: PurePath) -> str:
    """The group of a test file, given as a path relative to the repository."""
    parts = path.parts
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in SHARED_FOLDERS:
        return parts[1]
    return path.as_posix()


def pick(queue: Sequence[str], running: Collection[str]) -> str:
    """The group to hand a free worker next: the longest of ``queue`` that keeps engine groups
    within ``MAX_ENGINE_GROUPS`` beside those ``running``. When only engine groups are left and
    the cap is reached, the longest of them all the same: a worker given nothing would never be
    asked again (xdist reschedules a worker only when one of its tests ends)."""
    assert queue, "nothing left to pick from"
    engines = sum(1 for group in running if group in ENGINE_GROUPS)
    allowed = [g for g in queue if g not in ENGINE_GROUPS or engines < MAX_ENGINE_GROUPS]
    return max(allowed or queue, key=lambda group: SECONDS.get(group, DEFAULT_SECONDS))


def make_scheduler(config: Any, log: Any) -> Any:
    """xdist's scope scheduler with ``group_of`` for scopes, handing them out by ``pick``."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return group_of(PurePath(nodeid.split("::", 1)[0]))

        def _assign_work_unit(self, node: Any) -> None:
            running = [
                scope
                for work in self.assigned_work.values()
                for scope, done in work.items()
                if not all(done.values())
            ]
            chosen = pick(list(self.workqueue), running)
            self.workqueue.move_to_end(chosen, last=False)  # the base class takes the first
            super()._assign_work_unit(node)

    return Scheduler(config, log)
