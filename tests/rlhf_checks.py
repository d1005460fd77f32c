"""What every run of ``examples/rlhf_loop.py`` in the tests must show, whatever its engine."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# Steps of the loops on real engines: on a vLLM engine (2026-12-02) the reward averaged over 5
# steps went from 0.11 to 0.40 in 25 (the check asks for a rise of 0.1), each step ~0.45 s of
# the 2 cores; the loop on Ray actors alone, cheap, runs 40.
STEPS = 25
SUMMARY = re.compile(r"reward: first=(\d\.\d{3}) last=(\d\.\d{3})")


def assert_learned(output: str, history: Any, steps: int, plot: Path) -> None:
    """The loop's last line says the reward rose by more than 0.1 (a random policy scores about
    0.1); no rollout was stale (each came labelled with the trainer's current version); a push
    after every step and one before; the plot was written."""
    line = output.strip().splitlines()[-1]
    match = SUMMARY.fullmatch(line)
    assert match, line
    first, last = map(float, match.groups())
    assert last > first + 0.1, line
    assert history.stale == 0 and len(history.reward) == steps and len(history.push_ms) == steps + 1
    assert plot.stat().st_size > 10_000
