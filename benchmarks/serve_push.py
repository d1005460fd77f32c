"""One process's pushes into one ``vllm serve`` (vLLM's CPU build) through ``VLLMServers``: the
median time of a push of a tiny Qwen2 (0.6 MB: the control plane, HTTP calls included), after a
warm push. The server starts once, its backend the checkout the script runs from (``vllm serve``
runs as ``python -m``: the working directory comes first on its path); each checkout in
``--trees`` pushes from a process of its own, the trees alternating, for a before and after
(both must speak to that backend):

    python benchmarks/serve_push.py --trees /tmp/before . --runs 5

Needs the vllm extra (the tests' environment has it). Figures: docs/performance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine_push import TINY  # this folder's (the script's own directory is on the path)

ARGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
        "--max-model-len", "256", "--generation-config", "vllm", "--skip-tokenizer-init"]  # fmt: skip


def pushes(url: str, count: int) -> None:
    """In a process of the checkout measured: ``count`` timed pushes after a warm one."""
    import torch

    from weight_sync.adapters.hf import load_model
    from weight_sync.adapters.vllm import VLLMServers

    torch.manual_seed(0)
    model = load_model(TINY)
    times = []
    with VLLMServers([url]) as servers:
        servers.push(model.state_dict())
        for _ in range(count):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(0.001)
            began = time.perf_counter()
            servers.push(model.state_dict())
            times.append(time.perf_counter() - began)
    print(json.dumps({"median_ms": round(statistics.median(times) * 1000, 1)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs="+", default=["."], help="checkouts to push from")
    parser.add_argument("--runs", type=int, default=3, help="runs of each tree, alternating")
    parser.add_argument("--pushes", type=int, default=20)
    parser.add_argument("--push-from", help=argparse.SUPPRESS)  # the pushing process's URL
    args = parser.parse_args()
    if args.push_from:
        pushes(args.push_from, args.pushes)
        return
    from weight_sync.adapters.hf import load_model
    from weight_sync.adapters.vllm import ServerProcess

    trees = [str(Path(tree).resolve()) for tree in args.trees]
    medians: dict[str, list[float]] = {tree: [] for tree in trees}
    with tempfile.TemporaryDirectory() as scratch:
        load_model(TINY).save_pretrained(scratch)
        env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        with ServerProcess(scratch, args=ARGS, env=env, ready_timeout_s=600) as server:
            for _ in range(args.runs):
                for tree in trees:
                    command = [sys.executable, __file__, "--push-from", server.url,
                               "--pushes", str(args.pushes)]  # fmt: skip
                    run = subprocess.run(command, env={**os.environ, "PYTHONPATH": tree},
                                         capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
                    if run.returncode:
                        raise SystemExit(f"pushing from {tree} failed:\n{run.stderr[-3000:]}")
                    medians[tree].append(json.loads(run.stdout.splitlines()[-1])["median_ms"])
                    print(tree, medians[tree][-1], "ms", flush=True)
    for tree, values in medians.items():
        print(f"{tree}: {statistics.median(values):.1f} ms (runs: {values})")


if __name__ == "__main__":
    main()
