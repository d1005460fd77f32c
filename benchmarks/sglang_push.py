"""Pushes into a real SGLang server, against what SGLang users write instead, in one run.

    python benchmarks/sglang_push.py [--sglang-python .venv-sglang/bin/python] [--repeats 5]

One local SGLang server (CPU) of a ~105 MB float32 Qwen2 built from a config; the trainer is
this process. Strategies, each pushing the same state dict ``--repeats`` times (medians):

* ``weight_sync``: ``SGLangServers.push`` with 64 MiB buckets -- check, pause, buckets, flush,
  label, resume;
* ``weight_sync 1 MiB``: the same with 1 MiB buckets (the per-bucket cost);
* ``per_tensor``: one ``update_weights_from_distributed`` call and one broadcast per tensor,
  the way the examples of SGLang's weight-update API loop (here ``SGLangServers`` with 64-byte
  buckets, so the same pause/flush/label around it: the difference is the per-tensor calls);
* ``from_disk``: ``save_pretrained`` into a folder, then ``/update_weights_from_disk`` -- the
  simplest thing that works, with a shared file system.

Prints a table of seconds and the ratio of each to ``weight_sync``. Figures on a 2-core machine
are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch

from weight_sync import SyncConfig
from weight_sync.adapters.hf import load_model
from weight_sync.adapters.sglang import SGLangServer, SGLangServers
from weight_sync.tools.bench import timing as bench_timing
from weight_sync.control.http import call

MODEL = {  # ~26M parameters, 105 MB in float32
    "model_type": "qwen2",
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
ARGS = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--skip-tokenizer-init",
    "--mem-fraction-static",
    "0.5",
    "--max-total-tokens",
    "1024",
    "--sleep-on-idle",
    "--random-seed",
    "0",
]


def timed(push, repeats: int) -> list[float]:
    def step() -> None:
        result = push()
        if result is not None:
            print("  phases:", {k: round(v, 3) for k, v in result.phases.items()}, flush=True)

    return bench_timing.timed(step, repeats, warmup=0)  # the caller's first push was untimed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = Path(__file__).resolve().parents[1] / ".venv-sglang" / "bin" / "python"
    parser.add_argument(
        "--sglang-python", default=os.environ.get("WEIGHT_SYNC_SGLANG_PYTHON", str(default))
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_model(MODEL)
    state = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for n, t in state.items() if n != "lm_head.weight")
    with tempfile.TemporaryDirectory(prefix="sglang_bench_") as folder:
        start_dir, disk_dir = Path(folder, "start"), Path(folder, "disk")
        model.save_pretrained(start_dir)
        with SGLangServer(
            str(start_dir), python=args.sglang_python, args=ARGS, env={"SGLANG_USE_CPU_ENGINE": "1"}
        ) as server:
            url = server.url
            results: dict[str, list[float]] = {}
            for name, bucket in (
                ("weight_sync", 64 << 20),
                ("weight_sync 1 MiB", 1 << 20),
                ("per_tensor", 64),
            ):
                with SGLangServers([url], SyncConfig(bucket_bytes=bucket)) as servers:
                    servers.push(state)  # forms the group: not timed
                    results[name] = timed(lambda s=servers: s.push(state), args.repeats)

            def from_disk() -> None:
                model.save_pretrained(disk_dir)
                answer = call(
                    url, "update_weights_from_disk", {"model_path": str(disk_dir)}, timeout_s=600
                )
                assert answer["success"], answer

            results["from_disk"] = timed(from_disk, args.repeats)
    base = statistics.median(results["weight_sync"])
    print(
        f"one SGLang server (CPU), {len(state)} tensors, {nbytes / 1e6:.0f} MB float32, "
        f"medians of {args.repeats}"
    )
    print(f"{'strategy':<20}{'seconds':>9}{'GB/s':>8}{'x weight_sync':>15}")
    for name, seconds in results.items():
        median = statistics.median(seconds)
        print(f"{name:<20}{median:>9.3f}{nbytes / median / 1e9:>8.2f}{median / base:>15.2f}")


if __name__ == "__main__":
    main()
