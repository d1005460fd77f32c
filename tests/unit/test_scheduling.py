"""How the suite's tests are spread over xdist workers (tests/scheduling.py): groups, longest
first, at most two engine groups at once."""

from __future__ import annotations

from pathlib import PurePath

import pytest

from tests.scheduling import MAX_ENGINE_GROUPS, group_of, pick


@pytest.mark.parametrize(
    ("path", "group"),
    [
        ("tests/vllm/test_engine.py", "vllm"),
        ("tests/vllm_serve/test_lanes.py", "vllm_serve"),
        ("tests/sglang/test_servers.py", "sglang"),
        ("tests/deploy/test_multinode.py", "deploy"),
        ("tests/no_ray/test_examples.py", "no_ray"),
        ("tests/ray/test_lanes.py", "tests/ray/test_lanes.py"),
        ("tests/unit/test_packing.py", "tests/unit/test_packing.py"),
        ("tests/vllm_like.py", "tests/vllm_like.py"),
    ],
)
def test_a_folder_of_shared_processes_is_one_group_and_any_other_module_its_own(
    path: str, group: str
) -> None:
    assert group_of(PurePath(path)) == group


@pytest.mark.parametrize(
    ("queue", "running", "chosen"),
    [
        # longest first
        (["tests/unit/test_packing.py", "tests/ray/test_lanes.py"], [], "tests/ray/test_lanes.py"),
        (["vllm", "sglang", "vllm_serve"], [], "sglang"),
        # an unlisted group counts as short
        (["tests/unit/test_new.py", "tests/ray/test_demo.py"], [], "tests/ray/test_demo.py"),
        # one engine group running: another may start
        (["vllm", "tests/ray/test_push.py"], ["sglang"], "vllm"),
        # two running: the longest other group instead
        (["vllm", "tests/ray/test_lanes.py"], ["sglang", "vllm_serve"], "tests/ray/test_lanes.py"),
        (["no_ray", "tests/unit/x.py"], ["vllm", "sglang", "tests/ray/test_push.py"],
         "tests/unit/x.py"),
        # only engine groups left: the worker still gets one (xdist would never ask again)
        (["vllm", "no_ray"], ["sglang", "vllm_serve"], "vllm"),
    ],
)  # fmt: skip
def test_pick_hands_out_the_longest_group_keeping_engine_groups_within_the_cap(
    queue: list[str], running: list[str], chosen: str
) -> None:
    assert MAX_ENGINE_GROUPS == 2  # the table is written for two
    assert pick(queue, running) == chosen
