"""One process's pushes into one ``VLLMEngine`` actor (vLLM's CPU build): the median time of a
push of a tiny Qwen2 (0.6 MB: the control plane) and of a wider one (65 MB: the bytes), after a
warm push. Run it in two checkouts, alternating, for a before and after:

    PYTHONPATH=/tmp/before python benchmarks/engine_push.py
    PYTHONPATH=. python benchmarks/engine_push.py

Needs the vllm extra (the tests' environment has it). Figures: docs/performance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch

from weight_sync import WeightUpdater
from weight_sync.adapters.hf import load_model
from weight_sync.adapters.vllm import RemoteVLLMEngine

TINY = {
    "model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 512, "tie_word_embeddings": True,
}  # fmt: skip
WIDE = {**TINY, "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2}  # fmt: skip
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}


def measure(config: dict[str, Any], pushes: int, directory: Path) -> dict[str, float]:
    torch.manual_seed(0)
    model = load_model(config)
    model.save_pretrained(directory)
    engine = RemoteVLLMEngine.options(num_cpus=0, runtime_env={"env_vars": ENV}).remote(  # type: ignore[attr-defined]
        model=str(directory), dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
        kv_cache_memory_bytes=64 << 20, max_model_len=256, generation_config="vllm", seed=0,
    )  # fmt: skip
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    times = []
    try:
        with WeightUpdater([engine]) as updater:
            updater.push(state)  # warm: the lane formed, the layout sent
            for _ in range(pushes):
                began = time.perf_counter()
                updater.push(state)
                times.append(time.perf_counter() - began)
        ray.get(engine.shutdown.remote(), timeout=120)
    finally:
        ray.kill(engine)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return {
        "MB": round(nbytes / 1e6, 1),
        "median_ms": round(statistics.median(times) * 1000, 1),
        "min_ms": round(min(times) * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pushes", type=int, default=15)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            results = {
                name: measure(config, args.pushes, Path(scratch) / name)
                for name, config in (("tiny", TINY), ("wide", WIDE))
            }
    finally:
        ray.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
