"""Tiny models for the real-vLLM tests, from configs in code (no hub), and a trainer actor that
owns one with an optimizer and a ``WeightUpdater`` -- and computes, with ``transformers``, the
reference the engines must match."""

from __future__ import annotations

import copy
import datetime
import os
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from tests.ray.pool import start_over
from tests.reference import Trainer as InProcess
from weight_sync import PushResult, SyncConfig, WeightUpdater
from weight_sync.adapters.hf import load_model
from weight_sync.transport.rendezvous import bind_listener, open_store

# vLLM's CPU attention needs a head size of 32 or more: hidden 64 over 2 heads. Both have
# biases or not, GQA, and names vLLM stacks (q/k/v -> qkv_proj, gate/up -> gate_up_proj).
QWEN2 = {  # tied embeddings, q/k/v biases
    "model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 512, "tie_word_embeddings": True, "initializer_range": 0.1,
}  # fmt: skip
LLAMA = {  # untied LM head, no biases
    "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "initializer_range": 0.1,
}  # fmt: skip
MAX_MODEL_LEN = 256
LONG = 2000  # tokens of a request long enough for a push to land while it generates
BLOCK_TOKENS = 128  # vLLM's KV block on CPU: a prompt longer than this has a cacheable prefix


def save(config: dict[str, Any], directory: Path, seed: int) -> str:
    """``save_pretrained`` a randomly initialised model: the engine's starting weights."""
    torch.manual_seed(seed)
    load_model(config).save_pretrained(directory)
    return str(directory)


def engine_options(model: str, dtype: str = "float32", **overrides: Any) -> dict[str, Any]:
    """What a test engine is built with: small, eager, no tokenizer (token-id prompts)."""
    return {
        "model": model, "dtype": dtype, "skip_tokenizer_init": True, "enforce_eager": True,
        "kv_cache_memory_bytes": 64 << 20, "max_model_len": MAX_MODEL_LEN,
        "generation_config": "vllm", "seed": 0, **overrides,
    }  # fmt: skip


