"""A stand-in for vLLM, for the adapter's contract test: it loads a worker extension and calls
it the way vLLM does, and its model loads weights the way vLLM models do. It is not vLLM.

What it reproduces (vLLM v1, ``vllm/v1/worker/worker_base.py`` and ``LLM.collective_rpc``):

* ``worker_extension_cls`` is a fully qualified name, imported in the worker process, and
  appended to the worker class's bases after checking that it redefines no worker attribute;
* ``collective_rpc(method: str, args=...)`` calls ``getattr(worker, method)(*args)`` on every
  worker at once and returns the list of results, in worker order;
* the worker reaches the model as ``self.model_runner.model``, its device as ``self.device`` and
  its rank within the engine (tensor x pipeline parallel) as ``self.rank``;
* the model's ``load_weights(weights)`` takes an iterable of (checkpoint name, tensor), maps
  q/k/v onto its stacked ``qkv_proj`` (vLLM's ``stacked_params_mapping``), skips the tied
  ``lm_head.weight``, and returns the names it loaded;
* ``reset_prefix_cache()`` on the engine.
"""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import ray
import torch

from tests.ray.actors import TinyLM
from weight_sync.adapters.vllm import VLLMEngine

STACKED = [("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2)]


class EngineModel(TinyLM):
    """TinyLM laid out as vLLM lays it out: q/k/v stacked, LM head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__(fused=True, seed=1)

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, weight in weights:
            if name == "lm_head.weight":  # tied: vLLM skips it and keeps the embedding
                continue
            for fused, part, shard in STACKED:
                if f".{part}." in f".{name}":
                    name = name.replace(part, fused)
                    target = params[name].data
                    size = target.shape[0] // 3
                    target.narrow(0, shard * size, size).copy_(weight)
                    break
            else:
                params[name].data.copy_(weight)
            loaded.add(name)
        return loaded


class HostWorker:
    """Stands for vLLM's GPU worker (here on CPU). With several, each holds the whole model (a
    real tensor-parallel worker would keep its shard in ``load_weights``)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.device = torch.device("cpu")
        self.model_runner = SimpleNamespace(model=EngineModel())


class HostLLM:
    """Stands for ``vllm.LLM`` with one worker; records the engine-level calls it gets."""

    def __init__(self, worker_extension_cls: str, workers: int = 1) -> None:
        module, _, name = worker_extension_cls.rpartition(".")
        extension = getattr(importlib.import_module(module), name)
        clashes = [a for a in vars(extension) if not a.startswith("__") and hasattr(HostWorker, a)]
        assert not clashes, f"worker extension redefines {clashes}"
        worker_class = type("Worker", (HostWorker,), {})
        worker_class.__bases__ = (*worker_class.__bases__, extension)
        self.workers = [worker_class(rank) for rank in range(workers)]
        self.events: list[str] = []

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:  # fmt: skip
        """On every worker at once (vLLM's workers are processes; here, threads), in order."""
        self.events.append(method)
        with ThreadPoolExecutor(len(self.workers)) as pool:
            calls = [pool.submit(getattr(worker, method), *args, **(kwargs or {}))
                     for worker in self.workers]  # fmt: skip
            return [call.result(timeout=timeout) for call in calls]

    def reset_prefix_cache(self) -> bool:
        self.events.append("reset_prefix_cache")
        return True

    def pause_generation(self) -> None:
        self.events.append("pause_generation")

    def resume_generation(self) -> None:
        self.events.append("resume_generation")

    def generate(self, prompt: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.workers[0].model_runner.model(prompt).argmax(-1)


@ray.remote(num_cpus=0)
class HostedEngine(VLLMEngine):
    """The adapter's engine-side member, built on the host instead of vllm.LLM."""

    def __init__(self, workers: int = 1) -> None:
        from weight_sync.adapters.vllm import EXTENSION

        super().__init__(HostLLM(EXTENSION, workers))

    def events(self) -> list[str]:
        return [e for e in self.llm.events if e != "weight_sync_status"]

    def forget_on_worker(self, index: int) -> None:
        """As if one worker restarted: it holds no committed version any more."""
        self.llm.workers[index]._weight_sync_receiver().version = None

    def engine_states(self) -> list[dict[str, torch.Tensor]]:
        return [{n: t.clone() for n, t in worker.model_runner.model.state_dict().items()}
                for worker in self.llm.workers]  # fmt: skip