@ray.remote(num_cpus=0)
class Trainer:
    """A ``transformers`` causal LM with Adam, pushing to engines; it also keeps what each
    engine was last pushed (so partial pushes and casts have an exact reference)."""

    def __init__(self, config: dict[str, Any], engines: list, seed: int = 1, vllm_workers: int = 0,
                 **sync: Any) -> None:  # fmt: skip
        """``vllm_workers``: push through vLLM's own weight-transfer API (``engines`` are then
        ``vllm.LLM`` actors, ``vllm_workers`` their worker processes in all) instead of a
        ``WeightUpdater``."""
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        self.model = load_model(config)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.config = SyncConfig(**sync)
        if vllm_workers:
            from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

            from weight_sync.adapters.vllm.backend import StateDictSource, WeightSyncTrainerInitInfo

            self.vllm = WeightTransferTrainerFactory.trainer_init(
                WeightSyncTrainerInitInfo(rank=0, world_size=1 + vllm_workers, config=self.config),
                client=RayVLLMWeightSyncClient(engines),
                source=StateDictSource(self.model),
            )
        else:
            self.updater = WeightUpdater(engines, self.config)
        self.engine_state: dict[str, torch.Tensor] | None = None  # as the engines hold it
        self.closed = False

    def step(self) -> float:
        """One real optimizer step of next-token prediction on random tokens."""
        ids = torch.randint(0, self.model.config.vocab_size, (4, 32))
        loss = self.model(ids, labels=ids).loss
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def push(
        self, only: str | None = None, partial: bool = False, reshape: str | None = None
    ) -> PushResult:
        """Push the state dict (``only``: the names containing it); ``reshape`` names a tensor
        to send one row short (a push the engine must refuse)."""
        state = {n: t for n, t in self.model.state_dict().items() if only is None or only in n}
        if reshape is not None:
            state[reshape] = state[reshape][:-1]
        if hasattr(self, "vllm"):  # vLLM's send_weights: the source given at init, whole
            assert only is None and reshape is None and not partial
            result = self.vllm.send_weights()
        else:
            result = self.updater.push(state, partial=partial)
        cast = getattr(torch, self.config.cast_dtype) if self.config.cast_dtype else None
        pushed = {n: (t.to(cast) if cast is not None and t.is_floating_point() else t).clone()
                  for n, t in state.items()}  # fmt: skip
        self.engine_state = pushed if self.engine_state is None else {**self.engine_state, **pushed}
        return result

    def push_parameters(self) -> PushResult:
        """vLLM's own ``ModuleSource``: ``named_parameters``, so no tied LM head."""
        from vllm.distributed.weight_transfer import ModuleSource

        return self.vllm.send_weights(ModuleSource(self.model))

    def reference(
        self, prompts: list[list[int]], outputs: list[list[int]], current: bool = False
    ) -> list[dict[str, list]]:
        """What the engines should have produced, by ``transformers`` with the weights they were
        pushed (``current``: the trainer's weights now): for each prompt and the tokens an engine
        generated after it (teacher-forced), the log-probability of each of those tokens, the
        greedy token at each step, and the gap between the two best log-probabilities there (a
        tie if tiny)."""
        if current:
            state = self.model.state_dict()
        else:
            assert self.engine_state is not None, "push first"
            state = self.engine_state
        return reference(self.model, state, prompts, outputs, self.config.cast_dtype)

    def pid(self) -> int:
        import os

        return os.getpid()

    def slow_link(self, delay_s: float) -> None:
        """Make every broadcast of the current group take ``delay_s`` longer (a slow link), so a
        push lasts long enough to be struck mid-way."""
        group = self.updater.group
        assert group is not None, "push once first"
        broadcast = group.broadcast

        def slow(tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> Any:
            import time

            time.sleep(delay_s)
            return broadcast(tensor, src, timeout_s)

        group.broadcast = slow  # type: ignore[method-assign]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if hasattr(self, "vllm"):
            self.vllm.shutdown()
        else:
            self.updater.close()

    def renew(self, *args: Any, **kwargs: Any) -> None:
        """Start over as ``Trainer(*args, **kwargs)`` would, in this process (its updater closed
        first): the tests reuse one actor, whose start costs ~3 s of the 2 cores."""
        self.close()
        start_over(self, *args, **kwargs)


def reference(
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    prompts: list[list[int]],
    outputs: list[list[int]],
    dtype: str | None = None,
) -> list[dict[str, list]]:
    """``Trainer.reference``'s answer for ``model`` holding ``state`` (in ``dtype``)."""
    model = copy.deepcopy(model)
    if dtype:
        model.to(getattr(torch, dtype))
    model.load_state_dict(state)
    model.eval()
    found = []
    with torch.no_grad():
        for prompt, generated in zip(prompts, outputs, strict=True):
            ids = torch.tensor([prompt + generated])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            top2 = logits.topk(2, dim=-1).values
            found.append({
                "logprobs": logits.gather(-1, torch.tensor(generated)[:, None])[:, 0].tolist(),
                "greedy": logits.argmax(-1).tolist(),
                "gap": (top2[:, 0] - top2[:, 1]).tolist(),
            })  # fmt: skip
    return found


@ray.remote(num_cpus=0)
class LaneTrainer:
    """One of ``world_size`` ranks of a sharded trainer (Gloo among the actors): a
    ``transformers`` model with Adam whose state dict is pushed as DTensors sharded over every
    rank (rank 0's weights, scattered), each rank sending its own shards with a
    ``WeightUpdater(senders=...)``; ``reference`` answers for what was last pushed, as
    ``Trainer``'s."""

    def __init__(self, config: dict[str, Any], rank: int, world_size: int, seed: int = 3) -> None:
        torch.set_num_threads(1)
        self.rank, self.world_size = rank, world_size
        self.listener = bind_listener("127.0.0.1") if rank == 0 else None
        self.trainer = InProcess(config, seed)  # its model and Adam steps
        self.model = self.trainer.model
        self.pushed: dict[str, torch.Tensor] | None = None

    def port(self) -> int:
        assert self.listener is not None
        return self.listener.getsockname()[1]

    def setup(self, port: int, engines: list, **sync: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from weight_sync.actors import WeightUpdater

        store = open_store("127.0.0.1", port, self.world_size, 60, self.listener)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=60))  # fmt: skip
        self.mesh = init_device_mesh("cpu", (self.world_size,))
        self.updater = WeightUpdater(engines, SyncConfig(**sync), senders=dist.group.WORLD)

    def step(self) -> None:
        self.trainer.step()

    def push(self, extra: bool = False, die: bool = False) -> Any:
        """Every rank at once: the result, or the error's type and message. ``extra``: with a
        tensor the engines have no place for; ``die``: rank 1 exits once the senders agreed,
        before its lane moves a byte."""
        from torch.distributed.tensor import Shard, distribute_tensor

        state = {name: t.detach().clone() for name, t in self.model.state_dict().items()}
        if extra:
            state["model.layers.0.mlp.extra.weight"] = torch.ones(8, 64)
        sharded = {n: distribute_tensor(t, self.mesh, [Shard(0)]) for n, t in state.items()}
        if die and self.rank == 1:
            self.updater._pushes._lanes.out.push = lambda *args, **kwargs: os._exit(9)
        try:
            result = self.updater.push(sharded)
        except Exception as exc:
            return type(exc).__name__, str(exc)
        self.pushed = state
        return result

    def reference(
        self, prompts: list[list[int]], outputs: list[list[int]], dtype: str | None = None
    ) -> list[dict[str, list]]:
        assert self.pushed is not None, "push first"
        return reference(self.model, self.pushed, prompts, outputs, dtype)

    def close(self) -> None:
        self.updater.close()
        dist.destroy_process_group()
